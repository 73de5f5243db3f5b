"""The Wyoming front: Home Assistant's TTS protocol over TCP, served from the same process, asyncio loop and
`EngineThread` as the gRPC and HTTP fronts (`TTSServer` starts and stops it; `tts serve --wyoming-port`).

Wyoming (the `wyoming` package on PyPI is the reference client) frames each event as one JSON line
`{"type", "data", "data_length", "payload_length", "version"}`, then `data_length` bytes of JSON merged
into `data`, then `payload_length` bytes of binary payload. This module speaks it itself (a few lines),
so the package is only a test dependency. No authentication, by the protocol's design: a trusted LAN.

Events handled (client -> server):

* `describe` -> `info`: one TTS program (`dualar-tts`) with this model's voices (presets and registered
  voices, re-read at every describe) and `supports_synthesize_streaming: true`.
* `synthesize {text, voice?}` -> `audio-start {rate, width 2, channels 1}`, `audio-chunk`s (PCM16
  little-endian payload, as the engine produces them), `audio-stop`: the whole text as one job, as gRPC
  and HTTP run it.
* streaming: `synthesize-start {voice?}`, `synthesize-chunk {text}`..., `synthesize-stop` ->
  `audio-start`, `audio-chunk`s as the text is spoken, `audio-stop`, `synthesize-stopped`: one session
  of the engine loop (`SessionSpeech` below: `EngineThread.open_session`; `synthesize-chunk` -> `send`,
  `synthesize-stop` -> `close`, a disconnect -> `abort`): each complete sentence is spoken as soon as it
  is complete, with the earlier ones as context (their KV kept), on one codec stream, so the audio runs on
  without a seam across sentences. Streams count against `--max-sessions` (beyond: `resource_exhausted`).
  The `synthesize` with the whole text that clients send inside the stream for servers without
  streaming is ignored.
* `ping` -> `pong`; `select-program {name}` is accepted for this server's program.

`voice.name` is a preset or a registered voice (`info` lists them); without a name, `voice.language` must
be one the model speaks and the model's default voice is used. `voice.speaker` is ignored (no voice here
has several speakers).

Errors: anything else (an unknown event, malformed framing or JSON, `synthesize-chunk` outside a stream
or after its `synthesize-stop`, text over `ServiceLimits.max_text_bytes` (one `synthesize`, or all the
chunks of one stream together), an unknown voice or language, admission full, the server warming up or
draining, a job that fails) gets one `error {text, code}` event, where `code` is the outcome that
`tts_requests_total` counts (`invalid_argument`, `not_found`, `resource_exhausted`, `unavailable`,
`deadline_exceeded`, `no_audio`, `error`); then the server closes the connection, having cancelled its
job (a client reading for `audio-stop` or `synthesize-stopped` would otherwise wait forever). A client
that disconnects (end of its stream) cancels its job: the engine frees its row and KV blocks at the next
step. A client that stops reading pauses its job (back-pressure, as on the other fronts). At most
`ServiceLimits.max_wyoming_connections` are open (the next one gets `resource_exhausted` and is closed;
a client that has closed its side holds none: the next connection closes it);
one with no synthesis in progress and no complete event for `wyoming_idle_timeout` seconds is closed.

Each synthesis (one-shot or stream) and each refused event is one request in `tts_requests_total{outcome}`
and one log line (`rpc=wyoming` / `rpc=wyoming-stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np

from service.common import CallLog, NoAudio, error_message, log_call, outcome_of, prepare_off_loop
from tts import __version__
from tts.audio.files import to_pcm16
from tts.engine import InvalidRequest
from tts.runtime.engine_thread import (
    Audio,
    Cancelled,
    ChunkEnded,
    ChunkStarted,
    EngineFailed,
    Failed,
    Finished,
    LoopClosed,
    Overloaded,
    Preempted,
    RequestStream,
    SessionAudio,
    SessionEnded,
    SessionLimit,
    SessionStream,
    Started,
)
from tts.runtime.request import SpeechRequest, plan_job
from tts.runtime.voices import VoiceNotFound
from tts.text.budget import PreparationTimeout
from tts.text.normalize import _SENTENCE_END as SENTENCE_END  # the planner's sentence ends
from tts.text.normalize import TextError, speakable

if TYPE_CHECKING:
    from service.server import TTSServer

log = logging.getLogger(__name__)

KiB = 1024
# The `version` every event carries: the wyoming package release this front was checked against (its
# client reads events of any version; nothing acts on the field).
PROTOCOL_VERSION = "1.10.2"
PROGRAM = "dualar-tts"
PROJECT_URL = ""  # (`info`'s attribution needs one; the project has no public address to name yet)
SAMPLE_WIDTH = 2  # PCM16
# Kernel send buffer per connection (doubled by the kernel), and asyncio's write buffer: a client that
# stops reading fills them and then its job pauses, instead of generating into megabytes of buffers.
SEND_BUFFER_BYTES = 128 * KiB
WRITE_BUFFER_BYTES = 64 * KiB
# Passes of the event loop a connection arriving at the cap waits for the ends of clients that already
# left to be read (`WyomingFront._slot_free`): one registers a new connection's reader, the next polls it.
SLOT_PASSES = 3
# An error event is sent within this many seconds, or the connection is cut without it.
ERROR_SEND_SECONDS = 5.0
# Languages a model's text policy speaks (Wyoming lists them per voice; Home Assistant offers a voice for
# the languages it names). Fish models: the languages fish-speech and OpenAudio name as supported.
POLICY_LANGUAGES = {"english": ["en"]}
FISH_LANGUAGES = ["en", "zh", "ja", "ko", "fr", "de", "ar", "es"]
# Abbreviations whose period does not end a sentence in a stream (the model's normalizer reads them).
_ABBREVIATION = re.compile(r"(?:^|(?<=[\s(\"']))(?:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|vs|No|approx|e\.g|i\.e)\.$")


class ProtocolError(InvalidRequest):
    """Bytes that are not a Wyoming event (framing, JSON): the connection cannot go on."""


class ClientGone(ConnectionError):
    """The client closed the connection."""


def max_event_bytes(max_text_bytes: int) -> int:
    """Largest header line or data section accepted: room for the longest text the server takes, every
    character JSON-escaped (`\\uXXXX`: at most 6 bytes per UTF-8 byte), plus 64 KiB."""
    return 6 * max_text_bytes + 64 * KiB


# ---- framing ------------------------------------------------------------------------------------------


def _json_object(raw: bytes, what: str) -> dict:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ProtocolError(f"malformed event {what}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"malformed event {what}: a JSON object is needed, got {type(value).__name__}")
    return value


def _length(header: dict, key: str, limit: int) -> int:
    n = header.get(key)
    if n is None:
        return 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ProtocolError(f"malformed event header: {key} must be a non-negative integer, got {n!r}")
    if n > limit:
        raise ProtocolError(f"event {key} is {n} bytes; the limit is {limit}")
    return n


async def read_event(reader: asyncio.StreamReader, limit: int) -> tuple[str, dict]:
    """The next event `(type, data)`; `limit` bounds the header line and each of the data and payload
    sections (bytes; the payload is read and dropped: no event this server takes has one). Raises
    ClientGone at the end of the client's stream (a partial event included), ProtocolError for bytes that
    are not an event."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        raise ClientGone() from exc
    except asyncio.LimitOverrunError:
        raise ProtocolError(f"an event header line is over {limit} bytes") from None
    header = _json_object(line, "header")
    kind = header.get("type")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("malformed event header: `type` (a string) is missing")
    data = header.get("data")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProtocolError(
            f"malformed event header: `data` must be a JSON object, got {type(data).__name__}"
        )
    data_length = _length(header, "data_length", limit)
    payload_length = _length(header, "payload_length", limit)
    try:
        if data_length:
            data.update(_json_object(await reader.readexactly(data_length), "data"))
        if payload_length:
            await reader.readexactly(payload_length)
    except asyncio.IncompleteReadError as exc:
        raise ClientGone() from exc
    return kind, data


