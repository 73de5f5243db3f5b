"""The engine thread: one thread owns the `Engine` and the codec and does all device work.

DESIGN.md invariant 7. `EngineLoop` builds the engine inside its own thread, warms it up, then runs
`Engine.step()` while there is work and sleeps on a condition variable otherwise. Other threads (the
gRPC handlers' asyncio loop, tests, the load benchmark's server) only call the thread-safe methods
`submit`, `cancel` (via `RequestStream.cancel`) and read `RequestStream` events:

* `submit(job)` admits a `SynthesisJob` (bounded: beyond `max_batch + max_waiting` jobs in flight it
  raises `Overloaded`) and returns its `RequestStream`;
* the engine thread encodes the job's reference clip if it has one (codec work is device work), builds
  each text chunk's prompt (`Frontend.prompt`: the previous chunk as context, as `TTS.stream` does),
  submits one engine request per text chunk in turn, and decodes the generated codes incrementally
  (`codec.stream()`, one decoder per job, so the stream is seamless across text chunks): the first audio
  chunk after `first_chunk_frames` frames, then every `chunk_frames`, the rest at the end;
* events reach the consumer through a thread-safe handoff: `loop.call_soon_threadsafe` into an
  `asyncio.Queue` for asyncio consumers, a `queue.Queue` otherwise;
* back-pressure: when `max_queued_chunks` audio chunks of one job wait unread, the engine thread pauses
  that job's engine request (`Engine.set_paused`; its row and blocks stay reserved, the rest of the
  batch runs on) and does not start its next text chunk; once the consumer has read the queue down to
  half the cap the job resumes. Memory per job is bounded by the cap plus one chunk of frames;
* cancel ends the job at the next iteration and frees its blocks and row (`Engine.cancel`);
* if `step()` raises, every job in flight fails with `EngineFailed` (`Engine.fail_all` frees all
  blocks) and the loop keeps serving new jobs.

Events a `RequestStream` yields, in order: `Started`, then `Audio` chunks (sequence 0, 1, 2, ... without
gaps, frame ranges contiguous), then `Finished`; or `Failed` at any point (and nothing after it).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from ..api import Frontend, PreparedReference
from ..bundle import ModelBundle
from ..prompt import Turn, VoiceReference
from .engine import Engine, EngineConfig
from .request import FinishReason, InvalidRequest, Request, SamplingParams, StepOutput

log = logging.getLogger(__name__)

DEFAULT_FIRST_CHUNK_FRAMES = 4
DEFAULT_CHUNK_FRAMES = 16
DEFAULT_MAX_QUEUED_CHUNKS = 8


class Overloaded(RuntimeError):
    """Admission refused: `max_batch + max_waiting` jobs are in flight. Maps to RESOURCE_EXHAUSTED."""


class LoopClosed(RuntimeError):
    """The loop is not accepting work (still warming up, shutting down or stopped). Maps to UNAVAILABLE."""


class Cancelled(RuntimeError):
    """The job was cancelled (by its consumer or at shutdown). Maps to CANCELLED."""


class EngineFailed(RuntimeError):
    """The engine failed while running the job (a step or prefill raised). Maps to INTERNAL."""


@dataclass
class SynthesisJob:
    """One synthesis as the engine thread runs it.

    chunks: normalized text chunks (`Frontend.plan`), generated in order, each with the previous one as
    context. params: sampling parameters with a resolved `seed` (text chunk i uses `seed + i`, as
    `TTS.stream` does); `max_new_frames` is the frame budget per text chunk. references: resolved voice
    references (preset voices); reference: a prepared clip still to be encoded (on the engine thread).
    first_chunk_frames / chunk_frames: audio chunk sizes in frames (>= 1).
    """

    chunks: list[str]
    params: SamplingParams
    references: list[VoiceReference] = field(default_factory=list)
    reference: PreparedReference | None = None
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    request_id: str | None = None


# ---- events --------------------------------------------------------------------------------------------


@dataclass
class Started:
    """The job's first engine request is queued (its inputs passed every check)."""

    request_id: str
    seed: int
    text_chunks: int


@dataclass
class Audio:
    """Audio chunk `sequence`: float32 mono `samples [S]` for frames `[frame_start, frame_end)` and the
    codes `[N, frame_end - frame_start]` int64 they were decoded from."""

    sequence: int
    samples: np.ndarray
    frame_start: int
    frame_end: int
    codes: Tensor


