"""The codec stage: batched streaming decode (codes -> PCM) and reference encoding (PCM -> codes),
beside the frame step.

The job runner hands it work and takes results; it never waits for it. Each stream (one synthesis job)
owns a state slot of the codec's `BatchedStreamDecoder` from `open()` to `close()`. `decode(slot, tag,
codes)` queues frames; a worker thread takes everything queued when it is free and decodes it in ONE
call: one row per stream, the stream's queued pieces concatenated, ragged lengths, padded to a (rows,
frames) bucket. Under load the batch grows by itself: while one call runs, the next call's pieces
queue up.

Gathering (`gather` seconds, `tts serve --codec-gather-ms`; 0, the default: off): a call has a fixed cost
(S2-Pro's DAC decode in bfloat16, graph replay on an H100, docs/benchmarks.md: about 3 ms plus 0.05 ms a
frame; 3.5 ms for 1 x 16 frames, 15.6 ms for 16 x 16, 53 ms for 64 x 16), so many small calls back to back
take the GPU from the frame steps for little audio. With gathering the worker starts the next decode call
only when the queued work is worth a call, or when waiting longer would make a player run dry
(`gather_wait`). It starts the call at once when a stream's first piece is queued (the time to first
audio is never delayed), or when the queued pieces hold `gather_frames` frames (256 by default, 16 rows
of 16 frames: there the fixed part is down to a fifth of the call) or a row for each of `max_rows`
streams. Otherwise it waits until the oldest piece has waited `gather` seconds (the cap), or until the
earliest DEADLINE of the queued pieces less a margin, whichever comes first. A piece's deadline is when
its stream's player runs dry without it: the time (the stage's clock) when the audio released before it
will have played (the job runner computes it from the stream's playback clock, which real-time
admission keeps: tts.runtime.jobs); the margin (`gather_margin`) covers the call itself and the
delivery of its audio: twice the moving average of the recent calls' seconds plus GATHER_MARGIN_SECONDS.
A deadline that close already, or past, starts the call at once. So a stream's second chunk (4 frames
after a first chunk of 4: 186 ms of audio at S2-Pro's 21.5 frames/s, less the frame steps that made it)
waits only as long as its player can spare; a piece without a deadline (its playback clock unknown)
waits for the cap. The worker waits on its condition variable with that timeout; new work wakes it to
decide again. A queued reference encode runs while pieces gather (it never waits longer than without
gathering) where its recent seconds fit in their slack, else after their call; `stop` ends the wait at
once. `stats.gathered_calls` counts the calls gathering delayed,
`stats.slack_calls` those that a deadline started while the cap would have waited on.

Results (`results()`) come back per piece, in queue order per stream, as float32 numpy
samples; `notify()` wakes the runner's thread when they are ready.

Why a worker thread, not the engine thread (docs/DESIGN.md invariant 7, restated): two threads issue device
work, each on its own CUDA stream. The engine thread runs prefill and the frame steps on the current
stream; the codec worker runs decodes and encodes on the codec stream. They share no device tensors
(codes go in and PCM comes out through host memory), so nothing orders them and neither waits for the
other; the frame step's critical path has no sync on codec work. A codec call is many kernel launches
when it is not a CUDA graph (and a reference encode always is); on the engine thread those launches
would stall every running stream, on the worker they overlap the frame steps. On a CPU the worker is
the second core (torch releases the GIL inside ops).

On CUDA a decoder that is `graph_safe` is captured per (rows bucket, frames bucket): at start-up for the
shapes of first chunks and later chunks (`capture`, what `tts serve --graphs startup` does), any other
shape on its second use (`graphs.runner.GraphRunner`, one shared pool, thread-local capture mode);
`graphs=False` keeps it eager.
Inputs are staged in pinned host buffers and copied without blocking; the worker then waits for its
own stream only.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from graphs.runner import GraphRunner
from tts.codec.base import Codec
from tts.params import MAX_CHUNK_FRAMES

log = logging.getLogger(__name__)

# Rows per call when the decode is a CUDA graph. A pad row costs a real one: between the powers of two,
# buckets of 1.5x (at 64 streams a call took about 10 rows, which bucket 16 computed at 65%).
ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# Frames per call when the decode is a CUDA graph: few buckets, so that the start-up capture covers
# almost every call (first chunks: 4; later chunks (8, then 16) and the end of a stream, padded: 16);
# longer rows (pieces that queued up behind a slow call) take the larger ones. A padded frame costs a
# real one.
FRAME_BUCKETS = (4, 16, 32, 64, 128, 256)
MAX_PIECE_FRAMES = MAX_CHUNK_FRAMES  # the longest piece `decode` takes (an audio chunk's frames)
assert MAX_PIECE_FRAMES <= FRAME_BUCKETS[-1]
MAX_ROWS = 64  # the most rows (streams) one decode call holds, by default
MIN_ROWS = 16  # the fewest rows the job pipeline sizes a decode call for (whatever its max batch)


# Gathering's size target (frames queued): see the module docstring.
GATHER_FRAMES = 256
# Gathering's safety margin before a queued piece's deadline (`gather_margin`): a call started then must
# still decode, and its audio reach the player, before the player runs dry. The call's own time is
# measured (a moving average of the recent decode calls' seconds on the stage's clock, wall time:
# staging, the decode behind the frame steps that take the GPU first, the copy out), times
# GATHER_MARGIN_CALLS because the call that gathering starts is bigger than the average one (that is
# what it waited for: 16 rows cost 4x one row on an H100) and a call may meet a busier GPU; plus
# GATHER_MARGIN_SECONDS for what follows the call: the runner takes the audio between its iterations
# and the front hands it to the client.
GATHER_MARGIN_CALLS = 2.0
GATHER_MARGIN_SECONDS = 0.010
# Weight of a new decode call's seconds in that moving average (about the last 4-8 calls count).
CALL_EMA = 0.25


def _ema(average: float | None, sample: float) -> float:
    """A moving average (weight CALL_EMA) with `sample` added; the sample itself when there is none."""
    return sample if average is None else average + CALL_EMA * (sample - average)


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return buckets[min(bisect.bisect_left(buckets, n), len(buckets) - 1)]


@dataclass
class DecodeResult:
    """The audio of one queued piece: `samples` float32 `[frames * frame_length]`, or the `error` that
    failed its decode call (every piece of that call fails with it)."""

    tag: object
    slot: int
    frames: int
    samples: np.ndarray | None = None
    error: Exception | None = None


@dataclass
class _Piece:
    slot: int
    tag: object
    codes: Tensor  # [N, t] int64 on the CPU
    first: bool = False  # a stream's (a job's) first piece: its decode is never delayed by gathering
    queued_at: float = 0.0  # the stage's clock (seconds) when it was queued
    # When the stream's player runs dry without this piece (the stage's clock; None: not known)
    deadline: float | None = None

    @property
    def frames(self) -> int:
        return self.codes.shape[1]


def gather_bounds(
    pieces: Iterable[_Piece],
    now: float,
    *,
    gather: float,
    target_frames: int,
    max_rows: int,
    margin: float = 0.0,
) -> tuple[float, float]:
    """The two bounds on how long the codec worker may still wait before it starts a decode call of the
    queued `pieces` (in queue order; `now` on the clock of their `queued_at` and `deadline`), seconds >= 0:
    (cap, slack). cap, gathering's own rule: 0.0 when gathering is off (`gather <= 0`) or nothing is
    queued, when a piece is a stream's first, when the pieces hold `target_frames` frames or more or rows
    of `max_rows` streams or more; else until the oldest has waited `gather` seconds. slack: until the
    earliest `deadline` of the pieces less `margin` seconds (0.0 once that has passed; inf when no piece
    has a deadline). The worker waits for the smaller (`gather_wait`)."""
    if gather <= 0:
        return 0.0, 0.0
    frames = 0
    slots: set[int] = set()
    oldest = None
    earliest = math.inf
    for p in pieces:
        if p.first:
            return 0.0, math.inf
        frames += p.frames
        slots.add(p.slot)
        oldest = p.queued_at if oldest is None else min(oldest, p.queued_at)
        if p.deadline is not None:
            earliest = min(earliest, p.deadline)
    if oldest is None or frames >= target_frames or len(slots) >= max_rows:
        return 0.0, math.inf
    return max(0.0, oldest + gather - now), max(0.0, earliest - margin - now)


def gather_wait(pieces: Iterable[_Piece], now: float, **bounds: Any) -> float:
    """Seconds the codec worker should still wait before it starts a decode call of the queued `pieces`;
    0.0: start it now. The smaller of `gather_bounds` (same arguments): now when gathering is off or
    nothing is queued, when a piece is a stream's first, when the pieces hold `target_frames` frames or
    more or rows of `max_rows` streams or more; else when the oldest has waited `gather` seconds or when
    a piece's `deadline` is `margin` seconds away, whichever comes first."""
    return min(gather_bounds(pieces, now, **bounds))


