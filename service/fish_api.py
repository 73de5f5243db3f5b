"""Fish Audio's API on the HTTP front, so that the official `fish-audio-sdk`
(`fishaudio.FishAudio(base_url=...)` and the older `fish_audio_sdk`) works unchanged against this server.
Translation only: Fish's wire format <-> the runtime's `SpeechRequest`, `EngineThread.open_session` and the
voice registry; the rules are the runtime's.

* `POST /v1/tts`: the body as MessagePack (`Content-Type: application/msgpack`, as the SDK sends it) or JSON:
  `text`, `references` (at most one `{audio: bytes, text}`; base64 in JSON), `reference_id` (a voice name),
  `format` (`wav`, `pcm`, `mp3`, `opus`), `sample_rate` (absent, or the format's rate: the model's, 48000 for
  opus), `mp3_bitrate` / `opus_bitrate` (Fish's values; the encoders' own bitrates are used), `chunk_length`
  (100-300, the text chunk size), `min_chunk_length`, `latency` (`normal` / `balanced`: both stream),
  `normalize`, `prosody` (`speed` 0.5-2: tempo; `volume` -20..20 dB: gain), `temperature`, `top_p`,
  `repetition_penalty`, `max_new_tokens` (frames per text chunk; capped at the model's budget),
  `condition_on_previous_chunks`, `early_stop_threshold`, `seed` (an extension). The `model` header may name
  any model: this server serves one. The response is the encoded audio, streamed as `/v1/audio/speech`'s.
* WebSocket `/v1/tts/live` (MessagePack binary frames; JSON text frames are read too), one session per socket:
  `{"event": "start", "request": <the /v1/tts body, text ignored>}` (its `references` clip, checked as
  `/v1/tts`'s, is encoded once and is the session's voice; the start event may be as large as a `/v1/tts`
  body, the others at most MAX_EVENT_BYTES), `{"event": "text", "text"}` ->
  `SessionStream.send`, `{"event": "flush"}` -> `flush`, `{"event": "stop"}` -> `close`; the server sends
  `{"event": "audio", "audio": <bytes>}` as audio is made (all of them together: one file of the format) and
  `{"event": "finish", "reason": "stop"}` once everything is spoken. A bad event (not MessagePack, no start
  first, an unknown event, text after stop, text over the session's pending limit, a bad start request) ends
  the session at once: `{"event": "finish", "reason": "error", "message": ...}`, then the socket is closed.
  A client that disconnects aborts its session (rows, KV and codec stream freed).
* `/v1/tts/live/with-timestamp`: the same; audio events also carry `content` (the chunk's text as read),
  `chunk_seq` (the session's chunk number), `chunk_audio_offset_sec` (where the chunk's audio starts on the
  session's clock), `time` (ms since the session opened) and `alignment`: null, or the chunk's latest snapshot
  `{"segments": [{text, start, end}], "audio_duration"}` (seconds from the chunk's start: add
  `chunk_audio_offset_sec` for the session's clock). A trailing audio event with empty audio carries a
  chunk's final snapshot.
* Voices ("models"): `GET /model` (`{total, items}`, `page_size`, `page_number`, `title` filter), `GET
  /model/{id}`, `POST /model` (multipart: `title` = the voice name, one `voices` file, its transcript in
  `texts`), `DELETE /model/{id}`, on the server's voice registry; a voice's `_id` is its name
  (`reference_id`).

Errors are `{"status": <code>, "message": ...}` JSON, with the statuses of `/v1/audio/speech` (400 names the
Fish field). Authentication is the app's (the routes live on the HTTP front's FastAPI app).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import datetime
import json
import logging
import time
from typing import Any, Literal

import msgpack
import numpy as np
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.websockets import WebSocketDisconnect

from service.common import SpeechOutput, error_message, outcome_of, prepare_off_loop, register_voice
from tts.audio.formats import FORMATS, AudioEncoder
from tts.runtime.planner import PreparedReference
from tts.runtime.request import (
    VOICE,
    ReferenceClip,
    Sampling,
    check_voice_source,
    prepare_session_voice,
)
from tts.runtime.request import SpeechRequest as RuntimeRequest
from tts.runtime.request_errors import InvalidField, with_field
from tts.runtime.sessions import (
    ChunkEnded,
    ChunkStarted,
    SessionAudio,
    SessionClosed,
    SessionEnded,
    WordTimings,
)
from tts.runtime.voices import VoiceExists, VoiceNotFound

log = logging.getLogger(__name__)

# Fish's names of the request fields (`tts.runtime.request.FIELDS`), in error messages.
FISH_FIELDS = {
    "text": "text",
    "voice": "reference_id",
    "reference.audio": "references",
    "reference.text": "references",
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.seed": "seed",
    "sampling.max_new_frames": "max_new_tokens",
    "sampling.repetition_penalty": "repetition_penalty",
}
# (status) of `service.common.outcome_of`'s outcomes, as `/v1/audio/speech` answers them.
STATUS = {
    "invalid_argument": 400,
    "not_found": 404,
    "already_exists": 409,
    "resource_exhausted": 429,
    "preempted": 429,
    "unavailable": 503,
    "deadline_exceeded": 504,
    "no_audio": 422,
}
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
# One WebSocket event after start (start may carry a reference clip: as large as a /v1/tts body).
MAX_EVENT_BYTES = 1024 * 1024


class FishReference(BaseModel):
    """One reference clip: its encoded bytes (base64 in JSON) and transcript."""

    audio: bytes | str
    text: str


class FishProsody(BaseModel):
    speed: float = Field(1.0, ge=0.5, le=2.0)
    volume: float = Field(0.0, ge=-20.0, le=20.0)


class FishTTSRequest(BaseModel):
    """Fish's TTS request (`fishaudio.types.TTSRequest`); fields newer SDKs add are ignored."""

    model_config = ConfigDict(extra="ignore")
    text: str = ""
    references: list[FishReference] | None = None
    reference_id: str | None = None
    format: Literal["wav", "pcm", "mp3", "opus"] = "mp3"
    sample_rate: int | None = None
    mp3_bitrate: Literal[64, 128, 192] | None = None
    opus_bitrate: Literal[-1000, 24, 32, 48, 64] | None = None
    chunk_length: int | None = Field(None, ge=100, le=300)
    min_chunk_length: int | None = Field(None, ge=0)
    latency: Literal["normal", "balanced"] | None = None
    normalize: bool | None = None
    prosody: FishProsody | None = None
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    condition_on_previous_chunks: bool | None = None
    early_stop_threshold: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)


