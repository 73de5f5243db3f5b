"""`tts serve` as a real process: the documented flow (serve, client, bench-server, metrics) and SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import soundfile as sf
from helpers import sysfs_mounted

import tts.checkpoints.load
from service.client import build_request, channel_options
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.cli.main import main

pytest.importorskip("grpc_health")
ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, *args: str, data_home: Path | None = None, preexec_fn=None):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if data_home is not None:  # registered voices go under $XDG_DATA_HOME, not the user's home
            env["XDG_DATA_HOME"] = str(data_home)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tts.cli.main import main; sys.exit(main())",
                "serve",
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
        self.lines: list[str] = []
        self.serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("serving "):
                self.serving.set()

    def wait_serving(self, timeout=120.0) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while not self.serving.wait(0.1):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
        line = next(x for x in self.lines if x.startswith("serving "))
        address = re.search(r" on (\S+:\d+) ", line).group(1)
        metrics = re.search(r"metrics on (\S+)", line).group(1)
        return address, metrics


def test_serve_client_bench_and_sigterm(tmp_path, capsys):
    server = ServeProcess(
        "--model",
        "tiny",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--wyoming-port",
        "0",
        "--max-batch",
        "4",
        "--grace",
        "1",
        data_home=tmp_path,
    )
    try:
        address, metrics_url = server.wait_serving()
        # The HTTP front of the same process: health, and one OpenAI-style request.
        line = next(x for x in server.lines if x.startswith("serving "))
        # start-up says what it cost: the engine's build (graphs, KV pool), then the whole time to ready
        assert re.search(r"max batch 4, graphs off, ready in \d+\.\d s\)", line), line
        assert any(
            re.search(
                r"engine built in \d+\.\d\d s: 0 frame-step and 0 prefill graphs captured, KV pool \d+ MiB "
                r"\(\d+ blocks of \d+ tokens\)",
                x,
            )
            for x in server.lines
        )
        http_url = re.search(r"HTTP on (http://\S+/)", line).group(1)
        assert json.loads(urllib.request.urlopen(http_url + "health", timeout=10).read()) == {
            "status": "serving"
        }
        body = {"model": "tiny", "input": "Hello.", "response_format": "wav", "seed": 1, "max_new_frames": 5}
        speech = urllib.request.Request(
            http_url + "v1/audio/speech", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(speech, timeout=60) as resp:
            media_type, (audio, rate) = resp.headers["Content-Type"], sf.read(io.BytesIO(resp.read()))
        assert media_type == "audio/wav" and rate == 16000 and len(audio) > 0
        # The Wyoming front of the same process (Home Assistant's protocol).
        wyoming_port = int(re.search(r"Wyoming on tcp://[^:]+:(\d+)", line).group(1))
        assert wyoming_voices(wyoming_port) == ["alpha", "beta"]
        out = tmp_path / "hello.wav"
        assert (
            main(
                [
                    "client",
                    "Hello there.",
                    "--server",
                    address,
                    "-o",
                    str(out),
                    "--seed",
                    "1",
                    "--max-new-frames",
                    "20",
                ]
            )
            == 0
        )
        audio, rate = sf.read(out)
        assert rate == 16000 and 0 < len(audio) <= 20 * 640 and len(audio) % 640 == 0
        # Ogg (Opus) is written at 48 kHz, and the summary line says so.
        capsys.readouterr()
        ogg = tmp_path / "hello.ogg"
        assert (
            main(
                [
                    "client",
                    "Hello.",
                    "--server",
                    address,
                    "-o",
                    str(ogg),
                    "--max-new-frames",
                    "5",
                    "--seed",
                    "1",
                ]
            )
            == 0
        )
        assert "audio at 48000 Hz" in capsys.readouterr().out and sf.info(str(ogg)).samplerate == 48000
        # Bad input: exit code 2, one line, no file.
        bad = tmp_path / "bad.wav"
        assert main(["client", "Hi.", "--server", address, "-o", str(bad), "--voice", "nobody"]) == 2
        assert not bad.exists()
        # The load benchmark writes its JSON.
        report = tmp_path / "bench.json"
        args = [
            "bench-server",
            "--server",
            address,
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--max-new-frames",
            "6",
        ]
        assert main([*args, "--json", str(report)]) == 0
        levels = json.loads(report.read_text())["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["ok"] == 2 for lv in levels)
        assert set(levels[0]["ttfa_ms"]) == {"p50", "p95", "p99"} and set(levels[0]["rtf"]) == {"p50", "p95"}
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert 'tts_requests_total{outcome="ok"}' in text
        # SIGTERM with an open stream that cannot end (its client does not read 600 frames of float32
        # audio through HTTP/2 windows kept small): the process exits 0 within the grace period plus a
        # margin; the stream ends with UNAVAILABLE.
        channel = grpc.insecure_channel(address, options=channel_options() + [("grpc.http2.bdp_probe", 0)])
        text = "Hold this stream open for as long as the test needs it, whatever the random weights say."
        call = pb_grpc.TextToSpeechStub(channel).Synthesize(
            build_request(
                text,
                temperature=0.0,
                max_new_frames=600,
                min_new_frames=600,
                first_chunk_frames=1,
                chunk_frames=1,
                encoding="float32",
            )
        )
        assert next(call).WhichOneof("message") == "header"
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, "".join(server.lines)
        assert time.monotonic() - t0 < 1.0 + 10.0
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
        assert any(line.startswith("stopped in") for line in server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def wyoming_voices(port: int) -> list[str]:
    """The voices the Wyoming front on `port` lists in its `info` (the wyoming package's client)."""
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    async def exchange() -> list[str]:
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Describe().event())
            event = await client.read_event()
            assert event is not None
            return [v.name for v in Info.from_event(event).tts[0].voices]

    return asyncio.run(asyncio.wait_for(exchange(), 60))


