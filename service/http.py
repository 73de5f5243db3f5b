"""The HTTP front (FastAPI on uvicorn): an OpenAI-compatible `/v1/audio/speech`, voices, models, health,
Prometheus metrics and the playground page, served by the same process, asyncio loop and `EngineThread`
as the gRPC server (`TTSServer` starts it beside grpc.aio), so both fronts share one admission limit.

Endpoints:

* `POST /v1/audio/speech`: OpenAI's body (`model`, `input`, `voice`, `response_format`, `speed`,
  `stream_format`, `instructions`) plus this server's extensions (`seed`, `temperature`, `top_p`, `top_k`,
  `max_new_frames`, `min_new_frames`, `repetition_penalty`, `reference_audio` (base64 WAV, FLAC, MP3 or
  Ogg) with `reference_text`, `normalize` (default true; false reads the text as given, see
  tts/textpolicy.py)).
  The JSON becomes the runtime's `tts.runtime.request.SpeechRequest`, checked and planned by the same rules
  as a gRPC call's (this module imports no protobuf and no gRPC).
  The audio streams as the engine produces it (chunked transfer): encoded bytes (`stream_format`
  `audio`, the default) or server-sent events (`sse`): `speech.audio.delta` (`audio`: base64 of the
  next encoded bytes) and one `speech.audio.done` (`usage`: `input_tokens` = prompt tokens of the text
  without the voice, `output_tokens` = frames generated; plus `frames`, `audio_seconds`,
  `finish_reason`, `seed`, `request_id`). Every response carries `X-Request-Id`, `X-Seed`,
  `X-Sample-Rate` (of the encoded audio: 48000 for opus), `X-Model`, `X-Text-Chunks`, `X-Replica` (the
  serving process's name), and `X-Warnings` when the text lost something (text the model cannot speak
  left out, markup ignored; "; "-joined, also in the SSE `speech.audio.done` event's `warnings`); `pcm`
  is 16-bit little-endian mono (`X-Sample-Format: s16le`).
* `GET /v1/audio/voices`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (200 when warm; 503 while
  warming up, draining or stopped), `GET /load` (the load signal for balancers and autoscalers: requests
  in flight against the admission limit, KV blocks in use; `TTSServer.load`), `GET /metrics` (the
  server's Prometheus registry), `GET /` (the playground, `service/static/index.html`), and FastAPI's
  `/docs`.

Errors are OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`: 400 bad input (JSON a
parser chokes on included: integers of over 40 digits, nesting past the recursion limit, lone surrogate
escapes), 404 unknown model / voice / path, 409 a voice name that is taken, 413 body over the limit
(checked before the body is parsed; the rest of the body, up to DRAIN_BYTES more, is read first so that
the client can read the answer), 415 a voice upload that is not multipart/form-data, 422 `no_audio`: the
job ended without any audio (gRPC: FAILED_PRECONDITION), 429 admission full,
503 warming up or shutting down, 504 the request's preparation (text, reference clip) took longer than
`ServiceLimits.max_prepare_seconds`, 500 a bug. Statuses come from `service.common.outcome_of`, as gRPC's
do, and `param` is the request field at fault as the error names it (`HTTP_FIELDS`), never guessed.

The status line waits for the first audio (or the end of the job): a job that fails before any audio gets
its error status. When the job ended before the status line, `X-Finish-Reason` (`stop`, `length`,
`short`, `loop`: as gRPC's StreamEnd) and every warning (`X-Warnings`) come with it.

Connections: a request's headers must arrive within `ServiceLimits.http_read_timeout` seconds of the
connection's start (or the previous response's end), and its body may not pause longer; else the
connection is closed. A client that leaves before its body is complete is counted `cancelled` (one INFO
line), as a gRPC cancel is.

Once the status line is sent the status cannot change: a request that fails later (engine failure,
shutdown past the grace period) ends the SSE stream with an `error` event, and cuts an audio stream
without its final chunk (the client sees an incomplete chunked body, never a silently short file). A
client that disconnects cancels its job: the engine frees its KV blocks and batch row at the next step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import math
import socket
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.access import Access, AccessMiddleware, is_loopback
from service.common import (
    CallLog,
    NoAudio,
    ReplicaState,
    ServiceLimits,
    SpeechOutput,
    error_field,
    error_message,
    format_size,
    log_call,
    outcome_of,
    prepare_off_loop,
    register_voice,
)
from service.common import finish_reason as overall_finish_reason
from service.fish_api import register as register_fish_api
from service.metrics import ServiceMetrics
from tts.audio.formats import FORMATS, MAX_SPEED, MIN_SPEED, AudioEncoder
from tts.codec.base import AudioError
from tts.engine import InvalidRequest
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
)
from tts.runtime.request import (
    VOICE,
    ReferenceClip,
    Sampling,
    check_voice_source,
    plan_job,
)
from tts.runtime.request import SpeechRequest as RuntimeRequest
from tts.runtime.request_errors import with_field
from tts.runtime.voices import VoiceExists, VoiceNotFound
from tts.text.budget import PreparationTimeout
from tts.text.normalize import TextError, shorten

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

KiB = 1024
STATIC = Path(__file__).parent / "static"
# Kernel send buffer of each connection (the kernel doubles it). A fixed size bounds what a client that
# stops reading can have buffered: once it is full (and uvicorn's 64 KiB, and `max_queued_chunks` chunks),
# its request pauses, as a gRPC stream does when its HTTP/2 window is full, instead of generating into
# up to 4 MiB of autotuned buffer. 256 KiB per round trip is far above any audio bit rate served here.
SEND_BUFFER_BYTES = 128 * KiB
# An oversized request body is read and dropped up to this many bytes past the limit before the 413 is
# sent (`HTTPFront._read_body`); a larger one gets its 413 at once, and the connection closes.
DRAIN_BYTES = 64 * KiB * KiB
# OpenAI's voice names, in OpenAI's order, for tools that hard-code them. A voice of this server with the
# same name wins; else the model's table below; else the model's presets in name order, the i-th OpenAI
# name taking preset i modulo their count; a model without presets uses its default voice.
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
)
OPENAI_VOICE_PRESETS = {
    # The default voice's presets (docs/models.md): ava, cora, emma, gwen one US female voice at different
    # pitches and rates; ben, dave US male; hank dave's voice slower; finn a Scottish male voice.
    "default": {
        "alloy": "ava", "ash": "ben", "ballad": "hank", "coral": "cora", "echo": "dave", "fable": "finn",
        "onyx": "hank", "nova": "emma", "sage": "gwen", "shimmer": "emma", "verse": "ben",
    },
}  # fmt: skip
# The Content-Types a browser sends cross-site without a CORS preflight (the speech route wants JSON).
FORM_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
# OpenAI's model names: tools that hard-code them get the served model (there is only one).
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# (status, type, code) of `service.common.outcome_of`'s outcomes; others: 500 internal_error.
HTTP_STATUS = {
    "invalid_argument": (400, "invalid_request_error", None),
    "not_found": (404, "invalid_request_error", "not_found"),
    "already_exists": (409, "invalid_request_error", "already_exists"),
    "resource_exhausted": (429, "rate_limit_error", "server_at_capacity"),
    "preempted": (429, "rate_limit_error", "server_at_capacity"),
    "unavailable": (503, "server_error", "unavailable"),
    "cancelled": (499, "server_error", "cancelled"),
    "deadline_exceeded": (504, "server_error", "deadline_exceeded"),
    "no_audio": (422, "invalid_request_error", "no_audio"),
}
# Error messages are cut to this many characters (as gRPC's status details are).
MAX_MESSAGE_CHARS = 300
REQUEST_ERRORS = (
    TextError, InvalidRequest, AudioError, VoiceNotFound, Overloaded, LoopClosed, EngineFailed,
    PreparationTimeout,
)  # fmt: skip
# What `POST /v1/audio/voices` takes, for the errors that say so.
VOICE_FORM = (
    "POST /v1/audio/voices takes multipart/form-data with the fields name, file (a WAV, FLAC, MP3 or Ogg "
    "clip), text (its transcript) and optionally replace=true"
)
# The speech body's names of the request fields (`tts.runtime.request.FIELDS`), in `param` and messages.
HTTP_FIELDS = {
    "text": "input",
    "voice": "voice",
    "reference.audio": "reference_audio",
    "reference.text": "reference_text",
    **{f"sampling.{name}": name for name in (
        "temperature", "top_p", "top_k", "seed", "max_new_frames", "min_new_frames", "repetition_penalty",
    )},
}  # fmt: skip
# The voice form's names (POST /v1/audio/voices).
VOICE_FORM_FIELDS = {"voice": "name", "reference.audio": "file", "reference.text": "text"}


# Swagger UI's files /docs serves, from the `swagger-ui-py` package when it is installed (it bundles them).
SWAGGER_FILES = ("swagger-ui-bundle.js", "swagger-ui.css")


def swagger_assets() -> Path | None:
    """The folder holding Swagger UI's SWAGGER_FILES (package `swagger_ui`'s `static`, found without
    importing it), or None where it is not installed."""
    import importlib.util

    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("swagger_ui")
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            folder = Path(location) / "static"
            if all((folder / name).is_file() for name in SWAGGER_FILES):
                return folder
    return None


def docs_page(app: FastAPI) -> HTMLResponse:
    """`GET /docs`, with nothing from another host (it works offline): Swagger UI from the installed
    `swagger-ui-py` package's files (served under /docs/assets/); without it, a page listing every
    operation of the OpenAPI schema, linking `/openapi.json`."""
    if swagger_assets() is not None:
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title}: API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/favicon.ico",
            swagger_ui_parameters={"validatorUrl": None},  # (its default calls validator.swagger.io)
        )
    from html import escape

    rows = []
    for path, operations in app.openapi().get("paths", {}).items():
        for method, op in operations.items():
            rows.append(
                f"<tr><td><code>{escape(method.upper())}</code></td><td><code>{escape(path)}</code></td>"
                f"<td>{escape(op.get('summary', ''))}</td></tr>"
            )
    page = (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{escape(app.title)}: API</title>"
        "<link rel='icon' href='/favicon.ico' type='image/svg+xml'><style>body{font:15px/1.4 system-ui,"
        "sans-serif;max-width:56rem;margin:2rem auto;padding:0 1rem}td{padding:.2rem .8rem .2rem 0;"
        "vertical-align:top}</style></head><body>"
        f"<h1>{escape(app.title)}: API</h1><p>The OpenAPI schema: <a href='/openapi.json'>/openapi.json</a> "
        "(load it into any OpenAPI viewer). The reference: docs/api-http.md. Install the Python package "
        "<code>swagger-ui-py</code> for the browsable Swagger UI here, served from this server.</p>"
        f"<table>{''.join(rows)}</table><p><a href='/'>The playground</a></p></body></html>"
    )
    return HTMLResponse(page)


def body_limit(limits) -> int:
    """Largest request body accepted (bytes): the gRPC receive limit (reference clip limit + 1 MiB) grown
    by a third for base64, plus 64 KiB for JSON."""
    return math.ceil(limits.receive_bytes * 4 / 3) + 64 * KiB


class VoiceId(BaseModel):
    """OpenAI's custom-voice form of `voice`: `{"id": "name"}`."""

    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(BaseModel):
    """The body of `POST /v1/audio/speech`. Unknown fields are refused (400), not ignored; so is a value
    of the wrong JSON type (strict types: `true` is no speed, `"1"` no seed; an integer is a number)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="the served model's name (GET /v1/models) or tts-1 / ...")
    input: str = Field(description="the text to speak")
    voice: str | VoiceId | None = Field(
        None, description="a voice name (GET /v1/audio/voices); none: default"
    )
    instructions: str | None = Field(None, description="not supported: must be empty")
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: StrictFloat = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED, description="tempo, pitch unchanged")
    stream_format: Literal["audio", "sse"] = "audio"
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = Field(None, ge=-(2**31), le=2**31 - 1)
    max_new_frames: StrictInt | None = Field(
        None, ge=-(2**31), le=2**31 - 1, description="frame budget per text chunk"
    )
    min_new_frames: StrictInt | None = Field(
        None, ge=-(2**31), le=2**31 - 1, description="frames per text chunk before the end token may come"
    )
    repetition_penalty: StrictFloat | None = Field(
        None, description="(0, 2), 1 = off: fish-speech 1.5's and S1's penalty on the last 16 frames"
    )
    reference_audio: str | None = Field(
        None, description="base64 WAV, FLAC, MP3 or Ogg clip of a voice to clone"
    )
    reference_text: str | None = Field(None, description="the transcript of reference_audio")
    normalize: StrictBool = Field(
        True,
        description="read Markdown as rendered and normalize the text as the model's text policy says; "
        "false: read the text as given",
    )


class APIError(Exception):
    """An error answered as OpenAI-style JSON."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @property
    def outcome(self) -> str:
        """The `tts_requests_total{outcome}` label of this error."""
        return {
            400: "invalid_argument",
            404: "not_found",
            413: "too_large",
            415: "invalid_argument",
            422: "no_audio",
            429: "resource_exhausted",
            504: "deadline_exceeded",
        }.get(self.status, "unavailable" if self.status == 503 else "error")

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = dict(headers or {})
        if self.status in (429, 503):
            headers["Retry-After"] = "1"
        return JSONResponse(body, status_code=self.status, headers=headers)


