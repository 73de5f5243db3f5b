"""`tts serve --devices D1,D2,...`: one replica process per device behind HAProxy, on one host.

Every replica is an ordinary `tts serve` process (`--device Di`, `--replica-name ri`) on internal ports of
127.0.0.1; HAProxy, configured from `service/deploy/haproxy.cfg.template`, owns the public gRPC, HTTP and
metrics ports and spreads every call (every HTTP/2 stream) on its own over the replicas that pass their
health checks. This module only starts, watches and stops processes and renders that configuration: the
routing, the health checks and the retries are HAProxy's.

* Start: the public ports are checked, HAProxy's configuration is rendered into a temporary directory
  and checked (`haproxy -c`), HAProxy starts (it answers 503 / UNAVAILABLE until a replica serves), then
  every replica; `serving ...` is printed once every replica has warmed up and HAProxy has seen each one
  pass its health check. A replica that fails before it first serves stops everything with its error.
* A replica that exits while the cluster serves (a crash, a kill, an operator's SIGTERM) is reported on
  stderr and, unless `--restart off`, started again on the same ports after 1 s (doubling for each exit
  before it served again, at most 30 s); HAProxy sends it calls again once its health check passes.
  If HAProxy itself exits, the replicas are drained and the command exits 1.
* SIGTERM drains every replica (each says NOT_SERVING at once, keeps admitting for `--drain-delay`, then
  gives open streams `--grace`); Ctrl-C (SIGINT) does the same without the delay. Once every replica
  has exited (a replica still running `--drain-delay` + `--grace` + 10 s later is killed), HAProxy is
  stopped and the command exits 0.

Replica output is printed with the prefix `[rI]`, HAProxy's warnings with `[haproxy]` (but for its
servers' DOWN / UP news while the replicas start or stop: the cluster's own lines say that; a failed
start shows the last of them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import os
import re
import shutil
import signal
import socket
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from service.access import KEYS_ENV, is_loopback, parse_keys
from tts.runtime.errors import UserError

TEMPLATE = Path(__file__).resolve().parent / "deploy" / "haproxy.cfg.template"
PROXY = "haproxy"
PROXY_MISSING = "haproxy not found: apt-get install haproxy"
# While the replicas load, HAProxy's health checks fail (their HTTP ports are not open yet): it reports
# each server DOWN, then UP again; while they stop, DOWN again. The cluster says itself when every
# replica serves and when it stops, so these lines are held back then (and shown if the start fails);
# in between they are news (a replica that dies or drains).
PROXY_SERVER_NEWS = re.compile(r"Server \S+ is (DOWN|UP)\b|has no server available")
# Options `tts serve --devices` sets itself on every replica (not forwarded from its own command line).
OWN_OPTIONS = {
    "devices", "device", "host", "port", "http_port", "metrics_host", "metrics_port", "replica_name",
    "drain_delay", "replica_base_port", "check_interval", "restart", "func", "command",
    "api_key", "api_key_file", "allowed_host",
}  # fmt: skip
# The Host HAProxy's health checks send to a replica (service/deploy/haproxy.cfg.template).
CHECK_HOST = "tts-replica"
RESTART_DELAYS = (1.0, 30.0)  # the first restart delay, the longest (doubling in between)


@dataclass
class Replica:
    """One replica process: its name, device and internal ports, and its current process."""

    index: int
    device: str
    grpc_port: int
    http_port: int
    metrics_port: int
    proc: asyncio.subprocess.Process | None = None
    serving: asyncio.Event = field(default_factory=asyncio.Event)
    starts: int = 0
    failures: int = 0  # exits since it last served
    last_error: str = ""

    @property
    def name(self) -> str:
        return f"r{self.index}"


# ---- options and configuration ----------------------------------------------------------------------


def find_proxy() -> str:
    """The HAProxy binary (PATH, then the sbin folders); raises UserError naming the package."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
    found = shutil.which(PROXY, path=path)
    if found is None:
        raise UserError(PROXY_MISSING)
    return found


def parse_devices(text: str) -> list[str]:
    """`cuda:0,cuda:1` -> ["cuda:0", "cuda:1"]; raises UserError on an empty list or item."""
    devices = [d.strip() for d in text.split(",")]
    if not text.strip() or any(not d for d in devices):
        raise UserError(
            f"--devices must be a comma-separated list of devices like cuda:0,cuda:1, got {text!r}"
        )
    return devices