def encode_event(kind: str, data: dict | None = None, payload: bytes = b"") -> bytes:
    """One event's bytes: the header line, its data as a separate section (as the wyoming package writes
    them), then the payload."""
    header: dict = {"type": kind, "version": PROTOCOL_VERSION}
    body = b""
    if data:
        body = json.dumps(data, ensure_ascii=False).encode("utf-8")
        header["data_length"] = len(body)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode("utf-8") + b"\n" + body + payload


# ---- the one-shot synthesis: a job (and the sentence cut, for its callers) -----------------------------


def sentence_cut(text: str) -> int:
    """The index just past the last complete sentence of streamed `text` (0: none yet). A sentence is
    complete at one of the planner's sentence ends (`tts.text.normalize`) with something after it (a
    period at the very end may still become "3.14"), not after an abbreviation ("Dr. Smith")."""
    cut = 0
    for m in SENTENCE_END.finditer(text):
        end = m.end()
        if end == len(text) and not m.group()[-1:].isspace():
            continue
        if _ABBREVIATION.search(text[: m.start() + 1]) and m.group().strip() == ".":
            continue
        cut = end
    return cut


class SentenceJobs:
    """Streamed text in, audio out: each complete sentence (`sentence_cut`), and what is left at `close`,
    is planned and run as its own synthesis job through the engine thread, one job at a time, in order;
    `audio()` yields their samples as one stream. The one-shot `synthesize` runs through it (the whole
    text, one job: `close(text)`); streams are sessions (`SessionSpeech`).

    front: the WyomingFront (engine loop, limits). voice: a voice name (None: the model's default).
    label: what the text is called in the text limit's message. streamed: the text comes in pieces, and
    a piece with nothing to speak (punctuation, an emoji between two sentences) is skipped rather than
    refused.
    """

    def __init__(self, front: WyomingFront, voice: str | None, label: str, streamed: bool = True):
        self.front = front
        self.voice = voice
        self.label = label
        self.streamed = streamed
        self.closed = False
        self.text_bytes = 0
        self.first_job_at: float | None = None  # when the first piece was ready to run
        self.request_id = "-"
        self.voice_kind = "-"
        self._pending = ""
        self._pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self._stream: RequestStream | None = None
        self.samples = 0  # samples yielded by audio()
        self.first_audio: float | None = None  # when the owner sent the first audio (set by it)

    def send(self, text: str) -> None:
        """Add streamed text; a complete sentence is queued at once. Raises InvalidRequest past the
        server's text limit (all the text of the stream together)."""
        self._count(text)
        self._pending += text
        cut = sentence_cut(self._pending)
        if cut:
            self._queue(self._pending[:cut])
            self._pending = self._pending[cut:]

    def close(self, text: str = "") -> None:
        """No more text: `text` and what is buffered go as the last piece (one job)."""
        self._count(text)
        if self.streamed:
            self._queue(self._pending + text)
        else:  # (the whole text, as given: the planner says what is wrong with it)
            self._pieces.put_nowait(text)
        self._pending = ""
        self.closed = True
        self._pieces.put_nowait(None)

    def abort(self) -> None:
        """Drop the text not spoken and cancel the running job (its row and blocks are freed at the
        engine's next step). Idempotent."""
        self.closed = True
        if self._stream is not None:
            self._stream.cancel()

    async def audio(self) -> AsyncIterator[np.ndarray]:
        """Float32 samples `[S]` at the codec's rate, each piece's after the previous one's, until the
        piece after `close` is spoken. Raises what a piece fails with (TextError, InvalidRequest,
        VoiceNotFound, Overloaded, LoopClosed, PreparationTimeout, EngineFailed, ...)."""
        loop = self.front.loop
        while (piece := await self._pieces.get()) is not None:
            if self.first_job_at is None:
                self.first_job_at = time.monotonic()
            refusal = self.front.server.replica_state.refusal()
            if refusal is not None:
                raise refusal
            try:
                job = await prepare_off_loop(self._plan, piece, timeout=self.front.limits.max_prepare_seconds)
            except TextError:
                if not self.streamed or speakable(piece):
                    raise
                log.debug("wyoming: skipped a piece with nothing to speak: %r", piece[:40])
                continue
            job.request_id = "wyoming"  # (request ids: wyoming-N)
            self.voice_kind = job.voice_kind
            stream = self._stream = loop.submit(job, asyncio.get_running_loop())
            if self.request_id == "-":
                self.request_id = stream.request_id
            try:
                while True:
                    event = await stream.next()
                    if isinstance(event, Audio):
                        self.samples += len(event.samples)
                        yield event.samples
                    elif isinstance(event, Finished):
                        break
                    elif isinstance(event, Failed):
                        raise event.error
                    else:
                        assert isinstance(event, Started), event
            finally:
                stream.cancel()  # (a no-op once the job ended)
                self._stream = None

    def _count(self, text: str) -> None:
        _count_text(self, text)

    def _queue(self, piece: str) -> None:
        if piece.strip():
            self._pieces.put_nowait(piece.strip())

    def _plan(self, piece: str):
        """The job of one piece of text, through the request rules every front shares."""
        request = SpeechRequest(text=piece, voice=self.voice)
        return plan_job(self.front.loop.planner, request, self.front.limits.request_limits)


