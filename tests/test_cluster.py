"""`tts serve --devices cpu,cpu`: two tiny replicas behind HAProxy, as real processes on 127.0.0.1.

The cluster tests need the `haproxy` binary (Debian's package; `.ci/run` installs it) and skip, saying
so, only where it is absent. They wait on events (lines the cluster prints, statuses, HAProxy's view)
with generous deadlines and count exactly; no assertion depends on how fast anything runs, except that
HAProxy notices a draining replica within its `--drain-delay` (3 s here against 0.2 s checks).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from service_helpers import HOLD_FRAMES, HOLD_TEXT
from tts_tools.loadtest import replica_shares, run_loadtest

from service import cluster
from service.client import build_request, channel_options
from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.cli.main import build_parser, main

pytest.importorskip("grpc_health")
ROOT = Path(__file__).resolve().parent.parent
HAPROXY = shutil.which(
    "haproxy", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
)
needs_proxy = pytest.mark.skipif(
    HAPROXY is None,
    reason="the haproxy binary is not installed (apt-get install haproxy; .ci/run installs it)",
)
# A stream of exactly HOLD_FRAMES frames whatever the random weights do, float32 one frame per chunk: its
# 1.5 MB cannot pass HTTP/2's windows (BDP probing off) and HAProxy's buffers unless the client reads.
HOLD = dict(
    temperature=0.0, max_new_frames=HOLD_FRAMES, min_new_frames=HOLD_FRAMES, first_chunk_frames=1,
    chunk_frames=1, encoding="float32",
)  # fmt: skip
SHORT_FRAMES = 6
DRAIN_DELAY = 3.0


class ClusterProcess:
    """`tts serve --devices cpu,cpu` in a subprocess; its stderr lines are kept and can be waited for."""

    def __init__(self, *args: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_line(self, pattern: str, start: int = 0, timeout: float = 120.0) -> tuple[int, re.Match]:
        """The first line at index >= start that matches `pattern` (re.search): (index, match)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for i in range(start, len(self.lines)):
                    m = re.search(pattern, self.lines[i])
                    if m:
                        return i, m
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, f"no line like {pattern!r}:\n" + self.text()
                self.changed.wait(min(left, 1.0))

    def text(self) -> str:
        return "\n".join(self.lines[-80:])

    def pid(self, name: str) -> int:
        """The current process id of replica `name`."""
        pids = [
            int(m.group(1)) for x in self.lines if (m := re.match(rf"replica {name} \(cpu\): pid (\d+),", x))
        ]
        return pids[-1]

    def replica_address(self, name: str) -> str:
        return next(
            m.group(1) for x in self.lines if (m := re.match(rf"replica {name} \(cpu\): .* gRPC (\S+),", x))
        )

    def replica_http(self, name: str) -> str:
        return next(
            m.group(1) for x in self.lines if (m := re.match(rf"replica {name} \(cpu\): .* HTTP (\S+),", x))
        )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def running():
    if HAPROXY is None:
        pytest.skip("the haproxy binary is not installed")
    c = ClusterProcess(
        "--devices",
        "cpu,cpu",
        "--model",
        "tiny",
        "--port",
        "0",
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--check-interval",
        "0.2",
        "--drain-delay",
        str(DRAIN_DELAY),
        "--grace",
        "3",
        "--max-batch",
        "4",
        "--voices-dir",
        "none",
    )
    try:
        _, m = c.wait_line(
            r"^serving tts\.v1\.TextToSpeech on (\S+) through haproxy .*HTTP on (\S+); metrics on (\S+)"
        )
        c.address, c.http, c.metrics = m.groups()
        yield c
    finally:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGINT)
            try:
                c.proc.wait(30)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