class _Protocol(Exception):
    """A WebSocket session ends with `finish` reason `error` and this message."""


def fish_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Fish's error body: `{"status", "message"}` (the SDK reads `message`)."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return JSONResponse({"status": status, "message": message}, status_code=status, headers=headers)


def _status(exc: BaseException) -> int:
    return STATUS.get(outcome_of(exc), 500)


def decode_body(data: bytes, content_type: str) -> Any:
    """A request body or WebSocket frame as MessagePack or JSON. Raises InvalidField naming `body`."""
    try:
        if content_type in MSGPACK_TYPES:
            return msgpack.unpackb(data, raw=False)
        return json.loads(data)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, RecursionError) as exc:
        kind = "MessagePack" if content_type in MSGPACK_TYPES else "JSON"
        raise InvalidField("body", f"the body is not valid {kind}: {exc}") from exc


def parse_request(data: Any) -> FishTTSRequest:
    """Fish's request object, validated. Raises InvalidField naming the Fish field."""
    if not isinstance(data, dict):
        raise InvalidField("body", "the request must be an object")
    try:
        return FishTTSRequest.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        raise InvalidField(loc, f"{loc}: {err['msg']}") from exc


class FishAPI:
    """The Fish routes of one `HTTPFront` (`front`: its loop, limits, bundle, state, `synthesize`)."""

    def __init__(self, front):
        self.front = front
        self.bundle = front.bundle

    # ---- the request ----

    def output_rate(self, fmt: str) -> int:
        """The sample rate `fmt` is written at (a probe encoder, closed at once)."""
        probe = AudioEncoder(fmt, self.bundle.codec.sample_rate)
        try:
            return probe.output_rate
        finally:
            probe.close()

    def settings(self, r: FishTTSRequest) -> tuple[Sampling, ReferenceClip | None, str | None, float, float]:
        """(sampling, reference clip, voice name, speed, linear gain) of a request; raises InvalidField."""
        # (checked only where the client names a rate: the probe builds an encoder)
        if r.sample_rate is not None and r.sample_rate != (rate := self.output_rate(r.format)):
            raise InvalidField(
                "sample_rate", f"sample_rate {r.sample_rate} is not available for {r.format}: {rate} Hz only"
            )
        refs = r.references or []
        if len(refs) > 1:
            raise InvalidField("references", f"at most one reference clip is supported, got {len(refs)}")
        check_voice_source(r.reference_id or None, bool(refs))
        clip = None
        if refs:
            audio = refs[0].audio
            if isinstance(audio, str):
                try:
                    audio = base64.b64decode(audio, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise InvalidField(
                        "references", f"references.0.audio is not valid base64: {exc}"
                    ) from exc
            clip = ReferenceClip(audio, refs[0].text)
        max_frames = r.max_new_tokens
        if max_frames is not None and max_frames > 0:
            # The SDK always sends its default (1024): a budget over the model's is the model's budget.
            max_frames = min(max_frames, self.bundle.sampling.max_new_frames)
        sampling = Sampling(
            temperature=r.temperature,
            top_p=r.top_p,
            seed=r.seed,
            max_new_frames=max_frames,
            repetition_penalty=r.repetition_penalty,
        )
        prosody = r.prosody or FishProsody(speed=1.0, volume=0.0)
        return sampling, clip, r.reference_id or None, prosody.speed, 10 ** (prosody.volume / 20)

    async def tts_output(self, request: Request, call) -> SpeechOutput:
        """`POST /v1/tts`'s body -> the front's SpeechOutput (raises the front's APIError or InvalidField)."""
        body = await self.front._read_body(request)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        r = parse_request(decode_body(body, content_type))
        call.text_bytes = len(r.text.encode("utf-8", "replace"))
        sampling, clip, voice, speed, gain = self.settings(r)
        speech = RuntimeRequest(
            r.text,
            voice=voice,
            reference=clip,
            sampling=sampling,
            normalize=True if r.normalize is None else r.normalize,
            chunk_length=r.chunk_length,
            request_id="fish",
        )
        return SpeechOutput(speech, r.format, speed, "audio", gain)

    @staticmethod
    def render(err, headers: dict[str, str] | None) -> Response:
        return fish_error(err.status, err.message, headers)

    # ---- the WebSocket ----

    async def live(self, ws: WebSocket, timestamps: bool) -> None:
        """One session over `ws` (see the module docstring)."""
        await ws.accept()
        opened = None
        try:
            opened = await self._open(ws)
            if opened is not None:
                await self._serve(ws, *opened, timestamps)
        except WebSocketDisconnect:
            pass
        finally:
            if opened is not None:
                session, encoder, _ = opened
                session.abort()  # (a no-op once ended)
                encoder.close()
            with contextlib.suppress(Exception):
                await ws.close()

    async def session_reference(
        self, voice: str | None, clip: ReferenceClip | None
    ) -> PreparedReference | None:
        """A live session's reference clip checked and decoded as `/v1/tts`'s (`prepare_session_voice`) on a
        worker thread within `max_prepare_seconds` (None without a clip). Raises its request errors."""
        if clip is None:
            return None
        front = self.front
        limits = front.limits
        return await prepare_off_loop(
            prepare_session_voice,
            front.loop.planner,
            voice,
            clip,
            limits.request_limits,
            timeout=limits.max_prepare_seconds,
        )

    async def _open(self, ws: WebSocket) -> tuple[Any, AudioEncoder, float] | None:
        """The session the client's start event asks for, with its encoder and linear gain; None when it is
        refused (the client has its `finish` error)."""
        try:
            return await self._start(ws)
        except WebSocketDisconnect:  # gone before its start: no one to answer, nothing to log
            raise
        except _Protocol as exc:
            await self._finish_error(ws, str(exc))
        except Exception as exc:  # noqa: BLE001 - a request error (or a refusal): the client's answer
            if isinstance(exc, VoiceNotFound):
                exc = with_field(exc, VOICE)
            elif outcome_of(exc) == "error":
                log.exception("opening a Fish live session failed")
            await self._finish_error(ws, error_message(exc, FISH_FIELDS))
        return None

    async def _start(self, ws: WebSocket) -> tuple[Any, AudioEncoder, float]:
        """Read the start event and open its session: (session, encoder, linear gain). Raises _Protocol,
        a request error (naming the Fish field) or the server's refusal."""
        wait = self.front.limits.http_read_timeout  # (a socket without its start only holds a connection)
        try:
            start = await asyncio.wait_for(self._receive(ws, self.front.max_body), wait)  # (a /v1/tts body)
        except TimeoutError:
            raise _Protocol(f"no start event within {wait:g} s") from None
        if start.get("event") != "start":
            raise _Protocol(f"the first event must be start, got {start.get('event')!r}")
        r = parse_request(start.get("request"))
        sampling, clip, voice, speed, gain = self.settings(r)
        refusal = self.front.state.refusal()
        if refusal is not None:
            raise refusal
        reference = await self.session_reference(voice, clip)
        options = self.front.loop.session_options
        if r.chunk_length is not None:  # (Fish's chunk length bounds a session's chunks)
            options = dataclasses.replace(options, max_chunk_bytes=r.chunk_length)
        encoder = AudioEncoder(FORMATS[r.format], self.bundle.codec.sample_rate, speed=speed)
        try:
            session = self.front.loop.open_session(
                voice,
                reference=reference,
                aio_loop=asyncio.get_running_loop(),
                normalize=True if r.normalize is None else r.normalize,
                options=options,
                session_id="fish",
                **sampling.given(),
            )
        except BaseException:
            encoder.close()
            raise
        return session, encoder, gain

    async def _serve(self, ws: WebSocket, session, encoder: AudioEncoder, gain: float, stamps: bool) -> None:
        """Run an open session: client events in (`_read_events`), audio events out (`_write_events`),
        until everything is spoken and sent, or either side fails (the session is then aborted, and a bad
        client event or a failure of ours ends the socket with its `finish` error)."""
        reader = asyncio.ensure_future(self._read_events(ws, session))
        writer = asyncio.ensure_future(self._write_events(ws, session, encoder, gain, stamps))
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                if not task.done():
                    task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
        if writer.done() and not writer.cancelled() and writer.exception() is None:
            return  # finished: everything spoken and sent
        session.abort()
        failure = reader.exception() if reader.done() and not reader.cancelled() else None
        broke = writer.exception() if writer.done() and not writer.cancelled() else None
        if isinstance(failure, _Protocol):
            await self._finish_error(ws, str(failure))
        elif isinstance(broke, _ChunkFailed):
            log.info("a Fish live session ended: %s", broke)
            await self._finish_error(ws, str(broke))
        elif broke is not None and not isinstance(broke, WebSocketDisconnect | OSError):
            # (OSError: uvicorn's ClientDisconnected: the client left, no one to tell)
            log.warning("a Fish live session failed: %s", broke)
            await self._finish_error(ws, f"{type(broke).__name__}: {broke}")

    async def _receive(self, ws: WebSocket, limit: int = MAX_EVENT_BYTES) -> dict:
        """The next event (a dict) of at most `limit` bytes. Raises WebSocketDisconnect, _Protocol."""

        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data, text = message.get("bytes"), message.get("text")
        raw = data if data is not None else (text or "").encode()
        if len(raw) > limit:
            raise _Protocol(f"an event is {len(raw)} bytes; the limit is {limit}")
        try:
            event = decode_body(raw, MSGPACK_TYPES[0] if data is not None else "application/json")
        except InvalidField as exc:
            raise _Protocol(str(exc).replace("the body", "an event")) from exc
        if not isinstance(event, dict):
            raise _Protocol("an event must be a map with an `event` field")
        return event

    async def _read_events(self, ws: WebSocket, session) -> None:
        """Client events -> session commands, until the client leaves (returns) or errs (_Protocol)."""
        stopped = False
        while True:
            try:
                event = await self._receive(ws)
            except WebSocketDisconnect:
                return
            kind = event.get("event")
            if kind in ("text", "flush") and stopped:
                raise _Protocol(f"{kind} event after stop")
            if kind == "text":
                text = event.get("text")
                if not isinstance(text, str):
                    raise _Protocol("a text event needs `text` (a string)")
                try:
                    session.send(text)
                except SessionClosed as exc:
                    raise _Protocol(f"the session has ended: {exc}") from exc
                except Exception as exc:  # noqa: BLE001 - InvalidRequest: over the pending limit
                    raise _Protocol(f"text: {exc}") from exc
            elif kind == "flush":
                with contextlib.suppress(SessionClosed):
                    session.flush()
            elif kind == "stop":
                if stopped:
                    raise _Protocol("stop event after stop")
                stopped = True
                session.close()
            elif kind == "start":
                raise _Protocol("one session per socket: start was already sent")
            else:
                raise _Protocol(f"unknown event {kind!r} (expected text, flush or stop)")

    async def _write_events(
        self, ws: WebSocket, session, encoder: AudioEncoder, gain: float, stamps: bool
    ) -> None:
        """Session events -> audio events, then `finish`. Returns once finished."""
        writer = _LiveWriter(ws, encoder, gain, stamps, self.bundle.codec.sample_rate)
        while not await writer.write(await session.next()):
            pass

    @staticmethod
    async def _finish_error(ws: WebSocket, message: str) -> None:
        with contextlib.suppress(Exception):
            await ws.send_bytes(msgpack.packb({"event": "finish", "reason": "error", "message": message}))

    # ---- voices ----

    def voice_json(self, entry) -> dict:
        created = datetime.datetime.fromtimestamp(self.front.created, datetime.UTC).isoformat()
        return {
            "_id": entry.name,
            "type": "tts",
            "title": entry.name,
            "description": entry.kind or "preset",
            "cover_image": "",
            "train_mode": "fast",
            "state": "trained",
            "tags": [],
            "samples": [],
            "created_at": created,
            "updated_at": created,
            "languages": [],
            "visibility": "private",
            "lock_visibility": False,
            "like_count": 0,
            "mark_count": 0,
            "shared_count": 0,
            "task_count": 0,
            "author": {"_id": "local", "nickname": "local", "avatar": ""},
        }

    async def list_voices(self, request: Request) -> Response:
        q = request.query_params
        try:
            size = max(1, int(q.get("page_size", "10")))
            page = max(1, int(q.get("page_number", "1")))
        except ValueError:
            return fish_error(400, "page_size and page_number must be integers")
        title = q.get("title")
        entries = [e for e in self.front.loop.list_voices() if not title or title.lower() in e.name.lower()]
        items = [self.voice_json(e) for e in entries[(page - 1) * size : page * size]]
        return JSONResponse({"total": len(entries), "items": items})

    async def get_voice(self, voice_id: str) -> Response:
        for entry in self.front.loop.list_voices():
            if entry.name == voice_id:
                return JSONResponse(self.voice_json(entry))
        return fish_error(404, f"voice {voice_id!r} not found")

    async def create_voice(self, request: Request) -> Response:
        """`POST /model` (multipart): `title` (the voice's name and id), one `voices` file, `texts` (its
        transcript). 201 with the voice."""
        limit = self.front.limits.max_reference_bytes + 64 * 1024
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return fish_error(413, f"the upload is {declared} bytes; the limit is {limit}")
        try:
            form = await request.form(max_files=4, max_fields=32)
        except Exception as exc:  # noqa: BLE001 - a broken body: the client's error
            return fish_error(400, f"the body is not valid multipart/form-data: {exc}")
        title = form.get("title")
        files = [f for f in form.getlist("voices") if not isinstance(f, str)]
        texts = [t for t in form.getlist("texts") if isinstance(t, str) and t.strip()]
        if not isinstance(title, str) or not title:
            return fish_error(400, "title: the voice needs a title (its name)")
        if len(files) != 1:
            return fish_error(400, f"voices: exactly one audio file is supported, got {len(files)}")
        if len(texts) != 1:
            return fish_error(400, "texts: the clip's transcript is needed (one text)")
        names = {"voice": "title", "reference.audio": "voices", "reference.text": "texts"}
        try:
            clip = ReferenceClip(await files[0].read(), texts[0])
            entry = await register_voice(self.front, title, clip, False)
        except VoiceExists:
            return fish_error(
                409, f"a voice titled {title!r} exists; delete it first (DELETE /model/{title})"
            )
        except Exception as exc:  # noqa: BLE001 - InvalidRequest / AudioError / LoopClosed
            exc = with_field(exc, VOICE)
            status = _status(exc)
            if status == 500:
                raise
            return fish_error(status, error_message(exc, names))
        log.info("voice added (Fish API) name=%s", entry.name)
        return JSONResponse(self.voice_json(entry), status_code=201)

    async def delete_voice(self, voice_id: str) -> Response:
        try:
            self.front.loop.delete_voice(voice_id)
        except VoiceNotFound:
            return fish_error(404, f"voice {voice_id!r} not found")
        except Exception as exc:  # noqa: BLE001 - InvalidRequest: a preset
            if _status(exc) == 500:
                raise
            return fish_error(_status(exc), error_message(exc))
        log.info("voice deleted (Fish API) name=%s", voice_id)
        return JSONResponse({})


@dataclasses.dataclass
class _LiveChunk:
    """A session chunk as the timestamped socket reports it: its text, where its audio starts (samples on
    the session's clock), its words so far, whether the client has its latest alignment, and its audio's
    length (samples)."""

    text: str
    offset: int
    words: list = dataclasses.field(default_factory=list)
    sent: bool = True
    samples: int = 0


class _ChunkFailed(Exception):
    """A live session's text chunk failed (its text refused, the engine failed it): the socket ends
    with a `finish` error that says why."""


class _LiveWriter:
    """The audio events of one `/v1/tts/live` socket: a session's events encoded (one file of the format
    over all of them; `gain`: linear volume) and sent, with each chunk's text and alignment when `stamps`
    (the `with-timestamp` socket), then `finish`."""

    def __init__(self, ws: WebSocket, encoder: AudioEncoder, gain: float, stamps: bool, rate: int):
        self.ws, self.encoder, self.gain, self.stamps, self.rate = ws, encoder, gain, stamps, rate
        # Compressed formats (or a tempo change) encode on a worker thread, off the event loop.
        self.threaded = encoder.format.name not in ("pcm", "wav") or encoder.speed != 1.0
        self.opened = time.monotonic()
        self.chunks: dict[int, _LiveChunk] = {}
        self.last_chunk: int | None = None

    async def write(self, ev) -> bool:
        """Send what session event `ev` makes; True once the session ended (`finish` sent)."""
        if isinstance(ev, ChunkStarted):
            self.chunks[ev.chunk] = _LiveChunk(ev.text, ev.sample_offset)
            self.last_chunk = ev.chunk
        elif isinstance(ev, SessionAudio):
            await self._audio(ev)
        elif isinstance(ev, WordTimings):
            c = self.chunks.get(ev.chunk)
            if c is not None:
                c.words.extend(ev.words)
                c.sent = False
        elif isinstance(ev, ChunkEnded):
            c = self.chunks.get(ev.chunk)
            if self.stamps and c is not None and not c.sent:
                await self._send_audio(b"", ev.chunk)  # the chunk's final alignment
            if ev.reason == "error":  # (the protocol has no event for one chunk: the session ends)
                raise _ChunkFailed(f"a text chunk failed: {ev.error}")
        elif isinstance(ev, SessionEnded):
            await self._end(ev)
            return True
        return False

    async def _audio(self, ev: SessionAudio) -> None:
        c = self.chunks.get(ev.chunk)
        if c is not None:
            c.samples = ev.sample_offset + len(ev.samples) - c.offset
        data = await self._encode(ev.samples)
        if data or (self.stamps and c is not None and not c.sent):
            await self._send_audio(data, ev.chunk)

    async def _end(self, ev: SessionEnded) -> None:
        log.info(
            "Fish live session %s ended (%s): %.2f s of audio",
            ev.session_id,
            ev.reason,
            ev.audio_samples / self.rate,
        )
        tail = await self._encode(None)
        if tail:
            await self._send_audio(tail, self.last_chunk)
        if ev.reason == "closed":
            finish = {"event": "finish", "reason": "stop"}
        else:
            why = f": {ev.detail}" if ev.detail else ""
            finish = {"event": "finish", "reason": "error", "message": f"session {ev.reason}{why}"}
        await self.ws.send_bytes(msgpack.packb(finish))

    async def _encode(self, samples: np.ndarray | None) -> bytes:
        """`samples` encoded (None: the encoder's tail)."""
        encoder = self.encoder
        if samples is None:
            return await asyncio.to_thread(encoder.finish) if self.threaded else encoder.finish()
        if self.gain != 1.0:
            samples = np.clip(samples * self.gain, -1.0, 1.0).astype(np.float32)
        return await asyncio.to_thread(encoder.encode, samples) if self.threaded else encoder.encode(samples)

    async def _send_audio(self, data: bytes, chunk: int | None) -> None:
        event: dict[str, Any] = {"event": "audio", "audio": data}
        if self.stamps:
            event |= self._stamps(chunk)
        await self.ws.send_bytes(msgpack.packb(event, use_bin_type=True))

    def _stamps(self, chunk: int | None) -> dict[str, Any]:
        """A timestamped audio event's fields: the chunk's text, number and offset, the time, and the
        chunk's alignment when the client does not have its latest yet."""
        rate = self.rate
        stamps: dict[str, Any] = {
            "content": "",
            "alignment": None,
            "chunk_seq": chunk,
            "chunk_audio_offset_sec": None,
        }
        c = self.chunks.get(chunk) if chunk is not None else None
        if c is not None:
            stamps["content"] = c.text
            stamps["chunk_audio_offset_sec"] = c.offset / rate
            if not c.sent:
                c.sent = True
                stamps["alignment"] = {
                    "segments": [
                        {"text": w.text, "start": w.start - c.offset / rate, "end": w.end - c.offset / rate}
                        for w in c.words
                    ],
                    "audio_duration": c.samples / rate,
                }
        stamps["time"] = round((time.monotonic() - self.opened) * 1000)
        return stamps


def register(app: FastAPI, front) -> FishAPI:
    """Add Fish Audio's routes to the HTTP front's app (`front`: a `service.http.HTTPFront`)."""
    api = FishAPI(front)

    @app.post("/v1/tts", response_class=Response, summary="Fish Audio TTS (MessagePack or JSON body)")
    async def fish_tts(request: Request):
        return await front.synthesize(
            request,
            api.tts_output,
            FISH_FIELDS,
            api.render,
            accepts="MessagePack (application/msgpack) or JSON",
        )

    @app.websocket("/v1/tts/live")
    async def fish_live(ws: WebSocket):
        await api.live(ws, timestamps=False)

    @app.websocket("/v1/tts/live/with-timestamp")
    async def fish_live_stamped(ws: WebSocket):
        await api.live(ws, timestamps=True)

    @app.get("/model", summary="Fish Audio voices (models)")
    async def fish_voices(request: Request):
        return await api.list_voices(request)

    @app.get("/model/{voice_id}", summary="One Fish Audio voice")
    async def fish_voice(voice_id: str):
        return await api.get_voice(voice_id)

    @app.post("/model", status_code=201, summary="Create a Fish Audio voice from a clip and its transcript")
    async def fish_create_voice(request: Request):
        return await api.create_voice(request)

    @app.delete("/model/{voice_id}", summary="Delete a Fish Audio voice")
    async def fish_delete_voice(voice_id: str):
        return await api.delete_voice(voice_id)

    return api