class SessionSpeech:
    """A Wyoming stream as a session of the engine loop (`EngineThread.open_session`), behind the calls
    `_Connection` makes of a synthesis: `send` (synthesize-chunk), `close` (synthesize-stop), `abort` (a
    disconnect or an error) and `audio()`. Opening it raises what `open_session` raises (SessionLimit,
    LoopClosed, VoiceNotFound, InvalidRequest).

    front: the WyomingFront (engine loop, limits). voice: a voice name (None: the model's default).
    label: what the text is called in the text limit's message (`ServiceLimits.max_text_bytes` bounds all
    the text of the stream together)."""

    streamed = True

    def __init__(self, front: WyomingFront, voice: str | None, label: str):
        self.front = front
        self.label = label
        self.closed = False
        self.text_bytes = 0
        self.first_job_at: float | None = None  # when the first chunk of text was ready to speak
        self.request_id = "-"  # the session's id once a chunk started
        self.samples = 0  # samples yielded by audio()
        self.first_audio: float | None = None  # when the owner sent the first audio (set by it)
        self._stream: SessionStream = front.loop.open_session(
            voice, aio_loop=asyncio.get_running_loop(), session_id="wyoming"
        )
        self.voice_kind = f"voice:{voice}" if voice else "default"

    def send(self, text: str) -> None:
        """Add streamed text (spoken as soon as a sentence is complete). Raises InvalidRequest past the
        server's text limit, or past the session's bound of text waiting to be spoken."""
        _count_text(self, text)
        self._stream.send(text)

    def close(self, text: str = "") -> None:
        """No more text: what is buffered is spoken, then the session ends."""
        if text:
            self.send(text)
        self.closed = True
        self._stream.close()

    def abort(self) -> None:
        """End the session now: its row, KV blocks and codec stream are freed at the engine's next step.
        Idempotent."""
        self.closed = True
        self._stream.abort()

    async def audio(self) -> AsyncIterator[np.ndarray]:
        """Float32 samples `[S]` at the codec's rate, in order, until the session has spoken everything
        after `close`. Raises InvalidRequest (a chunk's text refused), EngineFailed (a chunk failed),
        Preempted (the audio was not read while others waited), LoopClosed (shutdown)."""
        while True:
            event = await self._stream.next()
            if isinstance(event, SessionAudio):
                self.samples += len(event.samples)
                yield event.samples
            elif isinstance(event, ChunkStarted):
                if self.first_job_at is None:
                    self.first_job_at = time.monotonic()
                    self.request_id = self._stream.session_id
            elif isinstance(event, ChunkEnded) and event.reason == "error":
                error = event.error or "the chunk failed"
                if error.startswith("Preempted: "):
                    continue  # (the SessionEnded that follows says so: RESOURCE_EXHAUSTED, not an error)
                # (the session's refused text says so: "text: ..."; anything else failed in the engine)
                raise InvalidRequest(error) if error.startswith("text: ") else EngineFailed(error)
            elif isinstance(event, SessionEnded):
                if event.reason in ("closed", "aborted"):
                    return
                if event.reason == "preempted":
                    raise Preempted(event.detail or "the stream was not read while other requests waited")
                if event.reason == "idle_timeout":
                    raise InvalidRequest(
                        "the stream got no text for too long and ended; send synthesize-stop"
                    )
                raise LoopClosed(f"the server shut down before the stream finished ({event.reason})")


