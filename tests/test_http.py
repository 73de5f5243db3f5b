"""The HTTP front end to end: a real TTSServer (gRPC + HTTP on ephemeral ports, tiny model) on 127.0.0.1,
real HTTP clients (http.client). Expected audio comes from the offline API with the same seed (seeded
requests give the same codes however they run); no assertion depends on what random weights generate
or on timing (waits are on states and counts)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.client
import io
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import time
import wave
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf

from service.client import build_request, channel_options
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from service.http import body_limit
from service.server import ServiceLimits
from tts.api import TTS
from tts.audio.files import read_audio, to_pcm16
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig
from tts.model.config import AlignerSpec
from tts.runtime.engine_thread import EngineThread

pytest.importorskip("fastapi")
av = pytest.importorskip("av")
from helpers import script_loop_guard  # noqa: E402
from service_helpers import HOLD_TEXT, ServerThread, engine_work, wait_idle  # noqa: E402

RATE = 16000  # the tiny model's codec
FRAME = 640  # samples per frame
# Extra samples a decoder may return beyond the audio, at the format's output rate (see
# tests/test_audio_formats.py): a streamed MP3 has no gapless header, ADTS AAC keeps its priming.
PADDING = {"mp3": 1105 + 576, "aac": 2 * 1024, "opus": 0, "flac": 0, "wav": 0, "pcm": 0}
MEDIA = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
}


class HTTPServerThread(ServerThread):
    """A ServerThread with its HTTP front on an ephemeral port (`self.port`)."""

    def __init__(self, bundle, engine_config=None, limits=None, metrics_port=None, wait_ready=True):
        super().__init__(bundle, engine_config, limits, metrics_port, wait_ready, http_port=0)

    def connect(self, rcvbuf: int | None = None) -> http.client.HTTPConnection:
        """A connection; `rcvbuf` shrinks the socket's receive buffer (so an unread response backs up)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        if rcvbuf is not None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.settimeout(60)
            sock.connect(("127.0.0.1", self.port))
            conn.sock = sock
        return conn

    def request(self, method: str, path: str, body=None, headers=None):
        """(status, headers, body bytes) of one request; a dict body is sent as JSON."""
        conn = self.connect()
        try:
            if isinstance(body, dict):
                body = json.dumps(body).encode()
                headers = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.headers, resp.read()
        finally:
            conn.close()

    def speech(self, **body):
        return self.request("POST", "/v1/audio/speech", body)

    def front_voice(self, name: str) -> str | None:
        """The voice the HTTP front takes an OpenAI voice name for."""
        assert self.server._http is not None
        return self.server._http.openai_voice(name)

    def open_speech(self, rcvbuf: int | None = None, **body):
        """Start a speech request and return (connection, response) once the status line arrived."""
        conn = self.connect(rcvbuf)
        conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
        return conn, conn.getresponse()


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """A response body -> (float32 samples, sample rate)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, RATE
    if fmt == "wav":
        audio, rate = sf.read(io.BytesIO(data), dtype="float32")
        return audio, rate
    container = av.open(io.BytesIO(data))
    frames = list(container.decode(audio=0))
    raw = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    scale = float(np.iinfo(raw.dtype).max) + 1 if raw.dtype.kind == "i" else 1.0
    return raw.astype(np.float32) / scale, frames[0].sample_rate


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0


def sse_events(data: bytes) -> list[dict]:
    events = []
    for block in data.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: ") :]))
    return events


def error_of(status, headers, body) -> tuple[int, dict]:
    assert headers["Content-Type"] == "application/json", (status, body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return status, err


def requests_total(server: HTTPServerThread, outcome: str) -> float:
    registry = server.server.metrics.registry
    return registry.get_sample_value("tts_requests_total", {"outcome": outcome}) or 0.0


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# Streams that cannot end by themselves while the client is not reading: the end token is held off for
# the whole budget (min_new_frames), whatever the random weights would do, and the texts are long
# enough for the runaway guard to allow the frames asked for.
LONG = dict(temperature=0.0, seed=4)


def held(frames: int) -> dict:
    return dict(input=HOLD_TEXT, max_new_frames=frames, min_new_frames=frames, **LONG)


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


@pytest.fixture(scope="module")
def server(bundle):
    limits = ServiceLimits(max_waiting=4, max_queued_chunks=2, max_reference_bytes=64 * 1024)
    srv = HTTPServerThread(bundle, EngineConfig(max_batch=8), limits, metrics_port=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(bundle):
    return TTS(bundle)


TEXT = "Hello there, this is a test of the HTTP front."


@pytest.fixture(scope="module")
def reference(offline):
    """The offline synthesis every format test compares with: same text, seed and budget."""
    return offline.synthesize(TEXT, seed=11, max_new_frames=30)


# ---- formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_each_format_decodes_to_the_synthesized_audio(server, reference, fmt):
    status, headers, body = server.speech(
        model="tiny", input=TEXT, seed=11, max_new_frames=30, response_format=fmt
    )
    assert status == 200, body
    assert headers["X-Seed"] == "11" and headers["X-Model"] == "tiny"
    assert headers["X-Request-Id"].startswith("http-")
    assert headers["Transfer-Encoding"] == "chunked"  # streamed as produced, no Content-Length
    rate = 48000 if fmt == "opus" else RATE
    assert headers["X-Sample-Rate"] == str(rate)
    if fmt == "pcm":
        assert headers["X-Sample-Format"] == "s16le" and headers["Content-Type"] == "audio/pcm"
        assert body == to_pcm16(reference.audio).astype("<i2").tobytes()  # exactly the synthesized audio
    else:
        assert headers["Content-Type"] == MEDIA[fmt]
    audio, decoded_rate = decode(body, fmt)
    assert decoded_rate == rate
    expected = len(reference.audio) * rate // RATE
    assert expected == reference.frames * FRAME * rate // RATE and reference.frames > 0
    assert expected <= len(audio) <= expected + PADDING[fmt] * rate // RATE, (len(audio), expected)
    if rms(reference.audio) > 0:  # not silence where the PCM is not
        assert rms(audio) > 0.25 * rms(reference.audio)
    if fmt in ("wav", "flac"):  # lossless (16-bit)
        np.testing.assert_allclose(audio[: len(reference.audio)], reference.audio, atol=1.5 / 32767)


def test_a_saved_wav_response_has_its_real_length(server, reference):
    """A `wav` body (stream_format audio) saved to a file says how long it is: the RIFF and data sizes are
    the real ones, not 0xFFFFFFFF (27 hours to `soxi` and Python's `wave`)."""
    status, headers, body = server.speech(
        model="tiny", input=TEXT, seed=11, max_new_frames=30, response_format="wav"
    )
    assert status == 200, body
    assert int.from_bytes(body[4:8], "little") == len(body) - 8
    with wave.open(io.BytesIO(body)) as w:
        assert w.getnframes() == len(reference.audio) and w.getframerate() == RATE
        assert len(w.readframes(w.getnframes())) == 2 * len(reference.audio)


def test_default_format_is_mp3_and_openai_model_names_are_accepted(server):
    status, headers, body = server.speech(
        model="tts-1", input="Hi there.", voice="alpha", seed=1, max_new_frames=5
    )
    assert status == 200 and headers["Content-Type"] == "audio/mpeg"
    assert len(decode(body, "mp3")[0]) >= 5 * FRAME
    # The OpenAI custom-voice form {"id": name} names a voice too; no model is fine.
    status, _, _ = server.speech(input="Hi.", voice={"id": "beta"}, seed=1, max_new_frames=3)
    assert status == 200


def test_each_http_request_logs_one_line_like_grpc(server, caplog):
    """A finished speech request, served or refused, logs the line gRPC calls log (`rpc=http`)."""
    caplog.set_level(logging.INFO, logger="service.calls")
    status, headers, _ = server.speech(input="Hi there.", voice="alpha", seed=1, max_new_frames=5)
    assert status == 200
    status, _, _ = server.speech(input="Hi.", voice="nobody")
    assert status == 404
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the ok line is written once the body has been sent
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request id=")]
        if len(lines) >= 2:
            break
        time.sleep(0.05)
    ok = [x for x in lines if f"id={headers['X-Request-Id']} " in x]
    assert len(ok) == 1 and "rpc=http" in ok[0] and "outcome=ok" in ok[0], lines
    assert "voice=preset:alpha" in ok[0] and "text_bytes=9" in ok[0] and " frames=" in ok[0]
    refused = [x for x in lines if "outcome=not_found" in x]
    assert len(refused) == 1 and "rpc=http" in refused[0] and "nobody" in refused[0], lines


def test_sse_done_event_says_loop_for_a_repetition_loop_left_in(bundle, monkeypatch):
    """A repeat the loop guard could not mend: the done event's finish_reason is "loop", with the
    warning."""
    script_loop_guard(monkeypatch, {k: (2, False) for k in range(6, 400, 6)})
    guarded = dataclasses.replace(bundle, aligner=AlignerSpec(1, (0, 3)))
    srv = HTTPServerThread(guarded, EngineConfig(max_batch=2, ignore_eos=True))
    try:
        # (a text long enough that its paced budget, tts.runtime.planner.PACE_BUDGET, is over 60 frames)
        text = "Hello, this is a text long enough for sixty frames."
        status, _, body = srv.speech(
            input=text, seed=1, max_new_frames=60, response_format="pcm", stream_format="sse"
        )
        done = sse_events(body)[-1]
        assert status == 200 and done["type"] == "speech.audio.done"
        assert done["finish_reason"] == "loop" and done["frames"] == 60  # (the frames kept)
        assert done["warnings"] == ["the text repeats words: the loop guard could not mend a repetition loop"]
    finally:
        srv.stop()


def test_sse_stream_carries_the_audio_and_a_done_event(server, reference):
    status, headers, body = server.speech(
        input=TEXT, seed=11, max_new_frames=30, response_format="pcm", stream_format="sse"
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(body)
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert pcm == to_pcm16(reference.audio).astype("<i2").tobytes()
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] == done["frames"] == reference.frames
    assert (
        usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    )
    assert done["audio_seconds"] == round(len(reference.audio) / RATE, 3)  # (to the millisecond)
    assert done["seed"] == 11 and done["request_id"] == headers["X-Request-Id"]
    assert done["finish_reason"] == ("length" if reference.finish_reasons[-1].value == "length" else "stop")
    # Deltas of a compressed format concatenate to one decodable file of the reported duration.
    status, _, body = server.speech(
        input=TEXT, seed=11, max_new_frames=30, response_format="mp3", stream_format="sse"
    )
    events = sse_events(body)
    mp3 = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    audio, _ = decode(mp3, "mp3")
    expected, ms = round(events[-1]["audio_seconds"] * RATE), RATE // 1000  # (reported to the ms)
    assert expected - ms <= len(audio) <= expected + ms + PADDING["mp3"]


def test_warnings_and_normalize_over_http(server, offline):
    warning = (
        "this model reads English only: 4 characters of Han text were left out "
        "(a multilingual model such as Fish Audio S2-Pro reads them)"
    )
    status, headers, body = server.speech(
        input="Hello 你好世界 world.",
        seed=2,
        max_new_frames=3,
        min_new_frames=3,  # (exactly 3 frames: no warning of a chunk cut by max_new_frames)
        response_format="pcm",
        stream_format="sse",
    )
    assert status == 200 and headers["X-Warnings"] == warning
    assert sse_events(body)[-1]["warnings"] == [warning]
    status, headers, _ = server.speech(
        input="Hello.", seed=2, max_new_frames=3, min_new_frames=3, response_format="pcm"
    )
    assert status == 200 and "X-Warnings" not in headers
    # normalize: false reads the Markdown as given (the tiny model reads bytes: the audio differs)
    kw = dict(seed=2, max_new_frames=4, min_new_frames=4, temperature=0.0)
    _, _, off = server.speech(input="**5** items", normalize=False, response_format="pcm", **kw)
    expected = offline.synthesize("**5** items", normalize=False, **kw).audio
    assert off == to_pcm16(expected).astype("<i2").tobytes()
    _, _, on = server.speech(input="**5** items", response_format="pcm", **kw)
    assert on != off


def test_speed_changes_the_duration(server, reference):
    for speed in (0.5, 2.0):
        status, headers, body = server.speech(
            input=TEXT, seed=11, max_new_frames=30, response_format="pcm", speed=speed
        )
        assert status == 200
        audio, _ = decode(body, "pcm")
        # atempo's output length is exact to within about one of its windows (~0.1 s).
        assert abs(len(audio) - len(reference.audio) / speed) <= 0.1 * RATE, (speed, len(audio))


def test_reference_audio_as_base64(server, offline):
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(8000) / 8000).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, tone, 8000, format="WAV", subtype="PCM_16")
    clip = base64.b64encode(buf.getvalue()).decode()
    status, _, body = server.speech(
        input="Hello.",
        reference_audio=clip,
        reference_text="A tone.",
        seed=3,
        max_new_frames=8,
        response_format="pcm",
    )
    assert status == 200
    samples, rate = read_audio(buf.getvalue())  # what the server decoded from the clip
    ref = offline.synthesize(
        "Hello.", voice=offline.reference_from_audio(samples, rate, "A tone."), seed=3, max_new_frames=8
    )
    assert body == to_pcm16(ref.audio).astype("<i2").tobytes()
    # A data: URL (what a browser's FileReader makes) is accepted too.
    status, _, _ = server.speech(
        input="Hello.",
        reference_audio="data:audio/wav;base64," + clip,
        reference_text="A tone.",
        seed=3,
        max_new_frames=2,
    )
    assert status == 200


