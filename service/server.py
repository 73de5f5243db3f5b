"""The server process: `TTSServer` owns both fronts (gRPC: service/grpc_front.py; HTTP: service/http.py),
the engine thread (`tts.runtime.engine_thread.EngineThread`), the metrics endpoint, the replica's state
(`service.common.ReplicaState`: the one definition of warming_up / serving / draining / failed / stopped
that gRPC health, HTTP /health and /load report) and the drain.

`TTSServer.stop(grace, drain_delay)` (the CLI calls it on SIGTERM/SIGINT) drains: health turns
NOT_SERVING at once; new calls are still admitted for `drain_delay` seconds (default 0), long enough for a
load balancer that polls health to stop sending, then answered UNAVAILABLE while open streams get `grace`
seconds to finish; then the rest end with UNAVAILABLE, the engine stops and the port closes (within
`drain_delay` + `grace` + about a second).

Scale-out (docs/operations.md, "Scaling out"): every stream header and GetInfo name the replica
(`--replica-name`),
`grpc.max_connection_age_ms` makes long-lived client connections reconnect (and so rebalance), and the
health service `liveness` stays SERVING while the process and its engine thread live (warming up and
draining included), for a liveness probe that must not restart a replica that is only busy or draining.

A part that fails and cannot recover (the codec stage dead, engine steps failing in a row, the engine
thread crashed: `EngineThread.failure`) takes the whole replica out: health (the server's, the service's
and `liveness`) turns NOT_SERVING at once, so the balancer drains it and a liveness probe restarts it;
HTTP /health answers 503 `{"status": "failed", "reason": ...}`; new calls are UNAVAILABLE naming the
reason; the metric `tts_replica_failed` is 1 and the reason is logged once at ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import TYPE_CHECKING

import grpc

from service.access import Access
from service.common import MiB, ReplicaState, ServiceLimits, format_size
from service.grpc_front import (
    LIVENESS_SERVICE,
    SERVICE_NAME,
    AuthInterceptor,
    TextToSpeechServicer,
    add_servicer,
    grpc_options,
)
from service.metrics import ServiceMetrics
from tts.checkpoints.bundle import ModelBundle
from tts.engine import EngineConfig
from tts.params import MAX_CHUNK_FRAMES
from tts.runtime.engine_thread import EngineThread

if TYPE_CHECKING:
    from grpc_health.v1 import health

    from service.http import HTTPFront
    from service.wyoming import WyomingFront

log = logging.getLogger(__name__)

# (the process's configuration and the names its callers use, kept importable from here)
__all__ = ["LIVENESS_SERVICE", "SERVICE_NAME", "MiB", "ServiceLimits", "TTSServer", "format_size"]


class TTSServer:
    """The server process's owner: the gRPC front, the HTTP front, health and drain around one engine loop.
    Use from a running asyncio loop:

        server = TTSServer(bundle, EngineConfig(max_batch=8), ServiceLimits())
        port = await server.start("127.0.0.1", 50051)   # health NOT_SERVING until warm-up is done
        await server.wait_ready()
        ...
        await server.stop(grace=10.0)

    The server's parts: `loop` (the engine thread), `replica_state` (ReplicaState), `servicer` (the gRPC
    front, once
    started), the HTTP front (`http_port`), `metrics`.

    metrics_port: None = no metrics endpoint, 0 = a free port (see `metrics_port` after start).
    codec_graphs: let the codec stage capture CUDA graphs of its decode. codec_gather: seconds a later
    audio chunk may wait in the codec stage for more work to share its decode call (0: none; less where
    its player would run dry first). codec_sms: SMs the codec's kernels may use (CUDA; 0: all).
    http_port: None = no HTTP front, 0 = a free port (see `http_port` after start); the HTTP front
    (service/http.py: OpenAI-style /v1/audio/speech, /health, /load, /metrics, the playground) listens on
    the gRPC host and submits to the same engine loop.
    replica: this process's name in stream headers, GetInfo and /load (default `HOSTNAME:PORT`, the
    gRPC port bound).
    wyoming_port: None = no Wyoming front, 0 = a free port (see `wyoming_port` after start); the Wyoming
    front (service/wyoming.py: Home Assistant's TTS protocol) listens on the gRPC host.
    access: API keys, TLS and the HTTP front's browser rules (service/access.py; default: no key, no TLS).
    gRPC and HTTP/WebSocket calls need a key when keys are set; Wyoming has no authentication (a trusted
    network only).
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
        codec_gather: float = 0.0,
        codec_sms: int = 0,
        http_port: int | None = None,
        replica: str | None = None,
        wyoming_port: int | None = None,
        access: Access | None = None,
    ):
        self.access = access or Access()
        self.limits = limits = limits or ServiceLimits()
        cap = max(
            1,
            (limits.max_send_bytes // 4) // (bundle.codec.frame_length * 4 + bundle.codec.num_codebooks * 5),
        )
        limits.max_chunk_frames = min(limits.max_chunk_frames, cap, MAX_CHUNK_FRAMES)
        self.loop = EngineThread(
            bundle,
            engine_config,
            max_waiting=limits.max_waiting,
            max_queued_chunks=limits.max_queued_chunks,
            pause_timeout=limits.pause_timeout,
            voices_dir=limits.voices_dir,
            reference_cache_bytes=limits.reference_cache_bytes,
            codec_graphs=codec_graphs,
            codec_gather=codec_gather,
            codec_sms=codec_sms,
            max_sessions=limits.max_sessions,
        )
        self.metrics = ServiceMetrics(self.loop)
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.replica_state = ReplicaState(self.loop, limits, replica or "")
        self.http_port = http_port
        self.servicer: TextToSpeechServicer | None = None
        self._http: HTTPFront | None = None
        self.wyoming_port = wyoming_port
        self._wyoming: WyomingFront | None = None
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None  # (grpc_health is untyped)
        self._ready = asyncio.Event()  # set once the state is first `serving` (wait_ready)
        self._stopped = asyncio.Event()
        self._health_lock = asyncio.Lock()

    @property
    def replica(self) -> str:
        """This process's name in stream headers, GetInfo, X-Replica and /load."""
        return self.replica_state.replica

    async def start(self, host: str = "127.0.0.1", port: int = 50051) -> int:
        """Bind and start serving (health NOT_SERVING), start the engine thread; returns the bound port.
        Raises RuntimeError if the port cannot be bound."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        interceptors = [AuthInterceptor(self.access)] if self.access.api_keys else []
        self._server = grpc.aio.server(options=grpc_options(self.limits), interceptors=interceptors)
        self.servicer = TextToSpeechServicer(self.loop, self.limits, self.metrics, self.replica_state)
        add_servicer(self.servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        await self._report_health()  # warming up: NOT_SERVING, liveness SERVING
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
            if self.access.tls:
                self.port = self._server.add_secure_port(address, self._credentials())
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {address}: {exc}") from exc
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {address}")
        if not self.replica_state.replica:
            self.replica_state.replica = f"{socket.gethostname()}:{self.port}"
        await self._server.start()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.metrics_host, self.metrics_port)
        if self.http_port is not None:  # (FastAPI and uvicorn are imported only for it)
            from service.http import HTTPFront

            self._http = HTTPFront(self.loop, self.limits, self.metrics, self.replica_state, self.access)
            self.http_port = await self._http.start(host, self.http_port)
        if self.wyoming_port is not None:
            from service.wyoming import WyomingFront

            self._wyoming = WyomingFront(self)
            self.wyoming_port = await self._wyoming.start(host, self.wyoming_port)
        aio_loop = asyncio.get_running_loop()

        def on_ready() -> None:  # (engine thread)
            aio_loop.call_soon_threadsafe(self._warmed_up)

        def on_stopped() -> None:  # (engine thread)
            aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._report_health()))

        def on_failed(reason: str) -> None:  # (any thread)
            log.error("this replica is out of service: %s; health NOT_SERVING", reason)
            with contextlib.suppress(RuntimeError):  # (the event loop closed: nothing left to tell)
                aio_loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._report_health()))

        self.loop.on_ready, self.loop.on_stopped = on_ready, on_stopped
        self.loop.on_failed = on_failed
        self.loop.start()
        return self.port

    def _credentials(self) -> grpc.ServerCredentials:
        """gRPC's TLS credentials from `access.tls_cert` / `tls_key` (PEM files); RuntimeError
        if unreadable."""
        assert self.access.tls_cert is not None and self.access.tls_key is not None
        try:
            with open(self.access.tls_key, "rb") as key, open(self.access.tls_cert, "rb") as cert:
                return grpc.ssl_server_credentials([(key.read(), cert.read())])
        except OSError as exc:
            raise RuntimeError(f"cannot read {exc.filename}: {exc.strerror}") from exc

    def _warmed_up(self) -> None:
        self.replica_state.warm = True
        if self.replica_state.serving:
            self._ready.set()
        asyncio.ensure_future(self._report_health())

    async def _report_health(self) -> None:
        """Set the gRPC health services from the replica's state (`ReplicaState`): the server's and the
        service's SERVING only while `serving`, `liveness` SERVING while `live`."""
        from grpc_health.v1 import health_pb2

        if self._health is None:  # (not started)
            return
        status = health_pb2.HealthCheckResponse
        async with self._health_lock:  # one update at a time, so the latest state is the one left
            serving = status.SERVING if self.replica_state.serving else status.NOT_SERVING
            live = status.SERVING if self.replica_state.live else status.NOT_SERVING
            for name, value in (("", serving), (SERVICE_NAME, serving), (LIVENESS_SERVICE, live)):
                await self._health.set(name, value)

    @property
    def state(self) -> str:
        """The replica's state: `warming_up`, `serving`, `draining` (stop() called), `failed` (a part failed
        and could not recover: `EngineThread.failure` says why) or `stopped` (`ReplicaState.state`)."""
        return self.replica_state.state

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
        """The load signal of HTTP `GET /load` (`ReplicaState.load`)."""
        return self.replica_state.load()

    async def stop(self, grace: float | None = 10.0, drain_delay: float = 0.0) -> None:
        """Graceful shutdown (drain): health NOT_SERVING at once; for `drain_delay` seconds new calls are
        still admitted (a balancer polling health stops sending in that time, so no call it sends is
        refused); then new calls are answered UNAVAILABLE by the handlers (the port stays open, so a
        balancer's health checks see NOT_SERVING, not a refused connection) while open streams get
        `grace` seconds to finish; then the rest end with UNAVAILABLE, the engine thread stops and the port
        closes. Returns within `drain_delay` + `grace` plus about a second. Idempotent."""
        if self.replica_state.stopping:
            await self._stopped.wait()
            return
        self.replica_state.stopping = True
        try:
            await self._report_health()  # draining: NOT_SERVING (liveness stays SERVING)
            if drain_delay > 0:
                log.info("draining: NOT_SERVING; still admitting for %.3g s", drain_delay)
                deadline = time.monotonic() + drain_delay
                while self.loop.alive and time.monotonic() < deadline:
                    await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            self.loop.close_admission()
            grace = 0.0 if grace is None else grace
            deadline = time.monotonic() + grace
            while (
                (self.loop.in_flight > 0 or self.loop.sessions_open > 0)
                and self.loop.alive
                and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.01)
            # Jobs still open end with UNAVAILABLE ("the server shut down before the request finished"),
            # sessions still open with SessionEnded("shutdown").
            await asyncio.to_thread(self.loop.stop, 30.0)
            if self._server is not None:
                await self._server.stop(0.5)  # the handlers have their final events: let them send them
            if self._http is not None:  # ---- HTTP front: its jobs have ended; close its connections
                await self._http.stop()
            if self._wyoming is not None:  # ---- Wyoming front: likewise
                await self._wyoming.stop()
        finally:
            self.metrics.close()
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()