def api_error(exc: BaseException, names: dict[str, str] = HTTP_FIELDS) -> APIError:
    """The APIError for an exception a request can end with: its status from its outcome
    (`service.common.outcome_of`, as gRPC's), `param` the field it names, both as `names` calls them."""
    outcome = outcome_of(exc)
    status, type_, err_code = HTTP_STATUS.get(outcome, (500, "server_error", "internal_error"))
    message = shorten(error_message(exc, names), MAX_MESSAGE_CHARS)
    param = error_field(exc, names)
    if isinstance(exc, VoiceNotFound):
        err_code = "voice_not_found"
    if isinstance(exc, EngineFailed):
        err_code = "engine_failed"
    return APIError(status, message, type_, param, err_code)


_BOOL = TypeAdapter(bool)


def _form_flag(value: object, param: str) -> bool:
    """A form field's true/false as pydantic reads a bool (1/0, true/false, yes/no, on/off, t/f, y/n, any
    case); APIError 400 naming `param` for anything else (a mistyped `replace=ture` must not quietly
    read as false)."""
    try:
        return _BOOL.validate_python(str(value).strip())
    except ValidationError as exc:
        raise APIError(
            400, f"`{param}` must be true or false, got {shorten(str(value), 40)!r}", param=param
        ) from exc


