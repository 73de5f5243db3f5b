"""`tts serve` as a real process: the README flow (serve, client, bench-server, metrics) and SIGTERM."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import soundfile as sf

from proto.tts.v1 import tts_pb2_grpc as pb_grpc
from service.client import build_request, channel_options
from tts.cli import main

pytest.importorskip("grpc_health")
ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tts.cli import main; sys.exit(main())", "serve", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
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


def test_serve_client_bench_and_sigterm(tmp_path):
    server = ServeProcess(
        "--model", "tiny", "--port", "0", "--metrics-port", "0", "--http-port", "0", "--max-batch", "4",
        "--grace", "1",
    )  # fmt: skip
    try:
        address, metrics_url = server.wait_serving()
        # The HTTP front of the same process: health, and one OpenAI-style request.
        line = next(x for x in server.lines if x.startswith("serving "))
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
        # SIGTERM with an open stream: the process exits 0 within the grace period; the stream ends
        # with UNAVAILABLE.
        channel = grpc.insecure_channel(address, options=channel_options())
        call = pb_grpc.TextToSpeechStub(channel).Synthesize(
            build_request("Long.", temperature=0.0, max_new_frames=900, first_chunk_frames=1)
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
