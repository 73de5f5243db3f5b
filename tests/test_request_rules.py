"""Every front applies the same request rules (tts/runtime/request.py): the same bad request gets the same
message and names the same field over gRPC (status details, trailing metadata `tts-field`), HTTP (the
OpenAI-style error's `message` and `param`), the Python API (the error's `field`) and the command line
(`tts: error: ...`), each in its own field names. And the HTTP front imports no protobuf and no gRPC."""

from __future__ import annotations

import base64
import http.client
import io
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import soundfile as sf
from service_helpers import ServerThread

from service.client import build_request
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from service.server import ServiceLimits
from tts.api import TTS
from tts.checkpoints.load import load_bundle
from tts.cli.main import main
from tts.engine import EngineConfig
from tts.runtime.request import ReferenceClip, SpeechRequest
from tts.runtime.request_errors import RequestError

pytest.importorskip("fastapi")
pytest.importorskip("grpc_health")

ROOT = Path(__file__).resolve().parent.parent
MAX_TEXT_BYTES = 200


@pytest.fixture(scope="module")
def server():
    limits = ServiceLimits(max_waiting=4, max_text_bytes=MAX_TEXT_BYTES, max_reference_bytes=64 * 1024)
    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=2), limits, http_port=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api():
    tts = TTS(load_bundle("tiny"), EngineConfig(max_batch=2))
    yield tts
    tts.close()


def over_grpc(server, **request) -> tuple[grpc.StatusCode, str, str | None]:
    """(status, details, tts-field) of a SynthesizeUnary call that must fail."""
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.TextToSpeechStub(channel).SynthesizeUnary(build_request(**request), timeout=60)
    err = info.value
    return err.code(), err.details(), dict(err.trailing_metadata() or ()).get("tts-field")


def over_http(server, **body) -> tuple[int, str, str | None]:
    """(status, message, param) of a POST /v1/audio/speech that must fail."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        err = json.loads(response.read())["error"]
    finally:
        conn.close()
    return response.status, err["message"], err["param"]


def from_api(call) -> tuple[type, str, str]:
    """(type, message, field) of the RequestError a Python API call raises."""
    with pytest.raises(RequestError) as info:
        call()
    return type(info.value), str(info.value), info.value.field


def on_the_command_line(capsys, argv: list[str]) -> str:
    """The one error line of a `tts` command that must fail with exit code 2."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tts: error: "), lines
    return lines[0].removeprefix("tts: error: ")


def wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def test_a_sampling_value_out_of_range(server, api, capsys, tmp_path):
    message = "top_p must be in (0, 1], got 1.5"
    assert over_grpc(server, text="Hi.", top_p=1.5) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        message,
        "sampling.top_p",
    )
    assert over_http(server, input="Hi.", top_p=1.5) == (400, message, "top_p")
    kind, text, field = from_api(lambda: api.prepare("Hi.", top_p=1.5))
    assert (text, field) == (message, "sampling.top_p") and issubclass(kind, ValueError)
    cli = on_the_command_line(capsys, ["synthesize", "Hi.", "-o", str(tmp_path / "a.wav"), "--top-p", "1.5"])
    assert cli == "--top-p must be in (0, 1], got 1.5"


def test_a_frame_budget_that_is_not_positive(server, api, capsys, tmp_path):
    message = "max_new_frames must be > 0, got 0"
    assert over_grpc(server, text="Hi.", max_new_frames=0) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        message,
        "sampling.max_new_frames",
    )
    assert over_http(server, input="Hi.", max_new_frames=0) == (400, message, "max_new_frames")
    assert from_api(lambda: api.prepare("Hi.", max_new_frames=0))[1:] == (message, "sampling.max_new_frames")
    argv = ["synthesize", "Hi.", "-o", str(tmp_path / "a.wav"), "--max-new-frames", "0"]
    assert on_the_command_line(capsys, argv) == "--max-new-frames must be > 0, got 0"


def test_a_frame_budget_past_the_context(server, api, capsys, tmp_path):
    message = f"max_new_frames (5000) exceeds the context size {api.max_context}"
    assert server.loop.max_context == api.max_context
    assert over_grpc(server, text="Hi.", max_new_frames=5000) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        message,
        "sampling.max_new_frames",
    )
    assert over_http(server, input="Hi.", max_new_frames=5000) == (400, message, "max_new_frames")
    assert from_api(lambda: api.prepare("Hi.", max_new_frames=5000))[1:] == (
        message,
        "sampling.max_new_frames",
    )
    # The command line names the option, from the field: the API's error, and the server's (`tts-field`).
    cli = f"--max-new-frames (5000) exceeds the context size {api.max_context}"
    out = str(tmp_path / "a.wav")
    argv = ["synthesize", "Hi.", "-o", out, "--model", "tiny", "--max-new-frames", "5000"]
    assert on_the_command_line(capsys, argv) == cli
    argv = ["client", "Hi.", "-o", out, "--server", server.address, "--max-new-frames", "5000"]
    assert on_the_command_line(capsys, argv) == cli


def test_text_with_nothing_to_speak(server, api, capsys, tmp_path):
    message = "text has nothing to speak (empty, whitespace or punctuation only)"
    assert over_grpc(server, text="...") == (grpc.StatusCode.INVALID_ARGUMENT, message, "text")
    assert over_http(server, input="...") == (400, message, "input")
    assert from_api(lambda: api.prepare("..."))[1:] == (message, "text")
    assert on_the_command_line(capsys, ["synthesize", "...", "-o", str(tmp_path / "a.wav")]) == message


