"""The engine thread: one thread owns the `Engine` and drives the job pipeline (`JobPipeline`).

`EngineThread` builds the engine, the request planner and the job runner inside its own thread, warms
them up, then calls `JobPipeline.step()` while there is work and sleeps on a condition variable
otherwise (the codec stage wakes it when audio is decoded). Other threads (the gRPC and HTTP handlers'
asyncio loop, tests, the load benchmark) only call the thread-safe methods and read `RequestStream`
events:

* `submit(job)` admits a planned `SynthesisJob` (bounded: beyond `max_batch + max_waiting` jobs in
  flight it raises `Overloaded`) and returns its `RequestStream`; the job runs as `tts.runtime.jobs`
  describes;
* events reach the consumer through a thread-safe handoff: for asyncio consumers, gathered per event
  loop and handed over in one `call_soon_threadsafe` per loop (before each engine step and at the end
  of each iteration) into each stream's `asyncio.Queue`; a `queue.Queue` otherwise;
* back-pressure: the stream counts unread audio chunks; at `max_queued_chunks` the runner pauses the
  job, and once the consumer has read the queue down to half the cap it posts a resume;
* `cancel()` ends the job at the next iteration and frees its blocks, row and codec slot;
* `add_voice` / `delete_voice` / `voices` manage registered voices (encoding on the codec stage);
* if an engine step raises, every job in flight fails with `EngineFailed` and the loop keeps serving;
* a part that cannot recover (the codec stage dead, engine steps failing in a row: `JobPipeline.failure`)
  or a crash of the engine thread itself takes the whole replica out of service: `failure` says why,
  `on_failed(reason)` is called once (the server turns its health NOT_SERVING), jobs in flight fail with
  `EngineFailed`, and `submit` raises LoopClosed (UNAVAILABLE: retry on another replica).

Events a `RequestStream` yields, in order: `Started`, then `Audio` chunks (sequence 0, 1, 2, ... without
gaps, frame ranges contiguous), then `Finished`; or `Failed` at any point (and nothing after it).

Sessions (`tts.runtime.sessions`: text streamed in, speech out; what the gRPC bidi, Fish Audio WebSocket
and Wyoming fronts serve) run on the engine thread too: `open_session(...)` returns a `SessionStream`
whose commands (`send`, `flush`, `cancel`, `close`, `abort`) are posted to the engine thread and whose
events (`ChunkStarted`, `SessionAudio`, `WordTimings`, `ChunkEnded`, `SessionWarning`, last
`SessionEnded`) reach the consumer as a job's do (the same hand-over, back-pressure and pause timeout).
The engine thread calls `SessionManager.tick` after every runner step and wakes at the sessions' hold and
idle deadlines. At most `max_sessions` are open (beyond: SessionLimit, RESOURCE_EXHAUSTED / HTTP 429);
each keeps one codec stream and at most one engine request. On shutdown (or when the replica goes out of
service) every session ends with `SessionEnded(reason="shutdown")`.
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
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from tts.checkpoints.bundle import ModelBundle
from tts.engine.engine import Engine, EngineConfig, for_bundle
from tts.engine.request import Request, SamplingParams
from tts.environment import STEP_STREAM
from tts.params import DEFAULT_CHUNK_FRAMES, DEFAULT_FIRST_CHUNK_FRAMES, InvalidRequest
from tts.runtime.jobs import (
    Audio,
    Cancelled,
    EngineFailed,
    Event,
    Failed,
    Finished,
    JobPipeline,
    LoopClosed,
    Preempted,
    Started,
    ramp_sizes,
)
from tts.runtime.planner import Planner, PreparedReference, SynthesisJob
from tts.runtime.sessions import (
    BargeIn,
    ChunkEnded,
    ChunkStarted,
    Session,
    SessionAudio,
    SessionClosed,
    SessionEnded,
    SessionEvent,
    SessionLimit,
    SessionManager,
    SessionOptions,
    SessionSpec,
    SessionWarning,
    WordTimings,
)
from tts.runtime.voices import ReferenceCache, VoiceEntry, VoiceRegistry, codec_fingerprint
from tts.text.prompt import VoiceReference
from tts.text.stream_cut import utf8_len

log = logging.getLogger(__name__)
T = TypeVar("T")
E = TypeVar("E")

DEFAULT_MAX_QUEUED_CHUNKS = 8
DEFAULT_REFERENCE_CACHE_BYTES = 64 * 1024 * 1024

__all__ = [
    "Audio", "Cancelled", "EngineFailed", "EngineThread", "Event", "Failed", "Finished", "LoopClosed",
    "Overloaded", "Preempted", "RequestStream", "Started", "SynthesisJob",
    "ChunkEnded", "ChunkStarted", "SessionAudio", "SessionClosed", "SessionEnded", "SessionEvent",
    "SessionLimit", "SessionOptions", "SessionStream", "SessionWarning", "WordTimings", "BargeIn",
]  # fmt: skip

DEFAULT_MAX_SESSIONS = 16


def _built(part: T | None) -> T:
    """`part` of the engine (EngineThread.engine, .planner, .runner), built on the engine thread."""
    if part is None:
        raise RuntimeError("engine not started")
    return part


class Overloaded(RuntimeError):
    """Admission refused: `max_batch + max_waiting` jobs are in flight. Maps to RESOURCE_EXHAUSTED."""


# ---- the consumer's side of a stream of events ------------------------------------------------------


class _EventStream(Generic[E]):
    """The consumer's side of the events of one job (`RequestStream`) or one session (`SessionStream`):
    the engine thread `deliver`s them, the consumer takes them with `await next()` (asyncio) or `get()`
    (threads). Back-pressure: audio events (of class `_audio`) delivered and not yet taken are counted;
    the engine thread marks the stream paused once `cap` wait unread (`pause_if_full`), and the consumer
    posts one resume (`_post_resume`) once it has read them down to the loop's `resume_level`; the
    engine thread then clears the mark (`_set_paused`)."""

    _audio: type  # the audio event class: what back-pressure counts
    # Whether `pause_if_full` answers True again while the stream is paused (a session's next chunk, a
    # new job, must pause too); False: a job pauses once, until resumed.
    _pause_again = False

    def __init__(self, loop: EngineThread, aio_loop: asyncio.AbstractEventLoop | None):
        self._loop = loop
        self._aio_loop = aio_loop
        # (Any: the events, and a session's `_Cut` marks)
        self._aq: asyncio.Queue[Any] | None = asyncio.Queue() if aio_loop is not None else None
        self._q: queue.Queue[Any] | None = None if aio_loop is not None else queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0  # audio events delivered and not yet taken
        self._paused = False  # set by the engine thread when the queue hit the cap
        self._resume_sent = False
        self.done = False  # the consumer has taken the last event (a job: or cancelled it)

    @property
    def queued_audio(self) -> int:
        """Audio events waiting to be read (the back-pressure count)."""
        with self._lock:
            return self._queued

    @property
    def paused(self) -> bool:
        with self._lock:
            return self._paused

    async def next(self) -> E:
        """The next event (asyncio consumers)."""
        assert self._aq is not None, "this stream has no asyncio loop; use get()"
        while True:
            event = self._took(await self._aq.get())
            if event is not None:
                return event

    def get(self, timeout: float | None = None) -> E:
        """The next event (thread consumers); raises queue.Empty after `timeout` seconds."""
        assert self._q is not None, "this stream has an asyncio loop; use await next()"
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            event = self._took(self._q.get(timeout=left))
            if event is not None:
                return event

    def _took(self, event: Any) -> E | None:
        """The event the consumer takes (None: one it skips), its audio counted; posts the resume when
        the paused stream's unread audio is down to `resume_level` (once per pause)."""
        with self._lock:
            taken = self._taking(event)
            resume = False
            if isinstance(event, self._audio):
                self._queued -= 1
                resume = self._paused and not self._resume_sent and self._queued <= self._loop.resume_level
                if resume:
                    self._resume_sent = True
        if resume:
            self._post_resume()
        return taken

    def _taking(self, event: Any) -> E | None:
        """(lock held) What the consumer gets for `event` (None: skip it); marks `done` at the last."""
        raise NotImplementedError

    def _post_resume(self) -> None:
        """Ask the engine thread to resume the paused stream."""
        raise NotImplementedError

    # ---- the engine thread's side ------------------------------------------------------------------

    def deliver(self, event: Any) -> bool:
        """(engine thread only) Hand `event` to the consumer: at once to a thread consumer, at the
        engine loop's next flush to an asyncio one. Returns False if the consumer's event loop is gone
        (nobody will read this stream)."""
        if isinstance(event, self._audio):
            with self._lock:
                self._queued += 1
        if self._aio_loop is None:
            assert self._q is not None  # (a stream without an asyncio loop has the thread queue)
            self._q.put(event)
            return True
        if self._aio_loop.is_closed():
            return False
        # Handed over in one batch per event loop by EngineThread._flush (this is the engine thread).
        self._loop._outbox.setdefault(self._aio_loop, []).append((self, event))
        return True

    def pause_if_full(self, cap: int, unread_here: int = 0) -> bool:
        """(engine thread) Mark the stream paused and return True if `cap` audio events wait unread:
        those delivered and not taken, plus `unread_here` not delivered yet (a session's). Atomic with
        the consumer's count, so a consumer that drains the queue meanwhile either prevents the pause or
        sees it and resumes. While paused: True again only for a session (`_pause_again`)."""
        with self._lock:
            if self._queued + unread_here >= cap and (self._pause_again or not self._paused):
                self._paused = True
                return True
            return False

    def _set_paused(self, paused: bool) -> None:
        """(engine thread) The stream is paused or, after its resume, no longer."""
        with self._lock:
            self._paused = paused
            if not paused:
                self._resume_sent = False