def free_ports(host: str, n: int) -> list[int]:
    """n distinct ports that were free on `host` a moment ago (all bound at once, then released)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def forwarded_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The `tts serve` options of `args` that differ from their defaults, as command-line words for a
    replica (the options in OWN_OPTIONS excepted: the cluster sets those per replica)."""
    words: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        if not action.option_strings or action.dest in OWN_OPTIONS or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        option = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            words.append(option)
            continue
        words += [option, ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)]
    return words


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _seconds(value: float) -> str:
    return f"{max(1, round(value * 1000))}ms"


def render_config(
    replicas: list[Replica],
    *,
    grpc_bind: str,
    http_bind: str | None,
    metrics_bind: str | None,
    admin_socket: str,
    check_interval: float,
    template: str | None = None,
) -> str:
    """HAProxy's configuration for `replicas` from the template (`TEMPLATE` unless given): server lines for
    each replica in the gRPC and HTTP backends, a metrics route per replica; the http / metrics sections
    are left out when their bind address is None."""
    text = TEMPLATE.read_text(encoding="utf-8") if template is None else template
    for section, on in (("http", http_bind is not None), ("metrics", metrics_bind is not None)):
        pattern = rf"# \[section {section}\]\n(.*?)# \[end {section}\]\n"
        text = re.sub(pattern, (lambda m: m.group(1)) if on else "", text, flags=re.S)
    # `port N` on a server line is where its health check goes: the replica's HTTP port.
    # `disabled`: every server starts in maintenance, out of rotation and not counted by /health (HAProxy
    # would count a server UP before its first check, while nothing listens on its ports yet); the
    # cluster puts it in rotation when the replica says it serves (`set_replica_state`).
    grpc = [
        f"    server {r.name} 127.0.0.1:{r.grpc_port} proto h2 port {r.http_port} check-proto h1 disabled"
        for r in replicas
    ]
    http = [f"    server {r.name} 127.0.0.1:{r.http_port} disabled" for r in replicas]
    routes = [f"    use_backend metrics_{r.name} if {{ path /replicas/{r.name}/metrics }}" for r in replicas]
    backends = []
    for r in replicas:
        backends += [
            f"\nbackend metrics_{r.name}",
            "    http-request set-path /metrics",
            f"    server {r.name} 127.0.0.1:{r.metrics_port}",
        ]
    return string.Template(text).substitute(
        grpc_bind=grpc_bind,
        http_bind=http_bind or "",
        metrics_bind=metrics_bind or "",
        admin_socket=admin_socket,
        check_interval=_seconds(check_interval),
        fast_interval=_seconds(check_interval / 2),
        replica_count=len(replicas),
        grpc_servers="\n".join(grpc),
        http_servers="\n".join(http),
        metrics_routes="\n".join(routes),
        metrics_backends="\n".join(backends),
    )