# JSON integers longer than this stay unconverted (no field takes one: the widest, seed, has 20 digits).
MAX_INT_DIGITS = 40


class _LongInt:
    """A JSON integer of more than MAX_INT_DIGITS digits, never converted: no field validates it (it is
    neither a number nor a string), so the error names the field; it reads as "a 5000-digit number"."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __str__(self) -> str:
        return f"a {self.digits}-digit number"


def _json_int(text: str) -> int | _LongInt:
    return int(text) if len(text) <= MAX_INT_DIGITS else _LongInt(text)


def _check_unicode(data: dict) -> None:
    """Raise APIError 400 naming the top-level field of the first string (or key) in `data` holding a
    lone surrogate (JSON's `\\ud800` escape parses to one): it cannot be encoded, so it would fail
    later as a 500. Iterative: the parsed JSON may nest up to the recursion limit."""
    stack: list[tuple[str | None, object]] = [(None, data)]
    while stack:
        field, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                top = key if field is None else field
                _check_text(top, key)
                stack.append((top, item))
        elif isinstance(value, list):
            stack.extend((field, item) for item in value)
        elif isinstance(value, str):
            _check_text(field, value)


def _check_text(field: str | None, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = field.encode("utf-8", "backslashreplace").decode() if field is not None else "body"
        char = text[exc.start].encode("unicode_escape").decode()
        raise APIError(
            400,
            f"{name} holds a lone surrogate ({char}) at character {exc.start}: not valid Unicode",
            param=name,
        ) from None


def _header_text(warnings: list[str]) -> str:
    """Warnings as one header value: "; "-joined, ASCII (anything else as "?")."""
    return "; ".join(warnings).encode("ascii", "replace").decode()


def finish_reason(finished: Finished) -> str:
    """The response's finish reason as gRPC's StreamEnd gives it: `loop` if a text chunk kept a repetition
    loop (OpenAI has no such reason), else `short` if one ended implausibly early, else `length` if one
    hit its budget, else `stop`."""
    return overall_finish_reason(finished.finish_reasons)


class StreamAborted(RuntimeError):
    """Raised into the server to cut an audio stream whose job failed after the status line was sent."""


class _QuietAborts(logging.Filter):
    """uvicorn logs every exception out of an app with a traceback; a StreamAborted is expected (we log it
    as one line), so its record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamAborted))


logging.getLogger("uvicorn.error").addFilter(_QuietAborts())


# ---- one synthesis over HTTP ---------------------------------------------------------------------------


class _Synthesis:
    """A job admitted for an HTTP request: turns its events into response bytes, keeps the metrics, and
    cancels the job unless it ended (`close`)."""

    def __init__(
        self,
        front: HTTPFront,
        stream,
        started: Started,
        encoder: AudioEncoder,
        call: CallLog,
        gain: float = 1.0,
    ):
        self.front, self.stream, self.started, self.encoder = front, stream, started, encoder
        self.gain = gain  # linear volume applied before encoding (1.0: none)
        self.call = call  # its log line: what `speech` knew, the rest filled in as the job ends
        self.t_received = call.received
        self.t_first: float | None = None
        self.samples = 0  # model-rate samples received from the engine
        self.ended = False  # Finished or Failed seen (the job is over on the engine side)
        self.finished = False  # Finished seen: all the audio is encoded (maybe not yet sent)
        self.input_tokens = 0
        self.finished_event: Finished | None = None
        # Encoding compressed formats (or with a tempo change) runs on a worker thread, off the event loop
        # that also serves gRPC; the encoder's lock makes close() wait for a running encode.
        self.threaded = encoder.format.name not in ("pcm", "wav") or encoder.speed != 1.0

    async def _encode(self, samples) -> bytes:
        if self.gain != 1.0:
            samples = np.clip(samples * self.gain, -1.0, 1.0).astype(np.float32)
        if self.threaded:
            return await asyncio.to_thread(self.encoder.encode, samples)
        return self.encoder.encode(samples)

    async def _finish(self) -> bytes:
        return await asyncio.to_thread(self.encoder.finish) if self.threaded else self.encoder.finish()

    async def events(self):
        """(kind, payload) pairs: ("audio", bytes) as they are encoded, then ("done", Finished) or
        ("failed", exception)."""
        while True:
            event = await self.stream.next()
            if isinstance(event, Audio):
                if self.t_first is None:
                    self.t_first = time.monotonic()
                self.samples += len(event.samples)
                data = await self._encode(event.samples)
                if data:
                    yield "audio", data
            elif isinstance(event, Finished):
                self.ended = self.finished = True
                self.finished_event = event
                if self.samples == 0:
                    # Nothing to hear: no OK for it (the status line waits for the first audio, so this
                    # is always said before it; gRPC ends such a call with FAILED_PRECONDITION).
                    err = api_error(NoAudio(event))
                    self.front.count(err.outcome)
                    self.front.log_call(self.call, err.outcome, err.message, synthesis=self)
                    yield "failed", err
                    return
                data = await self._finish()
                if data:
                    yield "audio", data
                self._count_ok()
                self.front.log_call(self.call, "ok", finished=event, synthesis=self)
                yield "done", event
                return
            else:
                assert isinstance(event, Failed), event
                self.ended = True
                err = api_error(event.error)
                self.front.count(err.outcome)
                self.front.log_call(self.call, err.outcome, err.message, synthesis=self)
                yield "failed", event.error
                return

    async def audio_body(self, events) -> AsyncGenerator[bytes, None]:
        async for kind, payload in events:
            if kind == "audio":
                yield payload
            elif kind == "failed":
                log.warning(
                    "request %s failed after its headers were sent: %s", self.started.request_id, payload
                )
                raise StreamAborted(str(payload))

    async def sse_body(self, events) -> AsyncGenerator[bytes, None]:
        async for kind, payload in events:
            event: dict[str, object]
            if kind == "audio":
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(payload).decode("ascii")}
            elif kind == "done":
                event = self._done_event(payload)
            else:
                err = payload if isinstance(payload, APIError) else api_error(payload)
                event = {
                    "type": "error",
                    "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code},
                }
            yield f"data: {json.dumps(event)}\n\n".encode()

    def _done_event(self, finished: Finished) -> dict:
        reason = finish_reason(finished)
        return {
            "type": "speech.audio.done",
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": finished.frames,
                "total_tokens": self.input_tokens + finished.frames,
            },
            "frames": finished.frames,
            # after tempo, before codec padding; to the millisecond (as `usage` counts, not a float's tail)
            "audio_seconds": round(self.encoder.samples_out / self.encoder.output_rate, 3),
            "finish_reason": reason,
            "seed": self.started.seed,
            "request_id": self.started.request_id,
            "warnings": list(finished.warnings),
        }

    def _count_ok(self) -> None:
        m = self.front.metrics
        audio_seconds = self.samples / self.front.bundle.codec.sample_rate
        m.requests.labels("ok").inc()
        m.audio_seconds.inc(audio_seconds)
        if audio_seconds > 0:
            m.ttfa.observe((self.t_first or self.t_received) - self.t_received)
            m.rtf.observe((time.monotonic() - self.t_received) / audio_seconds)

    def close(self, outcome: str = "cancelled") -> None:
        """The response is over (sent, failed or abandoned): cancel the job unless it ended (its blocks and
        row are freed at the engine's next step; counted as `outcome`), release the encoder."""
        if not self.ended:
            self.ended = True
            self.front.count(outcome)
            self.front.log_call(self.call, outcome, synthesis=self)
        self.stream.cancel()  # a no-op once the job ended
        self.encoder.close()