class ClosedLoop:
    """`clients` threads sending short streams through the proxy back to back until stopped; every call's
    send time, status, replica and frames are kept."""

    def __init__(self, address: str, clients: int):
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = pb_grpc.TextToSpeechStub(self.channel)
        self.results: list[dict] = []
        self.lock = threading.Condition()
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, k: int):
        i = 0
        while not self.stopped.is_set():
            i += 1
            request = build_request(
                f"Client {k} request {i}.", seed=i, max_new_frames=SHORT_FRAMES, min_new_frames=SHORT_FRAMES
            )
            sent = time.monotonic()
            r = {"sent": sent, "code": "OK", "replica": None, "frames": 0, "end": False}
            try:
                for response in self.stub.Synthesize(request, timeout=60):
                    kind = response.WhichOneof("message")
                    if kind == "header":
                        r["replica"] = response.header.replica
                    elif kind == "chunk":
                        r["frames"] = response.chunk.frame_end
                    else:
                        r["end"] = True
            except grpc.RpcError as exc:
                r["code"] = exc.code().name
            with self.lock:
                self.results.append(r)
                self.lock.notify_all()

    def wait_for(self, predicate, timeout: float = 120.0) -> None:
        """Wait until predicate(results) holds."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not predicate(self.results):
                left = deadline - time.monotonic()
                assert left > 0, f"condition not met; {len(self.results)} results"
                self.lock.wait(min(left, 1.0))

    def stop(self) -> list[dict]:
        self.stopped.set()
        for t in self.threads:
            t.join(120)
        self.channel.close()
        return self.results


def check_complete(results: list[dict]) -> None:
    """Every call that ended OK has its header, all its frames and its end message: no silent truncation."""
    for r in results:
        if r["code"] == "OK":
            assert r["end"] and r["frames"] == SHORT_FRAMES and r["replica"] in ("r0", "r1"), r


# ---- the cluster, in order: spread, kill, drain, stop ------------------------------------------------


@needs_proxy
def test_no_proxy_server_news_before_serving(running):
    """The replicas' start makes HAProxy's health checks fail (servers DOWN, then UP): those lines are
    held back until the cluster says it serves."""
    start, _ = running.wait_line(r"^serving tts\.v1\.TextToSpeech")
    noise = [
        x
        for x in running.lines[:start]
        if x.startswith("[haproxy]") and re.search(r" is (DOWN|UP)|no server", x)
    ]
    assert noise == []


@needs_proxy
def test_calls_are_spread_per_request_and_health_is_the_wholes(running, tmp_path):
    # The closed loop of `tts bench-server` through the proxy: 4 clients on one channel each.
    report = tmp_path / "bench.json"
    args = ["bench-server", "--server", running.address, "--concurrency", "4", "--requests", "40"]
    args += ["--max-new-frames", str(SHORT_FRAMES), "--min-new-frames", str(SHORT_FRAMES), "--warmup", "0"]
    assert main([*args, "--json", str(report)]) == 0
    level = json.loads(report.read_text())["levels"][0]
    assert level["ok"] == 40 and level["errors"] == {}, level
    # Both replicas serve. (Not an even split: leastconn sends more calls to the replica that finishes
    # sooner, and with the CPU busy elsewhere one of the two can take 27 of 40.)
    shares = replica_shares(level)
    assert set(shares) == {"r0", "r1"} and sum(level["replicas"].values()) == 40, level["replicas"]
    # One client channel, calls one after another: each call is balanced on its own (leastconn sends a call
    # to an idle replica; with both idle, HAProxy takes them in turn), so one connection reaches both.
    with grpc.insecure_channel(running.address, options=channel_options()) as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        seen = {stub.GetInfo(pb.GetInfoRequest(), timeout=30).replica for _ in range(8)}
    assert seen == {"r0", "r1"}
    # Several servers given to the benchmark: requests go to them in turn, shares exactly half each.
    both = f"{running.replica_address('r0')},{running.replica_address('r1')}"
    result = asyncio.run(
        run_loadtest(
            both, [2], requests=10, warmup=0, max_new_frames=SHORT_FRAMES, min_new_frames=SHORT_FRAMES
        )
    )
    assert result["levels"][0]["replicas"] == {"r0": 5, "r1": 5} and result["servers"] == both.split(",")
    # Health of the whole on the proxy's HTTP port; the load signal on each replica's.
    health = json.loads(urllib.request.urlopen(running.http + "health", timeout=10).read())
    assert health == {"status": "serving", "replicas_serving": 2, "replicas": 2}
    load = json.loads(urllib.request.urlopen(running.replica_http("r1") + "load", timeout=10).read())
    assert load["replica"] == "r1" and load["status"] == "serving" and load["max_in_flight"] == 4 + 16
    assert {"in_flight", "running", "waiting", "kv_blocks_used", "kv_blocks_total", "load", "kv_used"} <= set(
        load
    )
    metrics = urllib.request.urlopen(running.metrics, timeout=10).read().decode()
    assert 'haproxy_server_status{proxy="grpc_replicas",server="r0"' in metrics
    replica_metrics = running.metrics.replace("/metrics", "/replicas/r0/metrics")
    assert "tts_requests_in_flight" in urllib.request.urlopen(replica_metrics, timeout=10).read().decode()


@needs_proxy
def test_a_killed_replica_fails_only_its_open_streams_and_comes_back(running):
    victim, survivor = "r0", "r1"
    channel = grpc.insecure_channel(
        running.address, options=channel_options() + [("grpc.http2.bdp_probe", 0)]
    )
    stub = pb_grpc.TextToSpeechStub(channel)
    held: list[tuple[str, object]] = []  # streams that cannot end until read: one at least on each replica
    while {name for name, _ in held} != {victim, survivor}:
        assert len(held) < 8, [name for name, _ in held]
        call = stub.Synthesize(build_request(HOLD_TEXT, seed=len(held), **HOLD))
        held.append((next(call).header.replica, call))
    loop = ClosedLoop(running.address, clients=2)
    loop.wait_for(lambda rs: len(rs) >= 4)
    mark = len(running.lines)
    os.kill(running.pid(victim), signal.SIGKILL)
    killed = time.monotonic()
    running.wait_line(rf"^replica {victim} \(cpu\) exited \(killed by SIGKILL\); restarting", mark)
    # The streams open on the killed replica end with an error status, never OK; those on the survivor
    # end normally with every frame.
    for name, call in held:
        if name == victim:
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() != grpc.StatusCode.OK
            assert info.value.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.INTERNAL,
            ), info.value
        else:
            responses = list(call)
            assert responses[-1].WhichOneof("message") == "end" and responses[-1].end.frames == HOLD_FRAMES
    # It restarts, passes its health check and gets calls again.
    index, _ = running.wait_line(rf"^replica {victim} \(cpu\) serving again", mark)
    back = time.monotonic()
    loop.wait_for(
        lambda rs: any(r["sent"] > back and r["replica"] == victim and r["code"] == "OK" for r in rs)
    )
    results = loop.stop()
    channel.close()
    after = [r for r in results if r["sent"] > killed]
    assert after and all(r["code"] == "OK" for r in after), [r for r in after if r["code"] != "OK"]
    assert any(r["replica"] == survivor for r in after)
    check_complete(results)


@needs_proxy
def test_a_draining_replica_loses_no_call(running):
    victim = "r1"
    loop = ClosedLoop(running.address, clients=3)
    loop.wait_for(lambda rs: len(rs) >= 6)
    mark = len(running.lines)
    os.kill(running.pid(victim), signal.SIGTERM)
    # HAProxy sees it NOT_SERVING (503 on /health) and stops sending while it still admits calls.
    running.wait_line(r"Server grpc_replicas/r1 is DOWN", mark)
    running.wait_line(rf"^replica {victim} \(cpu\) exited \(exit code 0\); restarting", mark)
    running.wait_line(rf"^replica {victim} \(cpu\) serving again", mark)
    back = time.monotonic()
    loop.wait_for(lambda rs: any(r["sent"] > back and r["replica"] == victim for r in rs))
    results = loop.stop()
    failed = [r for r in results if r["code"] != "OK"]
    assert not failed, failed
    check_complete(results)


@needs_proxy
def test_sigterm_drains_every_replica_then_stops_the_proxy(running):
    pids = [running.pid("r0"), running.pid("r1")]
    proxy_pid = int(running.wait_line(r"^haproxy: pid (\d+),")[1].group(1))
    channel = grpc.insecure_channel(
        running.address, options=channel_options() + [("grpc.http2.bdp_probe", 0)]
    )
    held = pb_grpc.TextToSpeechStub(channel).Synthesize(build_request(HOLD_TEXT, seed=9, **HOLD))
    assert next(held).WhichOneof("message") == "header"
    mark = len(running.lines)
    t0 = time.monotonic()
    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(60) == 0, running.text()
    # A stream that cannot end was ended at the end of --grace: UNAVAILABLE, passed through the proxy.
    with pytest.raises(grpc.RpcError) as info:
        for _ in held:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    channel.close()
    assert time.monotonic() - t0 < DRAIN_DELAY + 3 + 10
    running.wait_line(r"^shutting down \(SIGTERM: drain delay 3 s, grace 3 s, 2 replicas\)", mark)
    running.wait_line(r"^stopped in ", mark)
    assert not any(pid_alive(p) for p in [*pids, proxy_pid])


# ---- options and configuration (no processes) -----------------------------------------------------------


def test_a_missing_proxy_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cluster.shutil, "which", lambda *a, **k: None)
    assert main(["serve", "--devices", "cpu,cpu", "--model", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == "tts: error: haproxy not found: apt-get install haproxy"


BAD = [
    (["--devices", ""], "--devices must be a comma-separated list of devices like cuda:0,cuda:1, got ''"),
    (["--devices", "cpu,,cpu"],
     "--devices must be a comma-separated list of devices like cuda:0,cuda:1, got 'cpu,,cpu'"),
    (["--devices", "cpu", "--device", "cuda:1"], "give --device or --devices, not both"),
    (["--devices", "cpu,nope"], "bad --device 'nope': "),
    (["--devices", "cpu", "--replica-name", "x"],
     "--replica-name does not go with --devices (the replicas are named r0, r1, ...)"),
    (["--devices", "cpu", "--wyoming-port", "10200"],
     "--wyoming-port does not go with --devices (HAProxy does not carry Wyoming yet)"),
    (["--devices", "cpu", "--check-interval", "0"],
     "--check-interval must be a number of seconds > 0, got 0"),
    (["--devices", "cpu,cpu", "--replica-base-port", "80"],
     "--replica-base-port must be 0 or in 1024..65530 for 2 replicas, got 80"),
    (["--drain-delay", "-1"], "--drain-delay must be a number of seconds >= 0, got -1"),
    (["--max-connection-age", "nan"], "--max-connection-age must be a number of seconds >= 0, got nan"),
    (["--max-connection-age-grace", "5"], "--max-connection-age-grace needs --max-connection-age"),
    (["--replica-name", "a b"],
     "--replica-name must be 1-100 characters of letters, digits and ._:@/- "
     "(starting with a letter or digit), got 'a b'"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_cluster_options_are_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(cluster, "find_proxy", lambda: "haproxy")
    monkeypatch.setattr("tts.checkpoints.load.load_bundle", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["serve", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tts: error: " + message) and "\n" not in err, err


def test_replicas_get_the_options_that_are_not_the_clusters():
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "--devices",
            "cpu,cpu",
            "--model",
            "tiny",
            "--port",
            "9000",
            "--max-batch",
            "4",
            "--buckets",
            "1,2",
            "--graphs",
            "off",
            "--grace",
            "2.5",
            "--max-connection-age",
            "60",
        ]
    )
    from tts.cli import serve as service_cli

    words = cluster.forwarded_options(args, service_cli._SERVE_PARSER)
    assert words == [
        "--model",
        "tiny",
        "--max-batch",
        "4",
        "--graphs",
        "off",
        "--buckets",
        "1,2",
        "--grace",
        "2.5",
        "--max-connection-age",
        "60.0",
    ]


def test_replicas_get_the_preparation_deadline():
    """`--max-prepare-seconds` reaches every replica (it is no cluster option)."""
    from tts.cli import serve as service_cli

    args = build_parser().parse_args(["serve", "--devices", "cpu,cpu", "--max-prepare-seconds", "2.5"])
    words = cluster.forwarded_options(args, service_cli._SERVE_PARSER)
    assert words == ["--max-prepare-seconds", "2.5"]


def test_replicas_get_the_session_limit():
    """`--max-sessions` reaches every replica (it is no cluster option)."""
    from tts.cli import serve as service_cli

    args = build_parser().parse_args(["serve", "--devices", "cpu,cpu", "--max-sessions", "3"])
    words = cluster.forwarded_options(args, service_cli._SERVE_PARSER)
    assert words == ["--max-sessions", "3"]


def _replicas(n: int) -> list[cluster.Replica]:
    return [cluster.Replica(i, "cpu", 41000 + 3 * i, 41001 + 3 * i, 41002 + 3 * i) for i in range(n)]


def test_the_rendered_configuration():
    text = cluster.render_config(
        _replicas(2),
        grpc_bind="127.0.0.1:50051",
        http_bind="127.0.0.1:8000",
        metrics_bind=None,
        admin_socket="/tmp/x/admin.sock",
        check_interval=0.5,
    )
    assert "server r0 127.0.0.1:41000 proto h2 port 41001 check-proto h1" in text
    assert "server r1 127.0.0.1:41004" in text and "bind 127.0.0.1:8000" in text
    assert "balance leastconn" in text and "inter 500ms fastinter 250ms" in text
    assert "frontend metrics" not in text and "# [section http]" not in text and "${" not in text
    assert "prometheus-exporter" in cluster.render_config(
        _replicas(1),
        grpc_bind="[::1]:1",
        http_bind=None,
        metrics_bind="127.0.0.1:9",
        admin_socket="s",
        check_interval=1,
    )


@needs_proxy
@pytest.mark.parametrize("http, metrics", [(True, True), (False, False)])
def test_haproxy_accepts_the_rendered_configuration(tmp_path, http, metrics):
    path = tmp_path / "haproxy.cfg"
    path.write_text(
        cluster.render_config(
            _replicas(3),
            grpc_bind="127.0.0.1:50051",
            http_bind="127.0.0.1:8000" if http else None,
            metrics_bind="127.0.0.1:9464" if metrics else None,
            admin_socket=str(tmp_path / "admin.sock"),
            check_interval=1.0,
        )
    )
    cluster.check_config(HAPROXY, path)  # raises UserError with HAProxy's alert
    path.write_text(path.read_text().replace("    balance leastconn", "    balance nonsense", 1))
    with pytest.raises(cluster.UserError, match=r"^haproxy rejected .*haproxy\.cfg: "):
        cluster.check_config(HAPROXY, path)


def test_server_states_parses_show_stat():
    text = (
        "# pxname,svname,qcur,status,\ngrpc_replicas,r0,0,UP,\ngrpc_replicas,r1,0,DOWN 1/2,\n"
        "grpc_replicas,BACKEND,0,UP,\n"
    )
    assert cluster.server_states(text) == {("grpc_replicas", "r0"): "UP", ("grpc_replicas", "r1"): "DOWN 1/2"}


@needs_proxy
def test_health_says_unavailable_until_the_proxy_can_route_to_a_replica(tmp_path):
    """The front's /health counts a replica only once the proxy can send it calls: the servers start in
    maintenance (HAProxy would otherwise count a server UP before its first check, while nothing listens
    on its port yet), and the cluster puts each in rotation when the replica says it serves. Checks are
    an hour apart here, so no health check changes anything during the test."""
    import http.server

    class Replica(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b'{"status": "serving"}' if self.path == "/health" else b"routed"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    replica_http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=replica_http.serve_forever, daemon=True).start()
    r = cluster.Replica(0, "cpu", *cluster.free_ports("127.0.0.1", 1), replica_http.server_address[1], 0)
    front, grpc_port = cluster.free_ports("127.0.0.1", 2)
    admin = str(tmp_path / "admin.sock")
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        cluster.render_config(
            [r],
            grpc_bind=f"127.0.0.1:{grpc_port}",
            http_bind=f"127.0.0.1:{front}",
            metrics_bind=None,
            admin_socket=admin,
            check_interval=3600.0,
        )
    )
    proxy = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stderr=subprocess.DEVNULL)
    try:

        def get(path: str) -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{front}{path}", timeout=30) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as err:
                return err.code, err.read()

        async def answers() -> str:
            return await cluster.admin_command(admin, "show info")

        deadline = time.monotonic() + 30
        while True:  # HAProxy's start: its admin socket answers once the configuration is loaded
            try:
                if "Name:" in asyncio.run(answers()):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proxy.poll() is None, "haproxy did not start"
            time.sleep(0.05)
        status, body = get("/health")
        assert status == 503 and json.loads(body)["replicas_serving"] == 0
        assert get("/v1/models")[0] == 503  # and nothing is routed to it
        asyncio.run(cluster.set_replica_state(admin, r, "ready", http=True))
        status, body = get("/health")
        assert status == 200 and json.loads(body) == {
            "status": "serving",
            "replicas_serving": 1,
            "replicas": 1,
        }
        assert get("/v1/models") == (200, b"routed")
        asyncio.run(cluster.set_replica_state(admin, r, "maint", http=True))  # (a replica that exited)
        assert get("/health")[0] == 503
    finally:
        proxy.terminate()
        proxy.wait(30)
        replica_http.shutdown()


@needs_proxy
def test_keys_reach_every_replica_by_environment_not_command_line():
    """`--api-key` with `--devices`: calls through HAProxy need the key (HTTP and gRPC), health stays open,
    the public Host passes each replica's Host check, and no replica's command line shows the key."""
    key = "cluster-key-123"
    c = ClusterProcess(
        "--devices", "cpu,cpu", "--model", "tiny", "--port", "0", "--http-port", "0", "--metrics-port", "-1",
        "--check-interval", "0.2", "--grace", "1", "--max-batch", "2", "--voices-dir", "none",
        "--api-key", key,
    )  # fmt: skip
    try:
        _, m = c.wait_line(r"^serving tts\.v1\.TextToSpeech on (\S+) through haproxy .*HTTP on (\S+)")
        address, http = m.groups()

        def get(path, headers=None):
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(http + path, headers=headers or {}), timeout=30
                ) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert get("health") == 200
        assert get("v1/models") == 401
        assert get("v1/models", {"Authorization": f"Bearer {key}"}) == 200
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = pb_grpc.TextToSpeechStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetInfo(pb.GetInfoRequest(), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetInfo(
                pb.GetInfoRequest(), metadata=(("authorization", f"Bearer {key}"),), timeout=30
            )
        for name in ("r0", "r1"):
            cmdline = Path(f"/proc/{c.pid(name)}/cmdline").read_bytes()
            assert key.encode() not in cmdline
    finally:
        c.proc.send_signal(signal.SIGINT)
        try:
            c.proc.wait(30)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