BAD_OPTIONS = [
    (["client", " ...", "-o", "{d}/a.wav", "--server", "127.0.0.1:1"],
     "text has nothing to speak (empty, whitespace or punctuation only)"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--timeout", "-1"],
     "--timeout must be a number of seconds > 0, got -1"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--timeout", "0"],
     "--timeout must be a number of seconds > 0, got 0"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--timeout", "nan"],
     "--timeout must be a number of seconds > 0, got nan"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--timeout", "inf"],
     "--timeout must be a number of seconds > 0, got inf"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--max-new-frames", "0"], "--max-new-frames must be > 0, got 0"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--server", "127.0.0.1:70000"],
     "--server 127.0.0.1:70000: the port must be in 1..65535"),
    (["client", "Hi.", "-o", "{d}/a.wav", "--reference-audio", "{d}/missing.wav", "--reference-text", "x"],
     "reference audio file not found: {d}/missing.wav"),
    (["serve", "--port", "70000"], "--port must be in 0..65535 (0 = any free port), got 70000"),
    (["serve", "--port", "-1"], "--port must be in 0..65535 (0 = any free port), got -1"),
    (["serve", "--metrics-port", "-2"],
     "--metrics-port must be -1 (off) or in 0..65535 (0 = any free port), got -2"),
    (["serve", "--metrics-port", "65536"],
     "--metrics-port must be -1 (off) or in 0..65535 (0 = any free port), got 65536"),
    (["serve", "--wyoming-port", "-2"],
     "--wyoming-port must be -1 (off) or in 0..65535 (0 = any free port), got -2"),
    (["serve", "--wyoming-port", "65536"],
     "--wyoming-port must be -1 (off) or in 0..65535 (0 = any free port), got 65536"),
    (["serve", "--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["serve", "--kv-memory-fraction", "0"], "--kv-memory-fraction must be in (0, 1), got 0"),
    (["serve", "--kv-memory-fraction", "1"], "--kv-memory-fraction must be in (0, 1), got 1"),
    (["serve", "--kv-memory-fraction", "nan"], "--kv-memory-fraction must be in (0, 1), got nan"),
    (["serve", "--max-waiting", "-1"], "--max-waiting must be >= 0, got -1"),
    (["serve", "--max-queued-chunks", "0"], "--max-queued-chunks must be >= 1, got 0"),
    (["serve", "--grace", "-1"], "--grace must be a number of seconds >= 0, got -1"),
    (["serve", "--grace", "nan"], "--grace must be a number of seconds >= 0, got nan"),
    (["serve", "--http-read-timeout", "0"], "--http-read-timeout must be a number of seconds > 0, got 0"),
    (["serve", "--max-http-connections", "1"], "--max-http-connections must be >= 2, got 1"),
    (["serve", "--max-wyoming-connections", "0"], "--max-wyoming-connections must be >= 1, got 0"),
    (["serve", "--max-grpc-connections", "0"], "--max-grpc-connections must be >= 1, got 0"),
    (
        ["serve", "--max-connection-idle", "-1"],
        "--max-connection-idle must be a number of seconds >= 0, got -1",
    ),
    (
        ["serve", "--wyoming-idle-timeout", "-1"],
        "--wyoming-idle-timeout must be a number of seconds >= 0, got -1",
    ),
    (["serve", "--max-prepare-seconds", "0"], "--max-prepare-seconds must be a number of seconds > 0, got 0"),
    (["serve", "--max-reference-mb", "0"], "--max-reference-mb must be in (0, 2046], got 0"),
    (["serve", "--max-reference-mb", "inf"], "--max-reference-mb must be in (0, 2046], got inf"),
    (["serve", "--max-reference-mb", "5000"], "--max-reference-mb must be in (0, 2046], got 5000"),
    (["serve", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["bench-server", "--server", "127.0.0.1:1", "--timeout", "0"],
     "--timeout must be a number of seconds > 0, got 0"),
    (["bench-server", "--server", "127.0.0.1:1", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["bench-server", "--server", "127.0.0.1:1", "--requests", "0"], "--requests must be >= 1, got 0"),
    (["bench-server", "--server", "127.0.0.1:1", "--max-new-frames", "-5"],
     "--max-new-frames must be > 0, got -5"),
    (["bench-server", "--server", "127.0.0.1:1", "--chunk-frames", "-1"],
     "--chunk-frames must be >= 0 (0 = server default), got -1"),
    (["bench-server", "--server", "127.0.0.1:1", "--top-k", "-1"],
     "--top-k must be in [0, 2**31) (0 = no limit), got -1"),
    (["bench-server", "--server", "127.0.0.1:99999"],
     "--server 127.0.0.1:99999: the port must be in 1..65535"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_OPTIONS])
def test_bad_numeric_options_are_one_line_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    def no_model(*args, **kwargs):  # a bad option must be found before the model is loaded (or served)
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(tts.checkpoints.load, "load_bundle", no_model)
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    if argv[0] == "serve":
        argv += ["--model", "tiny"]
    if argv[0] == "client" and "--server" not in argv:
        argv += ["--server", "127.0.0.1:1"]  # nothing listens there
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == "tts: error: " + message.replace("{d}", str(tmp_path)), err
    assert list(tmp_path.iterdir()) == []


def _listening_socket() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("which", ["--port", "--metrics-port", "--http-port", "--wyoming-port"])
def test_a_busy_port_is_named_in_one_line(which):
    """Before the model loads (no `model:` line), in one line naming the option."""
    with _listening_socket() as busy:
        port = busy.getsockname()[1]
        args = {"--port": "0", "--metrics-port": "0", "--http-port": "0", which: str(port)}
        args = [x for option_value in args.items() for x in option_value]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run(
            [sys.executable, "-m", "tts.cli", "serve", "--model", "tiny", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
    purpose = {
        "--port": "",
        "--metrics-port": " for metrics",
        "--http-port": " for HTTP",
        "--wyoming-port": " for Wyoming",
    }[which]
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr.strip()
        == f"tts: error: cannot listen on 127.0.0.1:{port}{purpose}: address already in use ({which})"
    )


def test_every_busy_port_is_named_in_the_one_error(capsys, monkeypatch):
    """A second `tts serve` on the same ports hears of all of them at once, before anything starts: gRPC,
    metrics and HTTP in one line, not one per attempt."""
    import tts.checkpoints.load

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the ports were checked")

    monkeypatch.setattr(tts.checkpoints.load, "load_bundle", no_model)
    with _listening_socket() as a, _listening_socket() as b, _listening_socket() as c:
        grpc_port, metrics_port, http_port = (s.getsockname()[1] for s in (a, b, c))
        rc = main(
            ["serve", "--model", "tiny", "--port", str(grpc_port), "--metrics-port", str(metrics_port)]
            + ["--http-port", str(http_port)]
        )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == (
        f"tts: error: cannot listen on 127.0.0.1:{grpc_port}: address already in use (--port); "
        f"on 127.0.0.1:{metrics_port} for metrics: address already in use (--metrics-port); "
        f"on 127.0.0.1:{http_port} for HTTP: address already in use (--http-port)"
    )


def test_one_port_for_two_fronts_is_refused_before_anything_starts(capsys, monkeypatch):
    import tts.checkpoints.load

    monkeypatch.setattr(tts.checkpoints.load, "load_bundle", lambda *a, **k: pytest.fail("loaded a model"))
    with socket.socket() as s:  # a port nothing listens on (bound, then released)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(
        ["serve", "--model", "tiny", "--port", str(port), "--http-port", str(port), "--metrics-port", "-1"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == f"tts: error: --http-port {port} is also --port: give each front a port of its own"


@pytest.mark.skipif(not sysfs_mounted(), reason="needs /sys (sysfs) as a directory nobody can write to")
def test_client_unwritable_output_fails_before_connecting(capsys):
    rc = main(["client", "Hi.", "--server", "127.0.0.1:1", "-o", "/sys/x.wav"])
    assert (
        rc == 2
        and capsys.readouterr().err.strip() == "tts: error: cannot write /sys/x.wav: permission denied"
    )


@pytest.mark.parametrize("command", ["client", "bench-server"])
def test_a_server_that_cannot_be_reached_is_named_in_one_line(tmp_path, capsys, monkeypatch, command):
    with socket.socket() as s:  # a port nothing listens on (bound, then released)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "x.wav"
    monkeypatch.chdir(tmp_path)
    argv = ["Hi.", "-o", str(out)] if command == "client" else ["--concurrency", "1", "--requests", "1"]
    rc = main([command, "--server", f"127.0.0.1:{port}", *argv])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 1
        and err == f"tts: error: cannot reach a server at 127.0.0.1:{port} (is `tts serve` running there?)"
    )
    assert list(tmp_path.iterdir()) == []  # (no audio, no bench_server.json)


def test_client_prints_the_servers_text_warning_once_before_wrote_and_sends_no_normalize(tmp_path, capsys):
    import numpy as np
    from service_helpers import ServerThread

    from tts.api import TTS
    from tts.engine import EngineConfig

    bundle = tts.checkpoints.load.load_bundle("tiny")
    srv = ServerThread(bundle, EngineConfig(max_batch=2))
    try:
        out = tmp_path / "a.wav"
        argv = ["client", "Hello 你好 world.", "--server", srv.address, "-o", str(out), "--seed", "1"]
        with contextlib.redirect_stdout(sys.stderr):  # the `wrote` line (stdout) and the warnings, in order
            assert main([*argv, "--max-new-frames", "3", "-q"]) == 0
        err = capsys.readouterr().err
        warning = "warning: this model reads English only: 2 characters of Han text"
        assert err.count(warning) == 1
        assert err.index(warning) < err.index("wrote ")  # as `tts synthesize` orders them
        # --no-normalize: the server reads "**5** items" as given (the audio of the offline run that does)
        kw = dict(seed=1, max_new_frames=6, temperature=0.0)
        argv = ["client", "**5** items", "--server", srv.address, "-o", str(out), "--encoding", "float32"]
        assert (
            main(
                [*argv, "--no-normalize", "--seed", "1", "--max-new-frames", "6", "--temperature", "0", "-q"]
            )
            == 0
        )
        audio, _ = sf.read(out, dtype="float32")
        offline = TTS(bundle)
        expected = offline.synthesize("**5** items", normalize=False, **kw).audio
        assert len(expected) > 0 and len(audio) == len(expected)
        np.testing.assert_allclose(audio, expected, atol=1e-6)
        normalized = offline.synthesize("**5** items", **kw).audio
        assert len(normalized) != len(audio) or not np.allclose(normalized, audio)
    finally:
        srv.stop()


def test_the_serving_line_says_the_device_memory_on_cuda_only(monkeypatch):
    """On CUDA the serving line adds what torch's allocator holds on the device and its peak (an
    operator sizing a smaller card reads it there); on a CPU nothing (the CPU run's line above)."""
    import torch

    from tts.cli.serve import device_memory_note

    assert device_memory_note(torch.device("cpu")) == ""
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 7.94 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 17 * 2**29)
    assert device_memory_note(torch.device("cuda", 0)) == ", device memory 7.9 GiB (peak 8.5 GiB)"


HTTP, GRPC = "--max-http-connections", "--max-grpc-connections"


def test_the_open_file_limit_is_raised_to_hold_the_connection_caps(monkeypatch):
    """`tts serve` raises a soft open-file limit below its connection caps + the reserve, up to the
    hard limit, and keeps the caps it was given."""
    import resource

    from tts.cli import serve

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 65536))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    caps = {HTTP: (4096, 2), GRPC: (1024, 1)}
    assert serve.fit_open_files(caps) == ({HTTP: 4096, GRPC: 1024}, None)
    assert calls == [(4096 + 1024 + serve.OPEN_FILES_RESERVE, 65536)]
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (8192, 8192))
    assert serve.fit_open_files(caps) == ({HTTP: 4096, GRPC: 1024}, None)  # (room enough: left alone)
    assert calls == []