def _put_all(batch: list[tuple]) -> None:
    """(a consumer's event loop) Queue a flushed batch of events, in delivery order."""
    for stream, event in batch:
        assert stream._aq is not None  # (streams with an event loop have the asyncio queue)
        stream._aq.put_nowait(event)


# ---- the consumer's side of one job -------------------------------------------------------------------


class RequestStream(_EventStream[Event]):
    """The consumer's handle on one job: `await next()` (asyncio) or `get()` (threads) its events,
    `cancel()` it. Created by `EngineThread.submit`. Cancelling a task that awaits `next()` does not
    cancel the job: call `cancel()` (the gRPC handlers do, in a `finally`). `queued_chunks`: the audio
    chunks waiting to be read (the back-pressure count)."""

    _audio = Audio

    def __init__(self, loop: EngineThread, job_id: str, aio_loop: asyncio.AbstractEventLoop | None):
        super().__init__(loop, aio_loop)
        self.request_id = job_id

    queued_chunks = _EventStream.queued_audio

    def cancel(self) -> None:
        """Stop the job at the engine's next iteration and free its blocks and row (idempotent)."""
        if not self.done:
            self.done = True
            self._loop._post(("cancel", self.request_id))

    def _taking(self, event: Event) -> Event:
        if isinstance(event, Finished | Failed):
            self.done = True
        return event

    def _post_resume(self) -> None:
        self._loop._post(("resume", self.request_id))


# ---- the consumer's side of one session ---------------------------------------------------------------


class _Cut:
    """(internal) Marks, in a session's event queue, where the engine thread applied a cancel or abort:
    audio delivered before it was generated before the barge-in and is discarded unread."""


