"""Client side of the synthesis service: request building, one streamed synthesis with client-side
timings, and audio decoding. Used by `tts client`, `tts bench-server` and the tests.

Client-side timings (seconds, `time.perf_counter`): `ttfa` from just before the call is sent to the
first response that holds PCM; `wall` to the end message; `rtf` = wall / audio seconds; `gaps` the
intervals between consecutive audio chunks (the first gap is measured from the first chunk).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.runtime.request import check_voice_source

MiB = 1024 * 1024
DEFAULT_MAX_RECEIVE_BYTES = 64 * MiB  # a unary reply holds a whole clip
DEFAULT_MAX_SEND_BYTES = 16 * MiB  # room for a reference clip


def channel_options(
    max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES, max_send_bytes: int = DEFAULT_MAX_SEND_BYTES
):
    """Explicit message size limits for a client channel."""
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_send_bytes),
    ]


# The environment variable of the key client commands send (a server with --api-key wants one).
CLIENT_KEY_ENV = "TTS_API_KEY"


class _BearerKey:
    """Adds `authorization: Bearer KEY` to a call's metadata (grpc.aio takes one call kind per interceptor
    object: `bearer_interceptors` makes one of each)."""

    def __init__(self, key: str):
        self.entry = ("authorization", f"Bearer {key}")

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()), self.entry)
        return details._replace(metadata=metadata)


class _BearerUnaryUnary(_BearerKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerUnaryStream(_BearerKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerStreamStream(_BearerKey, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(key: str) -> list:
    """grpc.aio client interceptors sending `authorization: Bearer KEY` on every call."""
    return [kind(key) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamStream)]


def aio_channel(server: str, api_key: str | None = None, **limits) -> grpc.aio.Channel:
    """An asyncio channel to `server` whose calls carry `api_key` (default: the environment's
    TTS_API_KEY, when set) as `authorization: Bearer KEY`."""
    key = api_key if api_key is not None else os.environ.get(CLIENT_KEY_ENV)
    interceptors = bearer_interceptors(key) if key else None
    return grpc.aio.insecure_channel(server, options=channel_options(**limits), interceptors=interceptors)


def rpc_error_line(server: str, exc: grpc.aio.AioRpcError, timeout: float | None = None) -> str:
    """The one line a command prints for a failed call to `server`: an unreachable server and an expired
    `timeout` (seconds, the command's --timeout) in plain words, anything else as `SERVER: CODE: details`."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details:
        return f"cannot reach a server at {server} (is `tts serve` running there?)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        return f"{server}: the synthesis did not end within --timeout {timeout:g} s"
    return f"{server}: {code.name}: {details}"


def error_field(exc: grpc.RpcError) -> str | None:
    """The request field a refused call names (its trailing metadata `tts-field`, in this API's names) by
    its canonical name (`tts.runtime.request.FIELDS`: `voice` for `voice.name`); None when it names none."""
    from service.grpc_front import FIELD_METADATA, GRPC_FIELDS  # (on a refusal only: the server's module)

    field = dict(exc.trailing_metadata() or ()).get(FIELD_METADATA)
    if not field:
        return None
    canonical = {wire: name for name, wire in GRPC_FIELDS.items()}
    return canonical.get(field, field)


ENCODINGS = {"pcm16": pb.AUDIO_ENCODING_PCM16, "float32": pb.AUDIO_ENCODING_FLOAT32}


def build_request(
    text: str,
    *,
    voice: str | None = None,
    reference_audio: bytes | None = None,
    reference_text: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    max_new_frames: int | None = None,
    min_new_frames: int | None = None,
    encoding: str = "pcm16",
    include_codes: bool = False,
    first_chunk_frames: int = 0,
    chunk_frames: int = 0,
    repetition_penalty: float | None = None,
    normalize: bool | None = None,
) -> pb.SynthesizeRequest:
    """A SynthesizeRequest; None leaves a sampling field to the server's model default.
    max_new_frames is the frame budget per text chunk; min_new_frames holds off the end token for that
    many frames per text chunk. normalize=False asks the server to read the text as given (None: unset,
    the server normalizes). Raises InvalidRequest (a ValueError) for a voice and a clip together."""
    req = pb.SynthesizeRequest(text=text)
    if normalize is not None:
        req.normalize = normalize
    check_voice_source(voice, reference_audio is not None)  # (InvalidRequest: a ValueError)
    if voice is not None:
        req.voice.name = voice
    if reference_audio is not None:
        req.voice.reference.audio = reference_audio
        req.voice.reference.text = reference_text or ""
    s = req.sampling
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("repetition_penalty", repetition_penalty),
    ):
        if value is not None:
            setattr(s, name, value)
    if max_new_frames is not None:
        s.max_new_frames = max_new_frames
    if min_new_frames is not None:
        s.min_new_frames = min_new_frames
    req.output.encoding = ENCODINGS[encoding]
    req.output.include_codes = include_codes
    req.output.first_chunk_frames = first_chunk_frames
    req.output.chunk_frames = chunk_frames
    return req


