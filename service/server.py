"""The gRPC synthesis server (grpc.aio): validation, admission, streaming, health, reflection, metrics.

Handlers only validate, enqueue and stream: every device operation (engine steps, prefill, reference
encoding, codec decode) happens in `EngineLoop`'s engine thread or its codec stage. A `Synthesize` call:

1. validates its input on a worker thread (`build_job` -> `Planner.job`): text (prepared by the model's
   text policy unless `normalize` is false, split into chunks at sentence ends, reserved tags refused;
   what was left out goes to the header's warnings), sampling values, voice name (a preset or a registered voice),
   reference clip (size limit, decodable audio (WAV, FLAC, MP3 or Ogg), length, transcript), chunk
   sizes, and that every text chunk's prompt plus its frame budget fits the context; each failure is INVALID_ARGUMENT
   (NOT_FOUND for an unknown voice) before any generation work; all of it within the call's deadline and
   `ServiceLimits.max_prepare_seconds` (`prepare_off_loop`; past either: DEADLINE_EXCEEDED);
2. is admitted by the engine loop or refused with RESOURCE_EXHAUSTED (bounded queue) / UNAVAILABLE
   (warming up, shutting down);
3. streams a header, audio chunks and an end message (finish reason, warnings); a client cancel or
   deadline cancels the handler task, whose call context (`_synthesis_call`) cancels the job (blocks,
   row and codec slot freed at the next engine step). A stream whose client stops reading pauses; paused
   longer than `pause_timeout` while others wait, it ends with RESOURCE_EXHAUSTED.

Both Synthesize forms consume one event loop (`_events`: Started, Audio..., Finished) inside one call
context (`_synthesis_call`); the streaming form writes each event as it comes, the unary one collects.

Every finished call logs one line (`request id=... outcome=...`) at INFO; client cancels are INFO too.

`TTSServer.stop(grace, drain_delay)` (the CLI calls it on SIGTERM/SIGINT) drains: health turns
NOT_SERVING at once; new calls are still admitted for `drain_delay` seconds (default 0), long enough for a
load balancer that polls health to stop sending, then answered UNAVAILABLE while open streams get `grace`
seconds to finish; then the rest end with UNAVAILABLE, the engine stops and the port closes (within
`drain_delay` + `grace` + about a second).

Scale-out (docs/operations.md, "Scaling out"): every stream header and GetInfo name the replica (`--replica-name`),
`grpc.max_connection_age_ms` makes long-lived client connections reconnect (and so rebalance), and the
health service `liveness` stays SERVING while the process and its engine thread live (warming up and
draining included), for a liveness probe that must not restart a replica that is only busy or draining.

A part that fails and cannot recover (the codec stage dead, engine steps failing in a row, the engine
thread crashed: `EngineLoop.failure`) takes the whole replica out: health (the server's, the service's
and `liveness`) turns NOT_SERVING at once, so the balancer drains it and a liveness probe restarts it;
HTTP /health answers 503 `{"status": "failed", "reason": ...}`; new calls are UNAVAILABLE naming the
reason; the metric `tts_replica_failed` is 1 and the reason is logged once at ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np
import torch

from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from service.metrics import ServiceMetrics
from tts.audio.files import read_audio, to_pcm16
from tts.checkpoints.bundle import ModelBundle
from tts.codec.base import AudioError
from tts.engine import EngineConfig, FinishReason, InvalidRequest
from tts.params import MAX_CHUNK_FRAMES
from tts.runtime.engine_thread import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_FIRST_CHUNK_FRAMES,
    DEFAULT_MAX_QUEUED_CHUNKS,
    Audio,
    Cancelled,
    EngineFailed,
    EngineLoop,
    Failed,
    Finished,
    LoopClosed,
    Overloaded,
    Preempted,
    RequestStream,
    Started,
    SynthesisJob,
)
from tts.runtime.planner import Planner
from tts.runtime.voices import VoiceExists, VoiceNotFound, reference_key
from tts.text.budget import PreparationTimeout, TextBudget, text_budget
from tts.text.normalize import TextError, shorten

if TYPE_CHECKING:
    from grpc_health.v1 import health

    from service.http import HTTPFront
    from service.wyoming import WyomingFront

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextToSpeech"].full_name  # "tts.v1.TextToSpeech"
# The health service name for liveness probes: SERVING from start-up (warm-up included) through a drain,
# NOT_SERVING once the engine thread has ended or the replica failed for good (`EngineLoop.failure`).
LIVENESS_SERVICE = "liveness"
MiB = 1024 * 1024
T = TypeVar("T")

try:  # what a send on a call that has already ended raises (grpc.aio.InternalError's subclass)
    from grpc._cython.cygrpc import ExecuteBatchError as CALL_ENDED
except ImportError:  # pragma: no cover - another grpc build: its public base class
    CALL_ENDED = grpc.aio.InternalError


@dataclass
class ServiceLimits:
    """What one server accepts. Sizes in bytes, chunk sizes in frames.

    max_receive_bytes: the gRPC receive limit (a request); defaults to room for the largest reference
    clip plus 1 MiB. pause_timeout: seconds a stream that is not read may hold its batch row while
    others wait (None: forever). max_audio_seconds: audio per request before it ends with `length`.
    reference_cache_bytes: the encoded-reference cache. voices_dir: registered voices (None: in memory). max_send_bytes: the gRPC send limit (a unary reply carries the whole clip; stream
    chunks stay far below it: `max_chunk_frames` is capped so that one chunk uses at most a quarter).
    max_connection_age: seconds after which the server asks a client connection to go away (HTTP/2
    GOAWAY; the client reconnects for its next call, through its balancer), None: never.
    max_connection_age_grace: seconds the streams open on such a connection may still run before it is
    closed (None: as long as they need).
    http_read_timeout: seconds an HTTP client may take to send a request's headers (counted from the
    connection's start or the previous response's end), and may leave a request body without a byte;
    past it the connection is closed.
    max_prepare_seconds: the longest a request's preparation (text, reference clip, planning) may take
    (a gRPC call's own deadline, when shorter, wins); past it the request ends with DEADLINE_EXCEEDED
    (HTTP 504).
    """

    max_waiting: int = 16
    max_queued_chunks: int = DEFAULT_MAX_QUEUED_CHUNKS
    pause_timeout: float | None = 10.0
    max_audio_seconds: float | None = 1800.0
    reference_cache_bytes: int = 64 * MiB
    voices_dir: str | None = None
    max_text_bytes: int = 20_000
    max_reference_bytes: int = 10 * MiB
    max_receive_bytes: int | None = None
    max_send_bytes: int = 64 * MiB
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    max_chunk_frames: int = 256
    max_connection_age: float | None = None
    max_connection_age_grace: float | None = None
    http_read_timeout: float = 30.0
    max_prepare_seconds: float = 10.0

    @property
    def receive_bytes(self) -> int:
        return self.max_receive_bytes or self.max_reference_bytes + MiB


def format_size(n: int) -> str:
    """Bytes as `12.3 MiB` / `64.0 KiB` / `100 bytes`."""
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


def grpc_options(limits: ServiceLimits) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments for `limits` (message sizes, connection age)."""
    options = [
        ("grpc.max_receive_message_length", limits.receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
    ]
    if limits.max_connection_age:
        options.append(("grpc.max_connection_age_ms", max(1, round(limits.max_connection_age * 1000))))
        if limits.max_connection_age_grace is not None:
            grace_ms = max(1, round(limits.max_connection_age_grace * 1000))
            options.append(("grpc.max_connection_age_grace_ms", grace_ms))
    return options


# ---- request validation -------------------------------------------------------------------------------


@dataclass
class PreparedRequest:
    job: SynthesisJob
    encoding: pb.AudioEncoding
    include_codes: bool


@dataclass(frozen=True)
class RequestFields:
    """What a front's request calls the fields that `build_job`'s messages name: the text and the
    reference clip with its transcript (gRPC: `GRPC_FIELDS`; the HTTP front passes its own)."""

    text: str
    reference_audio: str
    reference_text: str


GRPC_FIELDS = RequestFields("text", "voice.reference.audio", "voice.reference.text")


def build_job(
    planner: Planner,
    loop: EngineLoop,
    request: pb.SynthesizeRequest,
    limits: ServiceLimits,
    names: RequestFields = GRPC_FIELDS,
):
    """Validate a SynthesizeRequest and plan its SynthesisJob (host work only; any thread).

    Raises TextError / InvalidRequest / AudioError (INVALID_ARGUMENT) or VoiceNotFound (NOT_FOUND),
    each with a one-line reason naming the field (as `names` names it).
    """
    text = request.text
    nbytes = len(text.encode("utf-8"))
    if nbytes > limits.max_text_bytes:
        raise InvalidRequest(f"{names.text} is {nbytes} bytes; the limit is {limits.max_text_bytes}")

    s = request.sampling
    fields = {
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "seed": "seed",
        "repetition_penalty": "repetition_penalty",
    }
    sampling = {name: getattr(s, f) for name, f in fields.items() if s.HasField(f)}
    if s.HasField("max_new_frames"):
        if s.max_new_frames <= 0:
            raise InvalidRequest(f"max_new_frames must be > 0, got {s.max_new_frames}")
        sampling["max_new_frames"] = s.max_new_frames
    if s.HasField("min_new_frames"):
        if s.min_new_frames < 0:
            raise InvalidRequest(f"min_new_frames must be >= 0, got {s.min_new_frames}")
        sampling["min_new_frames"] = s.min_new_frames

    voice = None
    reference = None
    source = request.voice.WhichOneof("source")
    if source == "name":
        voice = request.voice.name
    elif source == "reference":
        reference = prepare_reference(
            planner, request.voice.reference, limits, names.reference_audio, names.reference_text
        )

    out = request.output
    first = out.first_chunk_frames or limits.first_chunk_frames
    chunk = out.chunk_frames or limits.chunk_frames
    for name, value in (("first_chunk_frames", first), ("chunk_frames", chunk)):
        if value > limits.max_chunk_frames:
            raise InvalidRequest(f"output.{name} must be at most {limits.max_chunk_frames}, got {value}")
    encoding = out.encoding or pb.AUDIO_ENCODING_PCM16
    if encoding not in (pb.AUDIO_ENCODING_PCM16, pb.AUDIO_ENCODING_FLOAT32):
        raise InvalidRequest(f"unknown output.encoding {encoding}")
    normalize = request.normalize if request.HasField("normalize") else True
    job = planner.job(
        text,
        voice=voice,
        reference=reference,
        first_chunk_frames=first,
        chunk_frames=chunk,
        max_audio_seconds=limits.max_audio_seconds,
        normalize=normalize,
        **sampling,
    )
    return PreparedRequest(job, encoding, out.include_codes)


async def prepare_off_loop(fn: Callable[..., T], *args, timeout: float | None) -> T:
    """`fn(*args)` (a request's preparation: `build_job` and the like, host work) on a worker thread, under a
    text budget (`tts.text.budget`) whose deadline is `timeout` seconds from now (None: none). Past the
    deadline this raises PreparationTimeout at once and the preparation stops at its next step; if the
    awaiting task is cancelled (the client cancelled, or its deadline passed), the preparation stops at
    its next step as well. The worker holds the GIL only between steps that are linear in the text, so
    the event loop and other requests go on meanwhile."""
    budget = TextBudget(None if timeout is None else time.monotonic() + max(0.0, timeout))

    def run() -> T:
        with text_budget(budget=budget):
            return fn(*args)

    try:
        return await asyncio.wait_for(asyncio.to_thread(run), timeout)
    except TimeoutError as exc:  # wait_for's, or the worker's own PreparationTimeout
        budget.cancel()
        limit = "" if timeout is None else f" ({timeout:.3g} s)"
        raise PreparationTimeout(f"preparing the request took longer than its deadline{limit}") from exc
    except asyncio.CancelledError:
        budget.cancel()
        raise


def prepare_reference(
    planner: Planner, ref: pb.ReferenceAudio, limits: ServiceLimits, audio_field: str, text_field: str
):
    """Check a ReferenceAudio message (size, decodable audio (WAV, FLAC, MP3 or Ogg), length, transcript)
    and key it for the reference cache. Raises AudioError / InvalidRequest naming the request's field
    of the clip (`audio_field`, e.g. "voice.reference.audio", or an HTTP form's "file") or of its
    transcript (`text_field`)."""
    if len(ref.audio) > limits.max_reference_bytes:
        raise InvalidRequest(
            f"reference audio is {format_size(len(ref.audio))}; the limit is {format_size(limits.max_reference_bytes)}"
        )
    if not ref.audio:
        raise AudioError("reference audio is empty")
    if not ref.text.strip():
        raise InvalidRequest(f"reference audio needs its transcript ({text_field})")
    try:
        audio, sample_rate = read_audio(bytes(ref.audio))
    except AudioError as exc:  # soundfile's message names an in-memory file object: drop it
        reason = re.sub(r"^cannot read reference audio: (Error opening <[^>]*>: )?", "", str(exc)).strip()
        raise AudioError(
            f"cannot read reference audio ({audio_field}: WAV, FLAC, MP3 or Ogg): {reason}"
        ) from exc
    fingerprint = planner.voices.fingerprint
    assert fingerprint is not None  # the loop's registry is opened with the codec's fingerprint
    key = reference_key(bytes(ref.audio), ref.text, fingerprint)
    return planner.prepare_reference(audio, sample_rate, ref.text, key=key)


# Status details are cut to this many characters (gRPC refuses metadata over 16 KiB with another status).
MAX_STATUS_CHARS = 300


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status, details, metrics outcome) for an error a request can end with; the details are one line
    of at most MAX_STATUS_CHARS characters, cut in the middle when longer."""
    code, details, outcome = _status_and_details(exc)
    return code, shorten(re.sub(r"\s*\n\s*", " ", details), MAX_STATUS_CHARS), outcome


def _status_and_details(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    if isinstance(exc, VoiceNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc), "not_found"
    if isinstance(exc, VoiceExists):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc), "already_exists"
    if isinstance(exc, TextError | InvalidRequest | AudioError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid_argument"
    if isinstance(exc, PreparationTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), "deadline_exceeded"
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "resource_exhausted"
    if isinstance(exc, Preempted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "preempted"
    if isinstance(exc, LoopClosed):
        return grpc.StatusCode.UNAVAILABLE, str(exc), "unavailable"
    if isinstance(exc, Cancelled):
        return grpc.StatusCode.CANCELLED, str(exc), "cancelled"
    if isinstance(exc, EngineFailed):
        return grpc.StatusCode.INTERNAL, str(exc), "error"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", "error"


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
    Raises NotImplementedError if the service has a client-streaming method (it has none)."""
    kinds = {False: grpc.unary_unary_rpc_method_handler, True: grpc.unary_stream_rpc_method_handler}
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TextToSpeech"].methods:
        if method.client_streaming:
            raise NotImplementedError(f"{method.name}: client-streaming methods are not handled here")
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


def overall_finish_reason(reasons: Sequence[pb.FinishReason]) -> pb.FinishReason:
    """The stream's finish reason: LOOP if any text chunk kept a repetition loop, else SHORT if any was
    short, else LENGTH if any hit its budget, else STOP."""
    for reason in (pb.FINISH_REASON_LOOP, pb.FINISH_REASON_SHORT, pb.FINISH_REASON_LENGTH):
        if reason in reasons:
            return reason
    return pb.FINISH_REASON_STOP


# ---- the servicer -------------------------------------------------------------------------------------


@dataclass
class CallLog:
    """What the one log line of a finished call says (see `TextToSpeechServicer._log`)."""

    rpc: str
    received: float
    request_id: str = "-"
    text_bytes: int = 0
    voice: str = "-"
    frames: int = 0
    audio_seconds: float = 0.0
    first_audio: float | None = None
    outcome: str = "ok"
    detail: str = ""
    logged: bool = False  # its line was written (and its outcome counted)


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
    def __init__(self, loop: EngineLoop, limits: ServiceLimits, metrics: ServiceMetrics, replica: str = ""):
        self.loop = loop
        self.limits = limits
        self.metrics = metrics
        self.bundle: ModelBundle = loop.bundle
        self.replica = replica  # named in every stream header and GetInfo

    async def _open(self, request, context, call: CallLog) -> tuple[PreparedRequest, RequestStream, Started]:
        """Validate, admit, and wait for the engine thread's acceptance; aborts with the right status."""
        call.text_bytes = len(request.text.encode("utf-8", "replace"))
        if not self.loop.ready:
            await self._abort(context, LoopClosed("the server is warming up; not accepting requests"), call)
        if not self.loop.alive:
            await self._abort(context, LoopClosed("the engine has stopped; not accepting requests"), call)
        if not self.loop.accepting:
            await self._abort(
                context, LoopClosed("the server is shutting down; not accepting requests"), call
            )
        planner = self.loop.planner
        assert planner is not None  # the engine thread sets it before the loop is ready
        remaining = context.time_remaining()
        timeout = self.limits.max_prepare_seconds
        timeout = timeout if remaining is None else min(timeout, remaining)
        try:
            prepared = await prepare_off_loop(
                build_job, planner, self.loop, request, self.limits, timeout=timeout
            )
            call.voice = prepared.job.voice_kind
            stream = self.loop.submit(prepared.job, asyncio.get_running_loop())
        except (
            TextError,
            InvalidRequest,
            AudioError,
            VoiceNotFound,
            Overloaded,
            LoopClosed,
            PreparationTimeout,
        ) as exc:
            await self._abort(context, exc, call)
        except Exception as exc:  # noqa: BLE001 - a bug: INTERNAL with its message, not a bare UNKNOWN
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

    async def _abort(self, context, exc: BaseException, call: CallLog | None = None):
        code, details, outcome = status_for(exc)
        self.metrics.requests.labels(outcome).inc()
        if call is not None:
            call.outcome, call.detail = outcome, details
            self._log(call)
        await context.abort(code, details)

    def _log(self, call: CallLog) -> None:
        """One line per finished call (INFO): id, text bytes, voice (`SynthesisJob.voice_kind`), frames, TTFA,
        RTF, outcome."""
        wall = time.monotonic() - call.received
        ttfa = f"{(call.first_audio - call.received) * 1000:.0f}" if call.first_audio is not None else "-"
        rtf = f"{wall / call.audio_seconds:.3f}" if call.audio_seconds > 0 else "-"
        call.logged = True
        detail = f" detail={call.detail!r}" if call.detail and call.outcome != "ok" else ""
        log.info(
            "request id=%s rpc=%s text_bytes=%d voice=%s frames=%d audio_s=%.2f ttfa_ms=%s rtf=%s outcome=%s%s",
            call.request_id,
            call.rpc,
            call.text_bytes,
            call.voice,
            call.frames,
            call.audio_seconds,
            ttfa,
            rtf,
            call.outcome,
            detail,
        )

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
        self._log(call)
        return pb.StreamEnd(
            finish_reason=overall_finish_reason(reasons),
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
        self._log(call)

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
                                f"the audio exceeds the maximum message size ({self.limits.max_send_bytes} bytes); "
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
        """Register a voice: checked here, encoded on the codec stage, persisted under the voices dir."""
        if not self.loop.ready or not self.loop.alive:
            await self._abort(context, LoopClosed("the server is not ready; try again"))
        try:
            self.loop.voices.check_new(request.name, request.replace)
            ref = await asyncio.to_thread(
                prepare_reference,
                self.loop.planner,
                request.reference,
                self.limits,
                "reference.audio",
                "reference.text",
            )
            entry = await asyncio.wrap_future(self.loop.add_voice(request.name, ref, request.replace))
        except (InvalidRequest, AudioError, VoiceExists) as exc:
            await self._abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - encoding or the voice file failed: INTERNAL, said once
            log.exception("adding voice %r failed", shorten(request.name, 60))
            await self._abort(context, EngineFailed(f"cannot add the voice: {exc}"))
        log.info("voice added name=%s seconds=%.2f", entry.name, entry.seconds(self.bundle.codec.frame_rate))
        return self._voice_info(entry)

    async def DeleteVoice(self, request, context):
        try:
            self.loop.delete_voice(request.name)
        except (VoiceNotFound, InvalidRequest) as exc:
            await self._abort(context, exc)
        log.info("voice deleted name=%s", request.name)
        return pb.DeleteVoiceResponse()

    async def GetInfo(self, request, context):
        if not self.loop.ready:
            await self._abort(context, LoopClosed("the server is warming up"))
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


# ---- the server ---------------------------------------------------------------------------------------


class TTSServer:
    """A gRPC server around one engine loop. Use from a running asyncio loop:

        server = TTSServer(bundle, EngineConfig(max_batch=8), ServiceLimits())
        port = await server.start("127.0.0.1", 50051)   # health NOT_SERVING until warm-up is done
        await server.wait_ready()
        ...
        await server.stop(grace=10.0)

    metrics_port: None = no metrics endpoint, 0 = a free port (see `metrics_port` after start).
    codec_graphs: let the codec stage capture CUDA graphs of its decode.
    http_port: None = no HTTP front, 0 = a free port (see `http_port` after start); the HTTP front
    (service/http.py: OpenAI-style /v1/audio/speech, /health, /load, /metrics, the playground) listens on
    the gRPC host and submits to the same engine loop.
    replica: this process's name in stream headers, GetInfo and /load (default `HOSTNAME:PORT`, the
    gRPC port bound).
    wyoming_port: None = no Wyoming front, 0 = a free port (see `wyoming_port` after start); the Wyoming
    front (service/wyoming.py: Home Assistant's TTS protocol) listens on the gRPC host.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        engine_config: EngineConfig | None = None,
        limits: ServiceLimits | None = None,
        *,
        metrics_host: str = "127.0.0.1",
        metrics_port: int | None = None,
        codec_graphs: bool = True,
        http_port: int | None = None,
        replica: str | None = None,
        wyoming_port: int | None = None,
    ):
        self.limits = limits = limits or ServiceLimits()
        cap = max(
            1,
            (limits.max_send_bytes // 4) // (bundle.codec.frame_length * 4 + bundle.codec.num_codebooks * 5),
        )
        limits.max_chunk_frames = min(limits.max_chunk_frames, cap, MAX_CHUNK_FRAMES)
        self.loop = EngineLoop(
            bundle,
            engine_config,
            max_waiting=limits.max_waiting,
            max_queued_chunks=limits.max_queued_chunks,
            pause_timeout=limits.pause_timeout,
            voices_dir=limits.voices_dir,
            reference_cache_bytes=limits.reference_cache_bytes,
            codec_graphs=codec_graphs,
        )
        self.metrics = ServiceMetrics(self.loop)
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.http_port = http_port  # ---- HTTP front (service/http.py)
        self.servicer: TextToSpeechServicer | None = None
        self._http: HTTPFront | None = None  # ---- end HTTP front
        self.wyoming_port = wyoming_port  # ---- Wyoming front (service/wyoming.py)
        self._wyoming: WyomingFront | None = None
        self.port: int | None = None
        self.replica = replica or ""
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None  # (grpc_health is untyped)
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self, host: str = "127.0.0.1", port: int = 50051) -> int:
        """Bind and start serving (health NOT_SERVING), start the engine thread; returns the bound port.
        Raises RuntimeError if the port cannot be bound."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        self._server = grpc.aio.server(options=grpc_options(self.limits))
        self.servicer = TextToSpeechServicer(self.loop, self.limits, self.metrics, self.replica)
        add_servicer(self.servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._server,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {address}: {exc}") from exc
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {address}")
        if not self.replica:
            self.replica = f"{socket.gethostname()}:{self.port}"
        self.servicer.replica = self.replica
        await self._server.start()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.metrics_host, self.metrics_port)
        if self.http_port is not None:  # ---- HTTP front (service/http.py)
            from service.http import HTTPFront

            self._http = HTTPFront(self)
            self.http_port = await self._http.start(host, self.http_port)  # ---- end HTTP front
        if self.wyoming_port is not None:  # ---- Wyoming front (service/wyoming.py)
            from service.wyoming import WyomingFront

            self._wyoming = WyomingFront(self)
            self.wyoming_port = await self._wyoming.start(host, self.wyoming_port)
        aio_loop = asyncio.get_running_loop()

        def on_ready() -> None:  # (engine thread)
            aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._mark_ready()))

        def on_stopped() -> None:  # (engine thread)
            aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._mark_not_serving()))

        def on_failed(reason: str) -> None:  # (any thread)
            log.error("this replica is out of service: %s; health NOT_SERVING", reason)
            with contextlib.suppress(RuntimeError):  # (the event loop closed: nothing left to tell)
                aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._mark_not_serving()))

        self.loop.on_ready, self.loop.on_stopped = on_ready, on_stopped
        self.loop.on_failed = on_failed
        self.loop.start()
        return self.port

    async def _mark_ready(self) -> None:
        if self._stopping or self.loop.failure is not None:
            return
        from grpc_health.v1 import health_pb2

        assert self._health is not None  # start() sets it before the hooks that call this
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._ready.set()

    async def _mark_not_serving(self) -> None:
        """The engine thread ended (shutdown, or a crash of the loop itself), or the replica failed for
        good: report NOT_SERVING (liveness too)."""
        from grpc_health.v1 import health_pb2

        assert self._health is not None  # start() sets it before the hooks that call this
        for name in ("", SERVICE_NAME, LIVENESS_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def state(self) -> str:
        """The serving state: `warming_up`, `serving`, `draining` (stop() called), `failed` (a part failed
        and could not recover: `EngineLoop.failure` says why) or `stopped` (the engine thread ended); the
        HTTP front's /health answers 200 only for `serving`."""
        if self.loop.failure is not None:
            return "failed"
        if self._stopping:
            return "draining" if self.loop.alive else "stopped"
        if not self._ready.is_set():
            return "warming_up"
        return "serving" if self.loop.alive else "stopped"

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until warm-up is done (health SERVING); re-raises an engine start-up failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self.loop.started_up:
                self.loop.wait_ready(0)  # raises the start-up error, if any
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready after {timeout} s")
            try:
                await asyncio.wait_for(self._ready.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    def load(self) -> dict:
        """The load signal a balancer or autoscaler reads cheaply (HTTP `GET /load`): the replica's name and
        state, requests in flight / running / waiting / paused against the admission limit, and KV blocks
        in use (the engine loop's snapshot and its live admission count; no engine work)."""
        s, in_flight = self.loop.stats, self.loop.in_flight
        # The loop's engine config: its max_batch is the engine's, and it exists before the engine is built.
        max_batch = self.loop.engine_config.max_batch
        limit = max_batch + self.limits.max_waiting
        return {
            "replica": self.replica,
            "status": self.state,
            "in_flight": in_flight,
            "max_in_flight": limit,
            "running": s.running,
            "waiting": s.waiting,
            "paused": s.paused,
            "max_batch": max_batch,
            "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total,
            "load": round(in_flight / limit, 4) if limit else 0.0,
            "kv_used": round(s.kv_blocks_used / s.kv_blocks_total, 4) if s.kv_blocks_total else 0.0,
            "frames_per_second": round(self.loop.frames_per_second(), 2),
        }

    async def stop(self, grace: float | None = 10.0, drain_delay: float = 0.0) -> None:
        """Graceful shutdown (drain): health NOT_SERVING at once; for `drain_delay` seconds new calls are
        still admitted (a balancer polling health stops sending in that time, so no call it sends is
        refused); then new calls are answered UNAVAILABLE by the handlers (the port stays open, so a
        balancer's health checks see NOT_SERVING, not a refused connection) while open streams get
        `grace` seconds to finish; then the rest end with UNAVAILABLE, the engine thread stops and the port
        closes. Returns within `drain_delay` + `grace` plus about a second. Idempotent."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            if self._health is not None:
                from grpc_health.v1 import health_pb2

                for name in ("", SERVICE_NAME):
                    await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            if drain_delay > 0:
                log.info("draining: NOT_SERVING; still admitting for %.3g s", drain_delay)
                deadline = time.monotonic() + drain_delay
                while self.loop.alive and time.monotonic() < deadline:
                    await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            self.loop.close_admission()
            grace = 0.0 if grace is None else grace
            deadline = time.monotonic() + grace
            while self.loop.in_flight > 0 and self.loop.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            # Jobs still open end with UNAVAILABLE ("the server shut down before the request finished").
            await asyncio.to_thread(self.loop.stop, 30.0)
            if self._server is not None:
                await self._server.stop(0.5)  # the handlers have their final events: let them send them
            if self._http is not None:  # ---- HTTP front: its jobs have ended; close its connections
                await self._http.stop()
            if self._wyoming is not None:  # ---- Wyoming front: its jobs have ended; close its connections
                await self._wyoming.stop()
            self.metrics.close()
        finally:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
