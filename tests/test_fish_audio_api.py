"""Fish Audio's API (service/fish_api.py) judged by the official `fish-audio-sdk`, unchanged, pointed at a
real local server (tiny model, ephemeral ports). Every chunk runs to exactly its `max_new_tokens` frames
(the model never samples its end token: `EndTokenNever`), so durations are exact: frames x frame length. No
assertion depends on what random weights generate or on timing (waits are on states and counts)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import shutil
import struct
import subprocess
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
fishaudio = pytest.importorskip("fishaudio")
av = pytest.importorskip("av")

from fishaudio import FishAudio  # noqa: E402
from fishaudio.exceptions import APIError, NotFoundError, WebSocketError  # noqa: E402
from fishaudio.types import FlushEvent, ReferenceAudio, TTSConfig  # noqa: E402
from helpers import tone_wav  # noqa: E402
from httpx_ws import connect_ws  # noqa: E402
from service_helpers import EndTokenNever, ServerThread, wait_idle  # noqa: E402

from service.server import ServiceLimits  # noqa: E402
from tts.checkpoints.load import load_bundle  # noqa: E402
from tts.engine import EngineConfig, model_runner  # noqa: E402
from tts.runtime.request import ReferenceClip, prepare_reference  # noqa: E402
from tts.text.prompt import VoiceReference  # noqa: E402

RATE = 16000  # the tiny model's codec
FRAME = 640  # samples per frame
N = 5  # frames per chunk (max_new_tokens)
PIECES = ["Hello there my", " friend. And", " then more", FlushEvent(), " Last words here."]
CHUNKS = 3  # "Hello there my friend." / "And then more" (flushed) / "Last words here." (stop)


@pytest.fixture(scope="module")
def server():
    mp = pytest.MonkeyPatch()
    mp.setattr(model_runner, "F", EndTokenNever())
    limits = ServiceLimits(max_waiting=4, max_reference_bytes=256 * 1024)
    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=8), limits, http_port=0)
    yield srv
    srv.stop()
    mp.undo()


@pytest.fixture(scope="module")
def client(server):
    return FishAudio(api_key="any-key", base_url=f"http://127.0.0.1:{server.port}")


def freed(server) -> None:
    """Every session ended and every job, row and KV block freed (waits on the loop's state)."""
    deadline = time.monotonic() + 30
    while server.loop.sessions_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.loop.sessions_open == 0
    wait_idle(server.loop)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, RATE
    if fmt == "wav":
        audio, rate = sf.read(io.BytesIO(data), dtype="float32")
        return audio, rate
    container = av.open(io.BytesIO(data))
    frames = list(container.decode(audio=0))
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]), frames[0].sample_rate


def config(fmt: str, **kw) -> TTSConfig:
    return TTSConfig(format=fmt, max_new_tokens=N, **kw)


# ---- POST /v1/tts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pcm", "wav", "opus"])
def test_convert_over_msgpack_gives_the_frames_asked_for(server, client, fmt):
    audio, rate = decode(client.tts.convert(text="Hello there.", config=config(fmt)), fmt)
    assert len(audio) == N * FRAME * rate // RATE
    freed(server)