class SessionStream(_EventStream[SessionEvent]):
    """The consumer's handle on one session of an `EngineThread` (made by `EngineThread.open_session`).

    Commands return at once; the engine thread applies them in order:
    * `send(text)`: add text. Raises InvalidRequest (not a string, or more than the session's
      `max_pending_bytes` waiting to be spoken: nothing of it is taken) and SessionClosed (after
      `close`/`abort`, or once the session ended). Text that reaches a session the engine has just ended
      (idle timeout, shutdown) is dropped: `SessionEnded` tells why.
    * `flush()`: speak the buffered text without waiting for a sentence end.
    * `cancel()`: barge-in. The audio and word timings queued unread are discarded at once (`next`/`get`
      never return them), the text not spoken is forgotten and the chunk in flight ends at the engine's
      next step (`ChunkEnded` "cancelled"), freeing its row and new KV blocks; the session stays open.
      The session clock counts the discarded audio: the next chunk's `sample_offset` leaves that gap.
    * `close()`: speak what is left, then end (`SessionEnded` "closed"). `abort()`: end now ("aborted";
      queued audio discarded as for `cancel`).
    Events: `await next()` (asyncio; or `async for`) or `get()` (threads), in order, `SessionEnded`
    last. Back-pressure: at `max_queued_chunks` unread audio events the chunk in flight pauses (its row
    kept), and resumes once half are read; one paused longer than the pause timeout while others wait for
    a row ends the session ("preempted"). `barge_in` describes the last barge-in (`BargeIn`, engine side),
    `discarded` counts the audio events barge-ins discarded unread.
    """

    _audio = SessionAudio
    _pause_again = True

    def __init__(
        self,
        loop: EngineThread,
        session_id: str,
        aio_loop: asyncio.AbstractEventLoop | None,
        max_pending_bytes: int,
    ):
        super().__init__(loop, aio_loop)
        self.session_id = session_id
        self._max_pending = max_pending_bytes
        self._pending = 0  # text bytes waiting in the session, as the engine thread last published
        self._in_transit = 0  # text bytes sent, not yet applied by the engine thread
        self._cutting = 0  # cancels not yet applied (their `_Cut` not yet taken): drop audio meanwhile
        self._closed = False  # close/abort called
        self._ended = False  # the engine thread ended the session
        self.discarded = 0  # SessionAudio events discarded unread by barge-ins (consumer side)
        self.barge_in: BargeIn | None = None  # the last barge-in's cost (set by the engine thread)

    # ---- commands (the consumer's thread) ----------------------------------------------------------

    def send(self, text: str) -> None:
        """Add a piece of text (see the class docstring for the errors)."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, not {type(text).__name__}")
        n = utf8_len(text)
        with self._lock:
            self._check_open("send text")
            waiting = self._pending + self._in_transit
            if waiting + n > self._max_pending:
                raise InvalidRequest(
                    f"text: {n} bytes would make {waiting + n} bytes waiting to be spoken in this session; "
                    f"at most {self._max_pending} (send less at a time, or wait for audio)"
                )
            self._in_transit += n
        self._loop._post(("session", (self.session_id, "send", text)))

    def flush(self) -> None:
        """Speak the text buffered so far. Raises SessionClosed after close/abort or once ended."""
        with self._lock:
            self._check_open("flush")
        self._loop._post(("session", (self.session_id, "flush", None)))

    def cancel(self) -> None:
        """Barge-in (see the class docstring). No-op once closed or ended."""
        with self._lock:
            if self._ended or self._closed:
                return
            self._cutting += 1
        self._loop._post(("session", (self.session_id, "cancel", None)))

    def close(self) -> None:
        """Speak what is left, then end. Idempotent."""
        with self._lock:
            if self._ended or self._closed:
                return
            self._closed = True
        self._loop._post(("session", (self.session_id, "close", None)))

    def abort(self) -> None:
        """End now, discarding the audio queued unread. Idempotent."""
        with self._lock:
            if self._ended:
                return
            self._closed = True
            self._cutting += 1
        self._loop._post(("session", (self.session_id, "abort", None)))

    def _check_open(self, what: str) -> None:
        if self._ended or self._closed:
            state = "has ended" if self._ended else "was closed"
            raise SessionClosed(f"cannot {what}: session {self.session_id} {state}")

    # ---- events (the consumer's thread) ------------------------------------------------------------

    def __aiter__(self):
        return self

    async def __anext__(self) -> SessionEvent:
        if self.done:
            raise StopAsyncIteration
        return await self.next()

    def _taking(self, event) -> SessionEvent | None:
        """(lock held) None for a cut mark, and for audio and word timings generated before a barge-in
        whose cut mark is not taken yet (discarded unread)."""
        if isinstance(event, _Cut):
            self._cutting -= 1
            return None
        if isinstance(event, SessionEnded):
            self.done = True
        elif self._cutting > 0 and isinstance(event, SessionAudio | WordTimings):
            self.discarded += isinstance(event, SessionAudio)
            return None
        return event

    def _post_resume(self) -> None:
        self._loop._post(("session", (self.session_id, "resume", None)))

    # ---- the engine thread's side ------------------------------------------------------------------

    def deliver(self, event) -> bool:
        """(engine thread) Hand `event` over (see `_EventStream.deliver`). False: nobody will read."""
        if isinstance(event, SessionEnded):
            with self._lock:
                self._ended = True
        return super().deliver(event)

    def _publish(self, pending: int, applied: int = 0) -> None:
        """(engine thread) The session's waiting text bytes now, after applying `applied` sent bytes."""
        with self._lock:
            self._in_transit -= applied
            self._pending = pending


@dataclass
class LoopStats:
    """A snapshot the engine thread refreshes every iteration (read by metrics, tests, GetInfo)."""

    jobs: int = 0  # jobs in flight (admitted, not ended)
    running: int = 0  # engine requests decoding (rows in use)
    waiting: int = 0  # engine requests waiting for a row / blocks
    paused: int = 0  # jobs paused by back-pressure
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes: int = 0  # the KV block pool's size
    kv_stalls: int = 0  # times a request waited for a KV block (the pool was full)
    kv_preemptions: int = 0  # requests ended to free KV blocks (RESOURCE_EXHAUSTED)
    frames_total: int = 0
    frame_steps: int = 0  # frame steps run
    step_rows: int = 0  # running rows summed over the frame steps (/ frame_steps: mean batch)
    prefill_passes: int = 0  # prefill forward passes (one request, or several packed)
    prefill_requests: int = 0  # requests prefilled (/ prefill_passes: requests per pass)
    prefill_replays: int = 0  # prefill passes replayed from a CUDA graph (tts.engine.prefill_graphs)
    loop_repeats: int = 0  # repeats the loop guard found (tts.engine.aligner)
    end_refusals: int = 0  # end tokens refused before the text was said (tts.engine.Engine._refuse_end)
    steps: int = 0
    step_failures: int = 0
    codec_failures: int = 0  # codec stage calls (decode, reset, encode) that raised
    failed: bool = False  # the replica is out of service (`EngineThread.failure`)
    replay_share: float = 0.0
    frame_step_seconds: float = 0.0  # wall time of engine steps (on CUDA: until the frame is on the host)
    # The engine thread's wall time by phase: prefill, replay, rows (inside engine steps), audio, route
    # (the job runner), commands (submissions, cancels), idle (waiting for work), handover (events to
    # asyncio consumers).
    phase_seconds: dict = field(default_factory=dict)
    # On CUDA, the device time of the engine steps' prefill and replay phases (`Engine.device_seconds`).
    device_seconds: dict = field(default_factory=dict)
    codec_decode_seconds: float = 0.0  # device time of codec decode calls (wall time on a CPU)
    codec_encode_seconds: float = 0.0
    codec_decode_calls: int = 0
    codec_decode_frames: int = 0
    codec_decode_padded_frames: int = 0  # rows x frames the padded calls computed
    codec_gathered_calls: int = 0  # decode calls the codec stage's gathering delayed
    codec_slack_calls: int = 0  # decode calls a player's deadline started before gathering's cap
    # The time to first audio split by phase (`JobPipeline.first_audio_seconds`), summed over the jobs
    # that had audio (`first_audio_jobs`).
    first_audio_seconds: dict = field(default_factory=dict)
    first_audio_jobs: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    sessions: int = 0  # sessions open (opened and not ended)
    barge_ins: int = 0  # chunks cancelled by a session's barge-in
    # Real-time admission (tts.engine.realtime; None / zeros when off): requests deferred at least once
    # by reason, requests admitted on their wait budget, the playing streams' least slack (seconds; None:
    # none plays) and the frame step's moving average at the running batch (seconds; None: unmeasured).
    realtime_deferred: dict = field(default_factory=dict)
    realtime_forced: int = 0
    realtime_rode_along: int = 0
    realtime_min_slack: float | None = None
    step_estimate: float | None = None
    barge_in_freed_steps: int = 0  # frame steps between those cancels and their rows freed, summed