# ---- errors --------------------------------------------------------------------------------------------


def test_bad_input_gets_openai_style_errors_before_any_work(server):
    wait_idle(server.loop)
    work = engine_work(server.loop)

    def speech_error(body, raw=False):
        status, headers, data = server.request(
            "POST",
            "/v1/audio/speech",
            body if raw else json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        return error_of(status, headers, data)

    status, err = speech_error({"input": ""})
    assert status == 400 and err["param"] == "input" and err["type"] == "invalid_request_error"
    assert err["message"] == "text has nothing to speak (empty, whitespace or punctuation only)"
    status, err = speech_error({"input": "Hi.", "top_p": 1.5})
    assert (status, err["param"], err["message"]) == (400, "top_p", "top_p must be in (0, 1], got 1.5")
    seed_range = "seed must be an integer in [-2**63, 2**63)"  # (a JSON number, as sent)
    for seed, shown in ((1e30, "1e+30"), (2**64, str(2**64)), (1.5, "1.5"), ("abc", '"abc"')):
        status, err = speech_error({"input": "Hi.", "seed": seed})
        assert (status, err["param"], err["message"]) == (400, "seed", f"{seed_range}, got {shown}")
    status, err = speech_error({"input": "Hi.", "repetition_penalty": 2.5})
    assert (status, err["param"]) == (400, "repetition_penalty") and "(0, 2)" in err["message"]
    status, err = speech_error({"input": "Hi.", "max_new_frames": 5000})
    assert status == 400 and "exceeds the context size 1024" in err["message"]
    status, err = speech_error({"input": "Hi.", "speed": 4.5})
    assert (status, err["param"]) == (400, "speed")
    # A value of the wrong JSON type is refused, never coerced (true is not a speed, "1" not a seed).
    JSON = {"Content-Type": "application/json"}
    wrong = [("speed", True), ("seed", "1"), ("seed", True), ("temperature", True), ("top_p", "0.5"),
             ("top_k", "5"), ("max_new_frames", True), ("repetition_penalty", "1.1"), ("normalize", "yes"),
             ("normalize", 1)]  # fmt: skip
    for field, value in wrong:
        status, err = speech_error({"input": "Hi.", field: value})
        assert (status, err["param"]) == (400, field), (field, value, err)
    status, err = speech_error({"input": "Hi.", "response_format": "ogg"})
    assert (status, err["param"]) == (400, "response_format")
    status, err = speech_error({"input": "Hi.", "temprature": 0.5})  # a typo is refused, not ignored
    assert (status, err["param"]) == (400, "temprature") and "not permitted" in err["message"]
    status, err = speech_error({"voice": "alpha"})
    assert (status, err["param"]) == (400, "input")
    status, err = speech_error({"input": "Hi.", "instructions": "Speak like a pirate."})
    assert (status, err["param"]) == (400, "instructions")
    status, err = speech_error(b'{"input": "Hi."', raw=True)
    assert status == 400 and "not valid JSON" in err["message"]
    status, err = speech_error({"input": "Hi.", "reference_audio": "not base64!", "reference_text": "x"})
    assert (status, err["param"]) == (400, "reference_audio")
    status, err = speech_error({"input": "Hi.", "reference_audio": base64.b64encode(b"\0" * 1000).decode()})
    assert (status, err["param"]) == (400, "reference_text")
    # Messages name the HTTP request's fields (input, reference_audio), not the gRPC message's.
    long_text = "a " * (server.server.limits.max_text_bytes // 2 + 1)
    status, err = speech_error({"input": long_text})
    assert (status, err["param"]) == (400, "input")
    assert (
        err["message"]
        == f"input is {len(long_text)} bytes; the limit is {server.server.limits.max_text_bytes}"
    )
    garbage = base64.b64encode(b"not audio at all" * 10).decode()
    status, err = speech_error({"input": "Hi.", "reference_audio": garbage, "reference_text": "x"})
    assert (status, err["param"]) == (400, "reference_audio")
    assert err["message"].startswith("cannot read reference audio (reference_audio: WAV, FLAC, MP3 or Ogg): ")
    big = base64.b64encode(b"\0" * 70_000).decode()  # over the 64 KiB reference limit, under the body limit
    status, err = speech_error({"input": "Hi.", "reference_audio": big, "reference_text": "x"})
    assert status == 400 and "the limit is 64.0 KiB" in err["message"]
    status, err = speech_error({"input": "Hi.", "voice": "nobody"})
    assert (status, err["param"], err["code"]) == (404, "voice", "voice_not_found")
    assert err["message"] == "unknown voice 'nobody' (available: alpha, beta)"
    status, err = speech_error({"input": "Hi.", "model": "whisper-1"})
    assert (status, err["param"], err["code"]) == (404, "model", "model_not_found")
    assert error_of(*server.request("GET", "/v1/nothing"))[0] == 404
    assert engine_work(server.loop) == work  # nothing reached the engine
    body = {"input": "Hi.", "speed": 2, "temperature": 1, "response_format": "pcm"}  # (integers are numbers)
    status, _, _ = server.request("POST", "/v1/audio/speech", json.dumps(body).encode(), JSON)
    assert status == 200
    wait_idle(server.loop)


def test_body_over_the_limit_is_413_before_parsing(server):
    limit = body_limit(server.server.limits)
    status, err = error_of(*server.request("POST", "/v1/audio/speech", b"x" * (limit + 1)))
    assert status == 413 and err["code"] == "request_too_large" and "the limit is" in err["message"]
    # Without a Content-Length (chunked upload): refused once the limit is passed.
    conn = server.connect()
    conn.putrequest("POST", "/v1/audio/speech")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    piece = b"y" * 65536
    try:
        for _ in range(limit // len(piece) + 2):
            conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before reading it all
    resp = conn.getresponse()
    status, err = error_of(resp.status, resp.headers, resp.read())
    assert status == 413 and err["message"].startswith("request body is at least")
    conn.close()


def test_admission_limit_is_shared_with_grpc_and_full_means_429(bundle):
    srv = HTTPServerThread(
        bundle, EngineConfig(max_batch=1), ServiceLimits(max_waiting=1, max_queued_chunks=2)
    )
    try:
        # HTTP: decoding, then paused by its unread response (it keeps its row, so it cannot end).
        conn, resp = srv.open_speech(rcvbuf=4096, response_format="pcm", **held(600))
        assert resp.status == 200
        wait_for(lambda: srv.loop.stats.paused == 1, "the request to pause")
        # gRPC: queued behind it (1 decoding + 1 waiting = full).
        channel = grpc.insecure_channel(f"127.0.0.1:{srv.server.port}", options=channel_options())
        call = pb_grpc.TextToSpeechStub(channel).Synthesize(
            build_request(HOLD_TEXT, max_new_frames=600, min_new_frames=600, **LONG)
        )
        assert next(call).WhichOneof("message") == "header"
        status, headers, body = srv.speech(input="One too many.")
        status, err = error_of(status, headers, body)
        assert status == 429 and headers["Retry-After"] == "1" and err["code"] == "server_at_capacity"
        assert "server is at capacity: 2 requests in flight (1 decoding + 1 queued)" in err["message"]
        with pytest.raises(grpc.RpcError) as info:
            next(pb_grpc.TextToSpeechStub(channel).Synthesize(build_request("Also too many.")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        call.cancel()
        conn.close()
        wait_idle(srv.loop)
        assert srv.speech(input="Now there is room.", seed=1, max_new_frames=4)[0] == 200
        channel.close()
    finally:
        srv.stop()


def test_client_disconnect_cancels_the_generation_and_frees_its_blocks(server):
    """A client that reads a little and closes its socket: the job is cancelled and everything freed."""
    wait_idle(server.loop)
    before = requests_total(server, "cancelled")
    for stream_format in ("audio", "sse"):
        conn, resp = server.open_speech(
            rcvbuf=4096,
            response_format="pcm",
            stream_format=stream_format,
            **held(600),
        )
        assert resp.status == 200
        assert resp.read1(100)  # some audio arrived
        # The unread response backs up (socket buffers, then max_queued_chunks): the job pauses, in flight.
        wait_for(lambda: server.loop.stats.paused == 1, "the request to pause")
        assert server.loop.in_flight == 1 and server.loop.engine.kv_usage()[0] > 0
        resp.close()  # the client goes away: its socket closes (unread data: the kernel sends a reset)
        conn.close()
        wait_idle(server.loop)  # job ended, no engine request, KV blocks and batch row free
    wait_for(lambda: requests_total(server, "cancelled") == before + 2, "the cancellations to be counted")


# ---- health, models, voices, metrics, playground -------------------------------------------------------


def test_models_voices_metrics_and_playground(server):
    status, _, body = server.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
    assert server.request("GET", "/v1/models/tiny")[0] == 200
    assert error_of(*server.request("GET", "/v1/models/tts-2"))[0] == 404
    status, _, body = server.request("GET", "/v1/audio/voices")
    voices = json.loads(body)["voices"]
    assert [(v["name"], v["kind"]) for v in voices] == [("alpha", "preset"), ("beta", "preset")]
    assert voices[0]["transcript"] and voices[0]["seconds"] > 0
    assert all(v["seconds"] == round(v["seconds"], 2) for v in voices)  # centiseconds, not float32 noise
    assert server.request("GET", "/health")[:1] == (200,)
    assert json.loads(server.request("GET", "/health")[2]) == {"status": "serving"}
    assert server.speech(input="Count me.", seed=1, max_new_frames=2)[0] == 200  # an HTTP request counts
    status, headers, body = server.request("GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("tts_frames_generated_total", "tts_kv_blocks_used", 'tts_requests_total{outcome="ok"}'):
        assert name in text, name
    # The separate metrics port keeps working, with the same registry.
    import urllib.request

    other = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10)
    assert 'tts_requests_total{outcome="ok"}' in other.read().decode()
    status, headers, body = server.request("GET", "/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    for ref in ("/v1/audio/speech", "/v1/audio/voices", "/v1/models", "X-Sample-Rate"):
        assert ref in page, ref
    status, headers, body = server.request("GET", "/favicon.ico")
    assert status == 200 and headers["Content-Type"] == "image/svg+xml" and body.startswith(b"<svg")
    card = json.loads(server.request("GET", "/v1/models/tiny")[2])
    assert card["max_input_bytes"] == server.server.limits.max_text_bytes


def test_health_is_503_while_warming_up_and_while_draining(bundle, monkeypatch, offline):
    release = threading.Event()
    original = EngineThread._run_warmup

    def slow_warmup(self):
        assert release.wait(60)
        original(self)

    monkeypatch.setattr(EngineThread, "_run_warmup", slow_warmup)
    srv = HTTPServerThread(
        bundle, EngineConfig(max_batch=2), ServiceLimits(max_queued_chunks=2), wait_ready=False
    )
    try:
        status, _, body = srv.request("GET", "/health")
        assert (status, json.loads(body)) == (503, {"status": "warming_up"})
        status, err = error_of(*srv.speech(input="Too early."))
        assert status == 503 and "warming up" in err["message"]
        release.set()
        srv.call(srv.server.wait_ready(60))
        assert srv.request("GET", "/health")[0] == 200
        # Draining: an open (paused) stream keeps the server in its grace period; meanwhile health is 503
        # and new requests are refused; the open stream then runs to its end.
        conn, resp = srv.open_speech(rcvbuf=4096, response_format="pcm", **held(600))
        assert resp.status == 200
        wait_for(lambda: srv.loop.stats.paused == 1, "the request to pause")
        stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(60.0), srv.aio_loop)
        wait_for(lambda: srv.server.state == "draining", "draining")
        status, _, body = srv.request("GET", "/health")
        assert (status, json.loads(body)) == (503, {"status": "draining"})
        status, err = error_of(*srv.speech(input="Too late."))
        assert status == 503 and "shutting down" in err["message"]
        audio = np.frombuffer(resp.read(), "<i2")  # reads on: the job resumes and finishes
        ref = offline.synthesize(HOLD_TEXT, max_new_frames=600, min_new_frames=600, **LONG)
        assert np.array_equal(audio, to_pcm16(ref.audio))
        conn.close()
        stopping.result(60)
        assert srv.server.state == "stopped" and srv.loop.engine.kv_usage()[0] == 0
    finally:
        release.set()
        srv.stop()


def test_shutdown_past_the_grace_cuts_an_open_stream(bundle):
    """A stream still open when the grace period ends: its job ends, the server stops at once, and the
    client gets an incomplete chunked body (an error), never what looks like a complete short file."""
    srv = HTTPServerThread(bundle, EngineConfig(max_batch=2), ServiceLimits(max_queued_chunks=2))
    try:
        conn, resp = srv.open_speech(rcvbuf=4096, response_format="pcm", **held(600))
        assert resp.status == 200
        wait_for(lambda: srv.loop.stats.paused == 1, "the request to pause")
        before = requests_total(srv, "unavailable")
        srv.stop(grace=0.0)  # returns once the engine thread and both fronts have stopped
        assert not srv.loop.alive and srv.loop.engine.kv_usage()[0] == 0
        assert requests_total(srv, "unavailable") == before + 1
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            resp.read()
        conn.close()
    finally:
        srv.stop()


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the playground's script")
def test_playground_script_lists_voices_and_plays_a_stream(server, offline, tmp_path):
    """The page's own JavaScript, run by node against the server with a stub DOM and Web Audio: it fills
    the voice list, streams PCM into the audio graph and reports the request."""
    page = (Path(__file__).resolve().parent.parent / "service" / "static" / "index.html").read_text()
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    harness = tmp_path / "harness.mjs"
    harness.write_text(
        STUB_DOM.replace("__BASE_URL__", f"http://127.0.0.1:{server.port}") + script + PLAYGROUND_RUN,
        encoding="utf-8",
    )
    r = subprocess.run(["node", str(harness)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["voices"] == ["alpha", "beta"] and result["model"] == "tiny"
    assert result["error"] == "" and result["status"].startswith("done in"), result
    ref = offline.synthesize(
        "Hello from the playground.", voice="beta", seed=5, max_new_frames=12, temperature=0.0
    )
    assert result["scheduled_samples"] == len(ref.audio) > 0  # every streamed sample reached the audio graph


STUB_DOM = r"""
const BASE = "__BASE_URL__";
const realFetch = globalThis.fetch;
globalThis.fetch = (url, init) => realFetch(BASE + url, init);
const elements = {};
class El {
  constructor(id) { this.id = id; this.textContent = ""; this.value = ""; this.checked = false; this.hidden = false;
    this.disabled = false; this.children = []; this.listeners = {}; }
  append(child) { this.children.push(child); }
  addEventListener(kind, fn) { this.listeners[kind] = fn; }
  play() { return Promise.resolve(); }
  pause() {}
  load() {}
  removeAttribute() {}
}
globalThis.document = {
  getElementById: (id) => (elements[id] ??= new El(id)),
  createElement: () => new El("option"),
};
globalThis.URL.createObjectURL = () => "blob:stub";
let scheduledSamples = 0;
globalThis.AudioContext = class {
  constructor(opts) { this.sampleRate = opts.sampleRate; this.currentTime = 0; this.destination = {}; }
  createBuffer(ch, n, rate) { const d = new Float32Array(n); return { duration: n / rate, getChannelData: () => d }; }
  createBufferSource() { return { connect() {}, start() {}, set buffer(b) { scheduledSamples += b.getChannelData(0).length; } }; }
  close() {}
};
"""  # noqa: E501 (JavaScript stubs run by node, kept on the lines the browser code would have)

PLAYGROUND_RUN = r"""
while (!$("voice").children.length && !$("error").textContent) await new Promise((r) => setTimeout(r, 10));  // the page's loadInfo()
$("text").value = "Hello from the playground.";
$("stream").checked = true;
$("speed").value = "1";
$("seed").value = "5";
$("voice").value = "beta";
$("format").value = "mp3";
// The test's budget: a fixed frame count (an extension field the page does not send itself).
const send = globalThis.fetch;
globalThis.fetch = (url, init) => {
  if (init && init.body) { const b = JSON.parse(init.body); b.max_new_frames = 12; b.temperature = 0; init.body = JSON.stringify(b); }
  return send(url, init);
};
await speak();
console.log(JSON.stringify({
  voices: $("voice").children.map((o) => o.value),
  status: $("status").textContent, error: $("error").textContent,
  scheduled_samples: scheduledSamples, model: $("model").textContent,
}));
"""  # noqa: E501 (see STUB_DOM)


def multipart(fields: dict[str, str], file: bytes, filename: str = "clip.wav") -> tuple[bytes, dict]:
    """A multipart/form-data body with text `fields` and one `file` part."""
    boundary = "tts-test-boundary-7d1c"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + file
        + b"\r\n"
    )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def test_voice_upload_use_and_delete(server):
    """POST a clip and transcript -> a registered voice (201), listed with kind 'registered', usable by
    name in /v1/audio/speech; the same name again is 409; DELETE removes it (then 404); presets stay."""
    t = np.arange(16000) / 16000
    clip = io.BytesIO()
    sf.write(
        clip, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV", subtype="PCM_16"
    )
    body, headers = multipart({"name": "uploaded", "text": "A tone."}, clip.getvalue())
    status, _, reply = server.request("POST", "/v1/audio/voices", body, headers)
    assert status == 201, reply
    voice = json.loads(reply)
    assert (voice["name"], voice["kind"], voice["transcript"]) == ("uploaded", "registered", "A tone.")
    assert voice["seconds"] == pytest.approx(1.0)
    listed = json.loads(server.request("GET", "/v1/audio/voices")[2])["voices"]
    assert {"name": "uploaded", "kind": "registered"}.items() <= listed[-1].items()
    status, _, audio = server.speech(
        input="Hello.", voice="uploaded", seed=1, max_new_frames=4, response_format="pcm"
    )
    assert status == 200 and len(audio) > 0
    status, err = error_of(*server.request("POST", "/v1/audio/voices", body, headers))
    assert status == 409 and err["code"] == "already_exists"
    assert server.request("DELETE", "/v1/audio/voices/uploaded")[0] == 200
    status, err = error_of(*server.request("DELETE", "/v1/audio/voices/uploaded"))
    assert status == 404
    status, err = error_of(*server.request("DELETE", "/v1/audio/voices/alpha"))
    assert status == 400 and "preset" in err["message"]
    bad, bad_headers = multipart({"name": "x", "text": "y"}, b"not audio at all")
    status, err = error_of(*server.request("POST", "/v1/audio/voices", bad, bad_headers))
    assert status == 400 and "cannot read reference audio" in err["message"]


def tone_wav(seconds: float = 1.0) -> bytes:
    t = np.arange(int(16000 * seconds)) / 16000
    clip = io.BytesIO()
    sf.write(
        clip, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, format="WAV", subtype="PCM_16"
    )
    return clip.getvalue()


def test_voice_upload_errors_name_the_form_fields(server):
    """An upload's errors name the documented form field at fault (`name`, `file`, `text`), not the
    speech body's `reference_audio`."""

    def upload_error(fields: dict[str, str], file: bytes) -> tuple[int, dict]:
        return error_of(*server.request("POST", "/v1/audio/voices", *multipart(fields, file)))

    status, err = upload_error({"name": "x", "text": "y"}, b"not audio at all")
    assert (status, err["param"]) == (400, "file")
    assert err["message"].startswith("cannot read reference audio (file: WAV, FLAC, MP3 or Ogg): ")
    status, err = upload_error({"name": "x", "text": "y"}, b"")
    assert (status, err["param"], err["message"]) == (400, "file", "reference audio is empty")
    # Over the 64 KiB reference limit, under the upload limit (reference limit + 64 KiB).
    status, err = upload_error({"name": "x", "text": "y"}, b"\0" * 70_000)
    assert (status, err["param"]) == (400, "file") and "the limit is 64.0 KiB" in err["message"]
    status, err = upload_error({"name": "bad name!", "text": "y"}, tone_wav())
    assert (status, err["param"]) == (400, "name") and "is not valid" in err["message"]
    status, err = upload_error({"name": "alpha", "text": "y"}, tone_wav())
    assert (status, err["param"]) == (400, "name") and "preset" in err["message"]
    status, err = upload_error({"name": "x"}, tone_wav())
    assert (status, err["param"]) == (400, "text")


def test_a_taken_voice_name_is_409_saying_how_to_replace_it_over_http(server):
    """The 409 tells an HTTP client the HTTP way to replace the voice (not the CLI's --replace)."""
    body, headers = multipart({"name": "taken", "text": "A tone."}, tone_wav())
    assert server.request("POST", "/v1/audio/voices", body, headers)[0] == 201
    try:
        status, err = error_of(*server.request("POST", "/v1/audio/voices", body, headers))
        assert (status, err["param"], err["code"]) == (409, "name", "already_exists")
        assert err["message"] == (
            "a voice named 'taken' exists; to replace it send replace=true with the form, "
            "or delete it first (DELETE /v1/audio/voices/taken)"
        )
        body, headers = multipart({"name": "taken", "text": "Again.", "replace": "maybe"}, tone_wav())
        status, err = error_of(*server.request("POST", "/v1/audio/voices", body, headers))
        assert (status, err["param"]) == (400, "replace") and "'maybe'" in err["message"]
        # Replaced: 200 OK (201 Created is for a new voice).
        body, headers = multipart({"name": "taken", "text": "Again.", "replace": "true"}, tone_wav())
        status, _, reply = server.request("POST", "/v1/audio/voices", body, headers)
        assert status == 200 and json.loads(reply)["transcript"] == "Again."
    finally:
        server.request("DELETE", "/v1/audio/voices/taken")


def test_a_voice_upload_that_is_not_multipart_is_415_naming_the_form_fields(server):
    """A JSON (or url-encoded, or untyped) body gets one line saying what the endpoint takes, not a
    complaint about a missing field of a form it never sent."""
    expected = (
        "POST /v1/audio/voices takes multipart/form-data with the fields name, file (a WAV, FLAC, MP3 or "
        "Ogg clip), text (its transcript) and optionally replace=true; got Content-Type {}"
    )
    status, err = error_of(*server.request("POST", "/v1/audio/voices", {"name": "x", "text": "y"}))
    assert (status, err["code"], err["message"]) == (
        415,
        "unsupported_media_type",
        expected.format("application/json"),
    )
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, err = error_of(*server.request("POST", "/v1/audio/voices", b"name=x&text=y", form))
    assert (status, err["message"]) == (415, expected.format("application/x-www-form-urlencoded"))
    status, err = error_of(*server.request("POST", "/v1/audio/voices", b"name=x"))
    assert (status, err["message"]) == (415, expected.format("(none)"))


def external_references(page: str) -> list[str]:
    """Every absolute or protocol-relative URL in a page (a browser offline could not load them)."""
    return re.findall(r"""(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}[^\s'"<>)]*""", page)


def test_docs_load_nothing_from_another_host(server, monkeypatch, tmp_path):
    """FastAPI's own /docs loads Swagger UI from a CDN (blank offline): ours serves it from the installed
    package, or lists the operations and links the schema when it is not installed."""
    import service.http

    monkeypatch.setattr(service.http, "swagger_assets", lambda: None)
    status, headers, body = server.request("GET", "/docs")
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert external_references(page) == [], external_references(page)
    assert "/openapi.json" in page and "/v1/audio/speech" in page
    assert server.request("GET", "/openapi.json")[0] == 200
    for name in service.http.SWAGGER_FILES:
        (tmp_path / name).write_text(f"/* {name} */", encoding="utf-8")
    monkeypatch.setattr(service.http, "swagger_assets", lambda: tmp_path)
    status, _, body = server.request("GET", "/docs")
    page = body.decode()
    assert status == 200 and external_references(page) == [], external_references(page)
    for name in service.http.SWAGGER_FILES:
        assert f"/docs/assets/{name}" in page
        status, _, asset = server.request("GET", f"/docs/assets/{name}")
        assert status == 200 and asset == f"/* {name} */".encode()
    assert server.request("GET", "/docs/assets/index.html")[0] == 404


def test_openai_voice_names_mean_presets(server):
    """Tools that hard-code OpenAI's voices get a preset, not a 404: the tiny model's presets in name order
    (alpha, beta) by the name's position in OpenAI's list; a voice of this server by that name wins."""
    from service.http import OPENAI_VOICES

    kw = dict(
        input="Hello.", seed=3, max_new_frames=4, min_new_frames=4, temperature=0.0, response_format="pcm"
    )
    alpha = server.speech(voice="alpha", **kw)[2]
    beta = server.speech(voice="beta", **kw)[2]
    assert alpha != beta
    for name, preset in (("alloy", alpha), ("ash", beta), ("coral", beta), ("verse", alpha)):
        status, _, audio = server.speech(voice=name, **kw)
        assert status == 200 and audio == preset, name
    assert server.front_voice("shimmer") == ["alpha", "beta"][OPENAI_VOICES.index("shimmer") % 2]
    body, headers = multipart({"name": "nova", "text": "A tone."}, tone_wav())
    assert server.request("POST", "/v1/audio/voices", body, headers)[0] == 201
    try:
        assert server.front_voice("nova") == "nova"
    finally:
        assert server.request("DELETE", "/v1/audio/voices/nova")[0] == 200


def test_the_default_models_openai_voice_table_names_its_presets():
    from service.http import OPENAI_VOICE_PRESETS, OPENAI_VOICES

    presets = {
        p.stem
        for p in (Path(__file__).resolve().parent.parent / "tts/assets/default/voices").glob("*.safetensors")
    }
    table = OPENAI_VOICE_PRESETS["default"]
    assert set(table) == set(OPENAI_VOICES) and set(table.values()) <= presets
