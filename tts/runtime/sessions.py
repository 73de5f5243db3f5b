"""Sessions: text streamed in, speech streamed out, one voice and one KV sequence per session.

A voice agent writes its reply a few words at a time and may be interrupted. A `Session` holds a voice,
sampling settings and an open text buffer:

* `send(text)` adds a piece of text. The buffer (`tts.text.stream_cut.TextBuffer`) cuts a chunk as soon
  as one is complete: the first chunk of a turn at its first clause end (audio starts after a few words),
  later chunks at sentence ends, everything on `flush()`, and any chunk at the length bound. Each chunk is
  prepared by the model's text policy (normalized, split at the planner's chunk length) and queued.
* The voice: a preset or registered voice, reference objects, or a reference clip sent with the session
  (`SessionManager.open(reference=...)`, checked by `tts.runtime.request.prepare_reference` as a one-shot
  request's clip is). The clip is encoded once, on the codec stage (through the reference cache), when the
  session opens; its chunks wait for it. Every chunk's prompt starts with the voice references, so the
  session's kept KV holds them as its prefix: they are prefilled with the first chunk only, and stay when
  the oldest turns are dropped for the context. A clip that fails to encode ends the session ("error").
* Chunks are spoken in order, one at a time, each as a one-chunk job of the job pipeline
  (`tts.runtime.jobs`) while more text arrives. Its prompt carries the session's earlier turns (text and
  codes) as context, as many as fit the model's context (the oldest dropped first:
  `Planner.session_prompt`), and its engine request continues the session's kept KV sequence
  (`tts.engine.sequences`): only the chunk's new tokens are prefilled, so a fifth sentence starts as fast
  as the first and the voice does not drift at chunk boundaries. Every chunk decodes on the session's one
  codec stream (a `CodecStage` slot kept from the first chunk to the end): chunk N+1's audio continues
  chunk N's decoder state, so the session's audio is the offline decode of all its codes, without a seam
  at chunk boundaries (a fresh stream only after a barge-in, a failed chunk, or at the codec's frame
  limit per stream).
* Back-pressure: a chunk whose audio waits unread (`max_queued_chunks` of the job pipeline) pauses, and
  the next chunk does not start (holding no row) until the consumer reads; a chunk paused longer than the
  pipeline's `pause_timeout` while others wait for a row is preempted and the session ends ("preempted").
* `cancel()` (barge-in, Cartesia / Deepgram `clear`): the text not spoken yet is forgotten and the chunk
  in flight ends at the engine's next step, before another frame of it (its row and the blocks it added
  freed; the history before it stays); its audio still being decoded is dropped; the session stays open
  for the next text. `Session.last_barge_in` counts what it cost (`BargeIn`).
* `close()` speaks what is left and ends the session; `abort()` ends it at once. Either frees the
  session's KV. An idle session (nothing to speak, no text for `idle_seconds`) ends itself; text without a
  boundary waits at most `hold_seconds` before it is cut anyway.

Events (in order, per session; every time is on the session's clock: audio samples since it opened):
`ChunkStarted`, `SessionAudio` (float32 samples with their offset), `WordTimings`, `ChunkEnded` (finish
reason and prefill counts), `SessionWarning`, and last `SessionEnded`. Network fronts translate them:

* gRPC bidi: one message per event;
* Fish Audio's WebSocket `/v1/tts/live`: `text` -> `send`, `flush` -> `flush`, `stop` -> `close`; audio
  events carry `SessionAudio.samples`; alignment segments `{text, start, end}` are `WordTiming.text`,
  `.start`, `.end` (seconds);
* Wyoming: `synthesize-start` -> open, `synthesize-chunk` -> `send`, `synthesize-stop` -> `close`; each
  `SessionAudio` an `audio-chunk` whose `timestamp` is `sample_offset / sample_rate` in ms.

Threading: a `SessionManager` and its sessions are driven on the thread that drives their `JobPipeline`
(the Python API's caller, or the service's engine thread): `send`, `flush`, `cancel`, `close`, `abort`
and `SessionManager.tick` must all be called there, `tick` after every `JobPipeline.step`. Network fronts
use `tts.runtime.engine_thread.EngineThread.open_session`, whose `SessionStream` posts the commands to the
engine thread and delivers the events to an asyncio (or thread) consumer.
"""

from __future__ import annotations

import functools
import itertools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
from torch import Tensor