@dataclass
class _Admitted:
    """A speech request whose job the engine thread started (`HTTPFront._admit`): the parsed request, the
    job's warnings, the text's prompt tokens (SSE's usage), its stream, Started event and encoder."""

    output: SpeechOutput
    warnings: list[str]
    input_tokens: int
    stream: RequestStream
    started: Started
    encoder: AudioEncoder


class _SynthesisResponse(StreamingResponse):
    """A StreamingResponse that cancels its job however the response ends: a client that disconnects
    cancels the sending task, which may be suspended anywhere; `abort()` (at shutdown) cuts a response
    whose client stopped reading."""

    def __init__(self, synthesis: _Synthesis, body: AsyncGenerator[bytes, None], **kwargs):
        super().__init__(body, **kwargs)
        self._body = body  # = self.body_iterator, kept with its generator type (aclose)
        self.synthesis = synthesis
        self.aborted = False
        self._task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send) -> None:
        active = self.synthesis.front.active
        self._task = asyncio.current_task()
        active.add(self)
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self.aborted:
                raise
            task = asyncio.current_task()
            assert task is not None  # (this coroutine runs in a task)
            if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation is handled here
                task.uncancel()
            if not self.synthesis.front.drop_connection(scope):
                raise StreamAborted("the server is shutting down") from None  # uvicorn closes it
            await asyncio.sleep(0)  # uvicorn's connection_lost runs: it sees a disconnect, not an app error
        finally:
            active.discard(self)
            self.synthesis.close("unavailable" if self.aborted else "cancelled")
            with contextlib.suppress(Exception):
                await self._body.aclose()

    def abort(self) -> None:
        """End the response now, without its final chunk (the connection is closed)."""
        if self._task is not None and not self.aborted:
            self.aborted = True
            self._task.cancel()


# ---- connections that stop sending ------------------------------------------------------------------------


class _ReadDeadline:
    """The read deadline of one HTTP/1.1 connection of `_timed_protocol` (`protocol`: its uvicorn h11
    protocol, whose `loop`, `conn` and `transport` it reads): armed while the client owes the request's
    headers (one deadline for all of them) or its body (a deadline per pause); past it the connection is
    closed. A connection upgraded to a WebSocket has none (its protocol reads it)."""

    def __init__(self, protocol, read_timeout: float):
        import h11

        self._h11 = h11
        self.protocol, self.read_timeout = protocol, read_timeout
        self.upgraded = False
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        self.disarm()
        self._timer = self.protocol.loop.call_later(self.read_timeout, self._expired)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _owed(self) -> str | None:
        """What the client still owes of its request: "headers", "body", or None (it is in)."""
        state = self.protocol.conn.their_state
        if state is self._h11.IDLE:
            return "headers"
        return "body" if state is self._h11.SEND_BODY else None

    def _expired(self) -> None:
        self._timer = None
        what = self._owed()
        if what is not None and not self.protocol.transport.is_closing():
            log.debug(
                "closing an HTTP connection: no complete request %s within %g s", what, self.read_timeout
            )
            self.protocol.transport.close()  # (a handler reading the body sees the client leave)

    def after_data(self) -> None:
        """Bytes came in: a new deadline per pause of a body, the headers' one kept, none once the request
        is in (or the connection is a WebSocket's)."""
        what = None if self.upgraded else self._owed()
        if what == "body" or (what == "headers" and self._timer is None):
            self.arm()
        elif what is None:
            self.disarm()

    def after_response(self) -> None:
        """A response ended: the next request's deadline starts now."""
        if not self.protocol.transport.is_closing() and self._owed() is not None:
            self.arm()