def test_v1_tts_takes_json_and_answers_errors_as_fish_does(server, client):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"text": "Hello there.", "format": "pcm", "max_new_tokens": N, "references": []}
    conn.request("POST", "/v1/tts", json.dumps(body), {"Content-Type": "application/json", "model": "s2-pro"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert len(resp.read()) == N * FRAME * 2
    # errors: {"status", "message"} naming Fish's field; the SDK raises them with that message
    conn.request(
        "POST",
        "/v1/tts",
        msgpack.packb({"text": "Hi.", "top_p": 7.0}),
        {"Content-Type": "application/msgpack"},
    )
    resp = conn.getresponse()
    err = json.loads(resp.read())
    assert resp.status == 400 and err["status"] == 400 and "top_p" in err["message"]
    conn.request("POST", "/v1/tts", b"\xc1\xc1", {"Content-Type": "application/msgpack"})
    resp = conn.getresponse()
    assert resp.status == 400 and "MessagePack" in json.loads(resp.read())["message"]
    conn.close()
    with pytest.raises(NotFoundError, match="nobody"):
        client.tts.convert(text="Hi.", reference_id="nobody", config=config("pcm"))
    with pytest.raises(APIError, match="sample_rate") as info:
        client.tts.convert(text="Hi.", config=config("pcm", sample_rate=44100))
    assert info.value.status == 400
    freed(server)


def test_prosody_volume_is_a_gain_and_speed_a_tempo(server, client):
    def tts(**body) -> np.ndarray:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        request = {"text": "Hello there.", "format": "pcm", "max_new_tokens": 20, "seed": 3, **body}
        conn.request("POST", "/v1/tts", msgpack.packb(request), {"Content-Type": "application/msgpack"})
        resp = conn.getresponse()
        assert resp.status == 200
        data = resp.read()
        conn.close()
        return np.frombuffer(data, "<i2").astype(np.float64)

    plain, half = tts(), tts(prosody={"speed": 1.0, "volume": 20 * np.log10(0.5)})
    assert len(half) == len(plain) == 20 * FRAME
    assert np.abs(half - plain * 0.5).max() <= 1.0  # (16-bit rounding)
    fast = tts(prosody={"speed": 2.0, "volume": 0.0})
    assert abs(len(fast) - len(plain) / 2) <= 0.1 * RATE
    freed(server)


def test_the_legacy_sdk_converts_too(server):
    from fish_audio_sdk import Session, TTSRequest

    session = Session("any-key", base_url=f"http://127.0.0.1:{server.port}")
    # (its TTSRequest has no max_new_tokens: the chunk runs to the model's frame budget)
    data = b"".join(session.tts(TTSRequest(text="Hello there.", format="wav")))
    audio, rate = decode(data, "wav")
    assert (len(audio), rate) == (server.loop.bundle.sampling.max_new_frames * FRAME, RATE)
    freed(server)


# ---- WebSocket /v1/tts/live ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pcm", "wav", "opus"])
def test_stream_websocket_speaks_every_piece_and_the_events_make_one_file(server, client, fmt):
    data = b"".join(client.tts.stream_websocket(iter(PIECES), config=config(fmt)))
    audio, rate = decode(data, fmt)
    assert len(audio) == CHUNKS * N * FRAME * rate // RATE
    freed(server)


def live(server, path: str, events: list[dict]) -> list[dict]:
    """Send `events` (dicts as MessagePack; bytes as they are) and read until `finish`."""
    import httpx

    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http_client:
        with connect_ws(path, client=http_client, headers={"Authorization": "Bearer x"}) as ws:
            for event in events:
                ws.send_bytes(event if isinstance(event, bytes) else msgpack.packb(event))
            got = []
            while True:
                got.append(msgpack.unpackb(ws.receive_bytes()))
                if got[-1]["event"] == "finish":
                    return got


def test_with_timestamp_segments_are_ordered_inside_the_audio_and_follow_the_text(server):
    start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": N}}
    texts = ["Hello there my", " friend. And", " then more"]
    events = live(
        server,
        "/v1/tts/live/with-timestamp",
        [start, *({"event": "text", "text": t} for t in texts), {"event": "flush"}, {"event": "stop"}],
    )
    assert events[-1] == {"event": "finish", "reason": "stop"}
    audio_events = [e for e in events if e["event"] == "audio"]
    total = sum(len(e["audio"]) for e in audio_events) // 2
    assert total == 2 * N * FRAME
    # the latest alignment snapshot per chunk (a later one replaces an earlier one)
    snapshots: dict[int, dict] = {}
    offsets: dict[int, float] = {}
    for e in audio_events:
        assert e["chunk_seq"] in (0, 1)
        offsets[e["chunk_seq"]] = e["chunk_audio_offset_sec"]
        if e["alignment"] is not None:
            snapshots[e["chunk_seq"]] = e["alignment"]
    assert offsets == {0: 0.0, 1: N * FRAME / RATE}
    words, ends = [], []
    for seq in (0, 1):
        segments = snapshots[seq]["segments"]
        assert snapshots[seq]["audio_duration"] == pytest.approx(N * FRAME / RATE)
        for s in segments:
            start_s, end_s = s["start"] + offsets[seq], s["end"] + offsets[seq]
            assert 0 <= start_s <= end_s <= total / RATE + 1e-9
            ends.append((start_s, end_s))
            words.append(s["text"])
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(ends, ends[1:], strict=False))  # monotonic
    assert " ".join(words).split() == "Hello there my friend. And then more".split()
    freed(server)


LONG = "This sentence is long enough to keep the session speaking for a good while. " * 4


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([b"\xc1not msgpack"], "MessagePack"),
        ([{"event": "text", "text": "Hi."}], "first event must be start"),
        ([None, {"event": "pause"}], "unknown event 'pause'"),
        (
            [None, {"event": "text", "text": LONG}, {"event": "stop"}, {"event": "text", "text": "More."}],
            "after stop",
        ),
        ([None, {"event": "text", "text": "x" * 9000}], "waiting to be spoken"),
        ([None, {"event": "text", "text": 5}], "needs `text`"),
        ([None, {"event": "start", "request": {}}], "one session per socket"),
        ([{"event": "start", "request": {"format": "flac"}}], "format"),
        ([{"event": "start", "request": {"reference_id": "nobody"}}], "nobody"),
    ],
)
def test_a_bad_event_ends_the_session_with_an_error_finish_and_frees_everything(
    server, client, events, message
):
    start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 100}}
    got = live(server, "/v1/tts/live", [start if e is None else e for e in events])
    assert got[-1]["event"] == "finish" and got[-1]["reason"] == "error"
    assert message in got[-1]["message"]
    freed(server)
    # the SDK raises on it; the server keeps serving
    with pytest.raises(WebSocketError):
        list(client.tts.stream_websocket(iter(["Hi."]), config=config("pcm", sample_rate=8000)))
    assert len(client.tts.convert(text="Hello there.", config=config("pcm"))) == N * FRAME * 2
    freed(server)