from tts.engine.aligner import ALIGN_MAX_TOKENS
from tts.engine.realtime import Playback
from tts.params import DEFAULT_CHUNK_FRAMES, DEFAULT_FIRST_CHUNK_FRAMES, InvalidRequest, SamplingParams
from tts.runtime.jobs import Audio, Cancelled, Event, Failed, Finished, JobPipeline, Preempted, Started
from tts.runtime.planner import PreparedReference, SynthesisJob, left_out
from tts.runtime.request import check_voice_source
from tts.runtime.timings import ChunkTimer, WordTiming, word_first_tokens, word_weights
from tts.text.normalize import TextError
from tts.text.prompt import Turn, VoiceReference
from tts.text.stream_cut import TextBuffer, utf8_len

log = logging.getLogger(__name__)


class SessionLimit(RuntimeError):
    """No session can be opened now: `max_sessions` are open. Maps to RESOURCE_EXHAUSTED / HTTP 429."""


class SessionClosed(InvalidRequest):
    """Text or a command for a session that was closed or has ended. Maps to INVALID_ARGUMENT / HTTP 400
    (FAILED_PRECONDITION where a front prefers it)."""


@dataclass
class SessionOptions:
    """A session's bounds and chunking.

    max_chunk_bytes: a chunk's length bound in UTF-8 bytes (None: the model's `chunk_length`).
    first_words: words a turn's first chunk needs before a clause end may cut it (0: sentences only).
    max_pending_bytes: text received and not yet spoken (buffered or queued), UTF-8 bytes; `send` beyond
    it raises InvalidRequest and takes nothing. hold_seconds: text without a boundary is cut after this
    long without new text. idle_seconds: a session with nothing to speak ends after this long without
    text (None: never). first_chunk_frames / chunk_frames: audio chunk sizes, frames (as for `stream`).
    max_history_frames: frames of earlier turns kept as context at most (None: the engine's context; the
    prompt drops the oldest turns that do not fit anyway).
    """

    max_chunk_bytes: int | None = None
    first_words: int = 3
    max_pending_bytes: int = 8192
    hold_seconds: float = 2.0
    idle_seconds: float | None = 60.0
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    max_history_frames: int | None = None


# ---- events ------------------------------------------------------------------------------------------


@dataclass
class ChunkStarted:
    """Chunk `chunk` (0, 1, ... per session) of text `text` (as the model reads it, normalized) was
    queued in the engine; its audio will start at `sample_offset` on the session clock."""

    session_id: str
    chunk: int
    text: str
    sample_offset: int


@dataclass
class SessionAudio:
    """Audio of chunk `chunk`: float32 mono `samples [S]` in [-1, 1] at `sample_rate` Hz, starting at
    `sample_offset` samples on the session clock (`sample_offset / sample_rate` seconds; offsets are
    contiguous: each event starts where the previous one ended). codes: `[N, frames]` int64 it was decoded
    from; frame_start / frame_end: its frames within the chunk. (Through a `SessionStream`, audio a
    barge-in discarded unread still counts on the session clock: the next audio's offset leaves that gap.)"""

    session_id: str
    chunk: int
    samples: np.ndarray
    sample_rate: int
    sample_offset: int
    frame_start: int
    frame_end: int
    codes: Tensor


@dataclass
class WordTimings:
    """Words of chunk `chunk` whose times are final, in text order (`tts.runtime.timings.WordTiming`:
    seconds and samples on the session clock, `estimated` where not measured by the aligner). Always
    inside audio already sent in `SessionAudio` events."""

    session_id: str
    chunk: int
    words: list[WordTiming]


@dataclass
class ChunkEnded:
    """Chunk `chunk` ended. reason: the engine's finish reason ("stop", "length", "short", "loop"),
    "cancelled" (barge-in or abort) or "error" (then `error` says why; the session stays open).
    frames: audio frames sent; audio_start / audio_end: its audio on the session clock, samples.
    prefill_tokens: prompt positions prefilled for it; cached_tokens: positions reused from the session's
    kept KV (0 for a first chunk, or after the history was dropped or evicted). warnings: for the client."""

    session_id: str
    chunk: int
    text: str
    reason: str
    frames: int
    audio_start: int
    audio_end: int
    prefill_tokens: int = 0
    cached_tokens: int = 0
    warnings: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class SessionWarning:
    """Something the client should know that ends nothing (text left out, markup ignored)."""

    session_id: str
    message: str


