"""The engine: scheduler + model runner + graph runner, one iteration at a time.

`Engine.step()` is one iteration of the continuous-batching loop:
1. apply cancellations and pause/resume requests made since the last iteration;
2. admit waiting requests (rows and KV blocks permitting), prefill each, load its row;
3. one frame step for all running rows (graph replay or eager: the same `decode_step`);
4. read the step's `out` buffer once, hand each request its frame, finish requests that emitted the
   end token or reached their budget, free their blocks and compact the rows.

The engine is single-threaded: one thread calls `step()` (DESIGN.md invariant 7). `submit`, `cancel`
and `set_paused` may be called from other threads; they only enqueue work for the next iteration.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphs.runner import DEFAULT_BUCKETS, GraphRunner

from ..kv_cache import BlockAllocator, PagedKVCache, blocks_needed
from ..model import DualARTransformer
from .model_runner import ModelRunner, RowInit
from .request import FinishReason, Request, RequestState, SamplingParams, StepOutput
from .scheduler import RowMove, Scheduler

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Engine sizing and graph settings.

    max_batch: rows decoded together (the largest bucket is capped by it).
    max_context: tokens per request, prompt + frames (default: the model's max_seq_len).
    block_size: tokens per KV block. num_blocks: KV pool size including the scratch block (default:
    enough for max_batch full-context requests, capped on CUDA by kv_memory_fraction of free memory).
    graphs: capture CUDA graphs (forced off on CPU unless standin_graphs, which tests use).
    capture: "lazy" (a bucket on its second use) or "startup" (all buckets at construction).
    max_waiting: bound of the waiting queue (QueueFull beyond it).
    """

    max_batch: int = 8
    max_context: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.5
    graphs: bool = True
    capture: str = "lazy"
    buckets: Sequence[int] = DEFAULT_BUCKETS
    max_waiting: int = 1024
    standin_graphs: bool = False
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"

    def validate(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.capture not in ("lazy", "startup"):
            raise ValueError(f"capture must be 'lazy' or 'startup', got {self.capture!r}")


class Engine:
    def __init__(self, model: DualARTransformer, config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        self.model = model.eval()
        mc = model.config
        self.device = model.embeddings.weight.device
        self.max_context = min(cfg.max_context or mc.max_seq_len, mc.max_seq_len)
        max_blocks_per_seq = blocks_needed(self.max_context, cfg.block_size)
        dtype = model.embeddings.weight.dtype
        num_blocks = cfg.num_blocks or self._default_num_blocks(max_blocks_per_seq, dtype)
        self.kv = PagedKVCache(
            mc.n_layer, num_blocks, cfg.block_size, mc.n_local_heads, mc.head_dim, dtype, self.device
        )
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks), cfg.block_size, cfg.max_batch, self.max_context, cfg.max_waiting
        )
        self.runner = ModelRunner(
            model, self.kv, cfg.max_batch, max_blocks_per_seq, self._attention_backend(cfg.attention_backend)
        )
        use_graphs = cfg.graphs and (self.device.type == "cuda" or cfg.standin_graphs)
        self.graphs = GraphRunner(
            self.runner.decode_step, max_batch=cfg.max_batch, buckets=cfg.buckets, enabled=use_graphs,
            device=self.device, buffer_ptrs=self.runner.buffers.data_ptrs,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._pending_cancel: dict[str, FinishReason] = {}
        self._pending_pause: dict[str, bool] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.frames_generated = 0
        if use_graphs and cfg.capture == "startup":
            self.graphs.capture_all()

    def _default_num_blocks(self, max_blocks_per_seq: int, dtype) -> int:
        mc, cfg = self.model.config, self.config
        wanted = cfg.max_batch * max_blocks_per_seq + 1
        if self.device.type != "cuda":
            return wanted
        per_block = PagedKVCache.bytes_per_block(
            mc.n_layer, cfg.block_size, mc.n_local_heads, mc.head_dim, dtype
        )
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(2, min(wanted, int(free * cfg.kv_memory_fraction) // per_block))

    def _attention_backend(self, name: str):
        if name == "torch" or (name == "auto" and self.device.type != "cuda"):
            return None
        try:
            from ..kernels.paged_attention import triton_paged_decode_attention
        except ImportError as exc:
            if name == "triton":
                raise
            log.warning("Triton paged attention unavailable (%s); using the torch implementation", exc)
            return None
        return triton_paged_decode_attention

    # ---- API for callers (any thread) --------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, prompt: torch.Tensor, params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue a request. Raises InvalidRequest (bad parameters, too long) or QueueFull."""
        request = Request(request_id or self.new_request_id(), prompt, params)
        with self._lock:
            if request.request_id in self._requests:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            self.scheduler.add(request)
            self._requests[request.request_id] = request
        return request

    def cancel(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """End a request at the next iteration (no-op if it already finished)."""
        with self._lock:
            if request_id in self._requests:
                self._pending_cancel[request_id] = reason

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Pause or resume a running request's decoding (back-pressure); its row stays reserved."""
        with self._lock:
            if request_id in self._requests:
                self._pending_pause[request_id] = paused

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or bool(self._pending_cancel)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> tuple[int, int]:
        """(used, usable) KV blocks."""
        a = self.scheduler.allocator
        return a.num_usable - a.num_free, a.num_usable

    # ---- one iteration (engine thread only) ----------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self._lock:
            cancels, self._pending_cancel = self._pending_cancel, {}
            pauses, self._pending_pause = self._pending_pause, {}
            for request_id, reason in cancels.items():
                request = self._requests.get(request_id)
                if request is not None:
                    outputs.append(self._finish(request, reason))
            admitted = self.scheduler.admit()
        for request_id, paused in pauses.items():
            self._apply_pause(request_id, paused)
        for row, request in admitted:
            self._start(row, request, outputs)
        n = self.scheduler.num_running
        if n == 0:
            return outputs
        self.graphs.run(n)
        # A copy: on a CPU device .cpu() would return a view of the persistent buffer, which the next
        # step overwrites (every emitted frame would then read as the latest one).
        out = self.runner.buffers.out[:n].to("cpu", copy=True)
        N = self.model.config.num_codebooks
        # Iterate over a snapshot: finishing a request moves the last row into its place.
        for request, row in zip(list(self.scheduler.running), out, strict=True):
            if not bool(row[N + 1]):  # paused: nothing emitted this step
                continue
            request.num_generated += 1
            self.frames_generated += 1
            stop = int(row[0]) == self.model.config.eos_token_id
            codes = row[1 : N + 1].unsqueeze(0) if not stop else row[1:1].view(0, N)
            if bool(row[N + 2]):
                reason = FinishReason.STOP if stop else FinishReason.LENGTH
                with self._lock:
                    finished = self._finish(request, reason)
                finished.codes = codes
                outputs.append(finished)
            else:
                outputs.append(StepOutput(request.request_id, codes))
        return outputs

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with an error (the step raised); frees all their blocks."""
        with self._lock:
            return [
                self._finish(r, FinishReason.ERROR, error)
                for r in list(self.scheduler.running) + list(self.scheduler.waiting)
            ]

    def _start(self, row: int, request: Request, outputs: list[StepOutput]) -> None:
        p = request.params
        try:
            self.runner.prefill(request.prompt, request.blocks)
        except Exception as exc:  # a bad prompt must not take the batch down
            log.exception("prefill failed for %s", request.request_id)
            with self._lock:
                outputs.append(self._finish(request, FinishReason.ERROR, f"prefill failed: {exc}"))
            return
        self.runner.load_row(
            row,
            RowInit(
                last_column=request.prompt[-1], position=request.prompt_len - 1, block_table=request.blocks,
                temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=request.seed,
                budget=p.max_new_tokens, ras_len=p.ras_window,
            ),
        )  # fmt: skip

    def _apply_pause(self, request_id: str, paused: bool) -> None:
        request = self._requests.get(request_id)
        if request is None or request.state != RequestState.RUNNING or request.paused == paused:
            return
        request.paused = paused
        self.runner.set_active(self.scheduler.running.index(request), not paused)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> StepOutput:
        """(lock held) End a request, free its blocks, keep the running rows contiguous."""
        move: RowMove | None = self.scheduler.finish(request, reason, error)
        if move is not None:
            if move.src != move.dst:
                self.runner.move_row(move.src, move.dst)
            self.runner.clear_row(move.src)
        self._requests.pop(request.request_id, None)
        N = self.model.config.num_codebooks
        return StepOutput(request.request_id, torch.empty(0, N, dtype=torch.int64), True, reason, error)
