"""The engine: scheduler + model runner + graph runner, one iteration at a time.

`Engine.step()` is one iteration of the continuous-batching loop:
1. apply cancellations and pause/resume requests made since the last iteration;
2. admit waiting requests (rows and KV blocks permitting, and with `EngineConfig.realtime_admission`
   only when no playing stream would fall behind for them: tts.engine.realtime), prefill each, load
   its row;
3. one frame step for all running rows (graph replay or eager: the same `decode_step`; on a CPU its
   eager twin `CpuFrameStep`);
4. read the step's `out` buffer once, hand each request its frame, finish requests that emitted the
   end token or reached their budget, free their blocks and compact the rows.

The engine is single-threaded: one thread calls `step()` (docs/DESIGN.md invariant 7). `submit`, `cancel`
and `set_paused` may be called from other threads; they only enqueue work for the next iteration.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from graphs.runner import DEFAULT_BUCKETS, GraphRunner
from tts.engine.aligner import (
    ALIGN_MAX_TOKENS,
    MAX_END_REFUSALS,
    MAX_REWINDS,
    MAX_STALLED_REFUSALS,
    RETRY_FRAMES,
    RETRY_TEMPERATURE,
    RETRY_TOP_P,
    REWIND_EXTRA_FRAMES,
    LoopGuard,
)
from tts.engine.cpu_step import CpuFrameStep
from tts.engine.model_runner import ModelRunner, RowInit
from tts.engine.prefill_graphs import PrefillGraphs
from tts.engine.realtime import Playback, RealtimeAdmission
from tts.engine.request import FinishReason, InvalidRequest, Request, RequestState, SamplingParams, StepOutput
from tts.engine.scheduler import Gate, RowMove, Scheduler
from tts.engine.sequences import KeptSequence, common_prefix, prefill_extend, prefill_extend_packed
from tts.model.config import AlignerSpec
from tts.model.kernels import kernel_head_dim_ok
from tts.model.kv_cache import BlockAllocator, PagedKVCache, blocks_needed
from tts.model.sampling import SAMPLER_TOPK_CAP
from tts.model.transformer import DualARTransformer, TransformerBlock
from tts.params import (
    AUTO_STREAM_TOKENS,
    DEFAULT_KV_MEMORY_FRACTION,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_REALTIME_MARGIN,
    DEFAULT_REALTIME_MAX_WAIT,
)

log = logging.getLogger(__name__)

# CUDA graphs of the frame step (`EngineConfig.graphs`, `--graphs`): none, a bucket captured on its
# second use, or every bucket captured at start-up.
GRAPH_SETTINGS = ("off", "lazy", "startup")
# The KV pool's share of the free device memory at start-up (CUDA; `EngineConfig.kv_memory_fraction`).
# The KV pool on a CPU holds at most this many bytes (yet one full-context request).
CPU_KV_BYTES = 2 << 30
# Context tokens a stream is assumed to hold when the batch size is sized from memory
# (`max_batch_for_memory`): a voice-conditioned prompt and about a minute of audio (21.5 frames/s).


def step_sample(wall: float, beside: float, device: float | None, launch: float = 0.0) -> float:
    """The seconds a frame step took, for real-time admission's averages: `wall` from its launch to its
    frame on the host, less the caller's work beside it (`beside` seconds, `Engine.step`'s
    while_stepping) where that work, not the step, held the frame back. `device`: the step's device
    time from before its launch (CUDA events; None on a CPU, where the work ran after the step's
    compute); `launch`: the host's seconds launching it (a graph replay's few microseconds; an eager
    step's whole host side). On CUDA the work ran while the device finished what was launched: it
    lengthened the wall time only by what it outlasted the device's time left after the launch."""
    if device is None:
        return wall - beside
    return wall - max(0.0, beside - max(0.0, device - launch))


@dataclass
class EngineConfig:
    """Engine sizing and graph settings.

    max_batch: rows decoded together (the largest bucket is capped by it).
    max_context: tokens per request, prompt + frames (default: the model's max_seq_len).
    block_size: tokens per KV block. num_blocks: KV pool size including the scratch block (default:
    enough for max_batch full-context requests, capped on CUDA at kv_memory_fraction of the device's
    free memory at construction, on a CPU at CPU_KV_BYTES but never below one full-context request).
    Requests take blocks as they grow (tts.engine.scheduler), so the pool, not max_batch, bounds the
    tokens held; `max_batch_for_memory` sizes max_batch from the memory.
    graphs: CUDA graphs of the frame step, one per batch-size bucket: "off" (every step eager), "lazy"
    (a bucket is captured on its second use, the default) or "startup" (every bucket is captured at
    construction, largest first). A CPU has no graphs: there it means "off".
    prefill_graphs: CUDA graphs of the prefill, one pass per token bucket (tts.engine.prefill_graphs),
    when the frame step has graphs: "off", "lazy" or "startup" as for `graphs`; None: as `graphs` on
    CUDA, "off" elsewhere.
    max_waiting: bound of the waiting queue (QueueFull beyond it; the service's default too).
    max_prefill_tokens: prompt tokens prefilled per iteration at most (at least one request), so that
    new requests cannot freeze the running streams for long (None: no bound).
    packed_prefill: prefill the requests admitted in one iteration in one forward pass
    (`ModelRunner.prefill_packed`; those continuing kept sequences in another,
    `tts.engine.sequences.prefill_extend_packed`; None: on CUDA, where one request's prefill is bound by
    kernel launches; off on a CPU, where it is bound by arithmetic and the per-request K/V are bit-stable).
    realtime_admission: admit a waiting request only while every playing stream (a request submitted
    with a `Playback`) keeps `realtime_margin` seconds of slack after paying for its prefill and the
    slower step, and only if the step stays fast enough for it to keep real time itself; a request
    that waited `realtime_max_wait` seconds is admitted whatever the slack (tts.engine.realtime).
    Off by default here (admission by rows and blocks only); `tts serve` turns it on on CUDA.
    prefill_gather: with real-time admission and packed prefills, seconds a fresh request that would
    open a prefill pass of its own while streams play waits for later ones to share the pass (0: none).
    repetition: how the frame step applies requests' repetition penalty ("fish-1.5", "s1"; see
    tts.engine.model_runner), None: not at all. The model family decides it (`ModelBundle.repetition`);
    the Python API and the service fill it in from the bundle.
    aligner: the model's aligner heads (`tts.engine.aligner`; `ModelBundle.aligner`, filled in likewise),
    None: the model has none. loop_guard: with an aligner, follow each request's position in its text
    and rewind repeats (`submit(text_span=...)`); False: never (the aligner is then not computed).
    """

    max_batch: int = 8
    max_context: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    graphs: str = "lazy"
    buckets: Sequence[int] = DEFAULT_BUCKETS
    prefill_graphs: str | None = None
    max_waiting: int = 16
    max_prefill_tokens: int | None = DEFAULT_MAX_PREFILL_TOKENS
    packed_prefill: bool | None = None
    realtime_admission: bool = False
    realtime_margin: float = DEFAULT_REALTIME_MARGIN
    realtime_max_wait: float = DEFAULT_REALTIME_MAX_WAIT
    prefill_gather: float = 0.0
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    repetition: str | None = None
    aligner: AlignerSpec | None = None
    loop_guard: bool = True
    # Benchmarking only:
    ignore_eos: bool = False  # never sample the end token (fixed-length benchmark runs)

    def validate(self) -> None:
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not 0 < self.kv_memory_fraction < 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1), got {self.kv_memory_fraction}")
        if self.graphs not in GRAPH_SETTINGS:
            raise ValueError(f"graphs must be one of {', '.join(GRAPH_SETTINGS)}, got {self.graphs!r}")
        if self.prefill_graphs is not None and self.prefill_graphs not in GRAPH_SETTINGS:
            choices = ", ".join(GRAPH_SETTINGS)
            raise ValueError(f"prefill_graphs must be one of {choices} or None, got {self.prefill_graphs!r}")
        for name in ("realtime_margin", "realtime_max_wait", "prefill_gather"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):  # (False for nan)
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
        if self.prefill_gather and not self.realtime_admission:
            raise ValueError("prefill_gather needs realtime_admission")
        if self.prefill_gather and self.prefill_gather >= self.realtime_max_wait:
            raise ValueError("prefill_gather must be below realtime_max_wait")