def test_text_over_the_servers_limit(server):
    text = "a " * MAX_TEXT_BYTES
    detail = f" is {len(text)} bytes; the limit is {MAX_TEXT_BYTES}"
    assert over_grpc(server, text=text) == (grpc.StatusCode.INVALID_ARGUMENT, "text" + detail, "text")
    assert over_http(server, input=text) == (400, "input" + detail, "input")
    limits = server.server.limits.request_limits
    request = SpeechRequest(text)
    assert from_api(lambda: request.plan(server.loop.planner, limits))[1:] == ("text" + detail, "text")


def test_an_unknown_voice(server, api, capsys, tmp_path):
    message = "unknown voice 'nobody' (available: alpha, beta)"
    assert over_grpc(server, text="Hi.", voice="nobody") == (grpc.StatusCode.NOT_FOUND, message, "voice.name")
    assert over_http(server, input="Hi.", voice="nobody") == (404, message, "voice")
    kind, text, field = from_api(lambda: api.prepare("Hi.", voice="nobody"))
    assert (text, field) == (message, "voice") and issubclass(kind, KeyError)  # (VoiceNotFound)
    argv = ["synthesize", "Hi.", "-o", str(tmp_path / "a.wav"), "--model", "tiny", "--voice", "nobody"]
    assert on_the_command_line(capsys, argv) == message


def test_an_audio_chunk_size_past_the_bound(server, api, capsys, tmp_path):
    limit = server.server.limits.max_chunk_frames
    assert limit == 256  # (the tiny model's chunks stay far below the send limit's cap)
    detail = f" must be at most {limit}, got 300"
    assert over_grpc(server, text="Hi.", chunk_frames=300) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "output.chunk_frames" + detail,
        "output.chunk_frames",
    )
    assert from_api(lambda: api.prepare("Hi.", chunk_frames=300))[1:] == (
        "output.chunk_frames" + detail,
        "output.chunk_frames",
    )
    argv = [
        "client",
        "Hi.",
        "-o",
        str(tmp_path / "a.wav"),
        "--server",
        "127.0.0.1:1",
        "--chunk-frames",
        "300",
    ]
    assert on_the_command_line(capsys, argv) == "--chunk-frames" + detail


def test_a_reference_clip_that_is_not_audio(server):
    garbage = b"not audio at all" * 10
    code, details, field = over_grpc(server, text="Hi.", reference_audio=garbage, reference_text="x")
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "voice.reference.audio")
    assert details.startswith("cannot read reference audio (voice.reference.audio: WAV, FLAC, MP3 or Ogg): ")
    reason = details.split("): ", 1)[1]
    b64 = base64.b64encode(garbage).decode()
    assert over_http(server, input="Hi.", reference_audio=b64, reference_text="x") == (
        400,
        f"cannot read reference audio (reference_audio: WAV, FLAC, MP3 or Ogg): {reason}",
        "reference_audio",
    )
    request = SpeechRequest("Hi.", reference=ReferenceClip(garbage, "x"))
    limits = server.server.limits.request_limits
    assert from_api(lambda: request.plan(server.loop.planner, limits))[1:] == (
        f"cannot read reference audio (reference.audio: WAV, FLAC, MP3 or Ogg): {reason}",
        "reference.audio",
    )


def test_a_reference_clip_without_its_transcript(server):
    clip = wav()
    assert over_grpc(server, text="Hi.", reference_audio=clip) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "reference audio needs its transcript (voice.reference.text)",
        "voice.reference.text",
    )
    assert over_http(server, input="Hi.", reference_audio=base64.b64encode(clip).decode()) == (
        400,
        "reference audio needs its transcript (reference_text)",
        "reference_text",
    )
    request = SpeechRequest("Hi.", reference=ReferenceClip(clip, " "))
    limits = server.server.limits.request_limits
    assert from_api(lambda: request.plan(server.loop.planner, limits))[1:] == (
        "reference audio needs its transcript (reference.text)",
        "reference.text",
    )


def test_a_voice_and_a_reference_clip_together(server, capsys, tmp_path):
    # (gRPC cannot say both: `voice` is a oneof)
    clip = wav()
    b64 = base64.b64encode(clip).decode()
    assert over_http(server, input="Hi.", voice="alpha", reference_audio=b64, reference_text="x") == (
        400,
        "give voice or reference_audio, not both",
        "voice",
    )
    request = SpeechRequest("Hi.", voice="alpha", reference=ReferenceClip(clip, "x"))
    limits = server.server.limits.request_limits
    assert from_api(lambda: request.plan(server.loop.planner, limits))[1:] == (
        "give voice or reference.audio, not both",
        "voice",
    )
    path = tmp_path / "ref.wav"
    path.write_bytes(clip)
    for command in ("synthesize", "client"):
        argv = [command, "Hi.", "-o", str(tmp_path / "a.wav"), "--voice", "alpha"]
        argv += ["--reference-audio", str(path), "--reference-text", "x"]
        assert on_the_command_line(capsys, argv) == "give --voice or --reference-audio, not both"


def test_the_http_front_imports_no_protobuf_and_no_grpc():
    """service/http.py (and what it imports) runs with protobuf and gRPC unimportable."""
    script = (
        "import sys\n"
        "for name in ('grpc', 'google.protobuf', 'service.grpc_gen', 'service.grpc_front'):\n"
        "    sys.modules[name] = None  # an import of it raises ImportError\n"
        "import service.http\n"
        "assert 'service.server' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
