"""The gRPC front's `SynthesizeSession` (bidi streaming): the translation between its messages and an
`EngineThread` session (`tts.runtime.engine_thread.SessionStream`). `TextToSpeechServicer.SynthesizeSession`
calls `run_session`, so the call goes through the servicer's registration (`add_servicer`) like every
other method, and a server interceptor covers it.

One call is one session:

1. the first client message must be `start` (voice: a name or a reference clip; sampling, output); it is
   checked (INVALID_ARGUMENT naming the field, NOT_FOUND for an unknown voice; a clip by a one-shot
   request's rules, on a worker thread within `max_prepare_seconds`) and the session opened
   (RESOURCE_EXHAUSTED at the server's `--max-sessions`, UNAVAILABLE while warming up or draining; a clip
   is encoded once, on the codec stage, before the first chunk); a `SessionHeader` goes out;
2. a reader task applies the client's messages in order: `text` -> `send`, `flush`, `cancel` (barge-in),
   `close` (also the client half-closing its side); a bad message (a second `start`, text after close,
   text over the session's waiting bound, bytes that are no valid message) aborts the session and ends
   the call with INVALID_ARGUMENT naming the field;
3. the handler writes one message per session event until `SessionEnd`; a session the server ended
   ("preempted", "shutdown", "error") then ends the call with RESOURCE_EXHAUSTED / UNAVAILABLE /
   INTERNAL;
4. however the call ends (client cancel, deadline, error), the session is aborted: its row, KV blocks and
   codec stream are freed by the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from service.common import CallLog, log_call, prepare_off_loop
from service.grpc_gen.v1 import tts_pb2 as pb
from tts.params import InvalidRequest
from tts.runtime.engine_thread import (
    ChunkEnded,
    ChunkStarted,
    LoopClosed,
    Preempted,
    SessionAudio,
    SessionEnded,
    SessionOptions,
    SessionStream,
    SessionWarning,
    WordTimings,
)
from tts.runtime.request import ReferenceClip, prepare_session_voice
from tts.runtime.request_errors import InvalidField, with_field
from tts.runtime.voices import VoiceNotFound
from tts.text.normalize import shorten

if TYPE_CHECKING:
    from service.grpc_front import TextToSpeechServicer

log = logging.getLogger(__name__)

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "short": pb.FINISH_REASON_SHORT,
    "loop": pb.FINISH_REASON_LOOP,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
}
# The session's names of the request fields (`tts.runtime.request.FIELDS`) that a SessionStart holds.
SESSION_FIELDS = {
    "voice": "start.voice.name",
    "reference.audio": "start.voice.reference.audio",
    "reference.text": "start.voice.reference.text",
}
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_new_frames",
    "min_new_frames",
    "repetition_penalty",
)


def given_sampling(s: pb.SamplingOptions) -> dict:
    """The sampling options a request or session start sets (an unset field: the model's default)."""
    return {name: getattr(s, name) for name in SAMPLING if s.HasField(name)}


@dataclass(frozen=True)
class Wire:
    """What the gRPC front lends this module (it imports this one, not the other way round):
    encode_audio(samples, encoding) -> bytes, encode_codes(codes) -> pb.Codes, the longest status or
    warning text, the type of a request that is no valid message (with a `message` saying why), and what
    a write on a call that has ended raises."""

    encode_audio: Callable
    encode_codes: Callable
    max_chars: int
    malformed: type
    call_ended: type[BaseException]


class SessionEndedByServer(Exception):
    """The engine ended the session for a reason the client did not ask for."""


def session_settings(
    servicer: TextToSpeechServicer, start: pb.SessionStart
) -> tuple[dict, pb.AudioEncoding, bool]:
    """A SessionStart as `EngineThread.open_session` keyword arguments, the encoding and include_codes.
    Raises InvalidField naming the field at fault (`start.sampling.top_p`, `start.output.chunk_frames`,
    ...), as the session's own checks would find it but with the field named."""
    planner = servicer.loop.planner
    source = start.voice.WhichOneof("source")
    sampling = given_sampling(start.sampling)
    for name, value in sampling.items():  # each value alone, so that the error names its field
        alone = {name: value}
        if name == "min_new_frames" and "max_new_frames" in sampling:  # (bounded by it)
            alone["max_new_frames"] = sampling["max_new_frames"]
        try:
            planner.sampling_params(**alone)
        except InvalidRequest as exc:
            raise InvalidField(f"start.sampling.{name}", f"start.sampling.{name}: {exc}") from exc
    try:
        params = planner.sampling_params(**sampling)
    except InvalidRequest as exc:  # only together (min_new_frames over max_new_frames)
        raise InvalidField("start.sampling.min_new_frames", f"start.sampling: {exc}") from exc
    if params.max_new_frames >= planner.max_context:
        raise InvalidField(
            "start.sampling.max_new_frames",
            f"start.sampling.max_new_frames ({params.max_new_frames}) exceeds the context size "
            f"{planner.max_context}",
        )
    out = start.output
    encoding = out.encoding or pb.AUDIO_ENCODING_PCM16
    if encoding not in (pb.AUDIO_ENCODING_PCM16, pb.AUDIO_ENCODING_FLOAT32):
        raise InvalidField("start.output.encoding", f"unknown start.output.encoding {encoding}")
    limits = servicer.limits
    defaults = servicer.loop.session_options
    options = SessionOptions(**{**defaults.__dict__})
    for name in ("first_chunk_frames", "chunk_frames"):
        value = getattr(out, name)
        if value > limits.max_chunk_frames:
            raise InvalidField(
                f"start.output.{name}",
                f"start.output.{name} must be at most {limits.max_chunk_frames}, got {value}",
            )
        if value:
            setattr(options, name, value)
    kwargs = dict(
        voice=start.voice.name if source == "name" else None,
        normalize=start.normalize if start.HasField("normalize") else True,
        options=options,
        **sampling,
    )
    return kwargs, encoding, out.include_codes


async def open_stream(servicer: TextToSpeechServicer, context, start: pb.SessionStart, kwargs: dict):
    """Open the session of `start` (`kwargs`: its `session_settings`): its reference clip, if any, checked
    and decoded on a worker thread (a one-shot request's rules and limits, within the call's deadline and
    `max_prepare_seconds`), then encoded once by the engine thread. Raises the request's errors (fields as
    `tts.runtime.request` names them: map with SESSION_FIELDS), SessionLimit, LoopClosed."""
    clip = None
    if start.voice.WhichOneof("source") == "reference":
        clip = ReferenceClip(bytes(start.voice.reference.audio), start.voice.reference.text)
    reference = None
    if clip is not None:
        remaining = context.time_remaining()
        timeout = servicer.limits.max_prepare_seconds
        timeout = timeout if remaining is None else min(timeout, remaining)
        planner, limits = servicer.loop.planner, servicer.limits.request_limits
        reference = await prepare_off_loop(
            prepare_session_voice, planner, kwargs["voice"], clip, limits, timeout=timeout
        )
    return servicer.loop.open_session(reference=reference, aio_loop=asyncio.get_running_loop(), **kwargs)


def _message(event, encoding: int, include_codes: bool, rate: int, wire: Wire) -> pb.SessionResponse:
    encode_audio, encode_codes, MAX_STATUS_CHARS = wire.encode_audio, wire.encode_codes, wire.max_chars

    if isinstance(event, SessionAudio):
        audio = pb.SessionAudio(
            chunk=event.chunk,
            sample_offset=event.sample_offset,
            audio=encode_audio(event.samples, encoding),
            frame_start=event.frame_start,
            frame_end=event.frame_end,
        )
        if include_codes:
            audio.codes.CopyFrom(encode_codes(event.codes))
        return pb.SessionResponse(audio=audio)
    if isinstance(event, WordTimings):
        words = [
            pb.WordTiming(text=w.text, start=w.start, end=w.end, estimated=w.estimated) for w in event.words
        ]
        return pb.SessionResponse(timings=pb.SessionWordTimings(chunk=event.chunk, words=words))
    if isinstance(event, ChunkStarted):
        return pb.SessionResponse(
            chunk_start=pb.SessionChunkStart(
                chunk=event.chunk, text=event.text, sample_offset=event.sample_offset
            )
        )
    if isinstance(event, ChunkEnded):
        return pb.SessionResponse(
            chunk_end=pb.SessionChunkEnd(
                chunk=event.chunk,
                text=event.text,
                finish_reason=_FINISH.get(event.reason, pb.FINISH_REASON_UNSPECIFIED),
                frames=event.frames,
                audio_start=event.audio_start,
                audio_end=event.audio_end,
                prefill_tokens=event.prefill_tokens,
                cached_tokens=event.cached_tokens,
                warnings=[shorten(w, MAX_STATUS_CHARS) for w in event.warnings],
                error=shorten(event.error or "", MAX_STATUS_CHARS),
            )
        )
    if isinstance(event, SessionWarning):
        return pb.SessionResponse(warning=shorten(event.message, MAX_STATUS_CHARS))
    assert isinstance(event, SessionEnded), event
    return pb.SessionResponse(
        end=pb.SessionEnd(
            reason=event.reason, audio_samples=event.audio_samples, audio_seconds=event.audio_samples / rate
        )
    )


async def _read(context, stream: SessionStream, errors: list[BaseException], wire: Wire) -> None:
    """Apply the client's messages to `stream` until it closes; a bad one is put on `errors` and the
    session aborted (the handler then ends the call with its status)."""
    MalformedRequest = wire.malformed

    closed = False
    try:
        while True:
            request = await context.read()
            if request is grpc.aio.EOF:
                stream.close()  # (a client that half-closes is done sending: speak what is left)
                return
            if isinstance(request, MalformedRequest):
                raise InvalidRequest(getattr(request, "message", "not a valid tts.v1.SessionRequest"))
            kind = request.WhichOneof("message")
            if kind == "start":
                raise InvalidField("start", "start may only be the first message of a session")
            if kind is None:
                raise InvalidField("message", "an empty SessionRequest (set one of its fields)")
            if closed:
                raise InvalidField(kind, f"{kind} after close: the session no longer takes messages")
            if kind == "text":
                try:
                    stream.send(request.text)
                except InvalidRequest as exc:
                    raise with_field(exc, "text") from exc
            elif kind == "flush":
                stream.flush()
            elif kind == "cancel":
                stream.cancel()
            else:
                stream.close()
                closed = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad message (or a bug): the call ends with its status
        errors.append(exc)
        stream.abort()


async def run_session(servicer: TextToSpeechServicer, context, wire: Wire) -> None:
    """Serve one SynthesizeSession call (see the module docstring)."""
    session = _SessionCall(servicer, context, wire)
    reader: asyncio.Task | None = None
    try:
        stream = await session.open()
        errors: list[BaseException] = []
        reader = asyncio.ensure_future(_read(context, stream, errors, wire))
        await session.relay(errors)
    except asyncio.CancelledError:
        session.ended_by_client()
        raise
    except wire.call_ended as exc:  # a write that raced with the client's cancel: a cancel (as Synthesize)
        session.ended_by_client()
        raise asyncio.CancelledError from exc
    finally:
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
        if session.stream is not None:
            session.stream.abort()  # (a no-op once ended) the row, KV blocks and codec stream are freed


class _SessionCall:
    """One SynthesizeSession call on the server side: its session (once open), how its audio is written
    (encoding, codes or not) and its one log line. Each step that refuses the call ends it with its status
    (`TextToSpeechServicer._abort`, which raises)."""

    def __init__(self, servicer: TextToSpeechServicer, context, wire: Wire):
        self.servicer, self.context, self.wire = servicer, context, wire
        self.call = CallLog("SynthesizeSession", time.monotonic())
        self.stream: SessionStream | None = None
        self.encoding: pb.AudioEncoding = pb.AUDIO_ENCODING_PCM16
        self.include_codes = False
        self.rate = servicer.bundle.codec.sample_rate
        self.samples = 0

    async def open(self) -> SessionStream:
        """Read the first message (it must be `start`), check it, open its session and write the header.
        Ends the call with INVALID_ARGUMENT (naming the field), NOT_FOUND (an unknown voice),
        RESOURCE_EXHAUSTED (the session limit) or UNAVAILABLE (warming up, draining)."""
        servicer, context, call = self.servicer, self.context, self.call
        first = await context.read()
        if (
            first is grpc.aio.EOF
            or isinstance(first, self.wire.malformed)
            or first.WhichOneof("message") != "start"
        ):
            what = "a malformed message" if isinstance(first, self.wire.malformed) else "no start"
            await servicer._abort(
                context,
                InvalidField("start", f"start must be the first message of a session (got {what})"),
                call,
            )
        refusal = servicer.state.refusal()
        if refusal is not None:
            await servicer._abort(context, refusal, call)
        try:
            kwargs, self.encoding, self.include_codes = session_settings(servicer, first.start)
            self.stream = await open_stream(servicer, context, first.start, kwargs)
        except VoiceNotFound as exc:
            await servicer._abort(context, with_field(exc, "start.voice.name"), call)
        except Exception as exc:  # noqa: BLE001 - a bad start or clip, the session limit, a closed loop
            await servicer._abort(context, exc, call, SESSION_FIELDS)
        assert self.stream is not None
        call.request_id = self.stream.session_id
        call.voice = kwargs["voice"] or first.start.voice.WhichOneof("source") or "default"
        await context.write(pb.SessionResponse(header=self._header(kwargs["options"].max_pending_bytes)))
        return self.stream

    def _header(self, max_pending_bytes: int) -> pb.SessionHeader:
        assert self.stream is not None
        servicer, codec = self.servicer, self.servicer.bundle.codec
        return pb.SessionHeader(
            session_id=self.stream.session_id,
            sample_rate=codec.sample_rate,
            channels=1,
            encoding=self.encoding,
            frame_rate=codec.frame_rate,
            num_codebooks=codec.num_codebooks,
            model=servicer.bundle.name,
            replica=servicer.replica,
            max_pending_bytes=max_pending_bytes,
        )

    async def relay(self, errors: list[BaseException]) -> None:
        """Write one message per session event until `SessionEnd`; a bad client message (on `errors`:
        the reader aborted the session) ends the call with its status instead of the end message."""
        assert self.stream is not None
        while True:
            event = await self.stream.next()
            if isinstance(event, SessionAudio):
                self._count_audio(event)
            if isinstance(event, SessionEnded) and errors:  # a bad message ended it: its status, no end
                await self.servicer._abort(self.context, errors[0], self.call)
            await self.context.write(_message(event, self.encoding, self.include_codes, self.rate, self.wire))
            if isinstance(event, SessionEnded):
                await self._end(event)
                return

    def _count_audio(self, event: SessionAudio) -> None:
        call = self.call
        self.samples += len(event.samples)
        if call.first_audio is None:
            call.first_audio = time.monotonic()
        call.frames += event.frame_end - event.frame_start

    async def _end(self, event: SessionEnded) -> None:
        """The session ended (its end message written): count and log the call; a session the server ended
        ("preempted", "shutdown", "error") ends the call with RESOURCE_EXHAUSTED / UNAVAILABLE / INTERNAL,
        or, for an error the client's clip caused (`SessionEnded.error`), that error's status (as for a
        one-shot request: INVALID_ARGUMENT for an AudioError)."""
        call, metrics = self.call, self.servicer.metrics
        call.audio_seconds = self.samples / self.rate
        metrics.audio_seconds.inc(call.audio_seconds)
        failure = {
            "preempted": Preempted(
                event.detail or "the session's audio was not read while other requests waited"
            ),
            "shutdown": LoopClosed("the server shut down; the session ended"),
            "error": event.error or SessionEndedByServer(event.detail or "the session could not open"),
        }.get(event.reason)
        if failure is not None:
            await self.servicer._abort(self.context, failure, self.call)
        metrics.requests.labels("ok").inc()
        call.outcome = "ok" if event.reason == "closed" else event.reason
        log_call(call)

    def ended_by_client(self) -> None:
        """The client cancelled (or its deadline passed): counted and logged as that, once."""
        if not self.call.logged:
            self.servicer._ended_by_client(self.context, self.call)