def kv_bytes_per_token(model: DualARTransformer) -> int:
    """Bytes of the slow AR's K and V per context token (every layer), in the model's dtype."""
    c = model.config
    return PagedKVCache.bytes_per_block(
        c.n_layer, 1, c.n_local_heads, c.head_dim, model.embeddings.weight.dtype
    )


def max_batch_for_memory(
    model: DualARTransformer,
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
    *,
    stream_tokens: int = AUTO_STREAM_TOKENS,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    free_bytes: int | None = None,
) -> int:
    """The batch size (rows decoded together) that a KV pool of `kv_memory_fraction` of the free device
    memory holds at `stream_tokens` context tokens per stream: the largest of `buckets` not above
    pool tokens // stream_tokens, at least the smallest bucket. free_bytes: the free memory (default:
    `torch.cuda.mem_get_info` of the model's device, which must then be a CUDA device). Rows beyond
    what the pool holds at once only wait for blocks (admission is by free blocks), so this sizes the
    graphs' largest bucket to what the memory can keep busy."""
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(model.embeddings.weight.device)
    tokens = int(free_bytes * kv_memory_fraction) // kv_bytes_per_token(model)
    fitting = [b for b in sorted(buckets) if b * stream_tokens <= tokens]
    return fitting[-1] if fitting else min(buckets)


def for_bundle(config: EngineConfig, bundle) -> EngineConfig:
    """`config` with the model bundle's repetition mode (`ModelBundle.repetition`) and aligner heads
    (`ModelBundle.aligner`) where it names none."""
    mode = getattr(bundle, "repetition", None)
    if config.repetition is None and mode is not None:
        config = replace(config, repetition=mode)
    aligner = getattr(bundle, "aligner", None)
    if config.aligner is None and aligner is not None:
        config = replace(config, aligner=aligner)
    return config