def test_a_client_that_leaves_mid_session_aborts_it(server):
    import httpx

    start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 100}}
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as http_client:
        with connect_ws("/v1/tts/live", client=http_client) as ws:
            ws.send_bytes(msgpack.packb(start))
            ws.send_bytes(msgpack.packb({"event": "text", "text": LONG}))
            ws.send_bytes(msgpack.packb({"event": "flush"}))
            first = msgpack.unpackb(ws.receive_bytes())
            assert first["event"] == "audio"
            assert server.loop.sessions_open == 1
    freed(server)


def test_a_websocket_outlives_the_http_read_timeout():
    """The HTTP request deadline (`http_read_timeout`) ends with the upgrade: a voice agent's socket may
    wait between turns. (The sleep only gives a wrongly armed timer the time to fire.)"""
    import httpx

    mp = pytest.MonkeyPatch()
    mp.setattr(model_runner, "F", EndTokenNever())
    limits = ServiceLimits(max_waiting=4, http_read_timeout=0.2)
    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=2), limits, http_port=0)
    try:
        start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": N}}
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}") as http_client:
            with connect_ws("/v1/tts/live", client=http_client) as ws:
                ws.send_bytes(msgpack.packb(start))
                time.sleep(1.0)
                ws.send_bytes(msgpack.packb({"event": "text", "text": "Hello there."}))
                ws.send_bytes(msgpack.packb({"event": "stop"}))
                got = []
                while not got or got[-1]["event"] != "finish":
                    got.append(msgpack.unpackb(ws.receive_bytes()))
        assert got[-1] == {"event": "finish", "reason": "stop"}
        assert sum(len(e["audio"]) for e in got if e["event"] == "audio") == N * FRAME * 2
        freed(srv)
    finally:
        srv.stop()
        mp.undo()


# ---- a reference clip in the live session's start ------------------------------------------------------


def test_stream_websocket_with_a_reference_clip_speaks_in_its_voice(server, client):
    clip = ReferenceClip(tone_wav(RATE), "A tone to clone.")
    engine = server.loop.engine
    before = engine.prefill_tokens
    references = [ReferenceAudio(audio=clip.audio, text=clip.text)]
    data = b"".join(client.tts.stream_websocket(iter(PIECES), references=references, config=config("pcm")))
    assert len(data) == CHUNKS * N * FRAME * 2  # every chunk, each of its frames
    freed(server)
    with_reference = engine.prefill_tokens - before
    before = engine.prefill_tokens
    assert len(b"".join(client.tts.stream_websocket(iter(PIECES), config=config("pcm")))) == len(data)
    freed(server)
    plain = engine.prefill_tokens - before
    # the clip's prompt (its transcript and codes) was prefilled once, for the first chunk only
    ref = prepare_reference(server.loop.planner, clip, server.server.limits.request_limits)
    voice = VoiceReference(server.loop.bundle.codec.encode_audio(ref.samples), ref.text)
    fmt = server.loop.bundle.prompt_format
    extra = fmt.build("Hi.", [voice], []).shape[0] - fmt.build("Hi.", [], []).shape[0]
    assert extra > voice.codes.shape[1] and with_reference == plain + extra