@dataclass
class SessionEnded:
    """The session ended (the last event): reason "closed" (`close`, after speaking everything),
    "aborted" (`abort`), "idle_timeout", "preempted" (its audio was not read while others waited for a
    row: RESOURCE_EXHAUSTED), "shutdown" (the server stopped or went out of service: UNAVAILABLE) or
    "error" (it could not open, or its reference clip could not be encoded). Its KV, its codec stream and
    every row are freed. detail: why, in one line, where the reason alone does not say (a preemption: a
    reader too slow, or the KV cache full; a clip that did not encode). error: for "error", the exception
    behind it where the client's input may have caused it (the codec's ValueError on the clip, e.g.
    AudioError), so that a front answers it as it answers the same error of a one-shot request."""

    session_id: str
    reason: str
    audio_samples: int
    detail: str = ""
    error: Exception | None = None


@dataclass
class BargeIn:
    """What the last barge-in (`cancel` of a chunk in flight) cost, counted exactly, not timed.
    chunk: the chunk cut. frames_after: frames its engine request generated after the cancel was applied
    (0: the row stopped before its next frame step). steps: engine frame steps run (for any row) from the
    cancel until its row and new KV blocks were freed (0 alone; at most 1: the step that frees it may run
    the other rows' frame). audio_after: audio pieces of it decoded after the cancel, dropped (never
    delivered)."""

    chunk: int
    frames_after: int
    steps: int
    audio_after: int


SessionEvent = ChunkStarted | SessionAudio | WordTimings | ChunkEnded | SessionWarning | SessionEnded


# ---- one session -------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Chunk:
    index: int
    text: str
    job_id: str = ""
    audio_start: int = 0
    frames: int = 0
    timer: ChunkTimer | None = None
    done: Event | None = None  # the job's final event, handled at the next pump
    cut: bool = False  # cancelled (barge-in): its later audio is dropped
    dropped: int = 0  # audio pieces dropped after the cut
    generated: int = 0  # audio frames its engine request generated (routed by the job pipeline)
    generated_at_cut: int = 0


class SessionOutlet(Protocol):
    """Where a session's events go when its consumer is on another thread (the service's engine thread
    moves `Session.events` there after every pass: `tts.runtime.engine_thread.SessionStream`)."""

    def pause_if_full(self, cap: int, unread_here: int) -> bool:
        """Mark the consumer paused and return True if `cap` audio events wait unread, counting those
        queued for the consumer and `unread_here` not moved yet (atomically with the consumer's reads)."""
        ...


class _ChunkSink:
    """The job pipeline's sink of one chunk: events go to the session."""

    def __init__(self, session: Session, chunk: _Chunk):
        self.session, self.chunk = session, chunk

    def deliver(self, event: Event) -> bool:
        self.session._job_event(self.chunk, event)
        return True

    def progress(self, frames: int, text_chunk: int, text_chunks: int) -> None:
        """(the job pipeline, per frame routed) The chunk's audio frames generated so far."""
        self.chunk.generated = frames

    def pause_if_full(self, cap: int) -> bool:
        """Back-pressure: pause the chunk while `cap` audio events wait unread (`Session.take_events`
        resumes it). A session nobody reads then holds its row only until the job pipeline's
        `pause_timeout` preempts it while others wait (its chunk ends with reason "error", Preempted, and
        the session with "preempted")."""
        session = self.session
        outlet = session.outlet
        if (
            session.unread_audio() >= cap
            if outlet is None
            else outlet.pause_if_full(cap, session.unread_audio())
        ):
            session._paused = True
            return True
        return False