def check_config(proxy: str, path: Path) -> None:
    """`haproxy -c`: raises UserError with HAProxy's first alert if it rejects the configuration."""
    import subprocess

    r = subprocess.run([proxy, "-c", "-q", "-f", str(path)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        lines = [x.strip() for x in (r.stderr + r.stdout).splitlines() if x.strip()]
        alert = next((x for x in lines if "ALERT" in x), lines[0] if lines else f"exit code {r.returncode}")
        raise UserError(f"{PROXY} rejected {path}: {alert}")


# ---- HAProxy's runtime API ----------------------------------------------------------------------------


async def admin_command(socket_path: str, command: str, timeout: float = 5.0) -> str:
    """Send one command to HAProxy's stats socket and return its answer."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), timeout)
    try:
        writer.write(command.encode() + b"\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.read(), timeout)).decode("utf-8", "replace")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def set_replica_state(socket_path: str, replica: Replica, state: str, *, http: bool) -> None:
    """Put `replica`'s servers (gRPC, and HTTP when `http`) in rotation (`state` "ready": HAProxy counts
    it UP at once, then its health checks go on) or take them out ("maint"). Raises RuntimeError with
    HAProxy's answer if it refuses."""
    for backend in ("grpc_replicas", "http_replicas") if http else ("grpc_replicas",):
        answer = await admin_command(socket_path, f"set server {backend}/{replica.name} state {state}")
        if answer.strip():
            raise RuntimeError(f"{PROXY} refused to set {backend}/{replica.name} {state}: {answer.strip()}")


def server_states(show_stat: str) -> dict[tuple[str, str], str]:
    """`show stat` CSV -> {(backend, server): status} ("UP", "DOWN", "MAINT", "no check", ...)."""
    text = show_stat.lstrip("# ")
    out = {}
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("svname") not in (None, "FRONTEND", "BACKEND"):
            out[(row["pxname"], row["svname"])] = row.get("status", "")
    return out


# ---- the supervisor -----------------------------------------------------------------------------------


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


def _find_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl  # Linux (glibc, musl)
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()  # looked up here: a child between fork and exec must not import anything


def _die_with_parent() -> None:
    """In a child before exec: get SIGTERM when the supervisor dies (Linux), so no replica outlives it."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class Cluster:
    """The replicas and HAProxy of one `tts serve --devices` command (see the module docstring)."""

    def __init__(
        self, args: argparse.Namespace, parser: argparse.ArgumentParser, devices: list[str], proxy: str
    ):
        self.args = args
        self.proxy = proxy
        self.workdir = Path(tempfile.mkdtemp(prefix="tts-serve-"))
        self.config_path = self.workdir / "haproxy.cfg"
        self.admin_socket = str(self.workdir / "admin.sock")
        self.forwarded = forwarded_options(args, parser)
        # Keys reach the replicas in their environment, not their command line (which `ps` shows).
        self.api_keys = parse_keys(args.api_key, os.environ.get(KEYS_ENV), args.api_key_file)
        # A replica (on loopback) sees the Host clients sent HAProxy: the public names, checked like a
        # single server's (loopback's and --allowed-host) when the public side is loopback; any otherwise.
        hosts = ["*"] if not is_loopback(args.host) else [*args.allowed_host, CHECK_HOST]
        self.forwarded += ["--allowed-host", ",".join(hosts)]
        self.drain_delay = args.drain_delay
        self.stopping = False
        self.started = False  # every replica served once and HAProxy saw it (`serving ...` said)
        self.held_proxy_lines: list[str] = []  # PROXY_SERVER_NEWS held back during the start
        self.stop_signal = signal.SIGTERM
        self._wake = asyncio.Event()
        self.proxy_proc: asyncio.subprocess.Process | None = None
        self.tasks: list[asyncio.Task] = []
        ports = self._ports(len(devices))
        self.replicas = [Replica(i, d, *ports[i]) for i, d in enumerate(devices)]

    def _ports(self, n: int) -> list[tuple[int, int, int]]:
        base = self.args.replica_base_port
        flat = list(range(base, base + 3 * n)) if base else free_ports("127.0.0.1", 3 * n)
        return [(flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]) for i in range(n)]

    # ---- output

    @staticmethod
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    async def _forward(self, stream: asyncio.StreamReader, prefix: str, replica: Replica | None) -> None:
        while True:
            raw = await stream.readline()
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if replica is None and (not self.started or self.stopping) and PROXY_SERVER_NEWS.search(line):
                if not self.started:
                    self.held_proxy_lines = [*self.held_proxy_lines[-19:], line]
                continue
            self.say(f"[{prefix}] {line}")
            if replica is not None:
                if line.startswith("serving "):
                    replica.serving.set()
                elif line.startswith("tts: error:"):
                    replica.last_error = line.removeprefix("tts: error:").strip()

    # ---- processes

    def _env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parent.parent)  # the folder holding the tts and service packages
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        env.pop(KEYS_ENV, None)
        if self.api_keys:
            env[KEYS_ENV] = ",".join(self.api_keys)
        return env

    async def _start_proxy(self) -> None:
        self.proxy_proc = proc = await asyncio.create_subprocess_exec(
            self.proxy,
            "-db",
            "-f",
            str(self.config_path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        assert proc.stdout is not None  # (stdout=PIPE)
        self.tasks.append(asyncio.ensure_future(self._forward(proc.stdout, PROXY, None)))
        deadline = time.monotonic() + 30
        while True:
            if proc.returncode is not None:
                raise UserError(f"{PROXY} exited at start-up ({_describe_exit(proc.returncode)})")
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                if "Name:" in await admin_command(self.admin_socket, "show info", 2.0):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{PROXY} did not answer on {self.admin_socket} within 30 s")
            await asyncio.sleep(0.05)

    async def _start_replica(self, r: Replica) -> None:
        a = self.args
        argv = [
            sys.executable,
            "-m",
            "tts.cli.main",
            *(["-v"] if getattr(a, "verbose", False) else []),
            "serve",
            "--device",
            r.device,
            "--host",
            "127.0.0.1",
            "--port",
            str(r.grpc_port),
            "--http-port",
            str(r.http_port),
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(r.metrics_port),
            "--replica-name",
            r.name,
            "--drain-delay",
            str(self.drain_delay),
            *self.forwarded,
        ]
        r.serving.clear()
        r.last_error = ""
        r.proc = proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        r.starts += 1
        assert proc.stdout is not None  # (stdout=PIPE)
        self.tasks.append(asyncio.ensure_future(self._forward(proc.stdout, r.name, r)))
        self.say(
            f"replica {r.name} ({r.device}): pid {proc.pid}, gRPC 127.0.0.1:{r.grpc_port}, "
            f"HTTP http://127.0.0.1:{r.http_port}/, metrics http://127.0.0.1:{r.metrics_port}/metrics"
        )

    async def _wait_first_start(self, r: Replica) -> None:
        """Wait until `r` serves; raise UserError / RuntimeError with its error if it exits first."""
        proc = r.proc
        assert proc is not None  # (_start started it)
        exited = asyncio.ensure_future(proc.wait())
        serving = asyncio.ensure_future(r.serving.wait())
        await asyncio.wait([exited, serving], return_when=asyncio.FIRST_COMPLETED)
        if serving.done():
            exited.cancel()
            await self._set_state(r, "ready")
            return
        serving.cancel()
        await asyncio.sleep(0.2)  # let its last lines through
        code = exited.result()  # = proc.returncode
        reason = r.last_error or _describe_exit(code)
        error = UserError if code == 2 else RuntimeError
        raise error(f"replica {r.name} ({r.device}) failed to start: {reason}")

    async def _set_state(self, r: Replica, state: str) -> None:
        await set_replica_state(self.admin_socket, r, state, http=self.args.http_port >= 0)

    async def _wait_proxy_sees_all(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        backends = ["grpc_replicas"] + (["http_replicas"] if self.args.http_port >= 0 else [])
        wanted = {(b, r.name) for b in backends for r in self.replicas}
        while True:
            states = server_states(await admin_command(self.admin_socket, "show stat"))
            if all(states.get(k, "").startswith("UP") for k in wanted):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{PROXY} did not see every replica pass its health check: {states}")
            await asyncio.sleep(0.05)

    async def _watch(self, r: Replica) -> None:
        """Report an unexpected exit of `r` and restart it (unless --restart off) until the cluster stops."""
        while True:
            assert r.proc is not None  # (started before it is watched, and restarted below)
            code = await r.proc.wait()
            if self.stopping:
                return
            with contextlib.suppress(OSError, RuntimeError, asyncio.TimeoutError):
                await self._set_state(r, "maint")  # out of rotation until it serves again
            served = r.serving.is_set()
            r.failures = 1 if served else r.failures + 1
            delay = min(RESTART_DELAYS[1], RESTART_DELAYS[0] * 2 ** (r.failures - 1))
            why = _describe_exit(code) + (f": {r.last_error}" if r.last_error else "")
            if self.args.restart == "off":
                self.say(f"replica {r.name} ({r.device}) exited ({why}); not restarting (--restart off)")
                return
            self.say(f"replica {r.name} ({r.device}) exited ({why}); restarting in {delay:g} s")
            try:
                await asyncio.wait_for(self._wake.wait(), delay)  # set when the cluster stops
            except asyncio.TimeoutError:
                pass
            if self.stopping:
                return
            await self._start_replica(r)
            self.tasks.append(asyncio.ensure_future(self._announce(r)))

    async def _announce(self, r: Replica) -> None:
        proc = r.proc
        assert proc is not None  # (_watch has just restarted it)
        await r.serving.wait()
        if r.proc is proc and not self.stopping:
            with contextlib.suppress(OSError, RuntimeError, asyncio.TimeoutError):
                await self._set_state(r, "ready")
            r.failures = 0
            self.say(f"replica {r.name} ({r.device}) serving again (pid {proc.pid}, start {r.starts})")

    async def _stop_replicas(self, sig: signal.Signals) -> None:
        running = [(r, r.proc) for r in self.replicas if r.proc is not None and r.proc.returncode is None]
        for _, proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        limit = (self.drain_delay if sig == signal.SIGTERM else 0.0) + self.args.grace + 10.0
        waits = [asyncio.ensure_future(proc.wait()) for _, proc in running]
        if waits:
            await asyncio.wait(waits, timeout=limit)
        for r, proc in running:
            if proc.returncode is None:
                self.say(
                    f"replica {r.name} ({r.device}) still running {limit:g} s after {sig.name}: killing it"
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    async def _stop_proxy(self) -> None:
        p = self.proxy_proc
        if p is not None and p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            try:
                await asyncio.wait_for(p.wait(), 10)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()

    # ---- the whole

    async def _start(self) -> None:
        """Render and check the configuration, start HAProxy and every replica, wait until each serves and
        HAProxy has seen it pass its health check; print `serving ...`."""
        a = self.args
        http_bind = _address(a.host, a.http_port) if a.http_port >= 0 else None
        metrics_bind = _address(a.metrics_host, a.metrics_port) if a.metrics_port >= 0 else None
        self.config_path.write_text(
            render_config(
                self.replicas,
                grpc_bind=_address(a.host, a.port),
                http_bind=http_bind,
                metrics_bind=metrics_bind,
                admin_socket=self.admin_socket,
                check_interval=a.check_interval,
            )
        )
        await asyncio.to_thread(check_config, self.proxy, self.config_path)
        await self._start_proxy()
        assert self.proxy_proc is not None  # (_start_proxy started it)
        self.say(f"{PROXY}: pid {self.proxy_proc.pid}, configuration {self.config_path}")
        for r in self.replicas:
            await self._start_replica(r)
        await asyncio.gather(*(self._wait_first_start(r) for r in self.replicas))
        await self._wait_proxy_sees_all()
        names = ", ".join(f"{r.name} on {r.device}" for r in self.replicas)
        http = f"; HTTP on http://{a.host}:{a.http_port}/" if http_bind else ""
        metrics = f"; metrics on http://{a.metrics_host}:{a.metrics_port}/metrics" if metrics_bind else ""
        self.say(
            f"serving tts.v1.TextToSpeech on {a.host}:{a.port} through {PROXY} ({len(self.replicas)} "
            "replicas: "
            f"{names}; max batch {a.max_batch} each){http}{metrics}"
        )
        self.started = True

    async def _serve(self) -> int:
        """Watch the replicas (restarting them) and HAProxy until a stop signal; returns the exit code."""
        watchers = [asyncio.ensure_future(self._watch(r)) for r in self.replicas]
        assert self.proxy_proc is not None  # (_start started it)
        proxy_exit = asyncio.ensure_future(self.proxy_proc.wait())
        stop_wait = asyncio.ensure_future(self._wake.wait())
        await asyncio.wait([proxy_exit, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if proxy_exit.done() and not self.stopping:
            self.say(f"{PROXY} exited unexpectedly ({_describe_exit(proxy_exit.result())}); stopping")
            self.stopping, self.stop_signal, code = True, signal.SIGINT, 1
            self._wake.set()
        for task in (*watchers, proxy_exit, stop_wait):
            task.cancel()
        return code

    async def run(self) -> int:
        """Start, serve until SIGTERM / SIGINT (or HAProxy's exit), drain and stop; returns the exit code.
        Raises UserError / RuntimeError (after stopping whatever had started) if the start fails."""
        aio_loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if not self.stopping:
                self.stop_signal = sig
            self.stopping = True
            self._wake.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            aio_loop.add_signal_handler(sig, on_signal, sig)
        code = 0
        try:
            start = asyncio.ensure_future(self._start())
            stop_wait = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait([start, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            if start.done():
                stop_wait.cancel()
                start.result()  # a failed start raises here
                code = await self._serve()
            else:
                start.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await start
        except BaseException as exc:
            if isinstance(exc, Exception) and not self.started:  # why HAProxy never saw every replica
                for line in self.held_proxy_lines:
                    self.say(f"[{PROXY}] {line}")
            self.stopping = True
            self._wake.set()
            await self._stop_replicas(signal.SIGINT)
            await self._stop_proxy()
            raise
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                aio_loop.remove_signal_handler(sig)
        delay = self.drain_delay if self.stop_signal == signal.SIGTERM else 0.0
        self.say(
            f"shutting down ({self.stop_signal.name}: drain delay {delay:g} s, grace {self.args.grace:g} s, "
            f"{len(self.replicas)} replicas)"
        )
        t0 = time.perf_counter()
        await self._stop_replicas(self.stop_signal)
        await self._stop_proxy()
        self.say(f"stopped in {time.perf_counter() - t0:.2f} s")
        return code

    def cleanup(self) -> None:
        """Remove the rendered configuration and the admin socket (after the processes have stopped)."""
        for task in self.tasks:
            task.cancel()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run_cluster(args: argparse.Namespace, parser: argparse.ArgumentParser, devices: list[str]) -> int:
    """`tts serve --devices ...` over `devices` (options and public ports already checked by `tts serve`):
    run until SIGTERM / Ctrl-C."""
    proxy = find_proxy()

    async def main() -> int:
        cluster = Cluster(args, parser, devices, proxy)
        try:
            return await cluster.run()
        finally:
            cluster.cleanup()

    return asyncio.run(main())
