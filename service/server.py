"""The gRPC synthesis server (grpc.aio): validation, admission, streaming, health, reflection, metrics.

Handlers only validate, enqueue and stream (DESIGN.md invariant 7): every device operation (engine
steps, prefill, reference encoding, codec decode) happens on the engine thread of `EngineLoop`.
A `Synthesize` call:

1. validates its input on a worker thread (`build_job`): text (normalized, split into chunks), sampling
   values, voice name, reference clip (size limit, decodable WAV/FLAC, length, transcript), chunk sizes,
   and that every text chunk's prompt plus its frame budget fits the context; each failure is
   INVALID_ARGUMENT (NOT_FOUND for an unknown voice) before any generation work;
2. is admitted by the engine loop or refused with RESOURCE_EXHAUSTED (bounded queue) / UNAVAILABLE
   (warming up, shutting down);
3. streams a header, audio chunks and an end message; a client cancel or deadline cancels the
   handler task, whose `finally` cancels the job (blocks and row freed at the next engine step) and
   lets the cancellation propagate.

`TTSServer.stop(grace)` (the CLI calls it on SIGTERM/SIGINT) flips health to NOT_SERVING, refuses new
calls, lets open streams finish within `grace` seconds, then cancels the rest and stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass, replace

import grpc
import numpy as np
import torch

from proto.tts.v1 import tts_pb2 as pb
from proto.tts.v1 import tts_pb2_grpc as pb_grpc
from tts.api import Frontend, VoiceNotFound
from tts.audio import read_audio, to_pcm16
from tts.bundle import ModelBundle
from tts.codec.base import AudioError
from tts.engine import EngineConfig, FinishReason, InvalidRequest
from tts.engine.loop import (
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
    RequestStream,
    Started,
    SynthesisJob,
)
from tts.prompt import VoiceReference
from tts.text import TextError

from .metrics import ServiceMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextToSpeech"].full_name  # "tts.v1.TextToSpeech"
MiB = 1024 * 1024


@dataclass
class ServiceLimits:
    """What one server accepts. Sizes in bytes, chunk sizes in frames.

    max_receive_bytes: the gRPC receive limit (a request); defaults to room for the largest reference
    clip plus 1 MiB. max_send_bytes: the gRPC send limit (a unary reply carries the whole clip; stream
    chunks stay far below it: `max_chunk_frames` is capped so that one chunk uses at most a quarter).
    """

    max_waiting: int = 16
    max_queued_chunks: int = DEFAULT_MAX_QUEUED_CHUNKS
    max_text_bytes: int = 20_000
    max_reference_bytes: int = 10 * MiB
    max_receive_bytes: int | None = None
    max_send_bytes: int = 64 * MiB
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    max_chunk_frames: int = 256

    @property
    def receive_bytes(self) -> int:
        return self.max_receive_bytes or self.max_reference_bytes + MiB


def format_size(n: int) -> str:
    """Bytes as `12.3 MiB` / `64.0 KiB` / `100 bytes`."""
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


def grpc_options(limits: ServiceLimits) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", limits.receive_bytes),
        ("grpc.max_send_message_length", limits.max_send_bytes),
        ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
    ]


# ---- request validation -------------------------------------------------------------------------------


@dataclass
class PreparedRequest:
    job: SynthesisJob
    encoding: int  # pb.AudioEncoding
    include_codes: bool


def build_job(frontend: Frontend, loop: EngineLoop, request: pb.SynthesizeRequest, limits: ServiceLimits):
    """Validate a SynthesizeRequest and turn it into a SynthesisJob (host work only; any thread).

    Raises TextError / InvalidRequest / AudioError (INVALID_ARGUMENT) or VoiceNotFound (NOT_FOUND),
    each with a one-line reason naming the field.
    """
    text = request.text
    nbytes = len(text.encode("utf-8"))
    if nbytes > limits.max_text_bytes:
        raise InvalidRequest(f"text is {nbytes} bytes; the limit is {limits.max_text_bytes}")
    chunks = frontend.plan(text)

    s = request.sampling
    fields = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
    overrides = {name: getattr(s, f) for name, f in fields.items() if s.HasField(f)}
    if s.HasField("max_new_frames"):
        if s.max_new_frames <= 0:
            raise InvalidRequest(f"max_new_frames must be > 0, got {s.max_new_frames}")
        overrides["max_new_frames"] = s.max_new_frames
    params = frontend.sampling_params(**overrides)
    seed = params.seed if params.seed is not None else secrets.randbits(62)
    frontend.check_chunk_seeds(seed, len(chunks))
    params = replace(params, seed=seed)

    references: list[VoiceReference] = []
    prepared = None
    source = request.voice.WhichOneof("source")
    if source is None:  # no voice: the model's default preset, as in the API and the CLI
        references = frontend.voice(None)
    elif source == "name":
        references = frontend.voice(request.voice.name)
    elif source == "reference":
        ref = request.voice.reference
        if len(ref.audio) > limits.max_reference_bytes:
            raise InvalidRequest(
                f"reference audio is {format_size(len(ref.audio))}; the limit is {format_size(limits.max_reference_bytes)}"
            )
        if not ref.audio:
            raise AudioError("reference audio is empty")
        if not ref.text.strip():
            raise InvalidRequest("reference audio needs its transcript (voice.reference.text)")
        try:
            audio, sample_rate = read_audio(bytes(ref.audio))
        except AudioError as exc:  # soundfile's message names an in-memory file object: drop it
            reason = re.sub(r"^cannot read reference audio: (Error opening <[^>]*>: )?", "", str(exc)).strip()
            raise AudioError(
                f"cannot read reference audio (voice.reference.audio, WAV or FLAC): {reason}"
            ) from exc
        prepared = frontend.prepare_reference(audio, sample_rate, ref.text)

    out = request.output
    first = out.first_chunk_frames or limits.first_chunk_frames
    chunk = out.chunk_frames or limits.chunk_frames
    for name, value in (("first_chunk_frames", first), ("chunk_frames", chunk)):
        if value > limits.max_chunk_frames:
            raise InvalidRequest(f"output.{name} must be at most {limits.max_chunk_frames}, got {value}")
    encoding = out.encoding or pb.AUDIO_ENCODING_PCM16
    if encoding not in (pb.AUDIO_ENCODING_PCM16, pb.AUDIO_ENCODING_FLOAT32):
        raise InvalidRequest(f"unknown output.encoding {encoding}")

    # Prompt + budget must fit the context, for every text chunk, before any device work. A reference
    # clip is not encoded yet: its frame count is known (ceil(samples / frame_length), Codec.encode).
    check_refs = list(references)
    if prepared is not None:
        codec = frontend.bundle.codec
        frames = max(1, math.ceil(prepared.samples.numel() / codec.frame_length))
        check_refs.append(
            VoiceReference(torch.zeros(codec.num_codebooks, frames, dtype=torch.int64), prepared.text)
        )
    for i, chunk_text in enumerate(chunks):
        prompt = frontend.bundle.prompt_format.build(chunk_text, check_refs, [])
        try:
            loop.check_request(prompt, replace(params, seed=seed + i))
        except InvalidRequest as exc:
            prefix = f"text chunk {i + 1} of {len(chunks)}: " if len(chunks) > 1 else ""
            raise InvalidRequest(f"{prefix}{exc}") from exc
    job = SynthesisJob(chunks, params, references, prepared, first, chunk)
    return PreparedRequest(job, encoding, out.include_codes)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status, details, metrics outcome) for an error a request can end with."""
    if isinstance(exc, VoiceNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc), "not_found"
    if isinstance(exc, TextError | InvalidRequest | AudioError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid_argument"
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "resource_exhausted"
    if isinstance(exc, LoopClosed):
        return grpc.StatusCode.UNAVAILABLE, str(exc), "unavailable"
    if isinstance(exc, Cancelled):
        return grpc.StatusCode.CANCELLED, str(exc), "cancelled"
    if isinstance(exc, EngineFailed):
        return grpc.StatusCode.INTERNAL, str(exc), "error"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}", "error"