def disable_cudnn_attention() -> None:
    """Take cuDNN out of torch's SDPA backends, for the whole process (torch keeps one global set).

    Why: every prompt length is a new attention shape for the prefill, and torch sends causal or masked
    SDPA on a Hopper GPU to cuDNN first, which builds an execution plan per new shape. Measured on an
    H200 (S2-Pro shape, one request; docs/benchmarks.md): the first prefill at a new length took 154-715 ms
    with cuDNN and 28-80 ms without; at a length seen before 30-59 ms with, 23-55 ms without. Flash and
    memory-efficient attention need no plan. Set once, not around each prefill: the flags are global,
    and the codec stage's thread runs SDPA at the same time."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class Engine:
    """The engine: scheduler, KV pool, model runner and frame-step graphs. On CUDA it calls
    `disable_cudnn_attention` (a process-wide SDPA setting; see there).

    A subclass may change how the frame step runs: `graph_runner_class` (the frame step's graph runner,
    a `graphs.runner.GraphRunner`) and `graphs_supported` (whether the device runs graphs at all)."""

    graph_runner_class: type[GraphRunner] = GraphRunner

    def __init__(
        self,
        model: DualARTransformer,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """clock: seconds, monotonic: the phases' wall times, and the real-time admission's step times
        and playback clocks (a test passes its own)."""
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        self.clock = clock
        self.model = model.eval()
        mc = model.config
        self.device = model.embeddings.weight.device
        packed = cfg.packed_prefill
        self.packed_prefill = self.device.type == "cuda" if packed is None else packed
        self.realtime = (
            RealtimeAdmission(
                cfg.realtime_margin,
                cfg.realtime_max_wait,
                packs=self.packed_prefill,
                gather=cfg.prefill_gather,
            )
            if cfg.realtime_admission
            else None
        )
        self.max_context = min(cfg.max_context or mc.max_seq_len, mc.max_seq_len)
        max_blocks_per_seq = blocks_needed(self.max_context, cfg.block_size)
        dtype = model.embeddings.weight.dtype
        num_blocks = cfg.num_blocks or self._default_num_blocks(max_blocks_per_seq, dtype)
        self.kv = PagedKVCache(
            mc.n_layer, num_blocks, cfg.block_size, mc.n_local_heads, mc.head_dim, dtype, self.device
        )
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            cfg.block_size,
            cfg.max_batch,
            self.max_context,
            cfg.max_waiting,
            cfg.max_prefill_tokens,
        )
        if self.device.type == "cuda":
            disable_cudnn_attention()
        first_block = cast("TransformerBlock", model.layers[0])  # (an nn.ModuleList of TransformerBlocks)
        if self.device.type == "cuda" and first_block.feed_forward.fused_w13() is None:
            model.fuse_weights()  # one GEMM for w1 and w3 on the CUDA path
        elif self.device.type == "cpu":
            model.use_cpu_decode_layout()  # fused w1/w3 and matrix-vector friendly strides
        self.runner = ModelRunner(
            model,
            self.kv,
            cfg.max_batch,
            max_blocks_per_seq,
            self._attention_backend(cfg.attention_backend),
            ignore_eos=cfg.ignore_eos,
            repetition=cfg.repetition,
            aligner=self._guard_aligner(cfg),
        )
        # The frame step: the captured one, or on a CPU its eager twin (same contract and buffers).
        self.cpu_step = CpuFrameStep(self.runner) if self.device.type == "cpu" else None
        step_fn = self.cpu_step.decode_step if self.cpu_step is not None else self.runner.decode_step
        use_graphs = cfg.graphs != "off" and self.graphs_supported()
        self.graphs = self.graph_runner_class(
            step_fn,
            max_batch=cfg.max_batch,
            buckets=cfg.buckets,
            enabled=use_graphs,
            device=self.device,
            buffer_ptrs=self.runner.buffers.data_ptrs,
        )
        self._lock = threading.Lock()
        self._pending_cancel: dict[str, FinishReason] = {}
        self._pending_pause: dict[str, bool] = {}
        self._carried: list[StepOutput] = []
        self._host_out: torch.Tensor | None = None  # pinned copy of the step's `out` (CUDA)
        self._out_ready: torch.cuda.Event | None = None  # marks `out` copied to _host_out (CUDA)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.frames_generated = 0
        self.frame_steps = 0  # frame steps run (one per iteration with a running row)
        self.step_rows = 0  # running rows summed over those steps: step_rows / frame_steps = batch occupancy
        self.prefill_requests = 0  # requests admitted and prefilled (/ runner.prefill_passes: packing)
        self.loop_repeats = 0  # repeats the loop guard found (rewound, ending the request, or left in)
        # Sessions' kept sequences (tts.engine.sequences) by id, and their counters: prompt positions
        # prefilled in all, positions a request found already cached, positions prefilled again because
        # the held history differed (turns dropped for the context, or the sequence evicted), extension
        # prefills run on CUDA one sequence per pass (not packed with others: packing off, one such
        # request admitted, a packed pass failed), idle sequences evicted for a waiting request.
        self.sequences: dict[str, KeptSequence] = {}
        self.prefill_tokens = 0
        self.reused_tokens = 0
        self.reprefill_tokens = 0
        self.prefix_prefills_eager = 0
        self.sequence_evictions = 0
        self.kv_stalls = 0  # times a running request had to wait for a KV block (the pool was full)
        self.kv_preemptions = 0  # requests ended (PREEMPTED) to free KV blocks
        self.end_refusals = 0  # end tokens refused before the text's end (`_refuse_end`)
        # Seconds spent per phase of `step` (host wall time; on CUDA "replay" lasts until the frame is on
        # the host): admitting and prefilling new requests, the frame step itself, the per-row outputs.
        self.phase_seconds = {"prefill": 0.0, "replay": 0.0, "rows": 0.0}
        # On CUDA, the time on the device's timeline of the prefill passes (from the first one's start to
        # the last one's end: an eager pass's launch gaps count) and of the frame step, from events on
        # the engine's stream read after the frame's sync (no sync of their own); iterations that warm up
        # or capture a graph are left out. Beside other work on the GPU (the codec stage's) a pass lasts
        # longer than alone.
        cuda = self.device.type == "cuda"
        self.device_seconds = {"prefill": 0.0, "replay": 0.0} if cuda else {}
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else None
        self._prefill_timed = False  # (events[0..1] recorded in this iteration)
        prefill_graphs = cfg.prefill_graphs
        if prefill_graphs is None:
            prefill_graphs = cfg.graphs if self.device.type == "cuda" else "off"
        if use_graphs and prefill_graphs != "off":
            self.runner.prefill_graphs = PrefillGraphs(self.runner, cfg.max_batch)
        if use_graphs and cfg.graphs == "startup":
            self.graphs.capture_all(variants=self._variants())
        if self.runner.prefill_graphs is not None and prefill_graphs == "startup":
            self.runner.prefill_graphs.capture_all()

    def graphs_supported(self) -> bool:
        """Whether the frame step and the prefill may run as graphs here (`EngineConfig.graphs`): CUDA
        graphs on a CUDA device; a CPU has none (its graphs setting means "off")."""
        return self.device.type == "cuda"

    # Prompt lengths the prefill warm-up runs: alone (one position, short, and lengths on both sides of
    # a multiple of 16, where Triton specializes integer arguments) and packed (totals likewise).
    WARMUP_PREFILLS = ((1,), (2,), (16,), (17,), (5, 11), (5, 12), (3, 7, 9), (16, 16, 16))

    def warmup_prefill(self) -> float:
        """Run the prefill, alone and packed, on throwaway prompts (token 0 everywhere) in blocks that
        are allocated here and freed again, so that the first real prefill of each kind does not pay
        the one-time work of its first use (kernel compiles and first launches: measured on an H200,
        about 1.1 s for the first prefill of a process and 1.7 s for the first packed one). A prompt set
        that does not fit the free blocks is skipped. Afterwards the free list is as before (same
        order) and `prefill_passes` is unchanged. With prefill graphs these prompts go through them like
        real ones (replays when captured at start-up, counted in the graphs' statistics; lazily, the
        first uses warm up and capture their buckets), and only the one-position prompt warms the
        eager prefill. Returns the wall seconds spent."""
        t0 = time.perf_counter()
        width = 1 + self.model.config.num_codebooks
        allocator, bs = self.scheduler.allocator, self.config.block_size
        passes = self.runner.prefill_passes
        for lengths in self.WARMUP_PREFILLS:
            if len(lengths) > 1 and (not self.packed_prefill or self.config.max_batch < 2):
                continue  # (no iteration admits two requests: the packed prefill never runs)
            if sum(blocks_needed(n + 1, bs) for n in lengths) > allocator.num_free:
                continue
            prompts = [torch.zeros(n + 1, width, dtype=torch.int64) for n in lengths]
            tables: list[list[int]] = []
            try:
                for n in lengths:
                    tables.append(allocator.allocate(blocks_needed(n + 1, bs)))
                if len(lengths) > 1:
                    self.runner.prefill_packed(prompts, tables)
                else:
                    self.runner.prefill(prompts[0], tables[0])
            finally:
                for table in reversed(tables):  # (reversed: the free list's order comes back as it was)
                    allocator.free(table)
        self.runner.prefill_passes = passes
        if self.device.type == "cuda":  # (this stream only: a device-wide sync breaks another's capture)
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter() - t0

    def _variants(self) -> tuple:
        """Step variants (one graph each per bucket): on CUDA, the sampler has a fast top-k path."""
        return ("topk", "sort") if self.device.type == "cuda" else (None,)

    def _sampler_variant(self):
        """ "topk" when every running row has 0 < top_k <= SAMPLER_TOPK_CAP: the sampler then only sorts
        the top SAMPLER_TOPK_CAP candidates (same draws); otherwise "sort" (full sort)."""
        if self.device.type != "cuda":
            return None
        if all(0 < r.params.top_k <= SAMPLER_TOPK_CAP for r in self.scheduler.running):
            return "topk"
        return "sort"

    def _default_num_blocks(self, max_blocks_per_seq: int, dtype) -> int:
        """The pool's blocks (scratch included): at most what max_batch full-context requests could ever
        hold (more would never be used); within that, on CUDA kv_memory_fraction of the free memory, on
        a CPU at most CPU_KV_BYTES yet one full context."""
        mc, cfg = self.model.config, self.config
        per_block = PagedKVCache.bytes_per_block(
            mc.n_layer, cfg.block_size, mc.n_local_heads, mc.head_dim, dtype
        )
        wanted = cfg.max_batch * max_blocks_per_seq + 1
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(2, min(wanted, int(free * cfg.kv_memory_fraction) // per_block))
        return min(wanted, max(max_blocks_per_seq + 1, CPU_KV_BYTES // per_block))

    def kv_info(self) -> dict:
        """The KV pool: `blocks` usable (the scratch block left out), `block_size` tokens, `bytes` of the
        whole pool, `used_blocks` now, and the `memory_fraction` that sized it (None: a CPU, or
        num_blocks given)."""
        used, usable = self.kv_usage()
        sized = self.device.type == "cuda" and self.config.num_blocks is None
        return {
            "blocks": usable,
            "used_blocks": used,
            "block_size": self.config.block_size,
            "bytes": self.kv.nbytes,
            "memory_fraction": self.config.kv_memory_fraction if sized else None,
        }

    def _attention_backend(self, name: str):
        if name == "torch" or (name == "auto" and self.device.type != "cuda"):
            return None
        if not kernel_head_dim_ok(self.model.config.head_dim):
            if name == "triton":
                raise ValueError(
                    "the Triton paged attention needs a power-of-two head_dim >= 16, not "
                    f"{self.model.config.head_dim}"
                )
            return None
        try:
            from tts.model.kernels.paged_attention import triton_paged_decode_attention
        except ImportError as exc:
            if name == "triton":
                raise
            log.warning("Triton paged attention unavailable (%s); using the torch implementation", exc)
            return None
        return triton_paged_decode_attention

    # ---- API for callers (any thread) --------------------------------------------------------------

    @staticmethod
    def _guard_aligner(cfg: EngineConfig) -> AlignerSpec | None:
        """The aligner the frame step computes: the model's, when the loop guard is on and can rewind
        (a rewind does not rebuild the repetition penalty's history, so a model with one is unguarded)."""
        if cfg.aligner is None or not cfg.loop_guard:
            return None
        if cfg.repetition is not None:
            log.warning("the loop guard is off: it cannot rewind a model with a repetition penalty")
            return None
        return cfg.aligner

    @property
    def loop_guard(self) -> bool:
        """Whether requests submitted with a text span are guarded against repetition loops."""
        return self.runner.aligner is not None

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(
        self,
        prompt: torch.Tensor,
        params: SamplingParams,
        request_id: str | None = None,
        text_span: tuple[int, int] | None = None,
        sequence: str | None = None,
        end_floor: int = 0,
        playback: Playback | None = None,
    ) -> Request:
        """Queue a request. text_span: the prompt positions `[start, end)` of the text it speaks, for the
        loop guard (`tts.engine.aligner`; ignored without one, and for spans longer than
        ALIGN_MAX_TOKENS); a guarded request's end token is refused before its text is said, or before
        `end_floor` frames (`Engine._refuse_end`). sequence: a session's kept sequence
        (`tts.engine.sequences`; created when new): the prompt's prefix that the sequence holds is not
        prefilled again, and the request's K/V go back to it when it ends; `Request.cached` says how many
        positions were reused. playback: the stream's playback clock, shared by a job's requests (for
        real-time admission; None: not a stream). Raises InvalidRequest (bad parameters or prompt, too
        long), QueueFull, or ValueError when another request holds the sequence."""
        self.check_prompt(prompt)
        request = Request(request_id or self.new_request_id(), prompt, params, playback=playback)
        request.arrival_time = self.clock()
        if text_span is not None:
            start, end = text_span
            if not (type(start) is int and type(end) is int and 0 <= start < end <= request.prompt_len):
                raise ValueError(
                    f"text_span {text_span} is not inside the prompt ({request.prompt_len} tokens)"
                )
            if self.loop_guard and end - start <= ALIGN_MAX_TOKENS:
                request.text_span = (start, end)
                request.guard = LoopGuard(end - start, request.prompt[start:end, 0].tolist())
                request.end_floor = end_floor
        with self._lock:
            if request.request_id in self._requests:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            if sequence is not None:
                self.scheduler.check(request)
                self._take_sequence(request, sequence)
            try:
                self.scheduler.add(request)
            except Exception:
                if sequence is not None:
                    self._return_sequence(request, keep=request.cached)
                raise
            self._requests[request.request_id] = request
        return request

    # ---- kept sequences (tts.engine.sequences) -------------------------------------------------------

    def _take_sequence(self, request: Request, seq_id: str) -> None:
        """(lock held) Hand the kept sequence's reusable prefix blocks to `request`; free the rest."""
        seq = self.sequences.setdefault(seq_id, KeptSequence(seq_id))
        if seq.busy:
            raise ValueError(f"sequence {seq_id!r} is in use by another request")
        cached = common_prefix(seq.columns, request.prompt)
        held = max(seq.length, seq.dropped)  # (what it held before an eviction, if it was evicted)
        self.reprefill_tokens += max(min(held, request.prompt_len - 1) - cached, 0)
        seq.dropped = 0
        keep = blocks_needed(cached, self.config.block_size)
        if seq.blocks[keep:]:
            self.scheduler.allocator.free(seq.blocks[keep:])
        request.blocks, request.cached, request.sequence = seq.blocks[:keep], cached, seq_id
        seq.blocks, seq.columns, seq.busy = [], None, True

    def _return_sequence(self, request: Request, keep: int) -> None:
        """(lock held) A session's request ends: the K/V of its first `keep` positions (their columns:
        its prompt, then its recorded frames) go back to its kept sequence; its other blocks stay on
        `request.blocks` for the scheduler to free."""
        seq = self.sequences.get(request.sequence or "")
        if seq is None:
            return
        bs = self.config.block_size
        n = blocks_needed(keep, bs)
        held = request.prompt
        if keep > request.prompt_len:
            frames = torch.tensor(request.columns[: keep - request.prompt_len], dtype=torch.int64)
            held = torch.cat([held, frames.view(-1, held.shape[1])])
        seq.columns = held[:keep].clone() if keep else None
        seq.blocks, request.blocks = request.blocks[:n], request.blocks[n:]
        seq.busy = False
        seq.last_used = time.monotonic()
        request.sequence = None

    def release_sequence(self, seq_id: str) -> int:
        """Free an idle kept sequence's blocks and forget it (a session closed or timed out). Returns the
        blocks freed. A sequence that a request holds is forgotten when that request ends (its blocks are
        then freed). No-op for an unknown id."""
        with self._lock:
            seq = self.sequences.pop(seq_id, None)
            if seq is None:
                return 0
            if seq.busy:
                for request in self._requests.values():
                    if request.sequence == seq_id:
                        request.sequence = None  # its blocks are freed when it ends
                return 0
            freed = len(seq.blocks)
            if seq.blocks:
                self.scheduler.allocator.free(seq.blocks)
            seq.blocks, seq.columns = [], None
            return freed

    def sequence_blocks(self, seq_id: str) -> int:
        """KV blocks an idle kept sequence holds now (0 when unknown or held by a request)."""
        seq = self.sequences.get(seq_id)
        return len(seq.blocks) if seq is not None else 0

    def _evict_for_waiting(self) -> None:
        """(lock held) When the head of the waiting queue lacks blocks, free idle kept sequences, least
        recently used first, until it has them: a quiet session never starves others
        (tts.engine.sequences)."""
        s = self.scheduler
        if not s.waiting or s.num_running >= s.max_batch:
            return
        self._evict_idle_sequences(s.admission_blocks(s.waiting[0]))

    def _evict_idle_sequences(self, wanted: int) -> None:
        """(lock held) Free idle kept sequences, least recently used first, until `wanted` blocks are
        free (or none is left)."""
        s = self.scheduler
        idle = sorted(
            (q for q in self.sequences.values() if not q.busy and q.blocks), key=lambda q: q.last_used
        )
        for seq in idle:
            if s.allocator.num_free >= wanted:
                return
            s.allocator.free(seq.blocks)
            seq.dropped = seq.length
            seq.blocks, seq.columns = [], None
            seq.evicted += 1
            self.sequence_evictions += 1

    def check(self, prompt: torch.Tensor, params: SamplingParams) -> None:
        """Raise InvalidRequest if this prompt and parameters could never run here (no side effects)."""
        self.check_prompt(prompt)
        self.scheduler.check(Request("check", prompt, replace(params, seed=params.seed or 0)))

    def check_prompt(self, prompt: torch.Tensor) -> None:
        """Raise InvalidRequest unless `prompt` is `[T >= 1, 1 + N]` with token ids in the vocabulary
        and, at semantic positions, codes in `[0, codebook_size)` (an out-of-range id would otherwise
        fail inside the step and take the whole batch with it)."""
        c = self.model.config
        prompt = torch.as_tensor(prompt)
        if prompt.dim() != 2 or prompt.shape[0] < 1 or prompt.shape[1] != 1 + c.num_codebooks:
            raise InvalidRequest(
                f"prompt must be [T, {1 + c.num_codebooks}] frame columns, got {tuple(prompt.shape)}"
            )
        tokens = prompt[:, 0]
        if int(tokens.min()) < 0 or int(tokens.max()) >= c.vocab_size:
            raise InvalidRequest(f"prompt has a token id outside [0, {c.vocab_size})")
        semantic = (tokens >= c.semantic_begin_id) & (tokens <= c.semantic_end_id)
        codes = prompt[semantic, 1:]
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= c.codebook_size):
            raise InvalidRequest(f"prompt has an audio code outside [0, {c.codebook_size})")

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

    def is_running(self, request_id: str) -> bool:
        """Whether the request holds a batch row now (admitted, not finished)."""
        with self._lock:
            request = self._requests.get(request_id)
            return request is not None and request.state == RequestState.RUNNING

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
    def step(self, while_stepping: Callable[[], object] | None = None) -> list[StepOutput]:
        """One iteration (see the module docstring); returns its outputs. `while_stepping`: the caller's
        own host work, run once the frame step is launched and before its frame is read back, so that
        on CUDA it costs the step nothing (the GPU computes meanwhile); not run in an iteration with no
        running row. It may call `submit`, `cancel` and `set_paused` (applied at the next iteration, as
        from another thread) and must not raise: an exception fails the step."""
        # Outputs of an iteration that raised (cancels already applied) come out first: never lost.
        outputs, self._carried = self._carried, []
        try:
            return self._step(outputs, while_stepping)
        except BaseException:
            self._carried = outputs
            raise

    def _step(
        self, outputs: list[StepOutput], while_stepping: Callable[[], object] | None
    ) -> list[StepOutput]:
        """One iteration (see the module docstring), its outputs appended to `outputs`."""
        admitted = self._apply_pending(outputs)
        events, self._prefill_timed = self._events, False
        timed = self.realtime is not None or events is not None  # (whose samples a capture spoils)
        firsts = self._graph_firsts() if timed else 0
        phases, t0 = self.phase_seconds, self.clock()
        self._start(admitted, outputs)
        self._grow(outputs)
        n = self.scheduler.num_running
        t1 = self.clock()
        phases["prefill"] += t1 - t0
        if n == 0:
            return outputs
        if events is not None:
            events[2].record()
        out, launch, beside = self._frame_step(n, while_stepping)
        t2 = self.clock()
        phases["replay"] += t2 - t1 - beside  # (the caller's work beside the step is the caller's time)
        captured = timed and self._graph_firsts() != firsts
        device_step = None
        if events is not None and not captured:  # (complete: the frame's sync waited for events[3])
            if self._prefill_timed:
                self.device_seconds["prefill"] += events[0].elapsed_time(events[1]) / 1e3
            device_step = events[2].elapsed_time(events[3]) / 1e3
            self.device_seconds["replay"] += device_step
        self._row_outputs(out, outputs)
        phases["rows"] += self.clock() - t2
        if self.realtime is not None:
            self._time_iteration(
                admitted, n, t1 - t0, step_sample(t2 - t1, beside, device_step, launch), captured, t2
            )
        return outputs

    def _graph_firsts(self) -> int:
        """Graph warm-ups and captures so far, the frame step's and the prefill's (first uses, whose
        times say nothing of the next ones)."""
        runners = [self.graphs] + ([self.runner.prefill_graphs.graphs] if self.runner.prefill_graphs else [])
        return sum(g.stats.eager_warmup + len(g.graphs) + len(g.stats.failed_captures) for g in runners)

    def rows_for(self, n: int) -> int:
        """Rows a frame step for `n` running requests computes (its graph bucket, or n when eager)."""
        bucket = self.graphs.bucket_for(n) if self.graphs.enabled else None
        return bucket or n

    def _time_iteration(
        self,
        admitted: list[tuple[int, Request]],
        n: int,
        prefill: float,
        step: float,
        captured: bool,
        now: float,
    ) -> None:
        """Real-time admission's bookkeeping after a frame step that ended at `now`: the step's seconds,
        or when requests were admitted, the prefill's extra seconds (the iteration's, less the step's
        average: on CUDA a prefill's device time may show in the step's sync); then the streams' chunks.
        An iteration whose step ran a graph's warm-up or capture is no sample."""
        assert self.realtime is not None  # (the caller checks)
        times, rows = self.realtime.times, self.rows_for(n)
        if admitted and not captured:
            usual = times.step_seconds(rows, now)
            extra = prefill if usual is None else prefill + step - usual
            times.observe_prefill(sum(r.prefill_tokens for _, r in admitted), max(extra, 0.0))
        elif not captured:
            times.observe_step(rows, step, now)
        self.realtime.after_step(self.scheduler.running, now)

    def _apply_pending(self, outputs: list[StepOutput]) -> list[tuple[int, Request]]:
        """Apply the cancellations and pauses requested since the last iteration (cancelled requests'
        outputs appended to `outputs`), then admit waiting requests (idle kept sequences evicted first
        where the head of the queue lacks blocks). Returns the admitted (row, request) pairs."""
        with self._lock:
            cancels, self._pending_cancel = self._pending_cancel, {}
            pauses, self._pending_pause = self._pending_pause, {}
            for request_id, reason in cancels.items():
                request = self._requests.get(request_id)
                if request is not None:
                    outputs.append(self._finish(request, reason))
            for request_id, paused in pauses.items():
                request = self._requests.get(request_id)
                if request is not None:
                    request.paused = paused  # a waiting request starts paused (load_row honours it)
                    if request.state == RequestState.RUNNING:
                        row = self.scheduler.running.index(request)
                        self.runner.set_active(row, not (paused or request.stalled))
            if self.sequences:
                self._evict_for_waiting()
            return self.scheduler.admit(self._realtime_gate())

    def _realtime_gate(self) -> Gate | None:
        """The scheduler's admission gate with real-time admission on (tts.engine.realtime), else None."""
        realtime = self.realtime
        if realtime is None or not self.scheduler.waiting:
            return None
        now, running = self.clock(), self.scheduler.running
        # (a gathering head holds up the whole queue: not while a request that must not wait is in it)
        gather = realtime.gather > 0 and not any(map(realtime.must_not_wait, self.scheduler.waiting))

        def gate(request: Request, admitted: list[Request]) -> bool:
            rows = self.rows_for(len(running) + 1)
            return realtime.admits(request, admitted, running, rows, now, gather=gather)

        return gate

    def _frame_step(
        self, n: int, while_stepping: Callable[[], object] | None = None
    ) -> tuple[torch.Tensor, float, float]:
        """One frame step for the `n` running rows (graph replay or eager), `while_stepping` run once it
        is launched; returns its `out[:n]` on the host, the seconds its launch took on the host and the
        seconds `while_stepping` took."""
        t0 = self.clock()
        self.graphs.run(n, self._sampler_variant())
        if self._events is not None:  # (the step's end, for device_seconds)
            self._events[3].record()
        self.frame_steps += 1
        self.step_rows += n
        t1 = self.clock()
        if while_stepping is not None:
            while_stepping()
        t2 = self.clock()
        return self._frame_to_host(n), t1 - t0, t2 - t1

    def _row_outputs(self, out: torch.Tensor, outputs: list[StepOutput]) -> None:
        """Hand each running request its row of the step's `out` (`_row_output`), appended to `outputs`.
        Per-row work in plain Python values and one split: this runs every frame for every row."""
        cols = self.runner.out_layout
        flags = out[:, [cols.token, cols.emitted, cols.done, cols.align]].tolist()
        # frame columns as Python ints, for the loop guards' rewinds (only where there can be guards)
        kept = any(r.sequence is not None for r in self.scheduler.running)
        columns = out[:, cols.frame].tolist() if self.runner.aligner is not None or kept else None
        row_codes = out[:, cols.codes].split(1)
        no_codes = out[:0, cols.codes]
        # Iterate over a snapshot: finishing a request moves the last row into its place, so `row` (the
        # index into this step's `out`) is not always the request's row by then (`running.index` is).
        for row, (request, (token, emitted, done, position), codes) in enumerate(
            zip(list(self.scheduler.running), flags, row_codes, strict=True)
        ):
            if not emitted:  # paused: nothing emitted this step
                continue
            column = columns[row] if columns is not None else None
            output = self._row_output(request, token, done, position, codes, column, no_codes)
            if output is not None:
                outputs.append(output)

    def _row_output(
        self,
        request: Request,
        token: int,
        done: int,
        position: int,
        codes: torch.Tensor,
        column: list[int] | None,
        no_codes: torch.Tensor,
    ) -> StepOutput | None:
        """The output of a request whose row emitted a frame: `token` (its main token), `done` (the step
        ended it), `position` (its text position, with an aligner), `codes` `[1, N]`, `column` (the frame
        column as Python ints; None where no guard or kept sequence needs it), `no_codes` `[0, N]`. None:
        its end token was refused (nothing to hand out)."""
        request.num_generated += 1
        request.sampled += 1
        self.frames_generated += 1
        if request.end_masked:  # the step after a refused end token: the end token may come again
            self._unmask_end(request)
        stop = token == self.model.config.eos_token_id
        if stop and request.guard is not None and self._refuse_end(request):
            return None
        hold = 0
        if request.guard is not None and not stop:
            assert column is not None  # (a guard exists only where the runner has an aligner)
            retract = self._guard(request, position, column, bool(done))
            if retract is not None:
                return retract
            hold = self._hold(request)
        elif request.sequence is not None and column is not None:
            request.columns.append(column)  # what goes back to the kept sequence
        align = position if request.guard is not None and not stop else None
        end_codes = None
        # The end-token frame is not audio (docs/fish_dual_ar.md §1.4 step 8), except for 1.5
        # (FrameConvention).
        if stop:
            codes, end_codes = no_codes, codes
        if done:
            return self._finished_row(request, stop, codes, end_codes, align)
        return StepOutput(request.request_id, codes, hold=hold, align_position=align)

    def _finished_row(
        self,
        request: Request,
        stop: bool,
        codes: torch.Tensor,
        end_codes: torch.Tensor | None,
        align: int | None,
    ) -> StepOutput:
        """The step ended `request` (its end token, `stop`, or its budget): finish it with its last
        frame's `codes`, the end-token frame's `end_codes` and text position `align`."""
        reason = FinishReason.STOP if stop else FinishReason.LENGTH
        if stop and request.guard is not None and self._ends_early(request):
            reason = FinishReason.SHORT  # (refusals spent: words are missing; never `stop`)
        if request.looped:  # a repeat stayed in its frames (tts.engine.aligner.MAX_REWINDS)
            reason = FinishReason.LOOP
        with self._lock:
            finished = self._finish(request, reason)
        finished.codes = codes
        finished.end_codes = end_codes
        finished.align_position = align
        return finished

    def _guard(self, request: Request, position: int, column: list[int], done: bool) -> StepOutput | None:
        """Feed a guarded request's new frame (its column `[token, c_0 .. c_N-1]`, text `position`) to its
        loop guard. On a repeat that began after the text's end, the request ends there (reason STOP:
        its text was said), unless that leaves fewer than its min_new_frames; on another, it is rewound to
        REWIND_EXTRA_FRAMES before the repeat and
        samples RETRY_FRAMES frames hotter. Either way the returned output takes back the repeat's frames
        already handed out (the new frame is dropped too). Past MAX_REWINDS a repeat stays, and the
        request will end with reason LOOP. None: carry on with the frame."""
        guard = request.guard
        assert guard is not None  # (the caller checks)
        request.columns.append(column)
        if request.retry_until and request.num_generated >= request.retry_until:
            request.retry_until = 0
            p = request.params
            self.runner.set_sampling(self.scheduler.running.index(request), p.temperature, p.top_p)
        repeat = guard.push(int(position))
        if repeat is None or done or repeat.first < 1:
            return None
        if repeat.at_end and repeat.first < request.params.min_new_frames:
            return None  # the text was said, and the caller asked for more frames: what follows stays
        self.loop_repeats += 1
        if not repeat.at_end and guard.repeats > MAX_REWINDS:
            request.looped = True
            return None
        # after the text's end: cut at the repeat; else sample again from REWIND_EXTRA_FRAMES before it,
        # or from the oldest frame not yet released (after a rewind, frames before it may have gone)
        first = (
            repeat.first if repeat.at_end else max(1, repeat.first - REWIND_EXTRA_FRAMES, request.released)
        )
        frames = len(request.columns) - first  # frames first .. newest, the newest not handed out
        del request.columns[first:]
        guard.rewind(first)
        request.num_generated -= frames
        if repeat.at_end:
            with self._lock:
                finished = self._finish(request, FinishReason.LOOP if request.looped else FinishReason.STOP)
            finished.retract = frames - 1
            return finished
        begin = self.model.config.semantic_begin_id
        # the RAS window: the kept frames' main tokens, all but the first frame's (as `_advance` pushes)
        ras = [c[0] - begin for c in request.columns[1:]]
        row = self.scheduler.running.index(request)
        self.runner.rewind_row(row, frames, torch.tensor(request.columns[-1]), ras)
        p = request.params
        self.runner.set_sampling(row, max(p.temperature, RETRY_TEMPERATURE), max(p.top_p, RETRY_TOP_P))
        request.retry_until = request.num_generated + RETRY_FRAMES
        no_codes = torch.empty(0, self.model.config.num_codebooks, dtype=torch.int64)
        return StepOutput(request.request_id, no_codes, retract=frames - 1)

    @staticmethod
    def _ends_early(request: Request) -> bool:
        """Whether a guarded request's end token, sampled now, comes before its text was said: its
        furthest trusted position short of the text's last tokens (`LoopGuard.said_all`), or fewer
        frames than its `end_floor` (far fewer than its text's length predicts)."""
        assert request.guard is not None  # (the caller checks)
        return request.num_generated - 1 < request.end_floor or not request.guard.said_all()

    def _refuse_end(self, request: Request) -> bool:
        """The end token was sampled for a guarded request: if that is before its text was said
        (`_ends_early`), refuse it, at most MAX_END_REFUSALS times per request (and no more once
        MAX_STALLED_REFUSALS in a row found the text position no further on): the end-token frame is
        taken back (it is never audio, so nothing handed out changes) and the step is sampled again with
        the end token masked, through the same buffers as min_new_frames (`ModelRunner.set_min_frames`).
        Its step counter keeps counting, so the draw is new and the request stays reproducible. Returns
        whether it was refused (False: the request ends; `short` if it ends early)."""
        if request.end_refusals >= MAX_END_REFUSALS or not self._ends_early(request):
            return False
        reached = request.guard.reached() if request.guard is not None else -1
        stalled = request.end_refusals > 0 and reached <= request.end_reached
        if stalled and request.end_stalls + 1 >= MAX_STALLED_REFUSALS:
            return False
        request.end_stalls = request.end_stalls + 1 if stalled else 0
        request.end_reached = reached
        request.end_refusals += 1
        self.end_refusals += 1
        request.num_generated -= 1
        begin = self.model.config.semantic_begin_id
        last = request.columns[-1] if request.columns else request.prompt[-1].tolist()
        ras = [c[0] - begin for c in request.columns[1:]]
        row = self.scheduler.running.index(request)  # (now: a request finished this step may have moved it)
        self.runner.rewind_row(row, 1, torch.tensor(last), ras)
        self.runner.set_min_frames(row, request.sampled + 1)  # the next step's counter is `sampled`
        self.runner.set_active(
            row, not (request.paused or request.stalled)
        )  # (the step deactivated it: it was done)
        request.end_masked = True
        return True

    def _unmask_end(self, request: Request) -> None:
        """After the step that a refused end token masked: the row's min_frames back to the caller's
        min_new_frames plus every frame taken back (as `ModelRunner.rewind_row` keeps it)."""
        request.end_masked = False
        taken = request.sampled - request.num_generated
        row = self.scheduler.running.index(request)  # (now: a request finished this step may have moved it)
        self.runner.set_min_frames(row, request.params.min_new_frames + taken)

    @staticmethod
    def _hold(request: Request) -> int:
        """How many of a guarded request's newest frames (its latest included) its consumer must keep
        unheard: what its guard may still take back, less frames released before (StepOutput.hold)."""
        assert request.guard is not None  # (the caller checks)
        kept = len(request.columns)
        hold = min(request.guard.retractable(), kept - request.released)
        request.released = kept - hold
        return hold

    def _frame_to_host(self, n: int) -> torch.Tensor:
        """The step's `out[:n]` on the host, copied before the next step overwrites it. On CUDA through a
        pinned buffer and an event whose wait releases the GIL: the codec stage's worker thread runs
        Python while this thread waits for the frame (a plain `.to("cpu")` waits holding the GIL)."""
        out = self.runner.buffers.out
        if self.device.type != "cuda":
            return out[:n].to("cpu", copy=True)  # (on a CPU device .cpu() would alias the buffer)
        if self._host_out is None:
            self._host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self._out_ready = torch.cuda.Event()
        assert self._out_ready is not None  # made together with _host_out
        self._host_out[:n].copy_(out[:n], non_blocking=True)
        self._out_ready.record()
        self._out_ready.synchronize()
        return self._host_out[:n].clone()

    def fail_all(self, error: str) -> list[StepOutput]:
        """End every request with an error (the step raised); frees all their blocks. Also returns the
        outputs that the failed iteration had produced before it raised (e.g. cancellations)."""
        outputs, self._carried = self._carried, []
        with self._lock:
            return outputs + [
                self._finish(r, FinishReason.ERROR, error)
                for r in list(self.scheduler.running) + list(self.scheduler.waiting)
            ]

    def _grow(self, outputs: list[StepOutput]) -> None:
        """Before a frame step: give every running, unpaused request the KV block its next position
        needs (`Scheduler.grow`) and write it into its row's block table. The pool's policy when it runs
        out: idle sessions' kept sequences are evicted first (least recently used first); then a
        request without its block is stalled (its row inactive for the step, its blocks and row
        kept) while the others decode and free blocks as they finish; when no running request can
        decode, the most recently admitted stalled one ends with finish reason PREEMPTED (its blocks
        freed), and so on until one can. Never a CUDA out-of-memory, never a stream ended without its
        reason."""
        scheduler = self.scheduler
        while True:
            stalled: set[Request] = set()
            rows: list[int] = []
            cols: list[int] = []
            blocks: list[int] = []
            for row, request in enumerate(scheduler.running):
                if request.paused:
                    continue
                new = scheduler.grow(request)
                if new is None:
                    stalled.add(request)
                elif new:
                    first = len(request.blocks) - len(new)
                    rows += [row] * len(new)
                    cols += range(first, first + len(new))
                    blocks += new
            if blocks:
                self.runner.set_table_entries(rows, cols, blocks)
            if stalled and self.sequences:  # idle sessions' kept blocks go before a stream waits
                free = scheduler.allocator.num_free
                with self._lock:
                    self._evict_idle_sequences(free + sum(scheduler.blocks_missing(r) for r in stalled))
                if scheduler.allocator.num_free > free:
                    continue
            decoding = len(scheduler.running) - len(stalled) - sum(r.paused for r in scheduler.running)
            if not stalled or decoding > 0:
                break
            victim = max(stalled, key=lambda r: r.admission)
            self.kv_preemptions += 1
            log.warning(
                "KV cache full: ending %s (%d blocks) so that the other requests can go on",
                victim.request_id,
                len(victim.blocks),
            )
            with self._lock:
                outputs.append(
                    self._finish(
                        victim,
                        FinishReason.PREEMPTED,
                        f"the KV cache is full ({scheduler.allocator.num_usable} blocks of "
                        f"{self.config.block_size} tokens): request ended to free its blocks; retry later",
                    )
                )
        for row, request in enumerate(scheduler.running):
            stall = request in stalled
            if stall != request.stalled:
                request.stalled = stall
                self.kv_stalls += stall
                self.runner.set_active(row, not (request.paused or stall))

    def _start(self, admitted: list[tuple[int, Request]], outputs: list[StepOutput]) -> None:
        """Prefill the newly admitted requests and load their rows. A request whose prefill fails ends
        with an error; it is finished only after the others are loaded, because finishing compacts
        the rows (the last running row moves into the freed one)."""
        self.prefill_requests += len(admitted)
        for _, request in admitted:
            request.prefill_tokens = max(request.prompt_len - 1 - request.cached, 0)
            self.prefill_tokens += request.prefill_tokens
            self.reused_tokens += request.cached
        events = self._events if admitted else None
        if events is not None:
            events[0].record()
        failed = self._prefill([r for _, r in admitted])
        if events is not None:  # (before the rows' loads: the passes alone)
            events[1].record()
            self._prefill_timed = True
        for _, request in admitted:
            if not any(request is r for r, _ in failed):
                self._load_row(request)
        with self._lock:
            for request, error in failed:
                outputs.append(self._finish(request, FinishReason.ERROR, error))

    def _prefill(self, requests: list[Request]) -> list[tuple[Request, str]]:
        """Prefill `requests` (packed where the engine packs); returns those whose prefill failed, each
        with its error."""
        failed = []
        prefilled = False
        # Requests that continue a kept sequence prefill only their new positions, packed apart from the
        # fresh ones (their columns also attend to a cached prefix).
        fresh = [r for r in requests if not r.cached]
        if self.packed_prefill and len(fresh) > 1:
            try:
                self.runner.prefill_packed([r.prompt for r in fresh], [r.blocks for r in fresh])
                prefilled = True
            except Exception:  # one at a time below, so that only a bad prompt's request fails
                log.exception("packed prefill of %d requests failed; prefilling one by one", len(fresh))
        kept = [r for r in requests if r.cached]
        extended = False
        if self.packed_prefill and len(kept) > 1:
            try:
                alone = prefill_extend_packed(self.runner, [(r.prompt, r.blocks, r.cached) for r in kept])
                self.prefix_prefills_eager += alone if self.device.type == "cuda" else 0
                extended = True
            except Exception:  # one at a time below, as for the fresh requests
                log.exception(
                    "packed extension prefill of %d requests failed; prefilling one by one", len(kept)
                )
        for request in requests:
            try:
                if request.cached:
                    if not extended:
                        self.prefix_prefills_eager += self.device.type == "cuda"
                        prefill_extend(self.runner, request.prompt, request.blocks, request.cached)
                elif not prefilled:
                    self.runner.prefill(request.prompt, request.blocks)
            except Exception as exc:  # a bad prompt must not take the batch down
                log.exception("prefill failed for %s", request.request_id)
                failed.append((request, f"prefill failed: {exc}"))
        return failed

    def _load_row(self, request: Request) -> None:
        """Write a prefilled request's first input and parameters into its row's buffers."""
        p = request.params
        self.runner.load_row(
            self.scheduler.running.index(request),
            RowInit(
                last_column=request.prompt[-1],
                position=request.prompt_len - 1,
                block_table=request.blocks,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=request.seed,
                budget=p.max_new_frames,
                ras_len=p.ras_window,
                paused=request.paused,
                min_frames=p.min_new_frames,
                repetition_penalty=p.repetition_penalty,
                align_span=request.text_span,
            ),
        )

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> StepOutput:
        """(lock held) End a request, free its blocks, keep the running rows contiguous. A session's
        request first gives its kept sequence back what it keeps (tts.engine.sequences)."""
        if request.sequence is not None:
            if reason in (FinishReason.ERROR, FinishReason.PREEMPTED):  # (preempted: to free blocks)
                self._return_sequence(request, keep=0)
            elif reason == FinishReason.CANCELLED or request.state != RequestState.RUNNING:
                self._return_sequence(request, keep=request.cached)
            else:
                # every position written: the prompt and each kept frame but the newest (never fed back)
                self._return_sequence(request, keep=request.prompt_len + max(len(request.columns) - 1, 0))
        if request.playback is not None and request.state == RequestState.RUNNING:
            # every frame is final now, the last one too: what its consumer releases with it
            request.playback.advance(request.num_generated, self.clock())
            request.playback.end_request(request.num_generated)
        move: RowMove | None = self.scheduler.finish(request, reason, error)
        if move is not None:
            if move.src != move.dst:
                self.runner.move_row(move.src, move.dst)
            self.runner.clear_row(move.src)
        self._requests.pop(request.request_id, None)
        N = self.model.config.num_codebooks
        return StepOutput(request.request_id, torch.empty(0, N, dtype=torch.int64), True, reason, error)