@dataclass
class CodecStats:
    """Counters the metrics endpoint reports. Seconds are device time on CUDA (events around each
    call), wall time elsewhere."""

    decode_calls: int = 0
    decode_frames: int = 0
    decode_padded_frames: int = 0  # frames the calls computed: rows x frames of each padded call
    decode_rows: int = 0
    decode_seconds: float = 0.0
    encode_calls: int = 0
    encode_seconds: float = 0.0
    failures: int = 0
    gathered_calls: int = 0  # decode calls that gathering delayed (the worker waited for more pieces)
    # decode calls that a queued piece's deadline started while gathering's cap would still have waited
    slack_calls: int = 0


def codec_stream(device: torch.device, sms: int = 0) -> tuple[torch.cuda.Stream, object]:
    """The codec worker's CUDA stream and what keeps it valid: with `sms` 0 an ordinary stream of the
    lowest priority (the engine's kernels go first where both wait); with `sms` > 0 a stream of a green
    context of at least that many of the device's SMs (the driver rounds the count up to its SM-group
    granularity), so that the codec's launched kernels never occupy the whole GPU and the engine's
    short kernels always find SMs free (its other SMs stay the engine's alone; CUDA graphs replayed on
    it ignore the limit). Raises ValueError for an `sms` the device does not have, RuntimeError where
    torch, the cuda-bindings package or the driver has no green contexts, or the driver refuses that
    split."""
    if not sms:
        return torch.cuda.Stream(device, priority=0), None
    count = torch.cuda.get_device_properties(device).multi_processor_count
    if not 0 < sms < count:
        raise ValueError(f"codec SMs must be in 1..{count - 1} on this device ({count} SMs), got {sms}")
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as exc:
        raise RuntimeError(
            f"codec SMs need torch.cuda.green_contexts, which this torch lacks: {exc}"
        ) from exc
    try:
        context = GreenContext.create(num_sms=sms, device_id=device.index or 0)
        return context.Stream(), context
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise RuntimeError(
            f"a green context of {sms} SMs could not be made on {device} (it needs the cuda-bindings "
            f"package and a driver with green contexts): {exc}"
        ) from exc


