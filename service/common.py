"""What both fronts (gRPC: service/grpc_front.py, HTTP: service/http.py) share, with no wire format in it:
the server's limits, the replica's state (the one definition of ready / serving / draining / failed that
gRPC health, HTTP /health and /load report, and of when a call is admitted), the outcome of an error (one
classification, which each front maps to its status codes), a request's preparation off the event loop,
and the one log line of a finished call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tts.codec.base import AudioError
from tts.engine import FinishReason, InvalidRequest
from tts.runtime.engine_thread import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_FIRST_CHUNK_FRAMES,
    DEFAULT_MAX_QUEUED_CHUNKS,
    DEFAULT_MAX_SESSIONS,
    Cancelled,
    EngineFailed,
    EngineThread,
    Finished,
    LoopClosed,
    Overloaded,
    Preempted,
    SessionLimit,
)
from tts.runtime.request import VOICE, MiB, ReferenceClip, RequestLimits, format_size, prepare_reference
from tts.runtime.request import SpeechRequest as RuntimeRequest
from tts.runtime.request_errors import RequestError, with_field
from tts.runtime.voices import VoiceExists, VoiceNotFound
from tts.text.budget import PreparationTimeout, TextBudget, text_budget
from tts.text.normalize import TextError

log = logging.getLogger("service.calls")
T = TypeVar("T")

__all__ = ["MiB", "format_size"]


@dataclass
class ServiceLimits:
    """What one server accepts. Sizes in bytes, chunk sizes in frames.

    max_receive_bytes: the gRPC receive limit (a request); defaults to room for the largest reference
    clip plus 1 MiB. pause_timeout: seconds a stream that is not read may hold its batch row while
    others wait (None: forever). max_audio_seconds: audio per request before it ends with `length`.
    reference_cache_bytes: the encoded-reference cache. voices_dir: registered voices (None: in memory).
    max_send_bytes: the gRPC send limit (a unary reply carries the whole clip; stream
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
    max_sessions: streaming sessions (gRPC SynthesizeSession, Wyoming's streamed synthesis) open at most;
    beyond, opening one is refused with RESOURCE_EXHAUSTED.
    max_http_connections: HTTP connections (WebSockets included) open at once on the HTTP port; a
    connection that reaches it is answered 503, so idle clients cannot use up the process's files.
    max_grpc_connections: gRPC client connections open at once; one past it is closed before its first
    call, which fails UNAVAILABLE. max_connection_idle: seconds a gRPC connection
    with no call open may stay before the server asks it to go away (GOAWAY; a client reconnects for its
    next call), None: never.
    max_wyoming_connections: Wyoming connections open at once; one more gets an error event
    (`resource_exhausted`) and is closed. wyoming_idle_timeout: seconds a Wyoming connection may stay
    with no synthesis in progress and no complete event before the server closes it (None: never).
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
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_http_connections: int = 4096
    max_grpc_connections: int = 1024
    max_connection_idle: float | None = 300.0
    max_wyoming_connections: int = 256
    wyoming_idle_timeout: float | None = 60.0

    @property
    def receive_bytes(self) -> int:
        return self.max_receive_bytes or self.max_reference_bytes + MiB

    @property
    def request_limits(self) -> RequestLimits:
        """The limits of one request (`tts.runtime.request`), as both fronts apply them."""
        return RequestLimits(
            max_text_bytes=self.max_text_bytes,
            max_reference_bytes=self.max_reference_bytes,
            max_chunk_frames=self.max_chunk_frames,
            first_chunk_frames=self.first_chunk_frames,
            chunk_frames=self.chunk_frames,
            max_audio_seconds=self.max_audio_seconds,
        )


# ---- the replica's state ------------------------------------------------------------------------------


class ReplicaState:
    """The one definition of this replica's state, which gRPC health, HTTP /health and /load report:

    * `warming_up`: the engine is starting (health NOT_SERVING, liveness SERVING);
    * `serving`: warm and admitting (health SERVING; HTTP /health 200);
    * `draining`: shutdown began (health NOT_SERVING at once; calls are still admitted until admission
      closes, then refused UNAVAILABLE / 503; liveness SERVING);
    * `failed`: a part failed and cannot recover (`EngineThread.failure` says why; health and liveness
      NOT_SERVING);
    * `stopped`: the engine thread ended (health and liveness NOT_SERVING).

    `refusal()` says why a call cannot be admitted now (the same words on both fronts)."""

    def __init__(self, loop: EngineThread, limits: ServiceLimits, replica: str = ""):
        self.loop, self.limits, self.replica = loop, limits, replica
        self.warm = False  # warm-up done (set by the server's on_ready hook)
        self.stopping = False  # stop() called

    @property
    def state(self) -> str:
        if self.loop.failure is not None:
            return "failed"
        if self.stopping:
            return "draining" if self.loop.alive else "stopped"
        if not self.warm:
            return "warming_up"
        return "serving" if self.loop.alive else "stopped"

    @property
    def serving(self) -> bool:
        """Readiness: health SERVING, HTTP /health 200."""
        return self.state == "serving"

    @property
    def live(self) -> bool:
        """Liveness: the process and its engine thread work (warming up and draining included)."""
        return self.state in ("warming_up", "serving", "draining")

    def health(self) -> tuple[bool, dict[str, str]]:
        """(ready, body) of HTTP /health: `{"status": state}`, with the reason when failed."""
        state = self.state
        body = {"status": state}
        if state == "failed":  # (the operator sees why the replica is out)
            body["reason"] = self.loop.failure or ""
        return state == "serving", body

    def refusal(self, new_work: bool = True) -> LoopClosed | None:
        """Why a call cannot be served now (None: it can). new_work=False: a call that only reads what the
        engine is (GetInfo), refused only while warming up."""
        loop = self.loop
        if not loop.ready:
            return LoopClosed("the server is warming up; not accepting requests")
        if not new_work:
            return None
        if not loop.alive:
            return LoopClosed("the engine has stopped; not accepting requests")
        if not loop.accepting:
            return LoopClosed("the server is shutting down; not accepting requests")
        return None

    def load(self) -> dict:
        """The load signal a balancer or autoscaler reads cheaply (HTTP `GET /load`): the replica's name and
        state, requests in flight / running / waiting / paused against the admission limit, streaming sessions
        open against their limit, and KV blocks
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
            "sessions": self.loop.sessions_open,
            "max_sessions": self.limits.max_sessions,
            "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total,
            "load": round(in_flight / limit, 4) if limit else 0.0,
            "kv_used": round(s.kv_blocks_used / s.kv_blocks_total, 4) if s.kv_blocks_total else 0.0,
            "frames_per_second": round(self.loop.frames_per_second(), 2),
        }


# ---- outcomes -----------------------------------------------------------------------------------------


async def register_voice(front, name: str, clip: ReferenceClip, replace: bool):
    """What every front does to register a voice (gRPC AddVoice, HTTP `POST /v1/audio/voices`, Fish
    `POST /model`): refused while the replica takes no new work, the name checked, the clip checked and
    encoded on the codec stage (its own thread: the event loop goes on), then kept in the registry.
    `front` has `state` (ReplicaState), `loop` (EngineThread) and `limits` (ServiceLimits). Returns the
    registry's entry. Raises LoopClosed, InvalidRequest (a bad or preset name, field `voice`), AudioError
    (the clip) or VoiceExists."""
    refusal = front.state.refusal()
    if refusal is not None:
        raise refusal
    try:
        front.loop.voices.check_new(name, replace)
    except InvalidRequest as exc:
        raise with_field(exc, VOICE) from exc
    prepared = await asyncio.to_thread(
        prepare_reference, front.loop.planner, clip, front.limits.request_limits
    )
    return await asyncio.wrap_future(front.loop.add_voice(name, prepared, replace))


class NoAudio(Exception):
    """A synthesis that ended without any audio (docs/DESIGN.md invariant 9: no OK with empty audio). gRPC:
    FAILED_PRECONDITION; HTTP: 422 `no_audio`; Wyoming: an error event `no_audio`. `field` is the request
    field at fault: the text. `finished`: the job's end (its finish reason and warnings make the message),
    None where no one job ended it (a Wyoming stream of sentences: `message` says why)."""

    field = "text"

    def __init__(self, finished: Finished | None = None, *, message: str | None = None):
        if message is None:
            assert finished is not None, "NoAudio needs the job's end or a message"
            why = "; ".join(finished.warnings) or "no frames"
            reason = finish_reason(finished.finish_reasons)
            message = f"the model produced no audio for this text (finish reason {reason}: {why})"
        super().__init__(message)
        self.finished = finished


def finish_reason(reasons: Sequence[FinishReason]) -> str:
    """A request's finish reason from its text chunks': `loop` if one kept a repetition loop, else `short`
    if one ended implausibly early, else `length` if one hit its budget, else `stop`."""
    for reason in (FinishReason.LOOP, FinishReason.SHORT, FinishReason.LENGTH):
        if reason in reasons:
            return reason.value
    return FinishReason.STOP.value


def outcome_of(exc: BaseException) -> str:
    """What a request that ended with `exc` came to, the `tts_requests_total{outcome}` label, from which
    each front picks its status: invalid_argument, not_found, already_exists, deadline_exceeded,
    resource_exhausted, preempted, unavailable, cancelled, no_audio, or error (a failure of ours)."""
    if isinstance(exc, VoiceNotFound):
        return "not_found"
    if isinstance(exc, VoiceExists):
        return "already_exists"
    if isinstance(exc, TextError | InvalidRequest | AudioError | RequestError):
        return "invalid_argument"
    kinds: tuple[tuple[type[BaseException], str], ...] = (
        (PreparationTimeout, "deadline_exceeded"),
        (Overloaded, "resource_exhausted"),
        (SessionLimit, "resource_exhausted"),
        (Preempted, "preempted"),
        (LoopClosed, "unavailable"),
        (Cancelled, "cancelled"),
        (NoAudio, "no_audio"),
    )
    for kind, outcome in kinds:
        if isinstance(exc, kind):
            return outcome
    return "error"


def error_message(exc: BaseException, names: dict[str, str] | None = None) -> str:
    """One line saying what went wrong: a request error's message with the fields as `names` calls them,
    our own failures (not EngineFailed's, which say what failed) with their type."""
    if isinstance(exc, RequestError):
        text = exc.message(names)
    elif outcome_of(exc) == "error" and not isinstance(exc, EngineFailed):
        text = f"{type(exc).__name__}: {exc}"
    else:
        text = str(exc)
    return re.sub(r"\s*\n\s*", " ", text)


def error_field(exc: BaseException, names: dict[str, str] | None = None) -> str | None:
    """The request field at fault in `exc` as `names` calls it (None: no field is)."""
    if isinstance(exc, RequestError):
        return exc.field_name(names)
    field = getattr(exc, "field", None) if isinstance(exc, NoAudio) else None
    return None if field is None else (names or {}).get(field, field)


# ---- preparation off the event loop --------------------------------------------------------------------


async def prepare_off_loop(fn: Callable[..., T], *args, timeout: float | None) -> T:
    """`fn(*args)` (a request's preparation: `SpeechRequest.plan` and the like, host work) on a worker
    thread, under a text budget (`tts.text.budget`) whose deadline is `timeout` seconds from now (None:
    none). Past the deadline this raises PreparationTimeout at once and the preparation stops at its next
    step; if the awaiting task is cancelled (the client cancelled, or its deadline passed), the preparation
    stops at its next step as well. The worker holds the GIL only between steps that are linear in the
    text, so the event loop and other requests go on meanwhile."""
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


# ---- the log line of a call ----------------------------------------------------------------------------


@dataclass
class CallLog:
    """What the one log line of a finished call says (`log_call`)."""

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


def log_call(call: CallLog) -> None:
    """One line per finished call, gRPC or HTTP (INFO): id, text bytes, voice (`SynthesisJob.voice_kind`),
    frames, TTFA, RTF, outcome."""
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


@dataclass
class SpeechOutput:
    """A parsed synthesis request of any HTTP wire format: the runtime's request and how to send its
    audio (format name of `tts.audio.formats.FORMATS`, tempo, `audio` or `sse`, linear gain)."""

    request: RuntimeRequest
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"
    gain: float = 1.0
