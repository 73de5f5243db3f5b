"""Replay one captured step per batch-size bucket (docs/DESIGN.md invariants 1, 4, 5, 6).

`GraphRunner` knows nothing about TTS. It is given `step_fn(b, variant)`, a function that does one step
for rows `[:b]` of persistent buffers and returns nothing (`variant` is an opaque, hashable choice of
code path that the caller makes per step, e.g. which sampler; each (bucket, variant) pair gets its own
graph), and it decides for each call with `n` live rows:

* the bucket: the smallest configured bucket >= n (rows n..b-1 are pad rows the caller keeps inert);
* eager or replay: a bucket is captured only after it has run eagerly once (the warm-up), either on its
  second use (lazy, the default; the engine's `graphs="lazy"`) or all buckets at start-up, largest
  first (`capture_all()`; the engine's `graphs="startup"`); all buckets share one memory pool;
* fallback: graphs disabled, n above the largest bucket, or a bucket whose capture failed run eagerly,
  and each such step is counted. A capture that raises is ended, its graph and pool dropped, logged and
  counted; the bucket stays eager and the runner keeps serving.
* one capture at a time in the process (`CAPTURE_LOCK`), whichever thread and runner it belongs to.

On CUDA the graph is a `torch.cuda.CUDAGraph`. Elsewhere a `StandInGraph` "captures" by remembering the
call and "replays" by calling `step_fn(b)` again on the same buffers, so the bucket logic, padding,
buffer discipline, fallback and statistics run (and are tested) on CPU.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# Held for the whole of every capture (and its failure handling), by every GraphRunner of the process.
# Why: torch supports one capture underway per process, and a capture brackets itself with device-wide
# synchronizes (ours and `torch.cuda.graph`'s, which also empties the cache); a device-wide synchronize
# from one thread while another thread's capture is open fails with CUDA error 900 ("operation not
# permitted when stream is capturing") in any capture mode. Seen on an H200: the codec stage's worker
# captured a decode graph while the engine thread captured a prefill graph, and the request's prefill
# failed. Other threads keep launching work meanwhile (thread-local capture mode); only captures wait.
CAPTURE_LOCK = threading.Lock()


class StandInGraph:
    """CPU stand-in for `torch.cuda.CUDAGraph`: replay re-runs the captured call."""

    def __init__(self) -> None:
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def replay(self) -> None:
        assert self._fn is not None, "replay before capture"
        self._fn()


@dataclass
class GraphStats:
    """Counters a benchmark or the metrics endpoint reports."""

    capture_seconds: dict[tuple, float] = field(default_factory=dict)  # (bucket, variant) -> seconds
    failed_captures: dict[tuple, str] = field(default_factory=dict)  # (bucket, variant) -> error
    replays: int = 0
    eager_steps: int = 0  # every eager step, whatever the reason
    eager_over_max: int = 0  # batch larger than the largest bucket
    eager_warmup: int = 0  # first use of a bucket
    pool_bytes: int = 0  # device memory reserved by captures (CUDA only)
    replays_by_bucket: dict[int, int] = field(default_factory=dict)

    @property
    def capture_seconds_total(self) -> float:
        return sum(self.capture_seconds.values())

    def failed_buckets(self) -> set[int]:
        return {b for b, _ in self.failed_captures}

    @property
    def replay_share(self) -> float:
        total = self.replays + self.eager_steps
        return self.replays / total if total else 0.0

    def as_dict(self) -> dict:
        def name(key):
            b, variant = key
            return str(b) if variant is None else f"{b}/{variant}"

        return {
            "capture_seconds": {name(k): v for k, v in self.capture_seconds.items()},
            "capture_seconds_total": self.capture_seconds_total,
            "failed_captures": {name(k): v for k, v in self.failed_captures.items()},
            "replays": self.replays,
            "eager_steps": self.eager_steps,
            "eager_over_max": self.eager_over_max,
            "eager_warmup": self.eager_warmup,
            "replay_share": self.replay_share,
            "pool_bytes": self.pool_bytes,
        }


class GraphRunner:
    """Pick a bucket per step, capture lazily or at start-up, replay, fall back to eager.

    step_fn: `step_fn(b, variant)` runs one step on rows `[:b]` of persistent buffers, returns None
    (`variant` is whatever hashable value the caller passes to `run`, hence `Any` in its type).
    buckets: batch sizes to capture (sorted, de-duplicated; those above max_batch become max_batch).
    enabled: False runs every step eagerly with b = n (no padding).
    device: where the buffers live; CUDA graphs on a CUDA device, stand-ins elsewhere.
    buffer_ptrs: optional callable returning `{name: data_ptr}` of the persistent buffers; checked after
    every capture and replay so that a reallocated buffer fails loudly instead of replaying stale memory.
    capture_stream: the CUDA stream captures record on (default: one of this runner's own). Captures
    use CUDA's thread-local capture mode, so another thread may keep launching work (e.g. a second
    GraphRunner's replays) while this one captures.
    """

    def __init__(
        self,
        step_fn: Callable[[int, Any], None],
        *,
        max_batch: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        enabled: bool = True,
        device: torch.device | str = "cpu",
        buffer_ptrs: Callable[[], dict[str, int]] | None = None,
        capture_stream: torch.cuda.Stream | None = None,
    ):
        self.step_fn = step_fn
        self.device = torch.device(device)
        self.enabled = enabled
        # A bucket above max_batch becomes max_batch, so every batch size up to max_batch has a graph.
        self.buckets = sorted({min(b, max_batch) for b in buckets if b >= 1})
        if enabled and not self.buckets:
            raise ValueError(f"no bucket in {list(buckets)} fits max_batch={max_batch}")
        self.stats = GraphStats()
        self.graphs: dict[tuple, torch.cuda.CUDAGraph | StandInGraph] = {}
        self._warmed: set[tuple] = set()
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self._buffer_ptrs = buffer_ptrs
        self._ptrs_at_capture: dict[str, int] | None = None
        self.capturing = False  # True while a capture is being recorded (for fault injection / checks)
        self._capture_stream = capture_stream

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def bucket_for(self, n: int) -> int | None:
        """Smallest bucket >= n, or None when n is above the largest bucket."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None

    # ---- the per-step entry point -------------------------------------------------------------------

    def run(self, n: int, variant=None) -> int:
        """Run one step for n live rows; returns the number of rows computed (bucket or n)."""
        if n <= 0:
            return 0
        if not self.enabled:
            return self._eager(n, variant)
        b = self.bucket_for(n)
        if b is None:
            self.stats.eager_over_max += 1
            return self._eager(n, variant)
        key = (b, variant)
        if key in self.stats.failed_captures:
            return self._eager(n, variant)
        if key not in self.graphs:
            if key not in self._warmed:
                self._warmed.add(key)
                self.stats.eager_warmup += 1
                return self._eager(b, variant)
            self._capture(key)
            if key not in self.graphs:  # capture failed: this step still has to run
                return self._eager(b, variant)
        self.graphs[key].replay()
        self.stats.replays += 1
        self.stats.replays_by_bucket[b] = self.stats.replays_by_bucket.get(b, 0) + 1
        self._check_ptrs()
        return b

    def capture_all(self, variants=(None,)) -> None:
        """Warm up and capture every bucket (for each variant) now, largest first (start-up capture).

        The caller must leave every row inert (pad rows): warm-up runs the real step on them.
        """
        for b in sorted(self.buckets, reverse=True):
            for variant in variants:
                self.capture(b, variant)

    def capture(self, b: int, variant=None) -> None:
        """Warm up (uncounted) and capture bucket `b` now, unless it is captured or failed already or
        graphs are off; a failure is handled as in `run`. The caller lays out the buffers the warm-up
        and the capture run on (inert rows)."""
        if not self.enabled:
            return
        key = (b, variant)
        if key in self.graphs or key in self.stats.failed_captures:
            return
        if key not in self._warmed:
            self._warmed.add(key)
            self._eager(b, variant, counted=False)
        self._capture(key)

    # ---- internals -----------------------------------------------------------------------------------

    def _eager(self, b: int, variant=None, counted: bool = True) -> int:
        if self.is_cuda:
            with torch.cuda.device(self.device):
                self.step_fn(b, variant)
        else:
            self.step_fn(b, variant)
        if counted:
            self.stats.eager_steps += 1
        return b

    def _capture(self, key: tuple) -> None:
        with CAPTURE_LOCK:
            t0 = time.perf_counter()
            self.capturing = True
            try:
                graph = self._capture_cuda(key) if self.is_cuda else self._capture_standin(key)
            except Exception as exc:  # noqa: BLE001 - any capture failure leaves the bucket eager
                self.stats.failed_captures[key] = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture of bucket %s failed; it stays eager: %s", key, exc)
                if self.is_cuda:
                    self._pool = None  # a failed capture may have poisoned the shared pool; start a new one
                    torch.cuda.synchronize(self.device)
                    torch.cuda.empty_cache()
                return
            finally:
                self.capturing = False
        self.graphs[key] = graph
        self.stats.capture_seconds[key] = time.perf_counter() - t0
        if self._buffer_ptrs is not None:
            ptrs = self._buffer_ptrs()
            if self._ptrs_at_capture is None:
                self._ptrs_at_capture = ptrs
            elif ptrs != self._ptrs_at_capture:
                raise RuntimeError("persistent buffers moved between captures")

    def _capture_standin(self, key: tuple) -> StandInGraph:
        graph = StandInGraph()
        graph.capture(lambda: self.step_fn(*key))
        return graph

    def _capture_cuda(self, key: tuple) -> torch.cuda.CUDAGraph:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            reserved_before = torch.cuda.memory_reserved()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            if self._capture_stream is None:  # not torch's class-wide default: threads must not share one
                self._capture_stream = torch.cuda.Stream(self.device)
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"
            ):
                self.step_fn(*key)
            torch.cuda.synchronize()
            self.stats.pool_bytes += max(0, torch.cuda.memory_reserved() - reserved_before)
        return graph

    def _check_ptrs(self) -> None:
        if self._buffer_ptrs is not None and self._ptrs_at_capture is not None:
            if self._buffer_ptrs() != self._ptrs_at_capture:
                raise RuntimeError("a persistent buffer was reallocated after capture; replay would be stale")