# ---- encoding -----------------------------------------------------------------------------------------


def encode_audio(samples: np.ndarray, encoding: int) -> bytes:
    """float32 samples -> little-endian PCM16 or float32 bytes."""
    if encoding == pb.AUDIO_ENCODING_FLOAT32:
        return np.asarray(samples, dtype="<f4").tobytes()
    return to_pcm16(samples).astype("<i2").tobytes()


def encode_codes(codes: torch.Tensor) -> pb.Codes:
    """codes `[N, frames]` -> Codes (codebook-major values)."""
    n, f = codes.shape
    return pb.Codes(num_codebooks=n, num_frames=f, values=codes.reshape(-1).tolist())


_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}


# ---- the servicer -------------------------------------------------------------------------------------


class TextToSpeechServicer(pb_grpc.TextToSpeechServicer):
    def __init__(self, loop: EngineLoop, limits: ServiceLimits, metrics: ServiceMetrics):
        self.loop = loop
        self.limits = limits
        self.metrics = metrics
        self.bundle: ModelBundle = loop.bundle

    async def _open(self, request, context) -> tuple[PreparedRequest, RequestStream, Started]:
        """Validate, admit, and wait for the engine thread's acceptance; aborts with the right status."""
        if not self.loop.ready:
            await self._abort(context, LoopClosed("the server is warming up; not accepting requests"))
        if not self.loop.alive:
            await self._abort(context, LoopClosed("the engine has stopped; not accepting requests"))
        try:
            prepared = await asyncio.to_thread(build_job, self.loop.frontend, self.loop, request, self.limits)
            stream = self.loop.submit(prepared.job, asyncio.get_running_loop())
        except (TextError, InvalidRequest, AudioError, VoiceNotFound, Overloaded, LoopClosed) as exc:
            await self._abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: INTERNAL with its message, not a bare UNKNOWN
            log.exception("preparing a request failed")
            await self._abort(context, exc)
        try:
            event = await stream.next()
        except BaseException:
            stream.cancel()
            raise
        if isinstance(event, Failed):
            await self._abort(context, event.error)
        assert isinstance(event, Started), event
        return prepared, stream, event

    async def _abort(self, context, exc: BaseException):
        code, details, outcome = status_for(exc)
        self.metrics.requests.labels(outcome).inc()
        await context.abort(code, details)

    def _header(self, started: Started, prepared: PreparedRequest) -> pb.StreamHeader:
        codec = self.bundle.codec
        return pb.StreamHeader(
            request_id=started.request_id, sample_rate=codec.sample_rate, channels=1,
            encoding=prepared.encoding, frame_rate=codec.frame_rate, num_codebooks=codec.num_codebooks,
            model=self.bundle.name, seed=started.seed, text_chunks=started.text_chunks,
        )  # fmt: skip

    def _end(self, finished: Finished, samples: int, chunks: int, t_received: float, t_first: float | None):
        audio_seconds = samples / self.bundle.codec.sample_rate
        wall = time.monotonic() - t_received
        ttfa = (t_first - t_received) if t_first is not None else 0.0
        rtf = wall / audio_seconds if audio_seconds > 0 else 0.0
        reasons = [_FINISH[r] for r in finished.finish_reasons]
        self.metrics.requests.labels("ok").inc()
        self.metrics.audio_seconds.inc(audio_seconds)
        if audio_seconds > 0:
            self.metrics.ttfa.observe(ttfa)
            self.metrics.rtf.observe(rtf)
        return pb.StreamEnd(
            finish_reason=pb.FINISH_REASON_LENGTH if pb.FINISH_REASON_LENGTH in reasons else pb.FINISH_REASON_STOP,
            frames=finished.frames, audio_seconds=audio_seconds, time_to_first_audio_seconds=ttfa, rtf=rtf,
            chunks=chunks, text_chunk_finish_reasons=reasons,
        )  # fmt: skip

    def _ended_by_client(self, context) -> None:
        remaining = context.time_remaining()
        outcome = "deadline_exceeded" if remaining is not None and remaining <= 0 else "cancelled"
        self.metrics.requests.labels(outcome).inc()

    async def Synthesize(self, request, context):
        t_received = time.monotonic()
        stream = None
        try:
            prepared, stream, started = await self._open(request, context)
            yield pb.SynthesizeResponse(header=self._header(started, prepared))
            samples = chunks = 0
            t_first = None
            while True:
                event = await stream.next()
                if isinstance(event, Audio):
                    chunk = pb.AudioChunk(
                        sequence=event.sequence, audio=encode_audio(event.samples, prepared.encoding),
                        frame_start=event.frame_start, frame_end=event.frame_end,
                    )  # fmt: skip
                    if prepared.include_codes:
                        chunk.codes.CopyFrom(encode_codes(event.codes))
                    if t_first is None:
                        t_first = time.monotonic()
                    samples += len(event.samples)
                    chunks += 1
                    yield pb.SynthesizeResponse(chunk=chunk)
                elif isinstance(event, Finished):
                    yield pb.SynthesizeResponse(end=self._end(event, samples, chunks, t_received, t_first))
                    return
                else:
                    await self._abort(context, event.error)
        except asyncio.CancelledError:
            self._ended_by_client(context)
            raise
        finally:
            if stream is not None:
                stream.cancel()  # no-op once the job ended; otherwise frees its blocks and row

    async def SynthesizeUnary(self, request, context):
        t_received = time.monotonic()
        stream = None
        try:
            prepared, stream, started = await self._open(request, context)
            parts: list[bytes] = []
            codes: list[torch.Tensor] = []
            size = samples = chunks = 0
            t_first = None
            while True:
                event = await stream.next()
                if isinstance(event, Audio):
                    data = encode_audio(event.samples, prepared.encoding)
                    size += len(data) + (event.codes.numel() * 5 if prepared.include_codes else 0)
                    if size > self.limits.max_send_bytes - 64 * 1024:
                        await self._abort(
                            context,
                            Overloaded(
                                f"the audio exceeds the maximum message size ({self.limits.max_send_bytes} bytes); "
                                "use the streaming Synthesize call"
                            ),
                        )
                    t_first = t_first if t_first is not None else time.monotonic()
                    parts.append(data)
                    codes.append(event.codes)
                    samples += len(event.samples)
                    chunks += 1
                elif isinstance(event, Finished):
                    reply = pb.SynthesizeUnaryResponse(
                        header=self._header(started, prepared), audio=b"".join(parts),
                        end=self._end(event, samples, chunks, t_received, t_first),
                    )  # fmt: skip
                    if prepared.include_codes:
                        n = self.bundle.codec.num_codebooks
                        reply.codes.CopyFrom(
                            encode_codes(
                                torch.cat(codes, 1) if codes else torch.zeros(n, 0, dtype=torch.int64)
                            )
                        )
                    return reply
                else:
                    await self._abort(context, event.error)
        except asyncio.CancelledError:
            self._ended_by_client(context)
            raise
        finally:
            if stream is not None:
                stream.cancel()

    async def ListVoices(self, request, context):
        codec = self.bundle.codec
        voices = [
            pb.VoiceInfo(name=name, transcript=v.text, seconds=v.codes.shape[1] / codec.frame_rate)
            for name, v in sorted(self.bundle.voices.items())
        ]
        return pb.ListVoicesResponse(voices=voices)

    async def GetInfo(self, request, context):
        if not self.loop.ready:
            await self._abort(context, LoopClosed("the server is warming up"))
        b, e, lim = self.bundle, self.loop.engine, self.limits
        c, g = b.codec, e.graphs
        return pb.GetInfoResponse(
            model=b.name, family=b.family, parameters=b.num_parameters(), device=str(b.device),
            dtype=str(b.dtype).removeprefix("torch."), sample_rate=c.sample_rate, frame_rate=c.frame_rate,
            num_codebooks=c.num_codebooks, codebook_size=c.codebook_size, max_context=e.max_context,
            max_batch=e.config.max_batch, buckets=g.buckets if g.enabled else [], graphs=g.enabled,
            capture=e.config.capture, captured_buckets=sorted({b for b, _ in g.graphs}), replay_share=g.stats.replay_share,
            max_waiting=lim.max_waiting, max_reference_bytes=lim.max_reference_bytes,
            max_message_bytes=lim.receive_bytes, max_text_bytes=lim.max_text_bytes,
            max_chunk_frames=lim.max_chunk_frames, text_chunk_bytes=b.chunk_length,
        )  # fmt: skip