class EngineThread:
    """Runs an `Engine` and its `JobPipeline` in a dedicated thread (see the module docstring).

    bundle: the model bundle. engine_config: the engine's sizing; its `max_waiting` is raised
    internally so that a job's later text chunks are never refused. max_waiting: jobs admitted beyond
    `max_batch` before `submit` raises Overloaded. max_queued_chunks: back-pressure cap of unread audio
    chunks per job. pause_timeout: seconds a paused job may hold its row while others wait (None:
    forever). voices_dir: where registered voices are kept (None: in memory only).
    reference_cache_bytes: capacity of the encoded-reference cache (0: off). codec_graphs: let the
    codec stage capture CUDA graphs. codec_gather: seconds a later audio chunk may wait in the codec
    stage for more work to share its decode call (0: none; `CodecStage`'s gather; less where its
    player would run dry first). codec_sms: SMs the codec's kernels may use (CUDA; 0: all). warmup: run
    one short synthesis before `wait_ready` returns.
    max_sessions: sessions open at most (`open_session` raises SessionLimit beyond). session_options:
    the sessions' default bounds and chunking. session_clock: seconds, monotonic, that the sessions' hold
    and idle timeouts read (tests pass their own, then call `wake()` after moving it).
    """

    def __init__(
        self,
        bundle: ModelBundle,
        engine_config: EngineConfig | None = None,
        *,
        max_waiting: int = 16,
        max_queued_chunks: int = DEFAULT_MAX_QUEUED_CHUNKS,
        pause_timeout: float | None = None,
        voices_dir=None,
        reference_cache_bytes: int = DEFAULT_REFERENCE_CACHE_BYTES,
        codec_graphs: bool = True,
        codec_gather: float = 0.0,
        codec_sms: int = 0,
        warmup: bool = True,
        name: str = "tts-engine",
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_options: SessionOptions | None = None,
        session_clock: Callable[[], float] = time.monotonic,
    ):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if max_queued_chunks < 1:
            raise ValueError("max_queued_chunks must be >= 1")
        if max_sessions < 0:
            raise ValueError("max_sessions must be >= 0")
        self.bundle = bundle
        cfg = replace(engine_config or EngineConfig())
        cfg.validate()
        self.max_jobs = cfg.max_batch + max_waiting
        self.max_sessions = max_sessions
        # Every job and every session has at most one engine request at a time.
        cfg.max_waiting = max(cfg.max_waiting, self.max_jobs + max_sessions)
        self.engine_config = cfg
        self.max_waiting = max_waiting
        self.max_queued_chunks = max_queued_chunks
        self.resume_level = max_queued_chunks // 2
        self.pause_timeout = pause_timeout
        self.fingerprint = codec_fingerprint(bundle.codec)
        self.voices = VoiceRegistry(
            bundle.voices,
            voices_dir,
            self.fingerprint,
            (bundle.codec.num_codebooks, bundle.codec.codebook_size),
        )
        self.reference_cache = ReferenceCache(reference_cache_bytes)
        self._codec_graphs = codec_graphs
        self.codec_gather = codec_gather
        self.codec_sms = codec_sms
        self._warmup = warmup
        # Built on the engine thread at start-up (`engine`, `planner`, `runner` read them).
        self._engine: Engine | None = None
        self._planner: Planner | None = None
        self._runner: JobPipeline | None = None
        self._sessions: SessionManager | None = None
        self.session_options = session_options or SessionOptions()
        self._session_clock = session_clock
        self._sessions_open = 0  # sessions opened (or being opened) and not ended (guarded by _cv)
        # (engine thread) The sessions with a consumer, by id, until their SessionEnded is handed over.
        self._session_streams: dict[str, tuple[Session, SessionStream]] = {}
        self._session_due: float | None = None  # time.monotonic() of the next hold/idle deadline
        self.stats = LoopStats()
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._admitted = 0  # jobs submitted and not ended (guarded by _cv)
        self._submitted: set[str] = set()  # (engine thread) ids of those the runner has
        self._accepting = False
        self._closing = False
        self._commands_seconds = 0.0  # engine thread: applying commands
        self._idle_seconds = 0.0  # engine thread: waiting for work
        self._handover_seconds = 0.0  # engine thread: handing events over to event loops (_flush)
        self._stalled = False  # the last iteration made no progress: sleep until a command or a wake
        self._woken = False
        # Events for asyncio consumers, by event loop, since the last _flush (engine thread only).
        self._outbox: dict[
            asyncio.AbstractEventLoop, list[tuple]
        ] = {}  # (RequestStream | SessionStream, event)
        self.handovers = 0  # call_soon_threadsafe calls made by _flush
        self._ids = itertools.count()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._fps_window: collections.deque[tuple[float, int]] = collections.deque(maxlen=8192)
        self._fps_lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        # Called on the engine thread once warm-up is done / once the thread is about to exit.
        self.on_ready: Callable[[], None] | None = None
        self.on_stopped: Callable[[], None] | None = None
        # Called once, from any thread, with the reason when the replica goes out of service (`failure`).
        self.on_failed: Callable[[str], None] | None = None
        self._crash: str | None = None  # why the engine thread itself died

    # ---- lifecycle (any thread) ----------------------------------------------------------------------

    def start(self) -> EngineThread:
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
        """Whether start-up (engine build, warm-up) succeeded: jobs can be submitted."""
        return self._ready.is_set() and self._start_error is None

    @property
    def started_up(self) -> bool:
        """Whether start-up has ended, successfully or not (then `wait_ready` raises its error)."""
        return self._ready.is_set()

    @property
    def accepting(self) -> bool:
        with self._cv:
            return self._accepting

    @property
    def engine(self) -> Engine:
        """The engine; RuntimeError until the engine thread has built it."""
        return _built(self._engine)

    @property
    def planner(self) -> Planner:
        """The planner; RuntimeError until the engine thread has built it."""
        return _built(self._planner)

    @property
    def runner(self) -> JobPipeline:
        """The job runner; RuntimeError until the engine thread has built it."""
        return _built(self._runner)

    @property
    def sessions(self) -> SessionManager:
        """The session manager (engine thread only); RuntimeError until the engine thread has built it."""
        return _built(self._sessions)

    @property
    def sessions_open(self) -> int:
        """Sessions opened and not ended (those the engine thread has not picked up included)."""
        with self._cv:
            return self._sessions_open

    def wake(self) -> None:
        """(any thread) Run an iteration now: the sessions' deadlines are checked (after a test moved the
        session clock)."""
        self._wake()

    @property
    def max_context(self) -> int:
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

    @property
    def failure(self) -> str | None:
        """Why this replica is out of service (a part failed and could not recover), None while it
        serves. Once set it stays: only a restart of the process brings the replica back."""
        if self._crash is not None:
            return self._crash
        runner = self._runner
        return runner.failure if runner is not None else None

    def _failed(self, reason: str) -> None:
        """(any thread) A part went out of service: refuse new work, wake the engine thread (it fails the
        jobs in flight), tell the owner."""
        with self._cv:
            self._woken = True
            self._stalled = False
            self._cv.notify()
        if self.on_failed is not None:
            try:
                self.on_failed(reason)
            except Exception:  # noqa: BLE001 - a broken callback must not hide the failure
                log.exception("on_failed callback failed")

    # ---- work (any thread) ---------------------------------------------------------------------------

    def submit(self, job: SynthesisJob, aio_loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Admit a planned `job`; returns its stream (events delivered into `aio_loop` if given).

        Raises Overloaded when `max_batch + max_waiting` jobs are in flight, LoopClosed when not accepting.
        Input errors found on the engine thread (a clip that does not encode) arrive as Failed.
        """
        if not job.chunks:
            raise ValueError("SynthesisJob has no text chunk")
        if job.params.seed is None:
            raise ValueError("SynthesisJob.params.seed must be resolved before submission")
        return self._admit(job, aio_loop, internal=False)

    @property
    def in_flight(self) -> int:
        """Jobs admitted and not ended (submitted ones the engine thread has not picked up included)."""
        with self._cv:
            return self._admitted

    def open_session(
        self,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        *,
        reference: PreparedReference | None = None,
        aio_loop: asyncio.AbstractEventLoop | None = None,
        normalize: bool = True,
        options: SessionOptions | None = None,
        session_id: str | None = None,
        **sampling,
    ) -> SessionStream:
        """Open a session (`tts.runtime.sessions`) on the engine thread; returns its `SessionStream`
        (events delivered into `aio_loop` if given, else read with `get()`).

        voice: a preset or registered voice name, or VoiceReference objects (None: the model's default);
        or reference: a clip checked by `tts.runtime.request.prepare_reference` (host work: the caller's
        worker thread), encoded once on the codec stage when the session opens (its first chunk waits).
        sampling: temperature, top_p, top_k, max_new_frames (per chunk), min_new_frames, seed (chunk i
        uses seed + i; random when not given), ras_window, repetition_penalty. options: bounds and
        chunking (None: the loop's `session_options`). session_id: a prefix for the session's id (made
        unique). Raises SessionLimit (`max_sessions` open: RESOURCE_EXHAUSTED / HTTP 429), LoopClosed
        (warming up, shutting down, out of service: UNAVAILABLE), InvalidRequest / VoiceNotFound (bad
        settings, a voice and a reference: INVALID_ARGUMENT / HTTP 400, 404 for the voice).
        """
        self._check_accepting()
        opts = options or self.session_options
        spec = self.sessions.plan(  # (off-thread checks)
            voice, reference=reference, normalize=normalize, options=opts, **sampling
        )
        with self._cv:
            self._check_accepting()
            if self._sessions_open >= self.max_sessions:
                raise SessionLimit(
                    f"server is at capacity: {self._sessions_open} sessions are open (at most "
                    f"{self.max_sessions}); close one or retry later"
                )
            sid = f"{session_id or 'session'}-{next(self._ids)}"
            stream = SessionStream(self, sid, aio_loop, opts.max_pending_bytes)
            self._sessions_open += 1
            self._inbox.append(("open_session", (sid, spec, stream)))
            self._stalled = False
            self._cv.notify()
        return stream

    def _check_accepting(self) -> None:
        """(any thread; _cv held or not) Raise LoopClosed unless new work is accepted."""
        if not self._accepting:
            reason = "shutting down" if self._ready.is_set() else "warming up"
            raise LoopClosed(f"the server is {reason}; not accepting requests")
        failure = self.failure
        if failure is not None:
            raise LoopClosed(f"this replica is out of service ({failure}); retry on another")

    def check_request(self, prompt: Tensor, params: SamplingParams) -> None:
        """Raise InvalidRequest if an engine request with this prompt and params could never run
        (prompt + budget over the context size, more KV blocks than the pool). Read-only; any thread."""
        self.engine.scheduler.check(Request("check", prompt, params))

    def add_voice(self, name: str, reference: PreparedReference, replace: bool = False) -> Future:
        """Register `reference` as voice `name`: checked now (raises InvalidRequest or VoiceExists),
        encoded on the codec stage, then stored (and persisted). Returns a future of the VoiceEntry."""
        runner = self.runner  # (raises if the engine is not started)
        self.voices.check_new(name, replace)
        result: Future = Future()

        def encoded(f: Future) -> None:
            try:
                entry = self.voices.add(name, VoiceReference(codes=f.result(), text=reference.text), replace)
            except Exception as exc:  # noqa: BLE001 - reported through the future
                result.set_exception(exc)
            else:
                result.set_result(entry)

        runner.stage.encode(reference.samples).add_done_callback(encoded)
        return result

    def delete_voice(self, name: str) -> None:
        """Remove a registered voice (raises VoiceNotFound, or InvalidRequest for a preset)."""
        self.voices.delete(name)

    def list_voices(self) -> list[VoiceEntry]:
        return self.voices.list()

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
            failure = self.failure
            if not internal and failure is not None:
                raise LoopClosed(f"this replica is out of service ({failure}); retry on another")
            if not internal and self._admitted >= self.max_jobs:
                self._inbox.append(("refused", None))
                self._cv.notify()
                raise Overloaded(
                    f"server is at capacity: {self._admitted} requests in flight "
                    f"({self.engine_config.max_batch} decoding + {self.max_waiting} queued); retry later"
                )
            job_id = f"{job.request_id or 'job'}-{next(self._ids)}"  # unique, whatever the caller's id
            stream = RequestStream(self, job_id, aio_loop)
            self._admitted += 1
            self._inbox.append(("submit", (job_id, job, stream)))
            self._stalled = False
            self._cv.notify()
        return stream

    def _post(self, command: tuple) -> None:
        with self._cv:
            self._inbox.append(command)
            self._stalled = False
            self._cv.notify()

    def _flush(self) -> None:
        """(engine thread) Hand the events delivered since the last flush to their consumers' event
        loops: one `call_soon_threadsafe` per event loop, not one per event. Each such call wakes the
        asyncio thread (a write to its self-pipe), which then runs the consumers' Python while this
        thread waits to take the GIL back; the runner flushes before each engine step, so that this
        work overlaps the step's prefill and frame on the device."""
        if not self._outbox:
            return
        t0 = time.perf_counter()
        outbox, self._outbox = self._outbox, {}
        for aio_loop, batch in outbox.items():
            try:
                aio_loop.call_soon_threadsafe(_put_all, batch)
                self.handovers += 1
            except RuntimeError:  # the event loop closed meanwhile: nobody will read these streams
                for stream in dict.fromkeys(stream for stream, _ in batch):
                    try:
                        if isinstance(stream, SessionStream):
                            entry = self._session_streams.get(stream.session_id)
                            if entry is not None:
                                entry[0].abort()
                        else:
                            self.runner.cancel(stream.request_id)
                    except Exception:  # noqa: BLE001 - the other event loops' batches still go over
                        log.exception("ending %s after its event loop closed failed", stream)
        self._handover_seconds += time.perf_counter() - t0

    def _wake(self) -> None:
        """(codec stage thread) Results are ready: run an iteration."""
        with self._cv:
            self._woken = True
            self._stalled = False
            self._cv.notify()

    # ---- internals: the engine thread ----------------------------------------------------------------

    @staticmethod
    def _use_step_stream(device: torch.device) -> None:
        """Run this thread's GPU work (frame steps, prefills) on a high-priority stream. A frame step is
        latency-bound (hundreds of small kernels in sequence) while the codec stage's convolutions, on
        its own low-priority stream, fill every SM; with equal priorities each small kernel waits for
        the codec's blocks ahead of it. Priorities only order pending blocks: nothing is preempted.
        TTS_STEP_STREAM=default keeps the default stream (for A/B measurements)."""
        if STEP_STREAM == "default":
            return
        # (torch's stub declares the static `priority_range` as an instance method)
        priority = min(torch.cuda.Stream.priority_range())  # type: ignore[call-arg]  # lower: sooner
        stream = torch.cuda.Stream(device, priority=priority)
        stream.wait_stream(torch.cuda.default_stream(device))  # the weights were loaded on the default one
        torch.cuda.set_stream(stream)  # (per thread)

    def _main(self) -> None:
        try:
            device = self.bundle.device
            if device.type == "cuda":
                torch.cuda.set_device(device)
                self._use_step_stream(device)
            t0 = time.perf_counter()
            self._engine = Engine(self.bundle.model, for_bundle(self.engine_config, self.bundle))
            kv = self._engine.kv_info()
            prefill = self._engine.runner.prefill_graphs
            log.info(
                "engine built in %.2f s: %d frame-step and %d prefill graphs captured, KV pool %d MiB "
                "(%d blocks of %d tokens)",
                time.perf_counter() - t0,
                len(self._engine.graphs.graphs),
                len(prefill.graphs.graphs) if prefill is not None else 0,
                kv["bytes"] // 2**20,
                kv["blocks"],
                kv["block_size"],
            )
            self._planner = Planner(self.bundle, self._engine.max_context, self._engine.check, self.voices)
            self._runner = JobPipeline(
                self._engine,
                self._planner,
                max_streams=self.max_jobs + self.max_sessions + 1,  # one codec stream per job, per session
                max_queued_chunks=self.max_queued_chunks,
                pause_timeout=self.pause_timeout,
                notify=self._wake,
                reference_cache=self.reference_cache,
                codec_graphs=self._codec_graphs,
                codec_gather=self.codec_gather,
                codec_sms=self.codec_sms,
            )
            self.runner.on_end = self._job_ended
            self.runner.on_failure = self._failed
            self.runner.before_engine_step = self._hand_over
            self._sessions = SessionManager(
                self._runner,
                max_sessions=self.max_sessions,
                clock=self._session_clock,
                options=self.session_options,
            )
            self._sessions.on_end = self._session_ended
            if self.engine_config.graphs == "startup" and self.engine.graphs.enabled:
                t0 = time.perf_counter()
                sizes = ramp_sizes(DEFAULT_FIRST_CHUNK_FRAMES, DEFAULT_CHUNK_FRAMES)
                captured = self.runner.stage.capture(sizes).result()
                log.info(
                    "codec stage: %d decode graphs captured in %.2f s", captured, time.perf_counter() - t0
                )
            if self.codec_sms:
                log.info(
                    "codec stage: on a green context of %d SMs, its decode launched kernel by kernel "
                    "(no decode graphs)",
                    self.codec_sms,
                )
            if self._warmup:
                self._run_warmup()
        except BaseException as exc:  # noqa: BLE001 - reported by wait_ready
            log.exception("engine start-up failed")
            self._start_error = exc
            self._ready.set()
            if self._runner is not None:
                self._runner.stage.stop()
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
        except BaseException as exc:  # noqa: BLE001 - logged once, then every job fails and health says so
            log.exception("the engine thread failed; this replica is out of service")
            self._crash = f"the engine thread failed: {type(exc).__name__}: {exc}"
            self._failed(self._crash)
        finally:
            self._shutdown()
            if self.on_stopped is not None:
                try:
                    self.on_stopped()
                except Exception:  # noqa: BLE001 - e.g. the consumer's event loop is already closed
                    log.debug("on_stopped callback failed", exc_info=True)

    def _run_warmup(self) -> None:
        if self.engine.device.type == "cuda":
            log.info("prefill warm-up done in %.2f s", self.engine.warmup_prefill())
        t0 = time.perf_counter()
        stream = self._admit(self.planner.warmup_job(), None, internal=True)
        while not stream.done:
            self._iterate(block=False)
            try:
                while True:
                    event = stream.get(timeout=0.001)
                    if isinstance(event, Failed):
                        raise RuntimeError(f"warm-up synthesis failed: {event.error}") from event.error
            except queue.Empty:
                pass
        log.info("engine warm-up done in %.2f s", time.perf_counter() - t0)

    def _iterate(self, block: bool) -> bool:
        """One pass: apply commands, then one runner step. False once closing."""
        runner = self.runner
        with self._cv:
            while (
                block
                and not self._inbox
                and not self._closing
                and not self._woken
                and (self._stalled or not runner.has_work())
            ):
                due = runner.preempt_due()  # a paused stream's timeout must be acted on while asleep
                if self._session_due is not None:  # a session's hold or idle deadline
                    left = self._session_due - time.monotonic()
                    due = left if due is None else min(due, left)
                if due is not None and due <= 0:
                    break
                t0 = time.perf_counter()
                self._cv.wait(timeout=1.0 if due is None else min(1.0, due))
                self._idle_seconds += time.perf_counter() - t0
            commands, self._inbox = self._inbox, []
            self._woken = False
            closing = self._closing
        self._apply_commands(commands)
        if closing:
            self._flush()
            return False
        try:
            # The commands that come while a frame step computes are applied then (on CUDA the step
            # waits for none of them); they take effect at the next iteration either way.
            progressed = runner.step(beside_step=self._apply_new_commands)
            progressed = self._tick_sessions() or progressed
        finally:
            self._flush()
        self.stats.steps += 1
        with self._cv:
            # No progress: everything running is paused or waits for the codec stage; sleep until a
            # command, a codec result or a paused stream's timeout.
            self._stalled = not progressed and not self._inbox and not self._woken
        self._refresh_stats()
        return True

    def _apply_commands(self, commands: list[tuple]) -> None:
        t0 = time.perf_counter()
        for command in commands:
            try:
                self._apply(command)
            except Exception:  # noqa: BLE001 - a bug in one job must not stop the engine thread
                log.exception("engine loop: %s command failed", command[0])
        self._commands_seconds += time.perf_counter() - t0

    def _apply_new_commands(self) -> bool:
        """Apply the commands queued since the iteration began (not a close: the next iteration sees
        it); returns whether there were any."""
        with self._cv:
            commands, self._inbox = self._inbox, []
        self._apply_commands(commands)
        return bool(commands)

    def _apply(self, command: tuple) -> None:
        kind, arg = command
        runner = self.runner
        if kind == "session":
            self._apply_session(*arg)
        elif kind == "open_session":
            self._open_session(*arg)
        elif kind == "submit":
            job_id, job, stream = arg
            self._submitted.add(job_id)
            runner.submit(job, stream, job_id)
        elif kind == "cancel":
            runner.cancel(arg)
        elif kind == "resume":
            stream_paused = runner.jobs.get(arg)
            runner.resume(arg)
            if stream_paused is not None:
                assert isinstance(stream_paused.sink, RequestStream)  # (this loop's jobs all have one)
                stream_paused.sink._set_paused(False)
        elif kind == "refused":
            runner.note_refusal()

    # ---- internals: sessions (engine thread) --------------------------------------------------------

    def _open_session(self, sid: str, spec: SessionSpec, stream: SessionStream) -> None:
        try:
            session = self.sessions.add(spec, sid)
        except Exception as exc:  # noqa: BLE001 - (ids are unique: not expected) the consumer is told
            log.exception("opening session %s failed", sid)
            with self._cv:
                self._sessions_open -= 1
            stream.deliver(SessionWarning(sid, f"the session could not open: {exc}"))
            stream.deliver(SessionEnded(sid, "error", 0))
            return
        session.outlet = stream
        self._session_streams[sid] = (session, stream)
        stream._publish(session.pending_bytes)

    def _apply_session(self, sid: str, op: str, arg) -> None:
        """A consumer's command for session `sid` (one already ended ignores it: its SessionEnded says
        why; text it was sent is dropped)."""
        entry = self._session_streams.get(sid)
        if entry is None:
            return
        session, stream = entry
        applied = 0
        try:
            if op == "send":
                applied = utf8_len(arg)
                try:
                    session.send(arg)
                except SessionClosed:
                    pass  # ended meanwhile (idle timeout): SessionEnded follows
                except InvalidRequest as exc:  # (the stream checked the bound first: not expected)
                    session.events.append(SessionWarning(sid, f"text not taken: {exc}"))
            elif op == "flush":
                if not (session.ended or session.closing):
                    session.flush()
            elif op in ("cancel", "abort"):
                self._move_events(sid)  # (generated before the cut: the consumer discards their audio)
                session.cancel() if op == "cancel" else session.abort()
                stream.deliver(_Cut())
            elif op == "close":
                session.close()
            elif op == "resume":
                session.resume()
                stream._set_paused(False)
        finally:
            stream._publish(session.pending_bytes, applied)
            self._move_events(sid)

    def _move_events(self, sid: str) -> bool:
        """Hand session `sid`'s new events to its stream (in order). True if there were any."""
        entry = self._session_streams.get(sid)
        if entry is None:
            return False
        session, stream = entry
        if not session.events:
            return False
        barge_in = session.last_barge_in
        while session.events:
            event = session.events.popleft()
            if isinstance(event, ChunkEnded) and event.reason == "cancelled" and barge_in is not None:
                if barge_in is not stream.barge_in and barge_in.chunk == event.chunk:
                    stream.barge_in = barge_in
                    self.stats.barge_ins += 1
                    self.stats.barge_in_freed_steps += barge_in.steps
            if not stream.deliver(event):  # its event loop is gone: nobody will read it
                if not session.ended:
                    session.abort()
            if isinstance(event, SessionEnded):
                del self._session_streams[sid]
                session.events.clear()
                break
        return True

    def _tick_sessions(self) -> bool:
        """After a runner step: finished chunks handled, the next started, deadlines acted on; every
        session's new events handed over and its waiting text published. True if anything happened."""
        sessions = self._sessions
        if sessions is None or not self._session_streams:
            self._session_due = None
            return False
        jobs = len(self.runner.jobs)
        if self.failure is not None:  # out of service: nothing more will be spoken
            sessions.close_all("shutdown")
        wait = sessions.tick()
        self._session_due = None if wait is None else time.monotonic() + wait
        moved = False
        for sid in list(self._session_streams):
            session, stream = self._session_streams[sid]
            stream._publish(session.pending_bytes)
            moved = self._move_events(sid) or moved
        return moved or len(self.runner.jobs) != jobs

    def _hand_over(self) -> None:
        """(engine thread, before each engine step) Sessions' events join the jobs' in the hand-over."""
        for sid in list(self._session_streams):
            self._move_events(sid)
        self._flush()

    def _session_ended(self, session: Session) -> None:
        with self._cv:
            self._sessions_open -= 1

    def _job_ended(self, job_id: str, event) -> None:
        if job_id not in self._submitted:  # a session's chunk: the session counts, not its jobs
            return
        self._submitted.discard(job_id)
        with self._cv:
            self._admitted -= 1

    def _refresh_stats(self) -> None:
        e, s, r = self.engine, self.stats, self.runner
        s.jobs = self.in_flight
        s.running = e.num_running
        s.waiting = e.num_waiting
        s.paused = r.paused_jobs
        s.kv_blocks_used, s.kv_blocks_total = e.kv_usage()
        s.kv_bytes, s.kv_stalls, s.kv_preemptions = e.kv.nbytes, e.kv_stalls, e.kv_preemptions
        s.frames_total = e.frames_generated
        s.frame_steps, s.step_rows = e.frame_steps, e.step_rows
        s.prefill_passes, s.prefill_requests = e.runner.prefill_passes, e.prefill_requests
        s.prefill_replays = e.runner.prefill_graphs.graphs.stats.replays if e.runner.prefill_graphs else 0
        s.loop_repeats = e.loop_repeats
        s.end_refusals = e.end_refusals
        s.replay_share = e.graphs.stats.replay_share
        s.frame_step_seconds = r.frame_step_seconds
        s.phase_seconds = {
            **e.phase_seconds,
            **r.phase_seconds,
            "commands": self._commands_seconds,
            "idle": self._idle_seconds,
            "handover": self._handover_seconds,
        }
        s.device_seconds = dict(e.device_seconds)
        s.step_failures = r.step_failures
        s.codec_failures = r.stage.stats.failures
        s.failed = self.failure is not None
        cs = r.stage.stats
        s.codec_decode_seconds, s.codec_encode_seconds = cs.decode_seconds, cs.encode_seconds
        s.codec_decode_calls, s.codec_decode_frames = cs.decode_calls, cs.decode_frames
        s.codec_decode_padded_frames = cs.decode_padded_frames
        s.codec_gathered_calls, s.codec_slack_calls = cs.gathered_calls, cs.slack_calls
        s.first_audio_seconds, s.first_audio_jobs = dict(r.first_audio_seconds), r.first_audio_jobs
        s.cache_hits, s.cache_misses = self.reference_cache.hits, self.reference_cache.misses
        s.sessions = self.sessions_open
        if e.realtime is not None:
            s.realtime_deferred, s.realtime_forced = dict(e.realtime.deferred), e.realtime.forced
            s.realtime_rode_along = e.realtime.rode_along
            s.realtime_min_slack = e.realtime.min_slack
            s.step_estimate = e.realtime.times.step_seconds(e.rows_for(max(e.num_running, 1)))
        with self._fps_lock:
            self._fps_window.append((time.monotonic(), e.frames_generated))
            while len(self._fps_window) > 2 and self._fps_window[1][0] < time.monotonic() - 10.0:
                self._fps_window.popleft()

    def _shutdown(self) -> None:
        """(engine thread, closing) End every job: free the engine's requests, tell the consumers."""
        with self._cv:  # also reached if the loop itself crashed: refuse work from now on
            self._accepting = False
            self._closing = True
        runner = self.runner
        try:
            self._end_all(runner)
        finally:
            self._flush()  # (whatever was delivered before a failure still goes over)
        runner.stage.stop()
        self._refresh_stats()

    def _end_all(self, runner: JobPipeline) -> None:
        """(engine thread, closing) End every session ("shutdown"), cancel the engine's requests, fail
        every job and every submission still in the inbox with LoopClosed."""
        if self._sessions is not None:
            try:
                self._sessions.close_all("shutdown")
            except Exception:  # noqa: BLE001 - the jobs below must still end
                log.exception("ending the sessions at shutdown failed")
            for sid, (session, stream) in list(self._session_streams.items()):
                self._move_events(sid)
                if sid in self._session_streams:  # (its SessionEnded was not among them: say it now)
                    del self._session_streams[sid]
                    stream.deliver(SessionEnded(sid, "shutdown", session.samples))
        for job in list(runner.jobs.values()):
            if job.engine_id is not None:
                self.engine.cancel(job.engine_id)
        try:
            if self.engine.has_work():
                self.engine.step()  # applies the cancels: blocks and rows are freed
        except Exception:  # noqa: BLE001
            log.exception("engine step failed during shutdown")
            self.engine.fail_all("shutdown")
        for job in list(runner.jobs.values()):
            job.engine_id = None
        if self._crash is not None:
            runner.fail_all(EngineFailed(self._crash))
        else:
            runner.fail_all(LoopClosed("the server shut down before the request finished"))
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for kind, arg in inbox:
            if kind == "submit":
                arg[2].deliver(Failed(LoopClosed("the server shut down")))
                with self._cv:
                    self._admitted -= 1
            elif kind == "open_session":
                arg[2].deliver(SessionEnded(arg[0], "shutdown", 0))
                with self._cv:
                    self._sessions_open -= 1