def _count_text(speech, text: str) -> None:
    """Count `text` into `speech.text_bytes`; InvalidRequest past the server's text limit."""
    limit = speech.front.limits.max_text_bytes
    n = speech.text_bytes + len(text.encode("utf-8", "replace"))
    if n > limit:
        raise InvalidRequest(f"{speech.label} is {n} bytes; the limit is {limit}")
    speech.text_bytes = n


# ---- one connection -----------------------------------------------------------------------------------


class _Connection:
    """One client: reads events in order and answers them; a synthesis runs in its own task (`_speak`)
    that writes the audio while the reader goes on (so a disconnect is seen at once)."""

    def __init__(self, front: WyomingFront, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.front, self.reader, self.writer = front, reader, writer
        self.peer = writer.get_extra_info("peername")
        self.jobs: SentenceJobs | SessionSpeech | None = None  # the synthesis in progress
        self.streaming = False  # between synthesize-start and synthesize-stop
        self.call: CallLog | None = None
        self.speaker: asyncio.Task | None = None
        self.ended = False  # an error was answered: the connection closes
        self.idle_since = time.monotonic()  # the last event, or the end of the last synthesis

    def client_left(self) -> bool:
        """Whether the client has closed its side or reset the connection (seen by the event loop; this
        connection's task may not have run since)."""
        return self.reader.at_eof() or self.reader.exception() is not None

    async def run(self) -> None:
        idle = self.front.limits.wyoming_idle_timeout
        watch = asyncio.ensure_future(self._close_when_idle(idle)) if idle else None
        try:
            while not self.ended:
                kind, data = await read_event(self.reader, self.front.max_event_bytes)
                self.idle_since = time.monotonic()
                await self._handle(kind, data)
        except (ClientGone, ConnectionError):
            pass
        except REQUEST_ERRORS as exc:
            await self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - a bug: an error event with its message, then close
            log.exception("wyoming: handling an event from %s failed", self.peer)
            await self._fail(exc)
        finally:
            if watch is not None:
                watch.cancel()
            self._end_synthesis("cancelled")  # (the client left mid-synthesis; else a no-op)
            if self.speaker is not None:
                self.speaker.cancel()
                with contextlib.suppress(BaseException):
                    await self.speaker
            if not self.writer.transport.is_closing():
                self.writer.transport.abort()

    # ---- events ----

    async def _handle(self, kind: str, data: dict) -> None:
        if kind == "describe":
            await self._send("info", self.front.info())
        elif kind == "ping":
            await self._send("pong", {"text": data.get("text")})
        elif kind == "select-program":
            if data.get("name") != PROGRAM:
                raise InvalidRequest(
                    f"select-program: unknown program {data.get('name')!r:.60} (this server has {PROGRAM})"
                )
        elif kind == "synthesize":
            if self.streaming:
                return  # the whole text again, for servers without streaming: already streamed
            self._check_idle(kind)
            text = _text(data, kind)
            jobs = self._begin("wyoming", _voice(self.front, data.get("voice")), "synthesize text")
            jobs.close(text)
        elif kind == "synthesize-start":
            if self.streaming:
                raise InvalidRequest("synthesize-start inside a stream: send synthesize-stop first")
            self._check_idle(kind)
            self._begin("wyoming-stream", _voice(self.front, data.get("voice")), "the streamed text")
            self.streaming = True
        elif kind == "synthesize-chunk":
            if not self.streaming:
                if self.jobs is not None:
                    raise InvalidRequest("synthesize-chunk after synthesize-stop: start a new stream first")
                raise InvalidRequest("synthesize-chunk without synthesize-start")
            assert self.jobs is not None
            self.jobs.send(_text(data, kind))
        elif kind == "synthesize-stop":
            if not self.streaming:
                raise InvalidRequest("synthesize-stop without synthesize-start")
            assert self.jobs is not None
            self.streaming = False
            self.jobs.close()
        else:
            raise InvalidRequest(
                f"unknown event type {kind!r:.60} (this server takes describe, synthesize, synthesize-start, "
                "synthesize-chunk, synthesize-stop, ping, select-program)"
            )

    async def _close_when_idle(self, seconds: float) -> None:
        """Close the connection once it has had no synthesis in progress and no complete event for
        `seconds` (a client that connects and sends nothing, or half an event, holds a file otherwise)."""
        while not self.ended:
            if self.jobs is not None:
                wait = seconds  # (the clock starts when the synthesis ends)
            else:
                wait = self.idle_since + seconds - time.monotonic()
                if wait <= 0:
                    log.debug("wyoming: closing %s, idle for %g s", self.peer, seconds)
                    # (what is still buffered, the end of the last audio, goes out first; the reader
                    # then sees the end and the connection ends)
                    self.writer.close()
                    asyncio.get_running_loop().call_later(ERROR_SEND_SECONDS, self.writer.transport.abort)
                    return
            await asyncio.sleep(wait)

    def _check_idle(self, kind: str) -> None:
        if self.jobs is not None:
            raise InvalidRequest(f"{kind} while a synthesis is still speaking: one at a time per connection")

    def _begin(self, rpc: str, voice: str | None, label: str) -> SentenceJobs | SessionSpeech:
        call = CallLog(rpc, time.monotonic())
        streaming = rpc == "wyoming-stream"
        self.call = call  # (before opening: a session that cannot open is counted as this request)
        if streaming:
            self.jobs = SessionSpeech(self.front, voice, label)
        else:
            self.jobs = SentenceJobs(self.front, voice, label, streamed=False)
        self.speaker = asyncio.ensure_future(self._speak(self.jobs, streaming))
        return self.jobs

    async def _speak(self, jobs: SentenceJobs | SessionSpeech, streaming: bool) -> None:
        """Write one synthesis's audio: `audio-start` before the first chunk, the chunks, `audio-stop`
        (and `synthesize-stopped` for a stream); or an error event, then the connection is closed."""
        codec = self.front.bundle.codec
        fmt = {"rate": codec.sample_rate, "width": SAMPLE_WIDTH, "channels": 1}
        try:
            async for chunk in jobs.audio():
                if jobs.first_audio is None:
                    jobs.first_audio = time.monotonic()
                    await self._send("audio-start", {**fmt, "timestamp": 0})
                pcm = to_pcm16(chunk).astype("<i2", copy=False).tobytes()
                timestamp = (jobs.samples - len(chunk)) * 1000 // codec.sample_rate
                await self._send("audio-chunk", {**fmt, "timestamp": timestamp}, pcm)
            if jobs.samples == 0:
                why = "for this text" if jobs.request_id != "-" else "in the streamed text: nothing to speak"
                raise NoAudio(message=f"the model produced no audio {why}")
            await self._send("audio-stop", {"timestamp": jobs.samples * 1000 // codec.sample_rate})
            if streaming:
                await self._send("synthesize-stopped")
        except (ClientGone, ConnectionError):
            self.writer.transport.abort()  # (the reader ends too, and counts the cancel)
            return
        except Exception as exc:  # noqa: BLE001 - every failure of the job reaches the client as an error
            if not isinstance(exc, REQUEST_ERRORS):
                log.exception("wyoming: a synthesis failed")
            await self._fail(exc)
            return
        self._end_synthesis("ok")

    def _end_synthesis(self, outcome: str) -> None:
        """The synthesis in progress ended with `outcome`: counted and logged once, its job cancelled
        unless it ended; the connection is ready for the next request."""
        jobs, call = self.jobs, self.call
        self.jobs, self.call, self.streaming = None, None, False
        self.idle_since = time.monotonic()
        if jobs is not None:
            jobs.abort()
        if call is None or call.logged:
            return
        if jobs is not None:
            codec = self.front.bundle.codec
            call.request_id, call.text_bytes = jobs.request_id, jobs.text_bytes
            call.voice = jobs.voice_kind
            call.frames = jobs.samples // codec.frame_length
            call.audio_seconds = jobs.samples / codec.sample_rate
            call.first_audio = jobs.first_audio
            # A stream's time to first audio counts from its first complete sentence, not from its start
            # (which waits for the client's text).
            if jobs.first_job_at is not None and call.rpc == "wyoming-stream":
                call.received = jobs.first_job_at
        m = self.front.metrics
        m.requests.labels(outcome).inc()
        if outcome == "ok":
            m.audio_seconds.inc(call.audio_seconds)
            if call.first_audio is not None:
                m.ttfa.observe(call.first_audio - call.received)
                if call.rpc == "wyoming":  # (a stream's pace is the client's text's)
                    m.rtf.observe((time.monotonic() - call.received) / call.audio_seconds)
        call.outcome = outcome
        log_call(call)  # the one line per request, as gRPC and HTTP write it

    async def _fail(self, exc: BaseException) -> None:
        """Answer `exc` with one error event (its outcome as the code), count it (as the synthesis in
        progress, or as a request of its own), cancel the synthesis and close the connection (flushing
        the error first, for at most ERROR_SEND_SECONDS)."""
        if self.ended:
            return
        self.ended = True
        message, outcome = error_message(exc), outcome_of(exc)  # (NoAudio: `no_audio`)
        if self.call is None:
            self.call = CallLog("wyoming", time.monotonic())
        self.call.detail = message
        self._end_synthesis(outcome)
        if self.speaker is not None and self.speaker is not asyncio.current_task():
            self.speaker.cancel()  # (no audio after the error)
        log.debug("wyoming: error to %s: %s", self.peer, message)
        transport = self.writer.transport
        try:
            await asyncio.wait_for(
                self._send("error", {"text": message, "code": outcome}), ERROR_SEND_SECONDS
            )
        except (TimeoutError, ConnectionError):
            transport.abort()
            return
        self.writer.close()  # (sends what is buffered, then closes; the reader sees the end)
        asyncio.get_running_loop().call_later(ERROR_SEND_SECONDS, transport.abort)

    async def _send(self, kind: str, data: dict | None = None, payload: bytes = b"") -> None:
        if self.writer.transport.is_closing():
            raise ClientGone()
        self.writer.write(encode_event(kind, data, payload))  # (one write: events never interleave)
        await self.writer.drain()


# What a request can fail with (answered without a traceback in the log).
REQUEST_ERRORS: tuple[type[BaseException], ...] = (
    InvalidRequest, VoiceNotFound, TextError, LoopClosed, Overloaded, PreparationTimeout, EngineFailed,
    Cancelled, Preempted, NoAudio, SessionLimit,
)  # fmt: skip


def _text(data: dict, kind: str) -> str:
    text = data.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{kind} needs `text` (a string)")
    return text


def _voice(front: WyomingFront, voice: object) -> str | None:
    """The voice name a `voice` field selects (None: the model's default); raises VoiceNotFound or
    InvalidRequest."""
    if voice is None:
        return None
    if not isinstance(voice, dict):
        raise InvalidRequest(f"`voice` must be an object with name, language or speaker, got {voice!r:.60}")
    name = voice.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise InvalidRequest(f"voice.name must be a string, got {name!r:.60}")
        front.loop.voices.get(name)  # (raises VoiceNotFound naming it)
        return name
    language = voice.get("language")
    if language is not None:
        languages = front.languages
        if not isinstance(language, str) or re.split(r"[-_]", language.lower())[0] not in languages:
            raise InvalidRequest(
                f"voice.language {language!r:.60} is not spoken by this model (it speaks "
                f"{', '.join(languages)})"
            )
    return None


# ---- the front ----------------------------------------------------------------------------------------


class WyomingFront:
    """The Wyoming front of a `TTSServer` (its engine loop, limits, metrics, log line). `start()` listens
    on the running asyncio loop; `stop()` closes the port and every connection."""

    def __init__(self, server: TTSServer):
        self.server = server
        self.loop = server.loop
        self.bundle = server.loop.bundle
        self.limits = server.limits
        self.metrics = server.metrics
        self.max_event_bytes = max_event_bytes(self.limits.max_text_bytes)
        policy = getattr(self.bundle.prompt_format, "text_policy", "english")
        self.languages = POLICY_LANGUAGES.get(policy, FISH_LANGUAGES)
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task, _Connection] = {}

    def info(self) -> dict:
        """The `info` event's data: one TTS program with the model's voices (presets and registered)."""
        attribution = {"name": PROGRAM, "url": PROJECT_URL}
        default = self.bundle.default_voice
        voices = [
            {
                "name": e.name,
                "attribution": attribution,
                "installed": True,
                "description": f"{e.name} ({e.kind}{', default' if e.name == default else ''})",
                "version": None,
                "languages": self.languages,
                "speakers": None,
            }
            for e in self.loop.list_voices()
        ]
        program = {
            "name": PROGRAM,
            "attribution": attribution,
            "installed": True,
            "description": f"{self.bundle.name} ({self.bundle.family})",
            "version": __version__,
            "voices": voices,
            "supports_synthesize_streaming": True,
        }
        return {"asr": [], "tts": [program], "handle": [], "intent": [], "wake": [], "mic": [], "snd": []}

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = a free port); returns the bound port. Raises RuntimeError if the address
        cannot be bound."""
        try:
            self._server = await asyncio.start_server(
                self._accept, host, port, limit=self.max_event_bytes, reuse_address=True
            )
        except OSError as exc:
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise RuntimeError(f"cannot listen on {address} (Wyoming): {exc.strerror or exc}") from exc
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        task = asyncio.current_task()
        assert task is not None
        connection = _Connection(self, reader, writer)
        if not await self._slot_free():
            n = self.limits.max_wyoming_connections
            await connection._fail(Overloaded(f"{n} Wyoming connections are open; try again later"))
            return
        if self._server is None or not self._server.is_serving():  # stop() began while it waited
            await connection._fail(LoopClosed("the server is shutting down; not accepting requests"))
            return
        self._connections[task] = connection
        try:
            await connection.run()
        finally:
            del self._connections[task]

    async def _slot_free(self) -> bool:
        """Whether a new connection may open: fewer than the cap held by clients still there. A client
        that has closed its side has left (its job is cancelled, as for any client whose stream ended):
        its connection is aborted here, so that its task ends even if it was stuck writing to it, and it
        holds no slot meanwhile; else a burst of connect-and-close (port checks) refuses the clients that
        come next. Connections accepted together in one pass of the event loop have not had their ends
        read yet, so at the cap this lets the loop run a few passes (its poll reads those ends; no timer)
        before it counts again."""
        cap = self.limits.max_wyoming_connections
        for _ in range(SLOT_PASSES + 1):
            left = [c for c in self._connections.values() if c.client_left()]
            for c in left:
                c.writer.transport.abort()
            if len(self._connections) - len(left) < cap:
                return True
            await asyncio.sleep(0)
        return False

    async def stop(self) -> None:
        """Stop listening and close every connection (their jobs cancelled). Call it once the engine loop
        has stopped: open syntheses have then ended with an error event. Idempotent."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._server = None