def test_a_hard_open_file_limit_lowers_every_cap_in_proportion_with_a_warning(monkeypatch):
    """Where the hard limit cannot hold the connections asked for, the soft limit goes up to it and
    every cap comes down in proportion to what fits beside the reserve, not below its smallest; a limit
    the system refuses to raise is read as it is."""
    import resource

    from tts.cli import serve

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 2048))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append(limits))
    caps = {HTTP: (3072, 2), GRPC: (1024, 1)}
    fitted, warning = serve.fit_open_files(caps)
    assert calls == [(2048, 2048)]
    room = 2048 - serve.OPEN_FILES_RESERVE  # 1792 of 4096 asked: each cap times 1792 / 4096
    assert fitted == {HTTP: 1344, GRPC: 448} and sum(fitted.values()) == room
    assert warning == (
        f"warning: the open-file limit (2048) holds {room} connections beside the server's own files, not "
        f"4096: --max-http-connections 1344, --max-grpc-connections 448 (raise the limit: ulimit -n "
        f"{4096 + serve.OPEN_FILES_RESERVE})"
    )

    def refuse(which, limits):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert serve.fit_open_files(caps)[0] == {HTTP: 576, GRPC: 192}  # (1024 less the reserve: 768)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (100, 100))
    assert serve.fit_open_files(caps)[0] == {HTTP: 2, GRPC: 1}  # (the smallest caps the options take)


