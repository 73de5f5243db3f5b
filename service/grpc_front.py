"""The gRPC front (grpc.aio): the `tts.v1.TextToSpeech` servicer, the translation between its messages and
the runtime's `SpeechRequest`, and the map from errors to gRPC statuses. `service.server.TTSServer` owns it.

Handlers only translate, enqueue and stream: every device operation (engine steps, prefill, reference
encoding, codec decode) happens in `EngineThread`'s engine thread or its codec stage. A `Synthesize` call:

1. becomes a `SpeechRequest` (`speech_request`) and is checked and planned on a worker thread
   (`tts.runtime.request`: text (prepared by the model's text policy unless `normalize` is false, split
   into chunks at sentence ends, reserved tags refused; what was left out goes to the header's
   warnings), sampling values, voice name (a preset or a registered voice), reference clip (size limit,
   decodable audio (WAV, FLAC, MP3 or Ogg), length, transcript), chunk sizes, and that every text chunk's
   prompt plus its frame budget fits the context); each failure is INVALID_ARGUMENT (NOT_FOUND for an
   unknown voice) before any generation work, with the request field at fault (as this API names it:
   `GRPC_FIELDS`) in the trailing metadata `tts-field`; all of it within the call's deadline and
   `ServiceLimits.max_prepare_seconds` (`prepare_off_loop`; past either: DEADLINE_EXCEEDED);
2. is admitted by the engine loop or refused with RESOURCE_EXHAUSTED (bounded queue) / UNAVAILABLE
   (warming up, shutting down: `ReplicaState.refusal`);
3. streams a header, audio chunks and an end message (finish reason, warnings); a job that ends without
   any audio ends with FAILED_PRECONDITION instead of an end message (no OK with empty audio; HTTP's 422
   `no_audio`); a client cancel or deadline cancels the handler task, whose call context
   (`_synthesis_call`) cancels the job (blocks, row and codec slot freed at the next engine step). A
   stream whose client stops reading pauses; paused longer than `pause_timeout` while others wait, it
   ends with RESOURCE_EXHAUSTED.

Both Synthesize forms consume one event loop (`_events`: Started, Audio..., Finished) inside one call
context (`_synthesis_call`); the streaming form writes each event as it comes, the unary one collects.

Every finished call logs one line (`request id=... outcome=...`, `service.common.log_call`) at INFO;
client cancels are INFO too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from service.access import OPEN_GRPC_PREFIXES, UNAUTHENTICATED_MESSAGE, Access
from service.common import (
    CallLog,
    NoAudio,
    ReplicaState,
    ServiceLimits,
    error_field,
    error_message,
    finish_reason,
    log_call,
    outcome_of,
    prepare_off_loop,
    register_voice,
)
from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from service.grpc_session import Wire, given_sampling, run_session
from service.metrics import ServiceMetrics
from tts.audio.files import to_pcm16
from tts.checkpoints.bundle import ModelBundle
from tts.codec.base import AudioError
from tts.engine import FinishReason, InvalidRequest
from tts.runtime.engine_thread import (
    Audio,
    EngineFailed,
    EngineThread,
    Failed,
    Finished,
    LoopClosed,
    Overloaded,
    RequestStream,
    Started,
    SynthesisJob,
)
from tts.runtime.request import (
    VOICE,
    ReferenceClip,
    Sampling,
    SpeechRequest,
    plan_job,
)
from tts.runtime.request_errors import InvalidField, with_field
from tts.runtime.voices import VoiceExists, VoiceNotFound
from tts.text.normalize import shorten

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextToSpeech"].full_name  # "tts.v1.TextToSpeech"
# The health service name for liveness probes: SERVING from start-up (warm-up included) through a drain,
# NOT_SERVING once the engine thread has ended or the replica failed for good (`EngineThread.failure`).
LIVENESS_SERVICE = "liveness"
# The trailing metadata key that names the request field at fault in an INVALID_ARGUMENT / NOT_FOUND status.
FIELD_METADATA = "tts-field"
# This API's names of the request fields (`tts.runtime.request.FIELDS`; those not here are the same).
GRPC_FIELDS = {
    "voice": "voice.name",
    "reference.audio": "voice.reference.audio",
    "reference.text": "voice.reference.text",
}
# AddVoiceRequest's names (its clip is `reference`, its name `name`).
ADD_VOICE_FIELDS = {"voice": "name"}
# The statuses of `service.common.outcome_of`'s outcomes.
STATUS = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "preempted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "cancelled": grpc.StatusCode.CANCELLED,
    "no_audio": grpc.StatusCode.FAILED_PRECONDITION,
    "error": grpc.StatusCode.INTERNAL,
}

try:  # what a send on a call that has already ended raises (grpc.aio.InternalError's subclass)
    from grpc._cython.cygrpc import ExecuteBatchError as CALL_ENDED
except ImportError:  # pragma: no cover - another grpc build: its public base class
    CALL_ENDED = grpc.aio.InternalError


def grpc_options(limits: ServiceLimits) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments for `limits` (message sizes, connections, their age and idle
    time)."""
    options = [
        ("grpc.max_receive_message_length", limits.receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
        # (gRPC core's connection quota: idle clients cannot use up the process's open files)
        ("grpc.max_allowed_incoming_connections", limits.max_grpc_connections),
    ]
    if limits.max_connection_idle:
        options.append(("grpc.max_connection_idle_ms", max(1, round(limits.max_connection_idle * 1000))))
    if limits.max_connection_age:
        options.append(("grpc.max_connection_age_ms", max(1, round(limits.max_connection_age * 1000))))
        if limits.max_connection_age_grace is not None:
            grace_ms = max(1, round(limits.max_connection_age_grace * 1000))
            options.append(("grpc.max_connection_age_grace_ms", grace_ms))
    return options


# ---- the request -----------------------------------------------------------------------------------------


@dataclass
class PreparedRequest:
    job: SynthesisJob
    encoding: pb.AudioEncoding
    include_codes: bool


def speech_request(request: pb.SynthesizeRequest) -> tuple[SpeechRequest, pb.AudioEncoding, bool]:
    """A SynthesizeRequest as the runtime's SpeechRequest, with the reply's encoding and whether it carries
    the codes (0 chunk sizes: the server's defaults; an unset field: the model's default). Raises
    InvalidField for an unknown encoding; every other rule is the SpeechRequest's."""
    sampling = Sampling(**given_sampling(request.sampling))
    source = request.voice.WhichOneof("source")
    ref = request.voice.reference
    out = request.output
    encoding = out.encoding or pb.AUDIO_ENCODING_PCM16
    if encoding not in (pb.AUDIO_ENCODING_PCM16, pb.AUDIO_ENCODING_FLOAT32):
        raise InvalidField("output.encoding", f"unknown output.encoding {encoding}")
    speech = SpeechRequest(
        request.text,
        voice=request.voice.name if source == "name" else None,
        reference=ReferenceClip(bytes(ref.audio), ref.text) if source == "reference" else None,
        sampling=sampling,
        first_chunk_frames=out.first_chunk_frames or None,
        chunk_frames=out.chunk_frames or None,
        normalize=request.normalize if request.HasField("normalize") else True,
    )
    return speech, encoding, out.include_codes


def prepare_request(planner, request: pb.SynthesizeRequest, limits: ServiceLimits) -> PreparedRequest:
    """Translate and plan a SynthesizeRequest (host work only; any thread). Raises the SpeechRequest's
    errors (`tts.runtime.request`)."""
    speech, encoding, include_codes = speech_request(request)
    return PreparedRequest(plan_job(planner, speech, limits.request_limits), encoding, include_codes)


# Status details are cut to this many characters (gRPC refuses metadata over 16 KiB with another status).
MAX_STATUS_CHARS = 300


def status_for(exc: BaseException, names: dict[str, str] | None = None) -> tuple[grpc.StatusCode, str, str]:
    """(status, details, metrics outcome) for an error a request can end with; the details are one line
    of at most MAX_STATUS_CHARS characters, cut in the middle when longer, naming fields as `names` does
    (default GRPC_FIELDS)."""
    outcome = outcome_of(exc)
    details = error_message(exc, GRPC_FIELDS if names is None else names)
    return STATUS[outcome], shorten(details, MAX_STATUS_CHARS), outcome


# ---- malformed request bytes ---------------------------------------------------------------------------
# grpc's own deserializer failure is UNKNOWN "Unexpected <class 'DecodeError'>" plus a logged traceback
# per request; `add_servicer` registers deserializers that hand the handler a `MalformedRequest` instead,
# which it answers with INVALID_ARGUMENT and one log line.


@dataclass
class MalformedRequest:
    """Bytes that are not a valid request message; `message` says why (the status details)."""

    message: str


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def invalid_utf8_field(data: bytes, descriptor, prefix: str = "") -> str | None:
    """The dotted name of the first string field (nested messages included) whose value in the protobuf
    wire bytes `data` of a `descriptor` message is not UTF-8; None if there is none or `data` is too
    broken to walk."""
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                value, pos = data[pos : pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if pos > len(data) or field is None:
                    continue
                if field.type == field.TYPE_STRING:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        return prefix + field.name
                elif field.type == field.TYPE_MESSAGE:
                    found = invalid_utf8_field(value, field.message_type, f"{prefix}{field.name}.")
                    if found:
                        return found
            else:
                return None  # groups: not in this API
    except IndexError:
        return None
    return None


def _tolerant_deserializer(message_class):
    """`message_class.FromString` that returns a MalformedRequest instead of raising DecodeError."""
    from google.protobuf.message import DecodeError

    descriptor = message_class.DESCRIPTOR

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            field = invalid_utf8_field(data, descriptor)
            hint = f" ({field} must be UTF-8)" if field else ""
            reason = str(exc).removeprefix(f"Error parsing message with type '{descriptor.full_name}': ")
            return MalformedRequest(f"the request is not a valid {descriptor.full_name}: {reason}{hint}")

    return deserialize


def _guarded(servicer, method_name: str, streaming: bool):
    """`servicer`'s handler for `method_name`, answering a MalformedRequest with INVALID_ARGUMENT."""
    behavior = getattr(servicer, method_name)

    async def reject(request: MalformedRequest, context) -> None:
        log.warning("%s from %s: %s", method_name, context.peer(), request.message)
        await servicer._abort(context, InvalidRequest(request.message))

    if streaming and inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            if isinstance(request, MalformedRequest):
                await reject(request, context)
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            finally:
                await responses.aclose()  # closed early: the handler's own cleanup runs now

        return stream
    if not streaming or inspect.iscoroutinefunction(behavior):  # (streaming ones write with context.write)

        async def call(request, context):
            if isinstance(request, MalformedRequest):
                await reject(request, context)
            response = behavior(request, context)
            return await response if inspect.isawaitable(response) else response

        return call
    return behavior  # not implemented (the generated base class) or synchronous: left as it is


def add_servicer(servicer: TextToSpeechServicer, server) -> None:
    """Register `servicer` for every method of tts.v1.TextToSpeech, as the generated
    `add_TextToSpeechServicer_to_server` does, but with request deserializers that turn bytes which are
    not a valid request (invalid UTF-8 in a string field, a truncated message) into INVALID_ARGUMENT.
    A bidi method (SynthesizeSession) reads its messages itself: a malformed one reaches it as a
    `MalformedRequest`. Raises NotImplementedError for a client-streaming method with a unary reply."""
    kinds = {False: grpc.unary_unary_rpc_method_handler, True: grpc.unary_stream_rpc_method_handler}
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TextToSpeech"].methods:
        if method.client_streaming:
            if not method.server_streaming:
                raise NotImplementedError(f"{method.name}: client-streaming methods are not handled here")
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                getattr(servicer, method.name),
                request_deserializer=_tolerant_deserializer(getattr(pb, method.input_type.name)),
                response_serializer=getattr(pb, method.output_type.name).SerializeToString,
            )
            continue
        handlers[method.name] = kinds[method.server_streaming](
            _guarded(servicer, method.name, method.server_streaming),
            request_deserializer=_tolerant_deserializer(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# ---- encoding -----------------------------------------------------------------------------------------


def encode_audio(samples: np.ndarray, encoding: int) -> bytes:
    """float32 samples -> little-endian PCM16 or float32 bytes."""
    if encoding == pb.AUDIO_ENCODING_FLOAT32:
        return np.asarray(samples, dtype="<f4").tobytes()
    return to_pcm16(samples).astype("<i2", copy=False).tobytes()


def encode_codes(codes: torch.Tensor) -> pb.Codes:
    """codes `[N, frames]` -> Codes (codebook-major values)."""
    n, f = codes.shape
    return pb.Codes(num_codebooks=n, num_frames=f, values=codes.reshape(-1).tolist())


_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.SHORT: pb.FINISH_REASON_SHORT,
    FinishReason.LOOP: pb.FINISH_REASON_LOOP,
}


# ---- the servicer -------------------------------------------------------------------------------------


@dataclass
class SynthesisCall(CallLog):
    """A Synthesize or SynthesizeUnary call: its log line, and once admitted its request, engine stream and
    the audio counted so far (for its end message). Made by `TextToSpeechServicer._synthesis_call`, filled
    in by `TextToSpeechServicer._events`."""

    prepared: PreparedRequest | None = None
    stream: RequestStream | None = None
    samples: int = 0
    chunks: int = 0


class TextToSpeechServicer(pb_grpc.TextToSpeechServicer):
    """tts.v1.TextToSpeech over one engine loop; `state` is the replica's (admission, its name)."""

    def __init__(
        self, loop: EngineThread, limits: ServiceLimits, metrics: ServiceMetrics, state: ReplicaState
    ):
        self.loop = loop
        self.limits = limits
        self.metrics = metrics
        self.bundle: ModelBundle = loop.bundle
        self.state = state

    @property
    def replica(self) -> str:
        """This process's name, in every stream header and GetInfo."""
        return self.state.replica

    async def _open(self, request, context, call: CallLog) -> tuple[PreparedRequest, RequestStream, Started]:
        """Validate, admit, and wait for the engine thread's acceptance; aborts with the right status."""
        call.text_bytes = len(request.text.encode("utf-8", "replace"))
        refusal = self.state.refusal()
        if refusal is not None:
            await self._abort(context, refusal, call)
        planner = self.loop.planner
        assert planner is not None  # the engine thread sets it before the loop is ready
        remaining = context.time_remaining()
        timeout = self.limits.max_prepare_seconds
        timeout = timeout if remaining is None else min(timeout, remaining)
        try:
            prepared = await prepare_off_loop(prepare_request, planner, request, self.limits, timeout=timeout)
            call.voice = prepared.job.voice_kind
            stream = self.loop.submit(prepared.job, asyncio.get_running_loop())
        except Exception as exc:  # noqa: BLE001 - a bad request, or a bug: INTERNAL with its message
            if outcome_of(exc) == "error":
                log.exception("preparing a request failed")
            await self._abort(context, exc, call)
        call.request_id = stream.request_id
        try:
            event = await stream.next()
        except BaseException:
            stream.cancel()
            raise
        if isinstance(event, Failed):
            await self._abort(context, event.error, call)
        assert isinstance(event, Started), event
        return prepared, stream, event

    async def _abort(
        self, context, exc: BaseException, call: CallLog | None = None, names: dict[str, str] | None = None
    ):
        """End the call with `exc`'s status (fields named as `names` names them; default GRPC_FIELDS), the
        field at fault in the trailing metadata `tts-field`; count and log it."""
        names = GRPC_FIELDS if names is None else names
        code, details, outcome = status_for(exc, names)
        self.metrics.requests.labels(outcome).inc()
        if call is not None:
            call.outcome, call.detail = outcome, details
            log_call(call)
        field = error_field(exc, names)
        await context.abort(code, details, trailing_metadata=((FIELD_METADATA, field),) if field else ())

    def _header(self, started: Started, prepared: PreparedRequest) -> pb.StreamHeader:
        codec = self.bundle.codec
        return pb.StreamHeader(
            request_id=started.request_id,
            sample_rate=codec.sample_rate,
            channels=1,
            encoding=prepared.encoding,
            frame_rate=codec.frame_rate,
            num_codebooks=codec.num_codebooks,
            model=self.bundle.name,
            seed=started.seed,
            text_chunks=started.text_chunks,
            replica=self.replica,
            warnings=[shorten(w, MAX_STATUS_CHARS) for w in prepared.job.warnings],
        )

    def _end(self, finished: Finished, call: SynthesisCall) -> pb.StreamEnd:
        audio_seconds = call.samples / self.bundle.codec.sample_rate
        wall = time.monotonic() - call.received
        ttfa = (call.first_audio - call.received) if call.first_audio is not None else 0.0
        rtf = wall / audio_seconds if audio_seconds > 0 else 0.0
        reasons = [_FINISH[r] for r in finished.finish_reasons]
        self.metrics.requests.labels("ok").inc()
        self.metrics.audio_seconds.inc(audio_seconds)
        if audio_seconds > 0:
            self.metrics.ttfa.observe(ttfa)
            self.metrics.rtf.observe(rtf)
        call.frames, call.audio_seconds = finished.frames, audio_seconds
        call.outcome = "ok" if pb.FINISH_REASON_SHORT not in reasons else "ok_short"
        log_call(call)
        return pb.StreamEnd(
            finish_reason=_FINISH[FinishReason(finish_reason(finished.finish_reasons))],
            frames=finished.frames,
            audio_seconds=audio_seconds,
            time_to_first_audio_seconds=ttfa,
            rtf=rtf,
            chunks=call.chunks,
            text_chunk_finish_reasons=reasons,
            warnings=[shorten(w, MAX_STATUS_CHARS) for w in finished.warnings],
        )

    def _ended_by_client(self, context, call: CallLog) -> None:
        remaining = context.time_remaining()
        outcome = "deadline_exceeded" if remaining is not None and remaining <= 0 else "cancelled"
        self.metrics.requests.labels(outcome).inc()
        call.outcome = outcome
        log_call(call)

    @contextlib.asynccontextmanager
    async def _synthesis_call(self, rpc: str, context):
        """The `SynthesisCall` of one Synthesize or SynthesizeUnary call, as a context around the handler's
        body: a client cancel or deadline (which cancels the handler task) is counted and logged as one,
        and on the way out the job, once admitted, is cancelled (a no-op once it ended; otherwise its
        blocks, row and codec slot are freed at the next engine step).

        A write (or an abort's status) that races with the client's cancel fails inside grpc
        (ExecuteBatchError: the call has already ended) instead of cancelling the task, and grpc learns
        of the cancel only later, so it would log the error with a traceback: it is still a cancel,
        counted and logged as one (once), and leaves as CancelledError, which grpc does not log.
        """
        call = SynthesisCall(rpc, time.monotonic())
        try:
            yield call
        except asyncio.CancelledError:
            if not call.logged:
                self._ended_by_client(context, call)
            raise
        except CALL_ENDED as exc:
            if not call.logged:
                self._ended_by_client(context, call)
            raise asyncio.CancelledError from exc
        finally:
            if call.stream is not None:
                call.stream.cancel()

    async def _events(
        self, request, context, call: SynthesisCall
    ) -> AsyncIterator[Started | Audio | Finished]:
        """The one event loop of both Synthesize forms: validate and admit `request` (`_open`, which aborts
        the call with the right status when it cannot; the request and its stream go on `call`), then
        yield the job's events: `Started`, each `Audio` chunk (counted into `call.samples` and
        `call.chunks` for `_end`), and `Finished`, the last. A failed job aborts the call with its status.
        Use inside `_synthesis_call`, which cancels the stream when the call ends."""
        call.prepared, call.stream, started = await self._open(request, context, call)
        yield started
        while True:
            event = await call.stream.next()
            if isinstance(event, Audio):
                call.samples += len(event.samples)
                call.chunks += 1
                yield event
            elif isinstance(event, Finished):
                if call.samples == 0:  # nothing to hear: no OK for it (docs/DESIGN.md invariant 9)
                    await self._abort(context, NoAudio(event), call)
                yield event
                return
            else:
                assert isinstance(event, Failed), event  # Started comes once, first (taken by _open)
                await self._abort(context, event.error, call)

    async def Synthesize(self, request, context):
        # Messages go out with `await context.write()` rather than by yielding: a client that cancels
        # then surfaces here as CancelledError (counted and logged as a cancel), whereas a failed write
        # of a yielded message is logged by grpc as an ERROR traceback and the generator closed late.
        async with self._synthesis_call("Synthesize", context) as call:
            async for event in self._events(request, context, call):
                prepared = call.prepared
                if isinstance(event, Started):
                    await context.write(pb.SynthesizeResponse(header=self._header(event, prepared)))
                elif isinstance(event, Audio):
                    chunk = pb.AudioChunk(
                        sequence=event.sequence,
                        audio=encode_audio(event.samples, prepared.encoding),
                        frame_start=event.frame_start,
                        frame_end=event.frame_end,
                    )
                    if prepared.include_codes:
                        chunk.codes.CopyFrom(encode_codes(event.codes))
                    if call.first_audio is None:
                        call.first_audio = time.monotonic()
                    call.frames = event.frame_end
                    await context.write(pb.SynthesizeResponse(chunk=chunk))
                else:
                    await context.write(pb.SynthesizeResponse(end=self._end(event, call)))

    async def SynthesizeUnary(self, request, context):
        async with self._synthesis_call("SynthesizeUnary", context) as call:
            parts: list[bytes] = []
            codes: list[torch.Tensor] = []
            size = 0
            async for event in self._events(request, context, call):
                prepared = call.prepared
                if isinstance(event, Started):
                    started = event
                elif isinstance(event, Audio):
                    data = encode_audio(event.samples, prepared.encoding)
                    size += len(data) + (event.codes.numel() * 5 if prepared.include_codes else 0)
                    if size > self.limits.max_send_bytes - 64 * 1024:
                        await self._abort(
                            context,
                            Overloaded(
                                f"the audio exceeds the maximum message size ({self.limits.max_send_bytes} "
                                "bytes); "
                                "use the streaming Synthesize call"
                            ),
                            call,
                        )
                    if call.first_audio is None:
                        call.first_audio = time.monotonic()
                    parts.append(data)
                    codes.append(event.codes)
                else:
                    reply = pb.SynthesizeUnaryResponse(
                        header=self._header(started, prepared),
                        audio=b"".join(parts),
                        end=self._end(event, call),
                    )
                    if prepared.include_codes:
                        n = self.bundle.codec.num_codebooks
                        reply.codes.CopyFrom(
                            encode_codes(
                                torch.cat(codes, 1) if codes else torch.zeros(n, 0, dtype=torch.int64)
                            )
                        )
                    return reply

    async def SynthesizeSession(self, request_iterator, context):
        # (the messages are read with context.read(): service/grpc_session.py)
        wire = Wire(encode_audio, encode_codes, MAX_STATUS_CHARS, MalformedRequest, CALL_ENDED)
        await run_session(self, context, wire)

    def _voice_info(self, entry) -> pb.VoiceInfo:
        return pb.VoiceInfo(
            name=entry.name,
            transcript=entry.voice.text,
            seconds=entry.seconds(self.bundle.codec.frame_rate),
            kind=entry.kind,
        )

    async def ListVoices(self, request, context):
        return pb.ListVoicesResponse(voices=[self._voice_info(e) for e in self.loop.list_voices()])

    async def AddVoice(self, request, context):
        """Register a voice (`register_voice`), persisted under the voices dir."""
        clip = ReferenceClip(bytes(request.reference.audio), request.reference.text)
        try:
            entry = await register_voice(self, request.name, clip, request.replace)
        except (InvalidRequest, AudioError, VoiceExists, LoopClosed) as exc:
            await self._abort(context, exc, names=ADD_VOICE_FIELDS)
        except Exception as exc:  # noqa: BLE001 - encoding or the voice file failed: INTERNAL, said once
            log.exception("adding voice %r failed", shorten(request.name, 60))
            await self._abort(context, EngineFailed(f"cannot add the voice: {exc}"))
        log.info("voice added name=%s seconds=%.2f", entry.name, entry.seconds(self.bundle.codec.frame_rate))
        return self._voice_info(entry)

    async def DeleteVoice(self, request, context):
        try:
            self.loop.delete_voice(request.name)
        except (VoiceNotFound, InvalidRequest) as exc:
            await self._abort(context, with_field(exc, VOICE), names=ADD_VOICE_FIELDS)
        log.info("voice deleted name=%s", request.name)
        return pb.DeleteVoiceResponse()

    async def GetInfo(self, request, context):
        refusal = self.state.refusal(new_work=False)
        if refusal is not None:
            await self._abort(context, refusal)
        b, e, lim = self.bundle, self.loop.engine, self.limits
        c, g = b.codec, e.graphs
        kv = e.kv_info()
        return pb.GetInfoResponse(
            model=b.name,
            family=b.family,
            parameters=b.num_parameters(),
            device=str(b.device),
            dtype=str(b.dtype).removeprefix("torch."),
            sample_rate=c.sample_rate,
            frame_rate=c.frame_rate,
            num_codebooks=c.num_codebooks,
            codebook_size=c.codebook_size,
            max_context=e.max_context,
            max_batch=e.config.max_batch,
            buckets=g.buckets if g.enabled else [],
            graphs=g.enabled,
            capture=e.config.graphs if g.enabled else "",
            captured_buckets=sorted({b for b, _ in g.graphs}),
            replay_share=g.stats.replay_share,
            max_waiting=lim.max_waiting,
            max_reference_bytes=lim.max_reference_bytes,
            max_message_bytes=lim.receive_bytes,
            max_text_bytes=lim.max_text_bytes,
            max_chunk_frames=lim.max_chunk_frames,
            text_chunk_bytes=b.chunk_length,
            max_reference_seconds=self.loop.planner.max_reference_seconds,
            max_audio_seconds=lim.max_audio_seconds or 0.0,
            pause_timeout_seconds=lim.pause_timeout or 0.0,
            reference_cache_bytes=lim.reference_cache_bytes,
            codec_dtype=_codec_dtype(c),
            replica=self.replica,
            kv_cache_bytes=kv["bytes"],
            kv_blocks=kv["blocks"],
            kv_block_size=kv["block_size"],
            kv_memory_fraction=kv["memory_fraction"] or 0.0,
        )


def _codec_dtype(codec) -> str:
    dtype = getattr(codec, "dtype", torch.float32)
    return str(dtype).removeprefix("torch.")


# ---- API keys ----


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without an accepted key with UNAUTHENTICATED before its handler runs (health
    and reflection excepted)."""

    def __init__(self, access: Access):
        self.access = access

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.access.key_ok(metadata.get("authorization")):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # (an async generator, as a streaming handler is)

    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, refuse),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, refuse_stream),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, refuse),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, refuse_stream),
    )
    for present, make, behaviour in kinds:
        if present is not None:
            return make(
                behaviour,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