def _timed_protocol(read_timeout: float):
    """uvicorn's h11 protocol with a read timeout, which uvicorn lacks (its `timeout_keep_alive` only runs
    between a response and the next request's first byte): a connection is closed when a request's
    headers are not complete `read_timeout` seconds after the connection opened or the previous response
    ended, or when its body goes that long without a byte (`_ReadDeadline`). Without it, a client that
    sends half a request holds its connection (and a file descriptor) forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _deadline: _ReadDeadline

        def connection_made(self, transport) -> None:
            self._deadline = _ReadDeadline(self, read_timeout)
            super().connection_made(transport)
            self._deadline.arm()

        def handle_websocket_upgrade(self, event) -> None:
            self._deadline.upgraded = True
            super().handle_websocket_upgrade(event)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._deadline.after_data()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._deadline.after_response()

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline.disarm()
            super().connection_lost(exc)

    return TimedH11Protocol


# ---- the app -------------------------------------------------------------------------------------------


class HTTPFront:
    """The HTTP front of a `TTSServer`: its engine loop, limits, metrics and replica state (`ReplicaState`:
    readiness, admission, the load signal). `start()` binds and serves uvicorn on the running asyncio loop;
    `stop()` ends it."""

    def __init__(
        self,
        loop: EngineThread,
        limits: ServiceLimits,
        metrics: ServiceMetrics,
        state: ReplicaState,
        access: Access | None = None,
    ):
        self.loop = loop
        self.access = access or Access()
        self.state = state
        self.bundle = loop.bundle
        self.limits = limits
        self.metrics = metrics
        self.max_body = body_limit(self.limits)
        self.created = int(time.time())
        self.app = self._build_app()
        self.port: int | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.active: set[_SynthesisResponse] = set()  # responses being sent

    def count(self, outcome: str) -> None:
        """Count one finished speech request in `tts_requests_total{outcome}` (shared with gRPC)."""
        self.metrics.requests.labels(outcome).inc()

    def log_call(
        self,
        call: CallLog,
        outcome: str,
        detail: str = "",
        finished: Finished | None = None,
        synthesis: _Synthesis | None = None,
    ) -> None:
        """The one log line of a finished speech request, as gRPC calls log theirs (`rpc=http`)."""
        call.outcome, call.detail = outcome, detail
        if synthesis is not None:
            call.first_audio = synthesis.t_first
            call.audio_seconds = synthesis.samples / self.bundle.codec.sample_rate
            call.frames = (
                finished.frames
                if finished is not None
                else synthesis.samples // self.bundle.codec.frame_length
            )
        log_call(call)

    def drop_connection(self, scope) -> bool:
        """Abort (not close: a client that stopped reading would keep a closing connection open while its
        unsent bytes wait) the connection serving the request of `scope`. Reaches into uvicorn's protocol
        objects (`server_state.connections`, `.cycle.scope`, `.transport`, as both of its HTTP/1.1
        implementations have them); returns False where they are not found."""
        state = getattr(self._uvicorn, "server_state", None)
        for connection in list(getattr(state, "connections", ())):
            cycle = getattr(connection, "cycle", None)
            transport = getattr(connection, "transport", None)
            if cycle is not None and getattr(cycle, "scope", None) is scope and transport is not None:
                transport.abort()
                return True
        return False

    # ---- serving ----

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0 = a free port) and serve; returns the bound port. Raises RuntimeError if
        the address cannot be bound."""
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the process owner (tts serve) handles SIGTERM/SIGINT for both fronts
                yield

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)  # inherited by connections
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            raise RuntimeError(f"cannot listen on {address} (HTTP): {exc.strerror or exc}") from exc
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.asgi(host),
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            ws="wsproto",  # the Fish Audio API's WebSockets (service/fish_api.py)
            # (a live session's start event may carry a reference clip: room for the largest one)
            ws_max_size=max(16 * 1024 * KiB, self.max_body + 64 * KiB),
            timeout_graceful_shutdown=5,
            timeout_keep_alive=5,
            limit_concurrency=self.limits.max_http_connections,
            http=_timed_protocol(self.limits.http_read_timeout),
            ssl_certfile=self.access.tls_cert,
            ssl_keyfile=self.access.tls_key,
        )
        self._uvicorn = Server(config)
        self._task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:  # start-up is a few loop iterations; fail fast if serve() raised
            if self._task.done():
                self._task.result()
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.005)
        return self.port

    def asgi(self, host: str):
        """The app as served on `host`: inside `AccessMiddleware` (keys, Origin, and the Host check when
        `host` is loopback) and, when origins are allowed (`Access.cors_origins`), Starlette's CORS
        middleware outermost, so preflights are answered and refusals carry CORS headers."""
        app: Any = AccessMiddleware(self.app, self.access, check_host=is_loopback(host))
        if self.access.cors_origins:
            from starlette.middleware.cors import CORSMiddleware

            app = CORSMiddleware(
                app,
                allow_origins=list(self.access.cors_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["Authorization", "Content-Type"],
                expose_headers=[
                    "X-Request-Id",
                    "X-Replica",
                    "X-Seed",
                    "X-Sample-Rate",
                    "X-Model",
                    "X-Text-Chunks",
                    "X-Warnings",
                    "X-Finish-Reason",
                    "X-Sample-Format",
                    "X-Channels",
                ],  # fmt: skip
            )
        return app

    async def stop(self) -> None:
        """Stop listening and close connections. Call it once the engine loop has stopped: responses whose
        job did not finish are cut at once (a client that stopped reading would otherwise hold them), the
        others get up to 5 s to send what is left. Idempotent."""
        if self._task is None:
            return
        assert self._uvicorn is not None  # set with _task, in start
        self._uvicorn.should_exit = True
        for response in list(self.active):
            if not response.synthesis.finished:
                response.abort()
        with contextlib.suppress(Exception):
            await self._task
        self._task = None

    # ---- routes ----

    def _build_app(self) -> FastAPI:
        """The FastAPI app: its error handlers, then every route (speech, voices, model and server state,
        the pages, Fish Audio's API)."""
        app = FastAPI(
            title="dualar-tts",
            summary="OpenAI-compatible text-to-speech over the dual-AR engine",
            version="1",
            redoc_url=None,
            docs_url=None,  # (FastAPI's loads Swagger UI from a CDN: /docs below works offline)
        )
        self._add_error_handlers(app)
        self._add_speech_routes(app)
        self._add_state_routes(app)
        self._add_pages(app)
        register_fish_api(app, self)  # Fish Audio's API: /v1/tts, /v1/tts/live, /model
        return app

    @staticmethod
    def _add_error_handlers(app: FastAPI) -> None:
        """FastAPI's own errors (unknown path, a body its validation refuses) as OpenAI-style errors."""

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException):
            return APIError(
                exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
            ).response()

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, exc: RequestValidationError):
            return APIError(400, str(exc)).response()

    def _add_speech_routes(self, app: FastAPI) -> None:
        """`POST /v1/audio/speech` and the voices: list, register, delete."""
        schema = {
            "content": {"application/json": {"schema": SpeechRequest.model_json_schema()}},
            "required": True,
        }

        @app.post(
            "/v1/audio/speech",
            openapi_extra={"requestBody": schema},
            response_class=Response,
            summary="Synthesize speech (OpenAI-compatible), streamed as it is generated",
        )
        async def speech(request: Request):
            return await self.speech(request)

        @app.get("/v1/audio/voices", summary="Voices: name, kind, transcript, seconds")
        async def voices():
            return {"voices": [self._voice_json(e) for e in self.loop.list_voices()]}

        @app.post(
            "/v1/audio/voices",
            status_code=201,
            summary="Register a voice from a clip and its transcript",
            responses={200: {"description": "Replaced the registered voice of that name (replace=true)"}},
        )
        async def add_voice(request: Request):
            return await self.add_voice(request)

        @app.delete("/v1/audio/voices/{name}", summary="Remove a registered voice")
        async def delete_voice(name: str):
            try:
                self.loop.delete_voice(name)
            except (VoiceNotFound, InvalidRequest) as exc:
                return api_error(with_field(exc, VOICE)).response()
            log.info("voice deleted name=%s", name)
            return {"deleted": name}

    def _add_state_routes(self, app: FastAPI) -> None:
        """The served model, health, load and metrics."""

        @app.get("/v1/models", summary="The served model")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id}", summary="One model")
        async def model(model_id: str):
            if model_id != self.bundle.name:
                raise StarletteHTTPException(404, f"unknown model {model_id!r} (served: {self.bundle.name})")
            return self._model_card()

        @app.get(
            "/health", summary="Readiness: 200 when warm, 503 while warming up, draining, failed or stopped"
        )
        async def health():
            ready, body = self.state.health()
            return JSONResponse(body, status_code=200 if ready else 503)

        @app.get("/load", summary="Load: requests in flight, running, waiting; KV blocks in use (always 200)")
        async def load():
            return JSONResponse(self.state.load(), headers={"Cache-Control": "no-cache"})

        @app.get("/metrics", summary="Prometheus metrics")
        async def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @staticmethod
    def _add_pages(app: FastAPI) -> None:
        """The playground (`/`, its scripts under /static), the API docs (`/docs`) and the icon."""

        @app.get("/", response_class=HTMLResponse, include_in_schema=False)
        async def playground():
            return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

        app.mount("/static", StaticFiles(directory=STATIC), name="static")  # the playground's scripts

        @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
        async def docs():
            return docs_page(app)

        @app.get("/docs/assets/{name}", include_in_schema=False)
        async def docs_asset(name: str):
            folder = swagger_assets()
            if folder is None or name not in SWAGGER_FILES:
                raise StarletteHTTPException(404, f"no docs asset {name!r}")
            media = "text/css" if name.endswith(".css") else "text/javascript"
            return Response((folder / name).read_bytes(), media_type=media)

        @app.get("/favicon.ico", include_in_schema=False)
        async def favicon():  # (an SVG: browsers take an icon by its Content-Type, whatever the name)
            return Response(
                (STATIC / "favicon.svg").read_bytes(),
                media_type="image/svg+xml",
                headers={"Cache-Control": "max-age=86400"},
            )

    def _voice_json(self, entry) -> dict:
        """A voice as `GET /v1/audio/voices` lists it: name, kind, transcript, seconds (frames / frame
        rate)."""
        return {
            "name": entry.name,
            "kind": entry.kind or "preset",
            "transcript": entry.voice.text,
            "seconds": round(entry.seconds(self.bundle.codec.frame_rate), 2),
        }

    def openai_voice(self, name: str) -> str | None:
        """The voice an OpenAI voice name (OPENAI_VOICES) means here: this server's voice of that name,
        else the model's OPENAI_VOICE_PRESETS entry, else the presets in name order by the name's position
        (modulo), else None (the model's default voice)."""
        entries = self.loop.list_voices()
        if any(e.name == name for e in entries):
            return name
        presets = [e.name for e in entries if (e.kind or "preset") == "preset"]
        table = OPENAI_VOICE_PRESETS.get(self.bundle.name, {})
        if table.get(name) in presets:
            return table[name]
        if not presets:
            return None
        return presets[OPENAI_VOICES.index(name) % len(presets)]

    def _model_card(self) -> dict:
        """OpenAI's model object, plus `max_input_bytes`: the longest `input` accepted (UTF-8 bytes)."""
        return {
            "id": self.bundle.name,
            "object": "model",
            "created": self.created,
            "owned_by": "dualar-tts",
            "max_input_bytes": self.limits.max_text_bytes,
        }

    # ---- POST /v1/audio/speech ----

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 once it is known to exceed the limit (before parsing). The rest of
        an oversized body is read and dropped first (up to DRAIN_BYTES more): most clients send their
        whole body before they read, and a server that answers and closes while bytes are still coming
        makes the kernel reset the connection, which loses the 413. Raises ClientDisconnect if the
        client leaves first."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            if int(declared) <= self.max_body + DRAIN_BYTES:
                await self._drain(request.stream(), 0)
            raise APIError(413, self._too_large(int(declared)), param=None, code="request_too_large")
        body = bytearray()
        stream = request.stream()
        async for part in stream:
            body += part
            if len(body) > self.max_body:
                size = await self._drain(stream, len(body))
                raise APIError(413, self._too_large(size, at_least=True), code="request_too_large")
        return bytes(body)

    async def _drain(self, stream: AsyncGenerator[bytes, None], size: int) -> int:
        """Read and drop the rest of a body (`size` bytes read so far) up to max_body + DRAIN_BYTES;
        returns the bytes read in all (past that bound: where it stopped)."""
        async for part in stream:
            size += len(part)
            if size > self.max_body + DRAIN_BYTES:
                break
        return size

    def _too_large(self, size: int, at_least: bool = False) -> str:
        what = f"at least {format_size(size)}" if at_least else format_size(size)
        return (
            f"request body is {what}; the limit is {format_size(self.max_body)} "
            f"(reference clips up to {format_size(self.limits.max_reference_bytes)} before base64)"
        )

    def _parse(self, body: bytes) -> SpeechRequest:
        try:
            # (json's own int() refuses numbers over 4,300 digits with a ValueError, and its parser
            # recurses once per nesting level: both are the client's error, not a 500)
            data = json.loads(body, parse_int=_json_int)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise APIError(400, "the request body's JSON nests too deeply") from exc
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        _check_unicode(data)
        try:
            return SpeechRequest.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            if err["loc"] == ("seed",):
                # pydantic's messages differ by how the value is wrong ("exceeded maximum size" for 1e30);
                # one line with the range, as the sampling checks word theirs ("top_p must be in ...").
                got = shorten(json.dumps(err["input"], default=str), 40)
                if isinstance(err["input"], _LongInt):
                    got = str(err["input"])
                raise APIError(
                    400, f"seed must be an integer in [-2**63, 2**63), got {got}", param="seed"
                ) from exc
            loc = ".".join(str(p) for p in err["loc"]) or "body"
            msg = err["msg"]
            if isinstance(err.get("input"), _LongInt):
                msg = f"{msg}, got {err['input']}"
            raise APIError(400, f"{loc}: {msg}", param=str(err["loc"][0]) if err["loc"] else None) from exc

    def _check_model(self, name: str | None) -> None:
        served = self.bundle.name
        if not name or name == served or name in OPENAI_MODEL_NAMES or name.startswith("gpt-4o-mini-tts-"):
            return
        raise APIError(
            404,
            f"unknown model {name!r} (this server serves {served!r})",
            param="model",
            code="model_not_found",
        )

    def _to_request(self, r: SpeechRequest) -> RuntimeRequest:
        """The body as the runtime's request (the rules are its own: `tts.runtime.request`); only what is
        HTTP's is checked here (instructions, base64)."""
        if r.instructions and r.instructions.strip():
            raise APIError(400, "instructions are not supported by this model", param="instructions")
        voice = r.voice.id if isinstance(r.voice, VoiceId) else r.voice
        if voice in OPENAI_VOICES:
            voice = self.openai_voice(voice)
        check_voice_source(voice or None, r.reference_audio is not None, r.reference_text is not None)
        reference = None
        if r.reference_audio is not None:
            encoded = r.reference_audio
            if encoded.startswith("data:") and "," in encoded:  # a data: URL, as browsers make them
                encoded = encoded.split(",", 1)[1]
            try:
                audio = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise APIError(
                    400, f"reference_audio is not valid base64: {exc}", param="reference_audio"
                ) from exc
            reference = ReferenceClip(audio, r.reference_text or "")
        sampling = Sampling(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=r.seed,
            max_new_frames=r.max_new_frames,
            min_new_frames=r.min_new_frames,
            repetition_penalty=r.repetition_penalty,
        )
        return RuntimeRequest(
            r.input,
            voice=None if reference is not None else (voice or None),
            reference=reference,
            sampling=sampling,
            normalize=r.normalize,
            request_id="http",  # request ids: http-N here, job-N from gRPC
        )

    def _prepare(self, request: RuntimeRequest, count_tokens: bool):
        """Plan the job (the same rules as gRPC's), and the text's prompt tokens when asked (worker
        thread)."""
        job = plan_job(self.loop.planner, request, self.limits.request_limits)
        tokens = 0
        if count_tokens:
            fmt = self.bundle.prompt_format
            tokens = sum(int(fmt.build(chunk, [], []).shape[0]) for chunk in job.chunks)
        return job, tokens

    async def add_voice(self, request: Request) -> Response:
        """`POST /v1/audio/voices` (multipart/form-data): `name`, `file` (a WAV, FLAC, MP3 or Ogg clip),
        `text` (its transcript), optional `replace` (true/false). The clip is checked like a request's
        reference clip,
        encoded on the codec stage and kept as a registered voice (persisted under the server's voices
        directory), the same registry gRPC's AddVoice fills. 201 with the voice (200 when it replaced one);
        400 / 409 (the name is taken) / 413 / 415 (not multipart/form-data) / 503 as OpenAI-style
        errors."""
        # Checked first: a JSON body would otherwise be read as an empty form ("the form needs a name").
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "multipart/form-data":
            return APIError(
                415, f"{VOICE_FORM}; got Content-Type {media_type or '(none)'}", code="unsupported_media_type"
            ).response()
        limit = self.limits.max_reference_bytes + 64 * 1024
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= limit + DRAIN_BYTES:  # (read first: see _read_body)
                with contextlib.suppress(ClientDisconnect):
                    await self._drain(request.stream(), 0)
            return APIError(
                413,
                f"the upload is {declared} bytes; the limit is {limit}",
                param="file",
                code="request_too_large",
            ).response()
        try:
            refusal = self.state.refusal()
            if refusal is not None:  # (before reading the body)
                raise refusal
            try:
                form = await request.form(max_files=1, max_fields=8)
            except Exception as exc:  # noqa: BLE001 - a broken body: the client's error
                raise APIError(
                    400, f"{VOICE_FORM}; the body is not valid multipart/form-data: {exc}"
                ) from exc
            name, text, upload = form.get("name"), form.get("text"), form.get("file")
            if not isinstance(name, str) or not name:
                raise APIError(400, "the form needs a voice `name`", param="name")
            if not isinstance(text, str) or not text.strip():
                raise APIError(400, "the form needs the clip's transcript as `text`", param="text")
            if upload is None or isinstance(upload, str):
                raise APIError(
                    400, "the form needs the clip as a `file` field (WAV, FLAC, MP3 or Ogg)", param="file"
                )
            replace = _form_flag(form.get("replace", "false"), "replace")
            # Errors name the form's fields (VOICE_FORM_FIELDS: the clip is `file`, the name `name`).
            entry = await register_voice(self, name, ReferenceClip(await upload.read(), text), replace)
        except APIError as exc:
            return exc.response()
        except VoiceExists:  # (the form field, in HTTP words)
            return APIError(
                409,
                f"a voice named {name!r} exists; to replace it send replace=true with the form, "
                f"or delete it first (DELETE /v1/audio/voices/{name})",
                param="name",
                code="already_exists",
            ).response()
        except (InvalidRequest, AudioError, LoopClosed) as exc:
            return api_error(exc, VOICE_FORM_FIELDS).response()
        log.info("voice added name=%s seconds=%.2f", entry.name, entry.seconds(self.bundle.codec.frame_rate))
        return JSONResponse(self._voice_json(entry), status_code=200 if entry.replaced else 201)

    async def speech(self, request: Request) -> Response:
        """`POST /v1/audio/speech`: read (size-limited), parse and validate the body, admit the job and wait
        for the engine thread to accept it; then a streaming response, or an OpenAI-style error (see the
        module docstring for the statuses)."""
        return await self.synthesize(request, self._openai_output)

    async def _openai_output(self, request: Request, call: CallLog) -> SpeechOutput:
        r = self._parse(await self._read_body(request))
        call.text_bytes = len(r.input.encode("utf-8", "replace"))
        self._check_model(r.model)
        return SpeechOutput(self._to_request(r), r.response_format, r.speed, r.stream_format)

    async def synthesize(
        self,
        request: Request,
        parse: Callable[[Request, CallLog], Awaitable[SpeechOutput]],
        names: dict[str, str] = HTTP_FIELDS,
        render: Callable[[APIError, dict[str, str] | None], Response] | None = None,
        accepts: str = "JSON (Content-Type: application/json)",
    ) -> Response:
        """Serve one synthesis request of any HTTP wire format: `parse(request, call)` reads the body into a
        `SpeechOutput` (raising APIError or a request error), then the job is admitted and its audio
        streamed as `speech` does. `names`: the wire's names of the request fields (errors' `param`);
        `render(error, headers)`: the error response (default: OpenAI-style JSON); `accepts`: the body
        types the wire takes (named in the 415 for a form or text body)."""
        respond = render or (lambda err, headers: err.response(headers))
        call = CallLog("http", time.monotonic())
        try:
            admitted = await self._admit(request, parse, call, accepts)
        except ClientDisconnect:
            # The client left before its body was complete (or the server closed a body that stopped
            # coming: `http_read_timeout`): not the server's error, and no one to answer.
            self.count("cancelled")
            self.log_call(call, "cancelled", "the client left before sending the whole body")
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - its status (a bug: 500 with its message)
            return respond(self._refused(exc, call, names), None)
        return await self._stream(request, admitted, call, names, respond)

    @staticmethod
    def _check_media_type(request: Request, accepts: str) -> None:
        """A browser sends a text/plain or form POST to any site without asking it first (no CORS
        preflight): refusing the types a form can send keeps other sites' pages out, whatever Origin.
        Raises APIError 415 naming what the wire `accepts`."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type in FORM_TYPES:
            raise APIError(
                415,
                f"the body must be {accepts}, got Content-Type {media_type}",
                code="unsupported_media_type",
            )

    async def _admit(
        self,
        request: Request,
        parse: Callable[[Request, CallLog], Awaitable[SpeechOutput]],
        call: CallLog,
        accepts: str,
    ) -> _Admitted:
        """Read and plan the request, submit its job and wait for the engine thread to start it. Raises
        what refuses it (APIError, a request error, a refusal, ClientDisconnect); a job already submitted is
        cancelled first (and counted `cancelled` when the request's task is)."""
        self._check_media_type(request, accepts)
        out = await parse(request, call)
        refusal = self.state.refusal()
        if refusal is not None:
            raise refusal
        job, input_tokens = await prepare_off_loop(
            self._prepare, out.request, out.stream_format == "sse", timeout=self.limits.max_prepare_seconds
        )
        call.voice = job.voice_kind
        stream = self.loop.submit(job, asyncio.get_running_loop())
        call.request_id = stream.request_id
        try:
            started = await stream.next()
            if isinstance(started, Failed):
                raise started.error
            assert isinstance(started, Started), started
            # A wav body is sent whole once the audio is complete, with its real RIFF and data sizes (a
            # streamed one could only say 0xFFFFFFFF, "27 hours", to a saved file's readers); pcm and sse
            # stream.
            encoder = AudioEncoder(
                FORMATS[out.response_format],
                self.bundle.codec.sample_rate,
                speed=out.speed,
                seekable=out.response_format == "wav" and out.stream_format == "audio",
            )
        except asyncio.CancelledError:
            stream.cancel()
            self.count("cancelled")
            self.log_call(call, "cancelled")
            raise
        except BaseException:
            stream.cancel()  # (a no-op once the job failed)
            raise
        return _Admitted(out, job.warnings, input_tokens, stream, started, encoder)

    def _refused(self, exc: Exception, call: CallLog, names: dict[str, str]) -> APIError:
        """The error answering a request refused before its job started (counted and logged): an APIError
        as it is, any other with the status of its outcome (`api_error`; a bug: 500, its traceback
        logged)."""
        if isinstance(exc, APIError):
            err = exc
        else:
            if not isinstance(exc, REQUEST_ERRORS):  # (RequestError among them: a TextError, ...)
                log.error("preparing an HTTP request failed", exc_info=exc)
            err = api_error(exc, names)
        self.count(err.outcome)
        self.log_call(call, err.outcome, err.message)
        return err

    async def _stream(
        self,
        request: Request,
        admitted: _Admitted,
        call: CallLog,
        names: dict[str, str],
        respond: Callable[[APIError, dict[str, str] | None], Response],
    ) -> Response:
        """The response of a started job: its status line waits for the first audio (or the end), so a job
        that fails or ends without audio before then gets an error status, not a 200 with an empty or cut
        body; then its audio streams (`_SynthesisResponse`)."""
        out = admitted.output
        synthesis = _Synthesis(self, admitted.stream, admitted.started, admitted.encoder, call, gain=out.gain)
        synthesis.input_tokens = admitted.input_tokens
        events = synthesis.events()
        try:
            first = await self._first_event(request, events)
        except ClientDisconnect:
            synthesis.close("cancelled")  # (counted and logged once, the job cancelled)
            await events.aclose()
            return Response(status_code=499)
        except BaseException:
            synthesis.close("cancelled")
            await events.aclose()
            raise
        if first[0] == "failed":
            synthesis.close()  # (already counted and logged)
            await events.aclose()
            failure = first[1]
            assert isinstance(failure, BaseException), failure
            err = failure if isinstance(failure, APIError) else api_error(failure, names)
            finished = synthesis.finished_event
            return respond(err, self._end_headers(finished, admitted.warnings) if finished else None)

        async def replayed():
            yield first
            async for item in events:
                yield item

        headers = self._stream_headers(admitted, synthesis)
        if out.stream_format == "sse":
            return _SynthesisResponse(
                synthesis, synthesis.sse_body(replayed()), media_type="text/event-stream", headers=headers
            )
        return _SynthesisResponse(
            synthesis,
            synthesis.audio_body(replayed()),
            media_type=admitted.encoder.media_type,
            headers=headers,
        )

    def _stream_headers(self, admitted: _Admitted, synthesis: _Synthesis) -> dict[str, str]:
        """The headers of a streamed response (see the module docstring)."""
        started, out = admitted.started, admitted.output
        headers = {
            "X-Request-Id": started.request_id,
            "X-Seed": str(started.seed),
            "X-Model": self.bundle.name,
            "X-Sample-Rate": str(admitted.encoder.output_rate),
            "X-Text-Chunks": str(started.text_chunks),
            "X-Replica": self.state.replica,
            "Cache-Control": "no-cache",
        }
        if synthesis.finished_event is not None:  # the whole result is known: as gRPC's StreamEnd says
            headers |= self._end_headers(synthesis.finished_event, admitted.warnings)
        elif admitted.warnings:
            headers["X-Warnings"] = _header_text(admitted.warnings)
        if out.response_format == "pcm":
            headers |= {"X-Sample-Format": "s16le", "X-Channels": "1"}
        if out.stream_format == "sse":
            headers["X-Accel-Buffering"] = "no"
        else:
            headers["Content-Disposition"] = (
                f'inline; filename="speech{FORMATS[out.response_format].extension}"'
            )
        return headers

    @staticmethod
    async def _first_event(request: Request, events) -> tuple[str, object]:
        """The first item of `events`; raises ClientDisconnect if the client leaves first (a job queued
        behind others must not keep its place for a client that is gone: the streaming response, which
        watches for that, has not started yet)."""

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        first = asyncio.ensure_future(events.__anext__())
        gone = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (first, gone):
                if not task.done():
                    task.cancel()
            await asyncio.gather(first, gone, return_exceptions=True)
        if first.done() and not first.cancelled():
            return first.result()
        raise ClientDisconnect()

    @staticmethod
    def _end_headers(finished: Finished, warnings: list[str]) -> dict[str, str]:
        """`X-Finish-Reason` and `X-Warnings` of a response whose job ended before its status line."""
        headers = {"X-Finish-Reason": finish_reason(finished)}
        every = list(dict.fromkeys([*warnings, *finished.warnings]))
        if every:
            headers["X-Warnings"] = _header_text(every)
        return headers