def test_serve_under_a_low_open_file_limit_caps_its_http_connections():
    """A real `tts serve` whose hard open-file limit is 300: it says so at start-up, and its HTTP cap is
    43 (its share of the 44 connections that fit beside the reserve): the 43rd connection open at once is
    answered 503, as the option's own cap does, instead of the process running out of files."""
    import resource

    from tts.cli.serve import OPEN_FILES_RESERVE

    limit, grpc = 300, 8
    cap = 4096 * (limit - OPEN_FILES_RESERVE) // (4096 + grpc)  # (both caps scaled to the room: 43)
    server = ServeProcess(
        "--model", "tiny", "--port", "0", "--metrics-port", "0", "--http-port", "0", "--wyoming-port", "-1",
        "--max-batch", "1", "--grace", "0", "--http-read-timeout", "600", "--max-grpc-connections", str(grpc),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)),
    )  # fmt: skip
    try:
        server.wait_serving()
        assert any(
            x.startswith("warning: the open-file limit (300) holds 44 connections")
            and f"--max-http-connections {cap}, --max-grpc-connections 1 " in x
            for x in server.lines
        )
        line = next(x for x in server.lines if x.startswith("serving "))
        host, port = re.search(r"HTTP on http://([^/:]+):(\d+)/", line).groups()
        health = f"http://{host}:{port}/health"
        assert urllib.request.urlopen(health, timeout=10).status == 200
        with contextlib.ExitStack() as stack:
            for _ in range(cap - 1):  # idle connections (uvicorn counts the next one too)
                stack.enter_context(socket.create_connection((host, int(port)), timeout=10))
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(health, timeout=10)
            assert err.value.code == 503
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(health, timeout=10).status == 200:
                    break
            except urllib.error.HTTPError:
                assert time.monotonic() < deadline, "the closed connections were never let go"
                time.sleep(0.05)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