class CodecStage:
    """See the module docstring.

    codec: the bundle's codec (its decoder runs on the codec's device). max_streams: slots (one per job
    in flight). notify: called (from the worker thread) whenever results or encodes are ready.
    graphs: capture CUDA graphs of the decode (CUDA and a graph-safe decoder only).
    max_rows / max_call_frames: the largest decode call (rows, at most max_streams, and rows bucket x
    frames bucket); more waits for the next call. A piece may hold at most MAX_PIECE_FRAMES frames.
    on_dead: called once (from the worker thread) with the error if the stage goes out of service.
    gather: seconds the oldest queued piece may wait for more work before a decode call (0: none, every
    call takes what is queued when the worker is free); gather_frames: the queued frames that start a
    call at once (see the module docstring, `gather_wait`). clock: seconds, monotonic, that the
    gathering reads, and the pieces' deadlines are on (tests pass their own). sms: CUDA SMs the
    decodes and encodes may use (0: all; `codec_stream`); with a limit the decode is launched kernel by
    kernel, never from a graph (a graph replayed on a green context's stream runs on every SM).

    Failures: a decode call, a reset or an encode that raises fails the work it held (its pieces'
    results carry the error), is counted (`stats.failures`) and logged once with its traceback. The
    streams it touched are marked broken: their state is undefined, so their later pieces fail too
    until a new `open` resets the slot. Then the stage checks itself with a probe (a reset and a
    one-frame decode of the scratch slot, which no stream uses): if that passes, the failure was the
    call's own and the stage serves on (every other stream's state is untouched: a call changes only
    its rows' slots); if it raises too (a broken device), the stage is dead: every queued job fails,
    `open`, `decode` and `encode` raise from then on, and `on_dead` tells the owner (the engine loop
    turns the replica's health NOT_SERVING).
    """

    def __init__(
        self,
        codec: Codec,
        max_streams: int,
        notify: Callable[[], None] = lambda: None,
        *,
        graphs: bool = True,
        max_rows: int = MAX_ROWS,
        max_call_frames: int = 1024,
        name: str = "tts-codec",
        on_dead: Callable[[Exception], None] | None = None,
        gather: float = 0.0,
        gather_frames: int = GATHER_FRAMES,
        clock: Callable[[], float] = time.monotonic,
        sms: int = 0,
    ):
        if not (math.isfinite(gather) and gather >= 0):
            raise ValueError(f"gather must be a number of seconds >= 0, got {gather}")
        if sms < 0:
            raise ValueError(f"sms must be >= 0 (0: all), got {sms}")
        self.sms = sms
        if gather_frames < 1:
            raise ValueError(f"gather_frames must be >= 1, got {gather_frames}")
        self.codec = codec
        self.max_streams = max_streams
        self.decoder = codec.batched_stream(max_streams)
        self.device = torch.device(self.decoder.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.device.type == "cuda"
        self._notify = notify
        # A call holds one row per stream: more rows than streams (e.g. the Python API's few) would only
        # cost buffers and start-up captures of graphs never replayed.
        max_rows = self.max_rows = min(max_rows, max_streams)
        self.max_call_frames = max(max_call_frames, MAX_PIECE_FRAMES)
        self.max_frames = MAX_PIECE_FRAMES
        self.gather = gather
        # (a call takes at most max_call_frames: a larger target would wait for the bound every time)
        self.gather_frames = min(gather_frames, self.max_call_frames)
        self.clock = clock
        # Moving average of the decode calls' seconds on `clock` (None before the first): the margin
        # gathering keeps before a deadline (`gather_margin`).
        self.call_seconds: float | None = None
        # Moving average of the reference encodes' seconds on `clock` (None before the first): an encode
        # runs ahead of gathering pieces only where it fits in their slack (`_next_turn`).
        self.encode_call_seconds: float | None = None
        self.stats = CodecStats()
        self._cv = threading.Condition()
        self._queue: deque[tuple] = deque()  # ("reset", slot) | ("decode", _Piece)
        self._encodes: deque[tuple[Tensor, Future]] = deque()
        self._results: deque[DecodeResult] = deque()
        self._tasks: deque[tuple[Callable[[], object], Future]] = deque()
        self._free = list(range(max_streams - 1, -1, -1))
        # Frames queued per slot (host side): a stream may not pass the decoder's position limit.
        self._frames = [0] * max_streams
        self.max_stream_frames: int | None = getattr(self.decoder, "max_frames", None)
        self._stopping = False
        self._busy = False
        self.dead: Exception | None = None  # set if the stage is out of service: every later call fails
        self.on_dead = on_dead
        # (worker thread) Slots whose state a failed call left undefined, and that call's error: their
        # pieces fail until the slot's next reset.
        self._broken: dict[int, Exception] = {}
        N = codec.num_codebooks
        pin = self.is_cuda
        # Staging buffers: the largest call's inputs (host, pinned on CUDA) and device copies whose
        # views [:rows], [:rows, :, :frames] a captured graph reads.
        self._h_slots = torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin)
        self._h_lengths = torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin)
        self._h_codes = torch.zeros(max_rows, N, self.max_frames, dtype=torch.int64, pin_memory=pin)
        self._slots = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self._lengths = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self._codes = torch.zeros(max_rows, N, self.max_frames, dtype=torch.int64, device=self.device)
        # Output: rows x frames x frame_length float32 of the largest call, viewed as [rows, frames * L].
        self._out: Tensor | None = None
        self._h_out: Tensor | None = None
        # The lowest priority (0): the engine thread's frame steps go first (EngineThread._use_step_stream);
        # or a green context's stream (`_green` keeps the context alive while the stream is used).
        self.stream: torch.cuda.Stream | None = None
        self._green: object = None
        if self.is_cuda:
            self.stream, self._green = codec_stream(self.device, sms)
        # (a graph replayed on a green context's stream runs on every SM: the limit needs launched kernels)
        use_graphs = graphs and not sms and self.is_cuda and getattr(self.decoder, "graph_safe", False)
        self.graphs = GraphRunner(
            self._decode_step,
            max_batch=max_rows,
            buckets=ROW_BUCKETS,
            enabled=use_graphs,
            device=self.device,
            capture_stream=torch.cuda.Stream(self.device) if use_graphs else None,
        )
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # ---- the runner's side (one thread) ------------------------------------------------------------

    def open(self) -> int:
        """A fresh stream: a free slot, reset before any of its decodes. Raises RuntimeError if none."""
        with self._cv:
            if self.dead is not None:
                raise self.dead
            if not self._free:
                raise RuntimeError(f"all {self.max_streams} codec streams are in use")
            slot = self._free.pop()
            self._frames[slot] = 0
            self._queue.append(("reset", slot))
            self._cv.notify()
        return slot

    def close(self, slot: int) -> None:
        """The stream ended: its slot may be reused (a later `open` resets it after this stream's queued
        work, which still completes; its results are delivered and may be ignored)."""
        with self._cv:
            self._free.append(slot)

    def decode(
        self,
        slot: int,
        tag: object,
        codes: Tensor,
        *,
        first: bool = False,
        deadline: float | None = None,
    ) -> None:
        """Queue `codes [N, t]` (int64, CPU, 1 <= t <= MAX_PIECE_FRAMES) of stream `slot`; its
        DecodeResult carries `tag`. first: the piece is the first audio of a job (a stream's first
        piece since `open` always is): gathering never delays its call. deadline: when the stream's
        player runs dry without this piece, on `clock` (seconds; None: not known): gathering starts its
        call before then (`gather_margin`)."""
        if not 1 <= codes.shape[1] <= MAX_PIECE_FRAMES:
            raise ValueError(f"a decode piece holds 1 to {MAX_PIECE_FRAMES} frames, got {codes.shape[1]}")
        limit = self.max_stream_frames
        if limit is not None and self._frames[slot] + codes.shape[1] > limit:
            raise ValueError(
                f"the audio passed the codec's limit of {limit} frames per stream "
                f"({limit / self.codec.frame_rate / 60:.0f} min)"
            )
        first = first or self._frames[slot] == 0
        self._frames[slot] += codes.shape[1]
        with self._cv:
            if self.dead is not None:
                raise self.dead
            self._queue.append(("decode", _Piece(slot, tag, codes, first, self.clock(), deadline)))
            self._cv.notify()

    def frames_left(self, slot: int) -> int | None:
        """Frames stream `slot` may still queue before the decoder's position limit (None: no limit). A
        stream kept across jobs (a session's) opens a fresh one when the next job might not fit."""
        limit = self.max_stream_frames
        return None if limit is None else limit - self._frames[slot]

    def encode(self, samples: Tensor) -> Future:
        """Queue an encode of mono float32 `samples [S]` at the codec's rate; the future's result is the
        codes `[N, T]` int64 on the CPU (or the exception)."""
        future: Future = Future()
        with self._cv:
            if self.dead is not None:
                future.set_exception(self.dead)
                return future
            self._encodes.append((samples, future))
            self._cv.notify()
        return future

    def capture(self, frames: tuple[int, ...]) -> Future:
        """Capture the decode graphs now (start-up capture) for calls of `frames` frames (each rounded up
        to its bucket) at every rows bucket that fits `max_call_frames`, largest first, so that serving
        never stops for a capture or a first eager call at these shapes. No-op without graphs. The warm-up
        calls run on pad rows (the scratch slot, length 0): no stream's state changes. Returns a future
        of the number of graphs captured."""
        future: Future = Future()
        if not self.graphs.enabled:
            future.set_result(0)
            return future
        with self._cv:
            self._tasks.append((lambda: self._capture(frames), future))
            self._cv.notify()
        return future

    def _capture(self, frames: tuple[int, ...]) -> int:
        L = self.codec.frame_length
        if self._out is None:
            size = self.max_call_frames * L
            self._out = torch.zeros(size, dtype=torch.float32, device=self.device)
            self._h_out = torch.zeros(size, dtype=torch.float32, pin_memory=self.is_cuda)
        self._slots.fill_(self.decoder.scratch_slot)
        self._lengths.zero_()
        self._codes.zero_()
        before = len(self.graphs.graphs)
        for T in sorted({_bucket(FRAME_BUCKETS, f) for f in frames}, reverse=True):
            for B in sorted(self.graphs.buckets, reverse=True):
                if B * T > self.max_call_frames or (B, T) in self.graphs.graphs:
                    continue
                self.graphs.run(B, T)  # the first use runs eagerly (cuDNN plans, allocator), ...
                self.graphs.run(B, T)  # ... the second captures and replays
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return len(self.graphs.graphs) - before

    def results(self) -> list[DecodeResult]:
        """Decode results ready since the last call (never blocks)."""
        with self._cv:
            out = list(self._results)
            self._results.clear()
        return out

    @property
    def free_slots(self) -> int:
        with self._cv:
            return len(self._free)

    @property
    def has_results(self) -> bool:
        with self._cv:
            return bool(self._results)

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing running, no result waiting to be taken."""
        with self._cv:
            return not (self._queue or self._encodes or self._results or self._tasks or self._busy)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the call in progress, fail queued encodes, end the worker."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # ---- the worker --------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a dead worker must fail its work, not hang it
            log.exception("the codec stage stopped")
            self._fail_everything(RuntimeError(f"the codec stage stopped: {type(exc).__name__}: {exc}"))

    def _fail_everything(self, error: Exception, held: list[_Piece] | None = None) -> None:
        """The stage is out of service: fail `held` (the pieces of the call in progress) and everything
        queued with `error`, refuse all later work, tell the owner (`on_dead`, once)."""
        with self._cv:
            first = self.dead is None
            self.dead = error
            pieces = list(held or []) + [item for kind, item in self._queue if kind == "decode"]
            encodes, self._queue, self._encodes = list(self._encodes), deque(), deque()
            tasks, self._tasks = list(self._tasks), deque()
            self._results.extend(DecodeResult(p.tag, p.slot, p.codes.shape[1], error=error) for p in pieces)
        for _, future in encodes + tasks:
            if not future.done():
                future.set_exception(error)
        if first and self.on_dead is not None:  # (before the notify: the owner wakes up knowing it)
            try:
                self.on_dead(error)
            except Exception:  # noqa: BLE001 - the owner's callback must not hide the failure
                log.exception("codec stage: on_dead callback failed")
        self._notify()

    def _failed(self, what: str, exc: Exception, rows: list[list[_Piece]], slots: list[int]) -> bool:
        """(worker) A call raised: fail its pieces, mark `slots` broken, count and log it once, then probe
        the stage. Returns False if the probe failed too (the stage is now dead)."""
        log.error("codec stage: %s failed; its requests fail", what, exc_info=exc)
        self.stats.failures += 1
        for slot in slots:
            self._broken[slot] = exc
        failed = [DecodeResult(p.tag, p.slot, p.codes.shape[1], error=exc) for row in rows for p in row]
        with self._cv:
            self._results.extend(failed)
        try:
            self._probe()
        except Exception as probe_exc:  # noqa: BLE001 - the device or the decoder is broken for good
            log.error(
                "codec stage: the probe after that failure failed too; out of service", exc_info=probe_exc
            )
            self._fail_everything(
                RuntimeError(f"the codec stage is out of service: {type(probe_exc).__name__}: {probe_exc}")
            )
            return False
        log.info("codec stage: the probe after that failure passed; serving on")
        return True

    def _probe(self) -> None:
        """(worker) Reset and decode one frame on the scratch slot (no stream's), then reset it again;
        raises whatever the decoder or the device raises."""
        scratch = torch.tensor([self.decoder.scratch_slot], dtype=torch.int64, device=self.device)
        codes = torch.zeros(1, self.codec.num_codebooks, 1, dtype=torch.int64, device=self.device)
        self.decoder.reset(scratch)
        self.decoder.decode(scratch, codes, torch.ones(1, dtype=torch.int64, device=self.device))
        self.decoder.reset(scratch)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _serve(self) -> None:
        if self.is_cuda:
            torch.cuda.set_device(self.device)
        with torch.inference_mode(), torch.cuda.stream(self.stream) if self.is_cuda else _null():
            gathered = False  # the worker waited for more pieces since its last decode call
            while True:
                with self._cv:
                    while True:
                        if not (self._queue or self._encodes or self._tasks or self._stopping):
                            self._cv.wait()
                            continue
                        if self._stopping or self._tasks or self._encodes:
                            break
                        left = min(self._gather_bounds())
                        if left <= 0:
                            break
                        gathered = True
                        self._cv.wait(left)  # new work wakes it to decide again
                    if self._stopping:
                        # Only the futures are used below: encodes and tasks fail alike.
                        encodes: list[tuple[object, Future]] = list(self._encodes)
                        self._encodes = deque()
                        encodes += list(self._tasks)
                        self._tasks.clear()
                        break
                    if self._tasks:
                        task, future = self._tasks.popleft()
                        self._busy = True
                    else:
                        task = None
                if task is not None:
                    try:
                        future.set_result(task())
                    except Exception as exc:  # noqa: BLE001 - reported through the future
                        future.set_exception(exc)
                    finally:
                        with self._cv:
                            self._busy = False
                    continue
                with self._cv:
                    resets, pieces, encode = self._next_turn(gathered)
                    gathered = gathered and not pieces
                    self._busy = True
                try:
                    alive = self._run_batch(resets, pieces, encode)
                finally:
                    with self._cv:
                        self._busy = False
                self._notify()
                if not alive:
                    return
        for _, future in encodes:
            future.set_exception(RuntimeError("the codec stage stopped"))

    def _next_turn(
        self, gathered: bool
    ) -> tuple[list[int], list[list[_Piece]], tuple[Tensor, Future] | None]:
        """(cv held) The next turn's work, taken off the queues: the resets and rows of a decode call
        (`_take_batch`) and an encode, or only an encode while the pieces gather (it goes in time the
        worker would wait, where its recent seconds fit in the pieces' slack before a deadline). A
        decode call is counted as gathered where the worker waited for more pieces since its last one
        (`gathered`), and as started by a deadline where gathering's cap alone would still wait."""
        cap, slack = self._gather_bounds()
        # (an encode that may outlast a piece's slack goes after the call: not measured yet, it may)
        fits = slack == math.inf or (
            self.encode_call_seconds is not None and self.encode_call_seconds < slack
        )
        if self._encodes and cap > 0 and slack > 0 and fits:
            return [], [], self._encodes.popleft()
        resets, pieces = self._take_batch()
        encode = self._encodes.popleft() if self._encodes and not pieces else None
        if pieces and gathered:
            self.stats.gathered_calls += 1
        if pieces and cap > 0:  # (slack is 0, or an encode would outlast it: a deadline started it)
            self.stats.slack_calls += 1
        return resets, pieces, encode

    def _run_batch(
        self, resets: list[int], rows: list[list[_Piece]], encode: tuple[Tensor, Future] | None
    ) -> bool:
        """(worker) One turn: the resets, the decode call, the encode. Whatever raises fails only the work
        it held (`_failed`). Returns False once the stage is dead."""
        if resets:
            try:
                self.decoder.reset(torch.tensor(resets, dtype=torch.int64).to(self.device))
            except Exception as exc:  # noqa: BLE001 - these streams fail; the others go on
                held = [row for row in rows if row[0].slot in resets]
                rows = [row for row in rows if row[0].slot not in resets]
                if not self._failed(f"reset of {len(resets)} streams", exc, held, resets):
                    self._fail_everything(self.dead or exc, [p for row in rows for p in row])
                    return False
            else:
                for slot in resets:
                    self._broken.pop(slot, None)
        broken = [row for row in rows if row[0].slot in self._broken]
        if broken:  # their state is undefined since a failed call: fail their pieces too
            with self._cv:
                self._results.extend(
                    DecodeResult(p.tag, p.slot, p.codes.shape[1], error=self._broken[p.slot])
                    for row in broken
                    for p in row
                )
            rows = [row for row in rows if row[0].slot not in self._broken]
        if rows:
            try:
                self._run_decode(rows)
            except Exception as exc:  # noqa: BLE001 - this call's streams fail; the others go on
                slots = [row[0].slot for row in rows]
                if not self._failed(f"decode of {len(rows)} streams", exc, rows, slots):
                    return False
        if encode is not None:
            self._run_encode(*encode)
            if self.dead is not None:
                return False
        return True

    def gather_margin(self) -> float:
        """Seconds before a queued piece's deadline at which gathering starts its call: GATHER_MARGIN_CALLS
        times the decode calls' moving-average seconds (`call_seconds`; 0 until one has been timed)
        plus GATHER_MARGIN_SECONDS (see their comment)."""
        return GATHER_MARGIN_CALLS * (self.call_seconds or 0.0) + GATHER_MARGIN_SECONDS

    def _gather_bounds(self) -> tuple[float, float]:
        """(cv held) The seconds the next decode call may still wait for more pieces: gathering's cap and
        the queued pieces' slack (`gather_bounds`)."""
        if self.gather <= 0:
            return 0.0, 0.0
        return gather_bounds(
            (item for kind, item in self._queue if kind == "decode"),
            self.clock(),
            gather=self.gather,
            target_frames=self.gather_frames,
            max_rows=self.max_rows,
            margin=self.gather_margin(),
        )

    def _take_batch(self) -> tuple[list[int], list[list[_Piece]]]:
        """(cv held) The resets and the rows of the next call: queued work in order, one row per slot
        (its pieces concatenated), while the padded call (rows bucket x frames bucket) stays within
        `max_rows` rows and `max_call_frames` frames. Stops before a reset of a slot that already has a
        row (that reset belongs after this call)."""
        resets: list[int] = []
        rows: dict[int, list[_Piece]] = {}
        frames: dict[int, int] = {}
        longest = 0
        while self._queue:
            kind, item = self._queue[0]
            if kind == "reset":
                if item in rows:
                    break
                resets.append(item)
            else:
                t = frames.get(item.slot, 0) + item.codes.shape[1]
                n = len(rows) + (item.slot not in rows)
                # A row is at most `max_frames` long (the staging buffers' width): a piece of a slot whose
                # row is full (e.g. a full-size chunk, then its text chunk's short tail) waits for the
                # next call, and so does everything queued behind it (per-slot order).
                if rows and (
                    n > self.max_rows
                    or t > self.max_frames
                    or _bucket(ROW_BUCKETS, n) * _bucket(FRAME_BUCKETS, max(longest, t))
                    > self.max_call_frames
                ):
                    break
                rows.setdefault(item.slot, []).append(item)
                frames[item.slot] = t
                longest = max(longest, t)
            self._queue.popleft()
        return resets, list(rows.values())

    def _run_decode(self, rows: list[list[_Piece]]) -> None:
        """(worker) One decode call of `rows` (one per slot, at most `max_frames` frames each); raises
        whatever the staging or the decoder raises (`_run_batch` fails the call's pieces)."""
        began = self.clock()  # (the call's time for gathering's margin: staging and copy-out included)
        L = self.codec.frame_length
        lengths = [sum(p.codes.shape[1] for p in row) for row in rows]
        n = len(rows)
        if self.graphs.enabled:  # padded to a captured shape
            T, B = _bucket(FRAME_BUCKETS, max(lengths)), self.graphs.bucket_for(n) or n
        else:  # eager: no padding (a padded frame costs a real frame's work)
            T, B = max(lengths), n
        h_codes, h_slots, h_lengths = self._h_codes, self._h_slots, self._h_lengths
        h_slots[:B] = self.decoder.scratch_slot
        h_lengths[:B] = 0
        h_codes[:B, :, :T] = 0
        for i, row in enumerate(rows):
            h_slots[i] = row[0].slot
            h_lengths[i] = lengths[i]
            h_codes[i, :, : lengths[i]] = torch.cat([p.codes for p in row], dim=1)
        if self._out is None:
            size = self.max_call_frames * L
            self._out = torch.zeros(size, dtype=torch.float32, device=self.device)
            self._h_out = torch.zeros(size, dtype=torch.float32, pin_memory=self.is_cuda)
        assert self._h_out is not None  # allocated together with self._out
        t0 = time.perf_counter()
        start = end = None
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        self._slots[:B].copy_(h_slots[:B], non_blocking=True)
        self._lengths[:B].copy_(h_lengths[:B], non_blocking=True)
        self._codes[:B, :, :T].copy_(h_codes[:B, :, :T], non_blocking=True)
        b = self.graphs.run(n, T)  # rows computed: n's bucket (pad rows set above) or n
        out = self._h_out[: n * T * L].view(n, T * L)
        out.copy_(self._out[: b * T * L].view(b, T * L)[:n], non_blocking=True)
        if self.is_cuda:
            assert start is not None and end is not None and self.stream is not None  # set on CUDA
            end.record()
            self.stream.synchronize()  # the worker's own stream only
            seconds = start.elapsed_time(end) / 1000.0
        else:
            seconds = time.perf_counter() - t0
        s = self.stats
        s.decode_calls += 1
        s.decode_rows += n
        s.decode_frames += sum(lengths)
        s.decode_padded_frames += b * T
        s.decode_seconds += seconds
        results = []
        for i, row in enumerate(rows):
            offset = 0
            for p in row:
                t = p.codes.shape[1]
                samples = out[i, offset * L : (offset + t) * L].numpy().copy()
                results.append(DecodeResult(p.tag, p.slot, t, samples))
                offset += t
        self.call_seconds = _ema(self.call_seconds, self.clock() - began)
        with self._cv:
            self._results.extend(results)

    def _decode_step(self, b: int, frames: int) -> None:
        """The captured (or eager) call: rows `[:b]` of the staging buffers, `frames` frames."""
        y = self.decoder.decode(self._slots[:b], self._codes[:b, :, :frames], self._lengths[:b])
        assert self._out is not None  # _run_decode and _capture allocate it before running a step
        self._out[: y.numel()].view(y.shape).copy_(y)

    def _run_encode(self, samples: Tensor, future: Future) -> None:
        t0, began = time.perf_counter(), self.clock()
        try:
            codes = self.codec.encode_audio(samples)
            if self.is_cuda:
                torch.cuda.current_stream(self.device).synchronize()
        except ValueError as exc:  # the clip (AudioError included): reported to the job that asked
            future.set_exception(exc)
            return
        except Exception as exc:  # noqa: BLE001 - reported to the job that asked; the stage checks itself
            future.set_exception(exc)
            self._failed("reference encode", exc, [], [])
            return
        finally:
            self.stats.encode_calls += 1
            self.stats.encode_seconds += time.perf_counter() - t0
            self.encode_call_seconds = _ema(self.encode_call_seconds, self.clock() - began)
        future.set_result(codes.cpu())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