def v1_tts_error(server, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/tts", msgpack.packb(body), {"Content-Type": "application/msgpack"})
    resp = conn.getresponse()
    status, message = resp.status, json.loads(resp.read())["message"]
    conn.close()
    return status, message


@pytest.mark.parametrize(
    ("reference", "reference_id"),
    [
        ({"audio": b"not audio at all" * 10, "text": "x"}, None),
        ({"audio": tone_wav(RATE), "text": " "}, None),  # no transcript
        ({"audio": tone_wav(RATE, 0.2), "text": "Too short."}, None),
        ({"audio": b"x" * (1024 * 1024 + 300 * 1024), "text": "x"}, None),  # over the server's 256 KiB
        ({"audio": tone_wav(RATE), "text": "A tone."}, "fishy"),  # a voice and a clip
    ],
)
def test_a_bad_reference_clip_gets_v1_ttss_error_and_frees_everything(
    server, client, reference, reference_id
):
    request = {"text": "", "format": "pcm", "max_new_tokens": N, "references": [reference]}
    if reference_id is not None:
        request["reference_id"] = reference_id
    status, message = v1_tts_error(server, {**request, "text": "Hi."})
    assert status == 400 and message
    got = live(
        server, "/v1/tts/live", [{"event": "start", "request": request}, {"event": "text", "text": "Hi."}]
    )
    assert got == [{"event": "finish", "reason": "error", "message": message}]
    freed(server)
    with pytest.raises(WebSocketError):
        refs = [ReferenceAudio(**reference)]
        voice = {"references": refs, "reference_id": reference_id}
        list(client.tts.stream_websocket(iter(["Hi."]), **voice, config=config("pcm")))
    freed(server)


# ---- voices ("models") -----------------------------------------------------------------------------------


def test_voices_create_list_use_and_delete(server, client):
    buf = io.BytesIO()
    t = np.arange(2 * RATE) / RATE
    sf.write(
        buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), RATE, format="WAV", subtype="PCM_16"
    )
    voice = client.voices.create(title="fishy", voices=[buf.getvalue()], texts=["A tone for two seconds."])
    assert voice.id == "fishy" and voice.title == "fishy"
    listed = client.voices.list(page_size=100)
    assert "fishy" in [v.id for v in listed.items] and listed.total == len(listed.items)
    assert client.voices.get("fishy").id == "fishy"
    audio = client.tts.convert(text="Hello there.", reference_id="fishy", config=config("pcm"))
    assert len(audio) == N * FRAME * 2
    with pytest.raises(APIError) as info:
        client.voices.create(title="fishy", voices=[buf.getvalue()], texts=["Again."])
    assert info.value.status == 409
    client.voices.delete("fishy")
    assert "fishy" not in [v.id for v in client.voices.list(page_size=100).items]
    with pytest.raises(NotFoundError):
        client.voices.get("fishy")
    with pytest.raises(NotFoundError):
        client.voices.delete("fishy")
    freed(server)


def test_a_voice_is_not_created_while_the_server_is_shutting_down(server, client, monkeypatch):
    # Every front refuses new work while the server drains, voice registrations included.
    buf = io.BytesIO()
    sf.write(buf, np.zeros(RATE, np.float32) + 0.1, RATE, format="WAV", subtype="PCM_16")
    monkeypatch.setattr(server.loop, "_accepting", False)
    with pytest.raises(APIError) as info:
        client.voices.create(title="late", voices=[buf.getvalue()], texts=["Too late."])
    assert info.value.status == 503 and "shutting down" in str(info.value)
    monkeypatch.undo()
    assert "late" not in [v.id for v in client.voices.list(page_size=100).items]


# ---- the playground's live mode (service/static/live.js) -------------------------------------------------