@dataclass
class Finished:
    """The job ended normally: `frames` generated in all, one finish reason per text chunk, and the
    monotonic times the job was submitted and its first audio chunk was queued."""

    frames: int
    finish_reasons: list[FinishReason]
    submitted_at: float
    first_audio_at: float | None


@dataclass
class Failed:
    """The job ended with `error` (InvalidRequest, AudioError, Cancelled, EngineFailed, LoopClosed)."""

    error: Exception


Event = Started | Audio | Finished | Failed


# ---- the consumer's side of one job -------------------------------------------------------------------


class RequestStream:
    """The consumer's handle on one job: `await next()` (asyncio) or `get()` (threads) its events,
    `cancel()` it. Created by `EngineLoop.submit`."""

    def __init__(self, loop: EngineLoop, job_id: str, aio_loop: asyncio.AbstractEventLoop | None):
        self.request_id = job_id
        self._loop = loop
        self._aio_loop = aio_loop
        self._aq: asyncio.Queue | None = asyncio.Queue() if aio_loop is not None else None
        self._q: queue.Queue | None = None if aio_loop is not None else queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0  # Audio events delivered and not yet taken
        self._paused = False  # set by the engine thread when the queue hit the cap
        self._resume_sent = False
        self.done = False  # the consumer has taken the final event (or cancelled)

    @property
    def queued_chunks(self) -> int:
        """Audio chunks waiting to be read (the back-pressure count)."""
        with self._lock:
            return self._queued

    @property
    def paused(self) -> bool:
        with self._lock:
            return self._paused

    async def next(self) -> Event:
        """The next event (asyncio consumers). Cancelling the awaiting task does not cancel the job:
        call `cancel()` (the gRPC handlers do, in a `finally`)."""
        assert self._aq is not None, "this stream was submitted without an asyncio loop; use get()"
        return self._took(await self._aq.get())

    def get(self, timeout: float | None = None) -> Event:
        """The next event (thread consumers); raises queue.Empty after `timeout` seconds."""
        assert self._q is not None, "this stream was submitted with an asyncio loop; use await next()"
        return self._took(self._q.get(timeout=timeout))

    def cancel(self) -> None:
        """Stop the job at the engine's next iteration and free its blocks and row (idempotent)."""
        if not self.done:
            self.done = True
            self._loop._post(("cancel", self.request_id))

    def _took(self, event: Event) -> Event:
        if isinstance(event, Finished | Failed):
            self.done = True
        elif isinstance(event, Audio):
            with self._lock:
                self._queued -= 1
                resume = self._paused and not self._resume_sent and self._queued <= self._loop.resume_level
                if resume:
                    self._resume_sent = True
            if resume:
                self._loop._post(("resume", self.request_id))
        return event

    # engine thread

    def _deliver(self, event: Event) -> bool:
        """Hand `event` to the consumer; returns False if the consumer's event loop is gone."""
        if isinstance(event, Audio):
            with self._lock:
                self._queued += 1
        if self._aio_loop is None:
            self._q.put(event)
            return True
        try:
            self._aio_loop.call_soon_threadsafe(self._aq.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody will read this stream
            return False
        return True

    def _pause_if_full(self, cap: int) -> bool:
        """Mark the stream paused if `cap` chunks wait unread. Atomic with the consumer's count, so a
        consumer that drains the queue meanwhile either prevents the pause or sees it and resumes."""
        with self._lock:
            if self._queued >= cap and not self._paused:
                self._paused = True
                return True
            return False

    def _set_paused(self, paused: bool) -> None:
        with self._lock:
            self._paused = paused
            if not paused:
                self._resume_sent = False


# ---- the engine thread's state of one job -------------------------------------------------------------


@dataclass(eq=False)
class _JobState:
    job_id: str
    job: SynthesisJob
    stream: RequestStream
    submitted_at: float
    decoder: object = None
    references: list[VoiceReference] = field(default_factory=list)
    index: int = 0  # current text chunk
    engine_id: str | None = None  # the engine request of the current text chunk, while it runs
    next_deferred: bool = False  # the next text chunk waits for the consumer (back-pressure)
    history: list[Turn] = field(default_factory=list)
    generated: list[Tensor] = field(default_factory=list)  # [1, N] codes of the current text chunk
    pending: list[Tensor] = field(default_factory=list)  # [1, N] codes not yet decoded
    frames_emitted: int = 0
    frames: int = 0
    sequence: int = 0
    reasons: list[FinishReason] = field(default_factory=list)
    first_audio_at: float | None = None
    paused: bool = False
    cancelled: bool = False


@dataclass
class LoopStats:
    """A snapshot the engine thread refreshes every iteration (read by metrics, tests, GetInfo)."""

    jobs: int = 0  # jobs in flight (admitted, not ended)
    running: int = 0  # engine requests decoding (rows in use)
    waiting: int = 0  # engine requests waiting for a row / blocks
    paused: int = 0  # jobs paused by back-pressure
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    frames_total: int = 0
    steps: int = 0
    step_failures: int = 0
    replay_share: float = 0.0


class EngineLoop:
    """Runs an `Engine` in a dedicated thread (see the module docstring).

    bundle: the model bundle (model, codec, prompt format). engine_config: the engine's sizing; its
    `max_waiting` is raised internally so that a job's later text chunks are never refused.
    max_waiting: jobs admitted beyond `max_batch` before `submit` raises Overloaded.
    max_queued_chunks: back-pressure cap of unread audio chunks per job.
    warmup: run one short synthesis before `wait_ready` returns (exercises prefill, the step, the codec).
    """

    def __init__(
        self, bundle: ModelBundle, engine_config: EngineConfig | None = None, *, max_waiting: int = 16,
        max_queued_chunks: int = DEFAULT_MAX_QUEUED_CHUNKS, warmup: bool = True, name: str = "tts-engine",
    ):  # fmt: skip
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if max_queued_chunks < 1:
            raise ValueError("max_queued_chunks must be >= 1")
        self.bundle = bundle
        cfg = replace(engine_config or EngineConfig())
        cfg.validate()
        self.max_jobs = cfg.max_batch + max_waiting
        cfg.max_waiting = max(cfg.max_waiting, self.max_jobs)  # every job has at most one engine request
        self.engine_config = cfg
        self.max_waiting = max_waiting
        self.max_queued_chunks = max_queued_chunks
        self.resume_level = max_queued_chunks // 2
        self._warmup = warmup
        self.engine: Engine | None = None
        self.frontend: Frontend | None = None
        self.stats = LoopStats()
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._admitted = 0  # jobs submitted and not ended (guarded by _cv)
        self._accepting = False
        self._closing = False
        self._stalled = False  # the last step made no progress: sleep until a command arrives
        self._jobs: dict[str, _JobState] = {}
        self._by_engine_id: dict[str, _JobState] = {}
        self._ids = itertools.count()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._fps_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=8192)
        self._fps_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        # Called on the engine thread once warm-up is done / once the thread is about to exit.
        self.on_ready: Callable[[], None] | None = None
        self.on_stopped: Callable[[], None] | None = None

    # ---- lifecycle (any thread) ----------------------------------------------------------------------

    def start(self) -> EngineLoop:
        """Start the engine thread (it builds the engine and warms up); returns at once."""
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine is built and warmed up. Re-raises a start-up failure; raises
        TimeoutError after `timeout` seconds."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the engine was not ready after {timeout} s")
        if self._start_error is not None:
            raise RuntimeError(f"engine start-up failed: {self._start_error}") from self._start_error

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._start_error is None

    @property
    def max_context(self) -> int:
        assert self.engine is not None, "engine not started"
        return self.engine.max_context

    def close_admission(self) -> None:
        """Refuse new jobs (LoopClosed); jobs in flight go on."""
        with self._cv:
            self._accepting = False

    def stop(self, timeout: float | None = 10.0) -> None:
        """End every job in flight (their streams get Failed(LoopClosed)), end the thread, join it."""
        with self._cv:
            self._accepting = False
            self._closing = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- work (any thread) ---------------------------------------------------------------------------

    def submit(self, job: SynthesisJob, aio_loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Admit `job`; returns its stream (events delivered into `aio_loop` if given).

        Raises Overloaded when `max_batch + max_waiting` jobs are in flight, LoopClosed when not accepting.
        Input errors found on the engine thread (reference encoding, prompt too long) arrive as Failed.
        """
        if not job.chunks:
            raise InvalidRequest("nothing to synthesize")
        if job.first_chunk_frames < 1 or job.chunk_frames < 1:
            raise InvalidRequest("chunk sizes must be >= 1 frame")
        if job.params.seed is None:
            raise ValueError("SynthesisJob.params.seed must be resolved before submission")
        return self._admit(job, aio_loop, internal=False)

    @property
    def in_flight(self) -> int:
        """Jobs admitted and not ended (submitted ones the engine thread has not picked up included)."""
        with self._cv:
            return self._admitted

    def check_request(self, prompt: Tensor, params: SamplingParams) -> None:
        """Raise InvalidRequest if an engine request with this prompt and params could never run
        (prompt + budget over the context size, more KV blocks than the pool). Read-only; any thread."""
        assert self.engine is not None, "engine not started"
        self.engine.scheduler.check(Request("check", prompt, params))

    def frames_per_second(self, window: float = 2.0) -> float:
        """Frames generated per second over the last `window` seconds (0 when idle)."""
        now = time.monotonic()
        with self._fps_lock:
            samples = list(self._fps_window)
        if not samples:
            return 0.0
        latest = samples[-1][1]
        older = [f for t, f in samples if t <= now - window]
        base = older[-1] if older else samples[0][1]
        span = window if older else max(now - samples[0][0], 1e-3)
        return max(0, latest - base) / span

    # ---- internals: commands -------------------------------------------------------------------------

    def _admit(self, job: SynthesisJob, aio_loop, internal: bool) -> RequestStream:
        with self._cv:
            if not internal and not self._accepting:
                reason = "shutting down" if self._ready.is_set() else "warming up"
                raise LoopClosed(f"the server is {reason}; not accepting requests")
            if not internal and self._admitted >= self.max_jobs:
                raise Overloaded(
                    f"server is at capacity: {self._admitted} requests in flight "
                    f"({self.engine_config.max_batch} decoding + {self.max_waiting} queued); retry later"
                )
            job_id = f"{job.request_id or 'job'}-{next(self._ids)}"  # unique, whatever the caller's id
            stream = RequestStream(self, job_id, aio_loop)
            self._admitted += 1
            self._inbox.append(("submit", _JobState(job_id, job, stream, time.monotonic())))
            self._stalled = False
            self._cv.notify()
        return stream

    def _post(self, command: tuple) -> None:
        with self._cv:
            self._inbox.append(command)
            self._stalled = False
            self._cv.notify()

    # ---- internals: the engine thread ----------------------------------------------------------------

    def _main(self) -> None:
        try:
            device = self.bundle.device
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.engine = Engine(self.bundle.model, self.engine_config)
            self.frontend = Frontend(self.bundle, self.engine.max_context)
            if self._warmup:
                self._run_warmup()
        except BaseException as exc:  # noqa: BLE001 - reported by wait_ready
            log.exception("engine start-up failed")
            self._start_error = exc
            self._ready.set()
            return
        with self._cv:
            self._accepting = not self._closing
        self._ready.set()
        if self.on_ready is not None:
            try:
                self.on_ready()
            except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
                log.exception("on_ready callback failed")
        try:
            while self._iterate(block=True):
                pass
        finally:
            self._shutdown()
            if self.on_stopped is not None:
                try:
                    self.on_stopped()
                except Exception:  # noqa: BLE001 - e.g. the consumer's event loop is already closed
                    log.debug("on_stopped callback failed", exc_info=True)

    def _run_warmup(self) -> None:
        t0 = time.perf_counter()
        params = replace(self.bundle.sampling, temperature=0.0, max_new_frames=4, seed=0)
        job = SynthesisJob(["Warm up."], params, first_chunk_frames=2, chunk_frames=2, request_id="warmup")
        stream = self._admit(job, None, internal=True)
        while not stream.done:
            self._iterate(block=False)
            try:
                while True:
                    event = stream.get(timeout=0)
                    if isinstance(event, Failed):
                        raise RuntimeError(f"warm-up synthesis failed: {event.error}") from event.error
            except queue.Empty:
                pass
        log.info("engine warm-up done in %.2f s", time.perf_counter() - t0)

    @torch.inference_mode()
    def _iterate(self, block: bool) -> bool:
        """One pass: apply commands, then one engine step if there is work. False once closing."""
        engine = self.engine
        with self._cv:
            while (
                block and not self._inbox and not self._closing and (self._stalled or not engine.has_work())
            ):
                self._cv.wait(timeout=1.0)
            commands, self._inbox = self._inbox, []
            closing = self._closing
        for command in commands:
            try:
                self._apply(command)
            except Exception as exc:  # noqa: BLE001 - a bug in one job must not stop the engine thread
                log.exception("engine loop: %s command failed", command[0])
                self._fail_job(command[1] if isinstance(command[1], str) else command[1].job_id, exc)
        if closing:
            return False
        if engine.has_work():
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the jobs, keep serving
                log.exception("engine step failed; failing every request in flight")
                self.stats.step_failures += 1
                outputs = engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                self._fail_jobs_without_request(EngineFailed(f"engine step failed: {exc}"))
            self.stats.steps += 1
            progressed = bool(outputs)
            for out in outputs:
                try:
                    self._route(out)  # includes the codec decode of this job's pending frames
                except Exception as exc:  # noqa: BLE001 - fail this job only
                    log.exception("engine loop: handling the output of %s failed", out.request_id)
                    self._fail_job(out.request_id.rpartition("/")[0], exc)  # engine id = job id/chunk
            with self._cv:
                if not progressed and not self._inbox:
                    self._stalled = True  # every running request is paused: wait for a command
        self._refresh_stats()
        return True

    def _apply(self, command: tuple) -> None:
        kind, arg = command
        if kind == "submit":
            self._start_job(arg)
            return
        state = self._jobs.get(arg)
        if state is None:
            return
        if kind == "cancel":
            state.cancelled = True
            if state.engine_id is not None:
                self.engine.cancel(state.engine_id)  # ends at the next step; routed as CANCELLED
            else:
                self._end(state, Failed(Cancelled("cancelled")))
        elif kind == "resume":
            state.paused = False
            state.stream._set_paused(False)
            if state.engine_id is not None:
                self.engine.set_paused(state.engine_id, False)
            elif state.next_deferred:
                state.next_deferred = False
                self._submit_chunk(state)

    def _start_job(self, state: _JobState) -> None:
        job = state.job
        self._jobs[state.job_id] = state
        state.decoder = self.bundle.codec.stream()
        try:
            state.references = list(job.references)
            if job.reference is not None:
                state.references.append(self.frontend.encode_reference(job.reference))
        except Exception as exc:  # noqa: BLE001 - bad input (AudioError, ...) or a codec failure
            self._end(state, Failed(exc))
            return
        if self._submit_chunk(state):
            self._deliver(state, Started(state.job_id, job.params.seed, len(job.chunks)))

    def _submit_chunk(self, state: _JobState) -> bool:
        """Queue the engine request of text chunk `state.index`; False (job ended) on failure."""
        job, i = state.job, state.index
        params = replace(job.params, seed=job.params.seed + i)
        engine_id = f"{state.job_id}/{i}"
        try:
            prompt = self.frontend.prompt(job.chunks[i], state.references, state.history, params)
            self.engine.submit(prompt, params, request_id=engine_id)
        except InvalidRequest as exc:
            prefix = f"text chunk {i + 1} of {len(job.chunks)}: " if len(job.chunks) > 1 else ""
            self._end(state, Failed(InvalidRequest(f"{prefix}{exc}")))
            return False
        except Exception as exc:  # noqa: BLE001 - QueueFull cannot happen (max_waiting is sized); be safe
            self._end(state, Failed(EngineFailed(f"cannot queue text chunk {i + 1}: {exc}")))
            return False
        state.engine_id = engine_id
        self._by_engine_id[engine_id] = state
        state.generated = []
        return True

    def _route(self, out: StepOutput) -> None:
        state = self._by_engine_id.get(out.request_id)
        if state is None:
            return
        if out.codes.numel():
            state.generated.append(out.codes)
            state.pending.append(out.codes)
            state.frames += out.codes.shape[0]
            size = state.job.first_chunk_frames if state.sequence == 0 else state.job.chunk_frames
            if len(state.pending) >= size:
                self._emit(state)
        if not out.finished:
            return
        del self._by_engine_id[out.request_id]
        state.engine_id = None
        if out.finish_reason == FinishReason.CANCELLED or state.cancelled:
            self._end(state, Failed(Cancelled("cancelled")))
        elif out.finish_reason == FinishReason.ERROR:
            self._end(state, Failed(EngineFailed(out.error or "engine error")))
        else:
            self._chunk_done(state, out.finish_reason)

    def _chunk_done(self, state: _JobState, reason: FinishReason) -> None:
        job = state.job
        state.reasons.append(reason)
        if state.generated:
            state.history = [Turn(job.chunks[state.index], torch.cat(state.generated).T)]
        state.index += 1
        if state.index < len(job.chunks):
            if state.paused:
                state.next_deferred = True  # started by the consumer's resume
            else:
                self._submit_chunk(state)
            return
        self._emit(state, final=True)
        self._end(state, Finished(state.frames, state.reasons, state.submitted_at, state.first_audio_at))

    def _emit(self, state: _JobState, final: bool = False) -> None:
        """Decode the pending frames into the next audio chunk and hand it over (back-pressure check)."""
        if state.pending:
            codes = torch.cat(state.pending).T  # [N, frames]
            samples = state.decoder.push(codes)
        else:
            codes = torch.zeros(self.bundle.codec.num_codebooks, 0, dtype=torch.int64)
            samples = torch.zeros(0)
        if final:
            samples = torch.cat([samples, state.decoder.flush()])
        if codes.shape[1] == 0 and samples.numel() == 0:
            return
        start = state.frames_emitted
        state.frames_emitted += codes.shape[1]
        state.pending = []
        pcm = samples.detach().to("cpu", torch.float32).numpy()
        audio = Audio(state.sequence, pcm, start, state.frames_emitted, codes)
        state.sequence += 1
        if state.first_audio_at is None:
            state.first_audio_at = time.monotonic()
        if not self._deliver(state, audio):
            return
        if not final and not state.paused and state.stream._pause_if_full(self.max_queued_chunks):
            state.paused = True
            if state.engine_id is not None:
                self.engine.set_paused(state.engine_id, True)

    def _deliver(self, state: _JobState, event: Event) -> bool:
        if state.stream._deliver(event):
            return True
        # The consumer's event loop is gone: nobody will read this job; stop it.
        if not state.cancelled:
            state.cancelled = True
            if state.engine_id is not None:
                self.engine.cancel(state.engine_id)
            else:
                self._end(state, None)
        return False

    def _end(self, state: _JobState, event: Event | None) -> None:
        if self._jobs.pop(state.job_id, None) is None:
            return
        if state.engine_id is not None:  # still in the engine (an error before its end): free it
            self.engine.cancel(state.engine_id)
            self._by_engine_id.pop(state.engine_id, None)
            state.engine_id = None
        if event is not None:
            state.stream._deliver(event)
        with self._cv:
            self._admitted -= 1

    def _fail_job(self, job_id: str | None, exc: Exception) -> None:
        state = self._jobs.get(job_id) if job_id is not None else None
        if state is not None:
            self._end(state, Failed(EngineFailed(f"{type(exc).__name__}: {exc}")))

    def _fail_jobs_without_request(self, error: Exception) -> None:
        for state in list(self._jobs.values()):
            if state.engine_id is None:
                self._end(state, Failed(error))

    def _refresh_stats(self) -> None:
        e, s = self.engine, self.stats
        s.jobs = self.in_flight
        s.running = e.num_running
        s.waiting = e.num_waiting
        s.paused = sum(1 for j in self._jobs.values() if j.paused)
        s.kv_blocks_used, s.kv_blocks_total = e.kv_usage()
        s.frames_total = e.frames_generated
        s.replay_share = e.graphs.stats.replay_share
        with self._fps_lock:
            self._fps_window.append((time.monotonic(), e.frames_generated))
            while len(self._fps_window) > 2 and self._fps_window[1][0] < time.monotonic() - 10.0:
                self._fps_window.popleft()

    def _shutdown(self) -> None:
        """(engine thread, closing) End every job: free the engine's requests, tell the consumers."""
        with self._cv:  # also reached if the loop itself crashed: refuse work from now on
            self._accepting = False
            self._closing = True
        for state in list(self._jobs.values()):
            if state.engine_id is not None:
                self.engine.cancel(state.engine_id)
        try:
            if self.engine.has_work():
                self.engine.step()  # applies the cancels: blocks and rows are freed
        except Exception:  # noqa: BLE001
            log.exception("engine step failed during shutdown")
            self.engine.fail_all("shutdown")
        for state in list(self._jobs.values()):
            self._by_engine_id.pop(state.engine_id or "", None)
            state.engine_id = None
            self._end(state, Failed(LoopClosed("the server shut down before the request finished")))
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for kind, arg in inbox:
            if kind == "submit":
                arg.stream._deliver(Failed(LoopClosed("the server shut down")))
                with self._cv:
                    self._admitted -= 1
        self._refresh_stats()