def decode_audio(data: bytes, encoding: int) -> np.ndarray:
    """Wire bytes -> float32 samples in [-1, 1]."""
    if encoding == pb.AUDIO_ENCODING_FLOAT32:
        return np.frombuffer(data, dtype="<f4").astype(np.float32)
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0


def decode_codes(codes: pb.Codes) -> np.ndarray:
    """Codes message -> `[num_codebooks, num_frames]` int64."""
    return np.asarray(codes.values, dtype=np.int64).reshape(codes.num_codebooks, codes.num_frames)


class StreamError(RuntimeError):
    """The stream broke the protocol (sequence gap, missing header or end)."""


@dataclass
class StreamResult:
    """One streamed synthesis as a client saw it."""

    header: pb.StreamHeader
    end: pb.StreamEnd
    audio: np.ndarray  # float32 [samples]
    raw: bytes  # the concatenated wire audio
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (sequence, frame_start, frame_end)
    codes: np.ndarray | None = None  # [N, frames] when include_codes
    ttfa: float | None = None
    wall: float = 0.0
    gaps: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # per audio chunk: seconds from the send
    chunk_samples: list[int] = field(default_factory=list)  # per audio chunk: samples it holds

    @property
    def sample_rate(self) -> int:
        return self.header.sample_rate

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.header.sample_rate if self.header.sample_rate else 0.0

    @property
    def rtf(self) -> float:
        return self.wall / self.audio_seconds if self.audio_seconds else float("inf")

    @property
    def max_gap(self) -> float:
        return max(self.gaps, default=0.0)

    @property
    def stream_frames_per_s(self) -> float | None:
        """This stream's frames per second once audio flows: the frames of the chunks after the first,
        over the time from the first chunk's arrival to the last one's (None with fewer than two chunks).
        It leaves out the time to first audio (queueing, prefill), so it compares with the engine's
        decode rate per stream (`tts bench`, frames/s per stream)."""
        if len(self.chunks) < 2 or self.arrivals[-1] <= self.arrivals[0]:
            return None
        return (self.chunks[-1][2] - self.chunks[0][2]) / (self.arrivals[-1] - self.arrivals[0])


async def synthesize_stream(
    stub: pb_grpc.TextToSpeechStub, request: pb.SynthesizeRequest, timeout: float | None = None
) -> StreamResult:
    """Run one streaming Synthesize call and check the protocol (header first, sequence numbers and frame
    ranges without gaps, end last). Raises grpc.aio.AioRpcError with the server's status, StreamError."""
    t0 = time.perf_counter()
    call = stub.Synthesize(request, timeout=timeout)
    header = end = None
    parts: list[bytes] = []
    chunks: list[tuple[int, int, int]] = []
    codes: list[np.ndarray] = []
    ttfa = None
    last = None
    gaps: list[float] = []
    arrivals: list[float] = []
    async for response in call:
        kind = response.WhichOneof("message")
        now = time.perf_counter()
        if kind == "header":
            if header is not None:
                raise StreamError("two headers")
            header = response.header
        elif kind == "chunk":
            c = response.chunk
            if header is None or end is not None:
                raise StreamError("audio chunk outside header .. end")
            if c.sequence != len(chunks):
                raise StreamError(f"sequence gap: expected {len(chunks)}, got {c.sequence}")
            if chunks and c.frame_start != chunks[-1][2]:
                raise StreamError(
                    f"frame gap: chunk {c.sequence} starts at {c.frame_start}, not {chunks[-1][2]}"
                )
            if c.audio and ttfa is None:
                ttfa = now - t0
            if last is not None:
                gaps.append(now - last)
            last = now
            arrivals.append(now - t0)
            parts.append(c.audio)
            chunks.append((c.sequence, c.frame_start, c.frame_end))
            if c.HasField("codes"):
                codes.append(decode_codes(c.codes))
        elif kind == "end":
            end = response.end
    wall = time.perf_counter() - t0
    if header is None or end is None:
        raise StreamError("the stream ended without a header and an end message")
    raw = b"".join(parts)
    width = 4 if header.encoding == pb.AUDIO_ENCODING_FLOAT32 else 2
    return StreamResult(
        header=header,
        end=end,
        audio=decode_audio(raw, header.encoding),
        raw=raw,
        chunks=chunks,
        codes=np.concatenate(codes, axis=1) if codes else None,
        ttfa=ttfa,
        wall=wall,
        gaps=gaps,
        arrivals=arrivals,
        chunk_samples=[len(p) // width for p in parts],
    )