class Session:
    """One streaming session (see the module docstring); made by `SessionManager.open`.

    `events` holds the session's events not yet read (the Python API's `SpeechSession` reads them; a
    front may read `events` itself). `id` names the session; it is also the engine's kept sequence id.
    """

    def __init__(
        self,
        manager: SessionManager,
        session_id: str,
        references: list[VoiceReference],
        params: SamplingParams,
        options: SessionOptions,
        normalize: bool,
        voice_kind: str,
        reference: PreparedReference | None = None,
    ):
        self.manager = manager
        self.id = session_id
        self.references = references
        self.params = params  # seed resolved: chunk i uses seed + i
        self.options = options
        self.normalize = normalize
        self.voice_kind = voice_kind
        planner = manager.runner.planner
        self.max_chunk_bytes = options.max_chunk_bytes or planner.bundle.chunk_length or 300
        self.buffer = TextBuffer(max(self.max_chunk_bytes, 16), options.first_words)
        # Chunks to speak, in order: (text as the model reads it, the UTF-8 bytes of received text it
        # accounts for in `pending_bytes`: a piece's bytes go with its last chunk).
        self.queue: deque[tuple[str, int]] = deque()
        self.history: list[Turn] = []
        self.events: deque[SessionEvent] = deque()
        self.current: _Chunk | None = None
        self.chunks = 0  # chunks started
        self.samples = 0  # the session clock: audio samples sent
        self.closing = False
        self.ended = False
        self.last_text = manager.clock()  # the last text or command
        self.text_since: float | None = None  # when the buffer got text that waits for a boundary
        self._paused = False  # the chunk in flight waits for the consumer (back-pressure)
        # The session's codec stream (`CodecStage` slot), opened by its first chunk and kept until it ends:
        # every chunk's audio continues the decoder state of the chunk before, as one job's text chunks do.
        self.slot: int | None = None
        self._reset_slot = False  # the next chunk starts a fresh stream (after a barge-in or a failure)
        # The turn's playback clock (real-time admission on; tts.engine.realtime): its chunks are one
        # stream to the player, so a later chunk continues a playing stream. None: the next chunk starts one.
        self.playback: Playback | None = None
        # Barge-in: the frame step count (`Engine.frame_steps`) when the last cancel was applied, and the
        # counts a front reports (`SessionStream.barge_in`).
        self.cancelled_at_step: int | None = None
        self.last_barge_in: BargeIn | None = None
        self.outlet: SessionOutlet | None = None  # a consumer outside the driving thread (EngineThread)
        # A reference clip sent with the session, while the codec stage encodes it (once, for every chunk):
        # no chunk starts before its voice is the first of `references` (`_encoded`).
        self.encoding: Future[VoiceReference] | None = None
        if reference is not None:
            self.encoding = manager.runner.encode_reference(reference)
            self.events.extend(SessionWarning(session_id, w) for w in reference.warnings)

    # ---- commands ---------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        """Add a piece of text. Raises SessionClosed after `close`/`abort` or once ended, and
        InvalidRequest (naming `text`) for a non-string or text over `max_pending_bytes` (nothing of it
        is taken). Chunks it completes are queued and started."""
        self._check_open("send text")
        if not isinstance(text, str):
            raise InvalidRequest(f"text must be a string, not {type(text).__name__}")
        pending = self.pending_bytes
        if pending + utf8_len(text) > self.options.max_pending_bytes:
            raise InvalidRequest(
                f"text: {utf8_len(text)} bytes would make {pending + utf8_len(text)} bytes waiting to be "
                f"spoken in this session; at most {self.options.max_pending_bytes} (send less at a time, "
                "or wait for audio)"
            )
        self.last_text = self.manager.clock()
        if not text:
            return
        self._plan(self.buffer.push(text))
        self.text_since = self.last_text if len(self.buffer) else None
        self._pump()

    def flush(self) -> None:
        """Speak the text buffered so far even without a sentence end. Raises SessionClosed once ended."""
        self._check_open("flush")
        self.last_text = self.manager.clock()
        self._plan(self.buffer.flush())
        self.text_since = None
        self._pump()

    def cancel(self) -> None:
        """Barge-in: forget the text not spoken yet and end the chunk in flight at the engine's next frame
        step (its `ChunkEnded` says "cancelled"; its row and the KV blocks it added are freed, the earlier
        history kept). The session stays open. No-op once ended."""
        if self.ended:
            return
        self.buffer.clear()
        self.queue.clear()
        self.text_since = None
        self.last_text = self.manager.clock()
        self.cancelled_at_step = self.manager.runner.engine.frame_steps
        if self.current is not None and self.current.done is None:
            self.current.cut = True  # its audio still on the codec stage is dropped, not delivered
            self.current.generated_at_cut = self.current.generated
            self._reset_slot = True  # (the stream's state holds audio nobody will hear)
            self.playback = None  # (and the player drops what it holds)
            self.manager.runner.cancel(self.current.job_id)

    def close(self) -> None:
        """Speak everything received (the buffer is flushed), then end (`SessionEnded` "closed"). Later
        `send`/`flush` raise SessionClosed. Idempotent."""
        if self.ended or self.closing:
            return
        self.flush()
        self.closing = True
        self._pump()

    def abort(self) -> None:
        """End now: the chunk in flight is cancelled, queued text dropped, the KV freed
        (`SessionEnded` "aborted"). Idempotent."""
        if self.ended:
            return
        self.cancel()
        self.closing = True
        self._end("aborted")

    def take_events(self) -> list[SessionEvent]:
        """Every event not read yet, in order (and the queue emptied). Resumes a chunk paused because
        its audio was not read (back-pressure): a front that reads `events` itself calls `resume`."""
        out = list(self.events)
        self.events.clear()
        self.resume()
        return out

    def resume(self) -> None:
        """The consumer read the audio: a chunk paused for back-pressure goes on (or the next chunk, held
        back while the audio before it waited unread, starts)."""
        if self._paused:
            self._paused = False
            if self.current is not None and self.current.done is None:
                self.manager.runner.resume(self.current.job_id)
            else:
                self.manager._due.add(self.id)  # the next tick starts the next chunk

    def _over_cap(self) -> bool:
        """Back-pressure between chunks: `max_queued_chunks` audio events wait unread, so the next chunk
        waits (no row, no frame) until the consumer reads (`resume`)."""
        cap = self.manager.runner.max_queued_chunks
        unread = self.unread_audio()
        full = unread >= cap if self.outlet is None else self.outlet.pause_if_full(cap, unread)
        if full:
            self._paused = True
        return full

    def unread_audio(self) -> int:
        """SessionAudio events waiting to be read (here, and in the outlet's queue when there is one)."""
        return sum(isinstance(e, SessionAudio) for e in self.events)

    @property
    def pending_bytes(self) -> int:
        """UTF-8 bytes of received text not spoken yet (buffered, or queued as chunks not started): what
        `max_pending_bytes` bounds."""
        return len(self.buffer) + sum(n for _, n in self.queue)

    # ---- state ------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A chunk is being spoken or queued, or the session's reference clip is being encoded."""
        return self.current is not None or bool(self.queue) or self.encoding is not None

    @property
    def pending_text(self) -> str:
        """Text buffered that waits for a boundary (or a flush)."""
        return self.buffer.text

    def _check_open(self, what: str) -> None:
        if self.ended or self.closing:
            state = "has ended" if self.ended else "was closed"
            raise SessionClosed(f"cannot {what}: session {self.id} {state}")

    # ---- internals (the driving thread) ----------------------------------------------------------

    def _plan(self, pieces: list[str]) -> None:
        planner = self.manager.runner.planner
        for piece in pieces:
            try:
                plan = planner.text_plan(piece, self.max_chunk_bytes, self.normalize)
            except TextError:
                self.events.append(SessionWarning(self.id, left_out(piece)))
                continue
            except InvalidRequest as exc:
                self._chunk_error(piece, f"text: {exc}")
                continue
            for warning in plan.warnings:
                self.events.append(SessionWarning(self.id, warning))
            sizes = [0] * len(plan.chunks)
            if sizes:
                sizes[-1] = utf8_len(piece)
            self.queue.extend(zip(plan.chunks, sizes, strict=True))

    def _chunk_error(self, text: str, error: str) -> None:
        """A chunk that cannot be spoken (refused text): reported as its own chunk, nothing else ends."""
        index = self.chunks
        self.chunks += 1
        self.events.append(
            ChunkEnded(self.id, index, text, "error", 0, self.samples, self.samples, error=error)
        )

    def _pump(self) -> None:
        """Handle a finished chunk, start the next one, end a closed or idle session."""
        if self.ended:
            return
        if self.encoding is not None and not (self.encoding.done() and self._encoded()):
            return  # (`SessionManager.tick` pumps again once the clip is encoded)
        chunk = self.current
        if chunk is not None and chunk.done is not None:
            self.current = None
            self._chunk_ended(chunk, chunk.done)
        if self.current is None and self.queue and not self._over_cap():
            self._start(self.queue.popleft()[0])
        if self.current is None and not self.queue:
            if self.closing:
                self._end("closed")
            elif not len(self.buffer):
                self.buffer.new_turn()  # the next text begins a new turn: its first clause goes early
                self.playback = None  # (and a new stream: the player may have run dry meanwhile)

    def _encoded(self) -> bool:
        """The reference clip's encode is done: its voice becomes the session's (the prefix of every
        chunk's prompt). False if it failed: the session has ended ("error", saying why)."""
        future, self.encoding = self.encoding, None
        assert future is not None  # (_pump calls this for a done encode only)
        try:
            voice = future.result()
        except Exception as exc:  # noqa: BLE001 - the codec failed on the clip: this session cannot speak
            message = f"the reference clip could not be encoded: {exc}"
            self.events.append(SessionWarning(self.id, message))
            self._end("error", message, exc if isinstance(exc, ValueError) else None)
            return False
        self.references = [voice, *self.references]
        return True

    def _start(self, text: str) -> None:
        runner = self.manager.runner
        planner = runner.planner
        index = self.chunks
        self.chunks += 1
        chunk = _Chunk(index, text, audio_start=self.samples)
        fmt = planner.bundle.prompt_format
        build = getattr(fmt, "build_with_span", None)
        text_tokens = None
        if build is not None and (planner.paced() or runner.engine.loop_guard):  # (who reads the span)
            try:
                start, end = build(text, [], [])[1]
                text_tokens = end - start
            except Exception:  # noqa: BLE001 - the job reports bad text itself
                text_tokens = None
        budget = min(self.params.max_new_frames, planner.guard_frames(text))
        budget = planner.chunk_budget(budget, text_tokens, self.params.min_new_frames)
        params = replace(self.params, seed=self._seed(index))
        spec = SynthesisJob(
            [text],
            params,
            [budget],
            list(self.references),
            None,
            self.options.first_chunk_frames,
            self.options.chunk_frames,
            f"{self.id}#{index}",
            voice_kind=self.voice_kind,
            text_bytes=utf8_len(text),
            history=list(self.history),
            sequence=self.id,
        )
        words = text.split()
        span_tokens = None
        if text_tokens is not None and runner.engine.loop_guard and text_tokens <= ALIGN_MAX_TOKENS:
            span_tokens = text_tokens
        codec = planner.bundle.codec
        model_text = functools.cache(fmt.model_text)  # (each word's, read twice below)
        first_tokens = None
        if span_tokens is not None:
            try:
                chunk_text = model_text(text)
                ends = planner.bundle.tokenizer.token_ends
                first_tokens = word_first_tokens(words, model_text, chunk_text, ends, span_tokens)
            except Exception:  # noqa: BLE001 - the words then take their shares of the span
                first_tokens = None
        chunk.timer = ChunkTimer(
            words,
            word_weights(words, model_text),
            span_tokens,
            self.samples,
            codec.frame_length,
            codec.sample_rate,
            index,
            first_tokens,
            codec.delay,
        )
        slot = self._codec_slot(budget)
        if self.playback is None and runner.engine.realtime is not None:
            self.playback = Playback(planner.frame_rate, spec.first_chunk_frames, spec.chunk_frames)
        self.current = chunk
        self.events.append(ChunkStarted(self.id, index, text, self.samples))
        chunk.job_id = runner.submit(
            spec, _ChunkSink(self, chunk), job_id=f"{self.id}#{index}", slot=slot, playback=self.playback
        )

    def _codec_slot(self, budget: int) -> int | None:
        """The session's codec stream for a chunk of at most `budget` frames: the one the earlier chunks
        used (their decoder state continues), a fresh one after a barge-in or a failed chunk, or where the
        codec's frame limit per stream would be passed. None if every stream is in use (then the chunk's
        job opens its own, and fails with that error)."""
        stage = self.manager.runner.stage
        if self.slot is not None:
            left = stage.frames_left(self.slot)
            if self._reset_slot or (left is not None and left < budget + 1):
                stage.close(self.slot)
                self.slot = None
        self._reset_slot = False
        if self.slot is None:
            try:
                self.slot = stage.open()
            except RuntimeError:
                return None
        return self.slot

    def _seed(self, index: int) -> int:
        assert self.params.seed is not None  # (resolved by SessionManager.open)
        return (self.params.seed + index) % (2**63)

    def _job_event(self, chunk: _Chunk, event: Event) -> None:
        """An event of the chunk's job (called by the job pipeline, inside `JobPipeline.step`)."""
        if isinstance(event, Started) or self.ended:  # (an ended session's late audio is dropped)
            return
        if isinstance(event, Audio):
            if chunk.cut:  # decoded after a barge-in: nobody is to hear it
                chunk.dropped += 1
                return
            offset = self.samples
            n = int(event.samples.shape[0])
            self.samples += n
            chunk.frames = event.frame_end
            rate = self.manager.runner.planner.sample_rate
            self.events.append(
                SessionAudio(
                    self.id,
                    chunk.index,
                    event.samples,
                    rate,
                    offset,
                    event.frame_start,
                    event.frame_end,
                    event.codes,
                )
            )
            assert chunk.timer is not None  # (set before the job starts)
            words = chunk.timer.audio(event.frame_end - event.frame_start, n, event.positions)
            if words:
                self.events.append(WordTimings(self.id, chunk.index, words))
            return
        chunk.done = event  # Finished or Failed: handled at the next pump (outside the runner's step)
        if chunk.cut and self.cancelled_at_step is not None:
            self.last_barge_in = BargeIn(
                chunk.index,
                chunk.generated - chunk.generated_at_cut,
                self.manager.runner.engine.frame_steps - self.cancelled_at_step,
                chunk.dropped,
            )
        self.manager._due.add(self.id)

    def _chunk_ended(self, chunk: _Chunk, event: Event) -> None:
        self.last_text = self.manager.clock()
        if isinstance(event, Finished):
            assert chunk.timer is not None
            words = chunk.timer.finish()
            if words:
                self.events.append(WordTimings(self.id, chunk.index, words))
            self.history = self._bounded(event.history)
            reason = event.finish_reasons[-1].value if event.finish_reasons else "stop"
            self.events.append(
                ChunkEnded(
                    self.id,
                    chunk.index,
                    chunk.text,
                    reason,
                    chunk.frames,
                    chunk.audio_start,
                    self.samples,
                    sum(event.prefill_tokens),
                    sum(event.cached_tokens),
                    list(event.warnings),
                )
            )
            return
        assert isinstance(event, Failed)
        cancelled = isinstance(event.error, Cancelled)
        self._reset_slot = True  # (a failed decode leaves the stream's state undefined)
        self.playback = None
        self.events.append(
            ChunkEnded(
                self.id,
                chunk.index,
                chunk.text,
                "cancelled" if cancelled else "error",
                chunk.frames,
                chunk.audio_start,
                self.samples,
                error=None if cancelled else f"{type(event.error).__name__}: {event.error}",
            )
        )
        if isinstance(event.error, Preempted):
            # Its consumer did not read while others waited for a row: the session ends as a job does (a
            # front maps it to RESOURCE_EXHAUSTED), rather than taking a row again with its next chunk.
            self._end("preempted", str(event.error))

    def _bounded(self, turns: list[Turn]) -> list[Turn]:
        """The newest turns whose frames fit `max_history_frames` (default: the engine's context)."""
        limit = self.options.max_history_frames or self.manager.runner.engine.max_context
        kept: list[Turn] = []
        total = 0
        for turn in reversed(turns):
            total += int(turn.codes.shape[1])
            if total > limit:
                break
            kept.append(turn)
        return kept[::-1]

    def _end(self, reason: str, detail: str = "", error: Exception | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        self.closing = True
        self.encoding = None  # (an encode in flight completes for the reference cache; nobody waits)
        if self.current is not None and self.current.done is None:
            self.manager.runner.cancel(self.current.job_id)  # its late events are dropped
        self.current = None
        self.queue.clear()
        self.buffer.clear()
        if self.slot is not None:  # (its chunk's decodes still queued complete first; their audio is dropped)
            self.manager.runner.stage.close(self.slot)
            self.slot = None
        self.manager._forget(self)
        self.events.append(SessionEnded(self.id, reason, self.samples, detail, error))


@dataclass
class SessionSpec:
    """A session's checked settings (`SessionManager.plan`): voice references, sampling (seed
    resolved), options, whether text is normalized, the voice's kind, and a reference clip to encode when
    the session opens (None: none; then `references` is empty)."""

    references: list[VoiceReference]
    params: SamplingParams
    options: SessionOptions
    normalize: bool
    voice_kind: str
    reference: PreparedReference | None = None


class SessionManager:
    """The sessions of one `JobPipeline` (see the module docstring).

    max_sessions: open sessions at most (`open` raises SessionLimit beyond). clock: seconds, monotonic
    (the timeouts read it; tests pass their own). options: each session's defaults.
    """

    def __init__(
        self,
        runner: JobPipeline,
        *,
        max_sessions: int = 16,
        clock: Callable[[], float] = time.monotonic,
        options: SessionOptions | None = None,
    ):
        self.runner = runner
        self.max_sessions = max_sessions
        self.clock = clock
        self.options = options or SessionOptions()
        self.sessions: dict[str, Session] = {}
        self._due: set[str] = set()
        self._ids = itertools.count()
        # Called (driving thread) when a session has ended, before its SessionEnded is queued.
        self.on_end: Callable[[Session], None] | None = None

    def open(
        self,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        *,
        reference: PreparedReference | None = None,
        session_id: str | None = None,
        normalize: bool = True,
        options: SessionOptions | None = None,
        **sampling,
    ) -> Session:
        """Open a session. voice: a preset or registered voice name, or VoiceReference objects (None: the
        model's default voice); or reference: a clip checked by `tts.runtime.request.prepare_reference`
        (not both), encoded once as the session opens. sampling: temperature, top_p, top_k,
        max_new_frames (per chunk), min_new_frames, seed (chunk i uses seed + i; random when not given),
        ras_window, repetition_penalty. Raises SessionLimit, InvalidRequest (bad values, a voice and a
        reference, a duplicate id), VoiceNotFound."""
        if len(self.sessions) >= self.max_sessions:
            raise SessionLimit(f"{self.max_sessions} sessions are open; close one or try again later")
        spec = self.plan(voice, reference=reference, normalize=normalize, options=options, **sampling)
        return self.add(spec, session_id)

    def plan(
        self,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        *,
        reference: PreparedReference | None = None,
        normalize: bool = True,
        options: SessionOptions | None = None,
        **sampling,
    ) -> SessionSpec:
        """Check a session's settings (as `open`; any thread: reads the planner and the voices only).
        Raises InvalidRequest (InvalidField `voice` for a voice and a reference), VoiceNotFound."""
        planner = self.runner.planner
        params = planner.sampling_params(**sampling)
        if params.max_new_frames >= planner.max_context:
            raise InvalidRequest(
                f"max_new_frames ({params.max_new_frames}) exceeds the context size {planner.max_context}"
            )
        references: list[VoiceReference] = []
        if reference is not None:
            check_voice_source(voice, True)  # (a voice name or a clip, as one-shot requests)
            kind = "reference"
        else:
            references, kind = planner._voice(voice)
        opts = options or self.options
        if not (1 <= opts.first_chunk_frames and 1 <= opts.chunk_frames):
            raise InvalidRequest("first_chunk_frames and chunk_frames must be >= 1")
        params = replace(params, seed=params.seed if params.seed is not None else secrets.randbits(62))
        return SessionSpec(references, params, opts, normalize, kind, reference)

    def add(self, spec: SessionSpec, session_id: str | None = None) -> Session:
        """(the driving thread) Open a session planned by `plan`. Raises InvalidRequest for an id in use
        (the limit is the caller's to check: `open` does)."""
        sid = session_id or f"session-{next(self._ids)}"
        if sid in self.sessions or sid in self.runner.engine.sequences:
            raise InvalidRequest(f"session id {sid!r} is in use")
        session = Session(
            self,
            sid,
            spec.references,
            spec.params,
            spec.options,
            spec.normalize,
            spec.voice_kind,
            spec.reference,
        )
        self.sessions[sid] = session
        return session

    def tick(self) -> float | None:
        """Call after every `JobPipeline.step` (and when woken by a deadline): finished chunks are handled
        and the next started, text held past `hold_seconds` is cut, idle sessions end. Returns seconds
        until the next deadline (None: none)."""
        due, self._due = self._due, set()
        for sid in due:
            session = self.sessions.get(sid)
            if session is not None:
                session._pump()
        for session in [s for s in self.sessions.values() if s.encoding is not None and s.encoding.done()]:
            session._pump()  # its reference clip is encoded: its first chunk may start
        now = self.clock()
        wait: float | None = None
        for session in list(self.sessions.values()):
            if session.text_since is not None and not session.closing:
                left = session.text_since + session.options.hold_seconds - now
                if left <= 0:
                    session.flush()
                else:
                    wait = left if wait is None else min(wait, left)
            idle = session.options.idle_seconds
            if idle is not None and not session.busy and not len(session.buffer) and not session.closing:
                left = session.last_text + idle - now
                if left <= 0:
                    session._end("idle_timeout")
                else:
                    wait = left if wait is None else min(wait, left)
        return wait

    def close_all(self, reason: str = "shutdown") -> None:
        """End every session now (shutdown)."""
        for session in list(self.sessions.values()):
            session.cancel()
            session._end(reason)

    def _forget(self, session: Session) -> None:
        self.sessions.pop(session.id, None)
        self._due.discard(session.id)
        self.runner.engine.release_sequence(session.id)
        if self.on_end is not None:
            self.on_end(session)