# ---- the server ---------------------------------------------------------------------------------------


class TTSServer:
    """A gRPC server around one engine loop. Use from a running asyncio loop:

        server = TTSServer(bundle, EngineConfig(max_batch=8), ServiceLimits())
        port = await server.start("127.0.0.1", 50051)   # health NOT_SERVING until warm-up is done
        await server.wait_ready()
        ...
        await server.stop(grace=10.0)

    metrics_port: None = no metrics endpoint, 0 = a free port (see `metrics_port` after start).
    http_port: None = no HTTP front, 0 = a free port (see `http_port` after start); the HTTP front
    (service/http.py: OpenAI-style /v1/audio/speech, /health, /metrics, the playground) listens on the
    gRPC host and submits to the same engine loop.
    """

    def __init__(
        self, bundle: ModelBundle, engine_config: EngineConfig | None = None,
        limits: ServiceLimits | None = None, *, metrics_host: str = "127.0.0.1", metrics_port: int | None = None,
        http_port: int | None = None,
    ):  # fmt: skip
        self.limits = limits = limits or ServiceLimits()
        cap = max(
            1,
            (limits.max_send_bytes // 4) // (bundle.codec.frame_length * 4 + bundle.codec.num_codebooks * 5),
        )
        if limits.max_chunk_frames > cap:
            limits.max_chunk_frames = cap
        self.loop = EngineLoop(
            bundle, engine_config, max_waiting=limits.max_waiting, max_queued_chunks=limits.max_queued_chunks
        )
        self.metrics = ServiceMetrics(self.loop)
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.http_port = http_port  # ---- HTTP front (service/http.py)
        self.servicer: TextToSpeechServicer | None = None
        self._http = None  # ---- end HTTP front
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = None
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self, host: str = "127.0.0.1", port: int = 50051) -> int:
        """Bind and start serving (health NOT_SERVING), start the engine thread; returns the bound port.
        Raises RuntimeError if the port cannot be bound."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        self._server = grpc.aio.server(options=grpc_options(self.limits))
        self.servicer = TextToSpeechServicer(self.loop, self.limits, self.metrics)
        pb_grpc.add_TextToSpeechServicer_to_server(self.servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
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
        await self._server.start()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.metrics_host, self.metrics_port)
        if self.http_port is not None:  # ---- HTTP front (service/http.py)
            from .http import HTTPFront

            self._http = HTTPFront(self)
            self.http_port = await self._http.start(host, self.http_port)  # ---- end HTTP front
        aio_loop = asyncio.get_running_loop()
        self.loop.on_ready = lambda: aio_loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._mark_ready())
        )
        self.loop.on_stopped = lambda: aio_loop.call_soon_threadsafe(
            lambda: asyncio.ensure_future(self._mark_not_serving())
        )
        self.loop.start()
        return self.port

    async def _mark_ready(self) -> None:
        if self._stopping:
            return
        from grpc_health.v1 import health_pb2

        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._ready.set()

    async def _mark_not_serving(self) -> None:
        """The engine thread ended (shutdown, or a crash of the loop itself): report NOT_SERVING."""
        from grpc_health.v1 import health_pb2

        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    @property
    def state(self) -> str:
        """The serving state: `warming_up`, `serving`, `draining` (stop() called) or `stopped` (the engine
        thread ended); the HTTP front's /health answers 200 only for `serving`."""
        if self._stopping:
            return "draining" if self.loop.alive else "stopped"
        if not self._ready.is_set():
            return "warming_up"
        return "serving" if self.loop.alive else "stopped"

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until warm-up is done (health SERVING); re-raises an engine start-up failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self.loop._ready.is_set():
                self.loop.wait_ready(0)  # raises the start-up error, if any
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the server was not ready after {timeout} s")
            try:
                await asyncio.wait_for(self._ready.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    async def stop(self, grace: float | None = 10.0) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new calls, let open streams finish for `grace` seconds,
        end the rest with UNAVAILABLE, stop the engine thread. Idempotent."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            if self._health is not None:
                await self._health.enter_graceful_shutdown()
            self.loop.close_admission()
            grace = 0.0 if grace is None else grace
            # gRPC refuses new calls from now on; open calls get `grace` (+ a moment to send their status).
            stopping = asyncio.ensure_future(self._server.stop(grace + 2.0)) if self._server else None
            deadline = time.monotonic() + grace
            while self.loop.stats.jobs > 0 and self.loop.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            # Jobs still open end with UNAVAILABLE ("not finished within the grace period").
            await asyncio.to_thread(self.loop.stop, 30.0)
            if stopping is not None:
                await stopping
            if self._http is not None:  # ---- HTTP front: its jobs have ended; close its connections
                await self._http.stop()
            self.metrics.close()
        finally:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