def test_the_playground_loads_the_live_mode_script(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/")
    page = conn.getresponse().read().decode()
    assert page.count('<script src="/static/live.js"></script>') == 1
    conn.request("GET", "/static/live.js")
    resp = conn.getresponse()
    script = resp.read().decode()
    conn.close()
    assert resp.status == 200 and "javascript" in resp.headers["Content-Type"]
    assert "/v1/tts/live/with-timestamp" in script


def test_the_live_scripts_decoder_reads_the_servers_events(server, tmp_path):
    """The page's MessagePack decoder (run by node) against real with-timestamp events of this server."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    start = {"event": "start", "request": {"text": "", "format": "wav", "max_new_tokens": N}}
    got = live(
        server,
        "/v1/tts/live/with-timestamp",
        [start, {"event": "text", "text": "Hello there my friend."}, {"event": "stop"}],
    )
    extra = {"big": 2**40, "neg": -(2**35), "small": -3, "f": 0.25, "t": True, "nil": None, "arr": [1, "é"]}
    frames = [msgpack.packb(e) for e in got] + [msgpack.packb(extra)]
    (tmp_path / "frames.bin").write_bytes(b"".join(len(f).to_bytes(4, "big") + f for f in frames))
    script = Path(__file__).parent.parent / "service" / "static" / "live.js"
    program = f"""
const vm = require("vm"), fs = require("fs");
vm.runInThisContext(fs.readFileSync({json.dumps(str(script))}, "utf8"));
const data = fs.readFileSync({json.dumps(str(tmp_path / "frames.bin"))});
const out = [];
for (let at = 0; at < data.length;) {{
  const n = data.readUInt32BE(at); at += 4;
  const frame = data.buffer.slice(data.byteOffset + at, data.byteOffset + at + n); at += n;
  out.push(fishUnpack(frame));
}}
console.log(JSON.stringify(out, (k, v) => (v instanceof Uint8Array ? Buffer.from(v).toString("base64") : v)));
"""
    decoded = json.loads(
        subprocess.run([node, "-e", program], capture_output=True, check=True, text=True).stdout
    )
    for mine, theirs in zip(decoded, [*got, extra], strict=True):
        if "audio" in theirs:
            assert base64.b64decode(mine.pop("audio")) == theirs.pop("audio")
        assert mine == theirs


def wav_stream(rate: int, samples: np.ndarray, extra: bytes = b"") -> bytes:
    """A streamed 16-bit mono WAV (RIFF and data sizes 0xFFFFFFFF), with `extra` chunks before its data."""
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
    unknown = b"\xff\xff\xff\xff"
    return b"RIFF" + unknown + b"WAVE" + fmt + extra + b"data" + unknown + samples.astype("<i2").tobytes()


def test_the_live_scripts_wav_reader_reads_the_stream_cut_anywhere(server, tmp_path):
    """The page's streamed-WAV reader (run by node) fed in pieces of 1, 3, 7 and 1000 bytes (a sample and the
    header cut anywhere): this server's WAV stream, and one with a LIST chunk (odd size, padded) before its
    data and samples whose bytes are 0 (a zero byte carried from one piece to the next)."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    start = {"event": "start", "request": {"text": "", "format": "wav", "max_new_tokens": N}}
    got = live(
        server,
        "/v1/tts/live",
        [start, {"event": "text", "text": "Hello there my friend."}, {"event": "stop"}],
    )
    served = b"".join(e["audio"] for e in got if e["event"] == "audio")
    served_samples, served_rate = sf.read(io.BytesIO(served), dtype="int16")
    assert served_rate == RATE and len(served_samples) == N * FRAME
    made = np.array([0, 256, -256, 1, -1, 32767, -32768, 512, 0, 3] * 5, np.int16)
    listed = b"LIST" + struct.pack("<I", 9) + b"INFOabcde" + b"\0"
    streams = [(served, RATE, served_samples), (wav_stream(22050, made, listed), 22050, made)]
    (tmp_path / "streams.json").write_text(json.dumps([base64.b64encode(s).decode() for s, _, _ in streams]))
    script = Path(__file__).parent.parent / "service" / "static" / "live.js"
    program = f"""
const vm = require("vm"), fs = require("fs");
vm.runInThisContext(fs.readFileSync({json.dumps(str(script))}, "utf8"));
const out = [];
for (const text of JSON.parse(fs.readFileSync({json.dumps(str(tmp_path / "streams.json"))}, "utf8"))) {{
  const bytes = new Uint8Array(Buffer.from(text, "base64"));
  for (const size of [1, 3, 7, 1000]) {{
    const reader = wavReader(), rates = new Set(), samples = [];
    for (let at = 0; at < bytes.length; at += size) {{
      const got = reader.push(bytes.slice(at, at + size));
      if (got.samples.length) rates.add(got.rate);
      for (const x of got.samples) samples.push(Math.round(x * 32768));
    }}
    out.push({{ rates: [...rates], samples }});
  }}
}}
console.log(JSON.stringify(out));
"""
    decoded = json.loads(
        subprocess.run([node, "-e", program], capture_output=True, check=True, text=True).stdout
    )
    for k, got_back in enumerate(decoded):
        _, rate, samples = streams[k // 4]
        assert got_back["rates"] == [rate], k
        assert got_back["samples"] == samples.tolist(), k


def test_a_client_gone_before_its_start_is_no_server_error(caplog):
    """A socket that closes before sending `start` ends quietly: `_open` lets the disconnect through (the
    socket handler ends there) instead of logging an internal error with a traceback."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from starlette.websockets import WebSocketDisconnect

    from service.fish_api import FishAPI

    class GoneSocket:
        async def receive(self):
            return {"type": "websocket.disconnect", "code": 1001}

    api = FishAPI(SimpleNamespace(bundle=None, max_body=1 << 20, limits=ServiceLimits()))
    with caplog.at_level(logging.INFO, logger="service.fish_api"):
        with pytest.raises(WebSocketDisconnect):
            asyncio.run(api._open(GoneSocket()))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_clip_the_codec_cannot_encode_finishes_with_why(server, monkeypatch):
    """The session's reference clip passes the checks but the codec fails on it: the socket's `finish`
    error says why (not only "session error"), and everything is freed."""
    from concurrent.futures import Future

    def broken(samples):
        future: Future = Future()
        future.set_exception(RuntimeError("codec exploded"))
        return future

    monkeypatch.setattr(server.loop.runner.stage, "encode", broken)
    rate = server.loop.bundle.codec.sample_rate
    # (a clip no other test sends: the reference cache cannot answer it)
    reference = {"audio": tone_wav(rate, 1.7), "text": "Only here."}
    start = {"event": "start", "request": {"text": "", "format": "pcm", "references": [reference]}}
    got = live(server, "/v1/tts/live", [start, {"event": "text", "text": "Hello."}, {"event": "stop"}])
    assert got[-1]["event"] == "finish" and got[-1]["reason"] == "error"
    assert got[-1]["message"].endswith("the reference clip could not be encoded: codec exploded")
    freed(server)


def test_a_text_chunk_that_fails_ends_the_session_with_why_not_silently(server, client):
    """A live session's chunk that fails (text the model's prompt refuses, a reserved tag) ends the
    socket with a `finish` error that says why, the Fish protocol's only way to report it; it was
    dropped silently and the session ended `stop` with a sentence missing."""
    start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 5}}
    text = {"event": "text", "text": "Hello there. <|im_end|> This is fine. "}
    got = live(server, "/v1/tts/live", [start, text, {"event": "stop"}])
    assert got[-1]["event"] == "finish" and got[-1]["reason"] == "error"
    assert "<|im_end|>" in got[-1]["message"]
    freed(server)
    with pytest.raises(WebSocketError):  # the official SDK raises on it
        list(
            client.tts.stream_websocket(iter(["Hello there. <|im_end|> This is fine."]), config=config("pcm"))
        )
    freed(server)


def test_connections_past_the_cap_get_503():
    """Idle connections cannot use up the server's file descriptors: past `max_http_connections` a new
    connection is answered 503 at once; once they close, requests are served again."""
    import httpx

    limits = ServiceLimits(max_http_connections=3, http_read_timeout=600.0)  # (no socket times out here)
    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=1), limits, http_port=0)
    try:
        base = f"http://127.0.0.1:{srv.port}"
        assert httpx.get(f"{base}/health").status_code == 200
        with httpx.Client(base_url=base) as http_client, contextlib.ExitStack() as stack:
            for _ in range(2):
                stack.enter_context(
                    connect_ws("/v1/tts/live", client=http_client, headers={"Authorization": "Bearer x"})
                )
            # (uvicorn counts the new connection too: with 2 open, a third reaches the cap of 3)
            assert httpx.get(f"{base}/health").status_code == 503
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline, "the closed sockets were never let go"
            time.sleep(0.05)
    finally:
        srv.stop()


def test_a_live_socket_without_its_start_event_is_told_why_and_closed():
    """A socket that never sends `start` holds a connection: after `http_read_timeout` it gets a finish
    error saying so, and the server closes it."""
    limits = ServiceLimits(http_read_timeout=0.5)
    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=1), limits, http_port=0)
    try:
        got = live(srv, "/v1/tts/live", [])
        assert got == [{"event": "finish", "reason": "error", "message": "no start event within 0.5 s"}]
    finally:
        srv.stop()
