"""`tts serve` and `tts client`: registered into the `tts` command by tts.cli.main.

Imports of grpc, the generated API and the server happen inside the commands, so `tts --help` and the
engine-only commands never need grpcio-health-checking or grpcio-reflection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
import signal
import socket
import sys
import time

from tts.cli.main import (
    EXIT_INCOMPLETE,
    TEXT_HELP,
    UserError,
    add_codec_dtype_arg,
    add_engine_args,
    add_model_args,
    add_normalize_arg,
    add_output_args,
    add_sampling_args,
    apply_threads,
    as_options,
    check_device,
    check_output_path,
    check_threads,
    engine_kwargs,
    output_format,
    read_reference_file,
    read_text_arg,
    refuse_partial,
    request_rule,
    require,
    resolve_graphs_arg,
    sampling_kwargs,
    summary_stream,
    torch_dtype,
    write_output,
)
from tts.runtime.errors import os_error_reason

log = logging.getLogger("tts.serve")

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP front (service/http.py)
REPLICA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,99}")
_SERVE_PARSER: argparse.ArgumentParser | None = None  # `tts serve --devices` forwards its options to replicas


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the synthesis server (gRPC and OpenAI-compatible HTTP)",
        description="Serve tts.v1.TextToSpeech over gRPC and the OpenAI-compatible HTTP API (--http-port) "
        "from one engine with continuous batching. Health reports NOT_SERVING (HTTP /health: 503) until "
        "the engine has warmed up. SIGTERM or Ctrl-C shut down gracefully. With --devices, one replica "
        "process per device "
        "behind HAProxy on the public ports (docs/operations.md: Scaling out).",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)"
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT}; 0 = any free)"
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"HTTP port of the OpenAI-compatible API, /health, /metrics and the playground on the same host "
        f"(default {DEFAULT_HTTP_PORT}; 0 = any free; -1 = off)",
    )
    p.add_argument(
        "--wyoming-port",
        type=int,
        default=-1,
        help="TCP port of the Wyoming protocol (Home Assistant's TTS, streaming text included) on the same "
        "host; no authentication, for a trusted network (default -1 = off; 0 = any free)",
    )
    add_model_args(p)
    add_codec_dtype_arg(p)
    from tts.params import AUTO_STREAM_TOKENS

    p.add_argument(
        "--max-batch",
        type=max_batch_arg,
        default="auto",
        help="requests decoded together, or auto (the default): on CUDA sized from the memory the KV cache "
        f"gets (--kv-memory-fraction) at {AUTO_STREAM_TOKENS} context tokens a stream, rounded down to a "
        "bucket; 8 on a CPU",
    )
    p.add_argument(
        "--max-waiting", type=int, default=16, help="requests queued beyond --max-batch (default 16)"
    )
    p.add_argument(
        "--max-sessions",
        type=int,
        default=16,
        help="streaming sessions (gRPC SynthesizeSession, Wyoming streaming) open at most (default 16)",
    )
    add_engine_args(p, graphs="startup")
    add_admission_args(p)
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus endpoint")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0 = any free; -1 = off)",
    )
    p.add_argument(
        "--grace", type=float, default=10.0, help="seconds open streams get at shutdown (default 10)"
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=None,
        help="on SIGTERM, seconds the server keeps admitting new calls while its health already says "
        "NOT_SERVING, so a load balancer that polls health stops sending before calls are refused "
        "(default 0; with --devices 5 x --check-interval); Ctrl-C (SIGINT) skips it",
    )
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=0.0,
        help="seconds after which a client connection is asked to go away (HTTP/2 GOAWAY) so long-lived "
        "clients reconnect and rebalance; streams on it continue (default 0 = never)",
    )
    p.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=None,
        help="seconds streams on a connection past --max-connection-age may still run before it is closed "
        "(default: as long as they need)",
    )
    p.add_argument(
        "--max-connection-idle",
        type=float,
        default=300.0,
        help="seconds a gRPC connection with no call open may stay before it is asked to go away (HTTP/2 "
        "GOAWAY; the client reconnects for its next call) (default 300; 0 = never)",
    )
    p.add_argument(
        "--max-grpc-connections",
        type=int,
        default=1024,
        help="gRPC client connections open at once; one past it is closed before its first call, which "
        "fails UNAVAILABLE (default 1024; the open-file limit is raised to hold them)",
    )
    p.add_argument(
        "--replica-name",
        default=None,
        help="this process's name in stream headers, GetInfo, the X-Replica header and /load (default "
        "HOSTNAME:PORT)",
    )
    g = p.add_argument_group("replicas on one host (--devices)")
    g.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, e.g. cuda:0,cuda:1 (or cpu,cpu): one replica process per device on "
        "internal ports of 127.0.0.1, behind HAProxy on --host/--port/--http-port/--metrics-port",
    )
    g.add_argument(
        "--replica-base-port",
        type=int,
        default=0,
        help="replica i listens on BASE+3i (gRPC), BASE+3i+1 (HTTP), BASE+3i+2 (metrics) of 127.0.0.1 "
        "(default 0: free ports picked at start)",
    )
    g.add_argument(
        "--check-interval",
        type=float,
        default=1.0,
        help="seconds between HAProxy's health checks of each replica (default 1)",
    )
    g.add_argument(
        "--restart",
        choices=["on", "off"],
        default="on",
        help="restart a replica that exits unexpectedly (default on; with off the others go on serving)",
    )
    p.add_argument(
        "--max-reference-mb", type=float, default=10.0, help="reference clip size limit (default 10)"
    )
    p.add_argument("--max-queued-chunks", type=int, default=8, help="unread chunks before a stream pauses")
    p.add_argument(
        "--pause-timeout",
        type=float,
        default=10.0,
        help="seconds a stream whose client does not read may keep its batch row while other requests "
        "wait; then it ends with RESOURCE_EXHAUSTED (default 10; 0 = never)",
    )
    p.add_argument(
        "--http-read-timeout",
        type=float,
        default=30.0,
        help="seconds an HTTP client may take to send a request's headers, or leave its body without a "
        "byte, before its connection is closed (default 30)",
    )
    p.add_argument(
        "--max-http-connections",
        type=int,
        default=4096,
        help="HTTP connections (WebSockets included) open at once on the HTTP port; the one that reaches "
        "it is answered 503, so idle clients cannot use up the process's open files (default 4096). The "
        "open-file limit is raised to hold this cap, gRPC's, Wyoming's and 256 more files; where its hard "
        "limit is lower, the caps come down in proportion, with a warning",
    )
    p.add_argument(
        "--max-wyoming-connections",
        type=int,
        default=256,
        help="Wyoming connections open at once; one more gets an error event (resource_exhausted) and is "
        "closed (default 256; the open-file limit is raised to hold them)",
    )
    p.add_argument(
        "--wyoming-idle-timeout",
        type=float,
        default=60.0,
        help="seconds a Wyoming connection may stay open with no synthesis in progress and no complete "
        "event before the server closes it (default 60; 0 = never)",
    )
    p.add_argument(
        "--max-prepare-seconds",
        type=float,
        default=10.0,
        help="the longest a request's preparation (text, reference clip, planning) may take before it ends "
        "with DEADLINE_EXCEEDED / HTTP 504 (default 10; a gRPC call's own shorter deadline wins)",
    )
    p.add_argument(
        "--max-text-bytes",
        type=int,
        default=20_000,
        help="longest text per request in UTF-8 bytes (default 20000)",
    )
    p.add_argument(
        "--max-audio-seconds",
        type=float,
        default=1800.0,
        help="audio per request before it ends with finish reason length (default 1800; 0 = no limit)",
    )
    p.add_argument(
        "--voices-dir",
        default=None,
        help="where registered voices (AddVoice, `tts voices add`) are kept (default: the per-user "
        "directory `tts voices` shows for this model; 'none' = in memory only)",
    )
    p.add_argument(
        "--reference-cache-mb",
        type=float,
        default=64.0,
        help="memory for encoded reference clips, reused when the same clip comes again (default 64; 0 = "
        "off)",
    )
    p.add_argument(
        "--codec-graphs",
        choices=["on", "off"],
        default=None,
        help="capture the codec stage's batched decode in CUDA graphs (CUDA only; default on, off with "
        "--codec-sms)",
    )
    p.add_argument(
        "--codec-gather-ms",
        type=float,
        default=0.0,
        help="how long a later audio chunk may wait at most in the codec stage for others to share its "
        "decode call (a call has a fixed part, about 3 ms on an H100); a job's first chunk never waits, "
        "nor does a call of 256 frames or more, and with real-time admission on (the default on CUDA) "
        "a call starts before the audio already sent to a queued chunk's player has played, less twice "
        "the recent calls' time and 10 ms (default 0 = no waiting: each call takes what is queued). "
        "Measured at 64 streams on an H100 with 200: the codec's GPU time halved, the frame steps were "
        "no faster, and a few chunks were still late (docs/benchmarks.md): a setting for clients that "
        "buffer",
    )
    p.add_argument(
        "--codec-sms",
        type=int,
        default=0,
        metavar="N",
        help="CUDA: run the codec stage's decode on N of the GPU's SMs (a green context; its kernels "
        "launched one by one, no codec graphs), so that its convolutions never hold the whole GPU while "
        "the engine's frame steps and prefills wait for SMs (default 0: all SMs, shared)",
    )
    add_access_args(p)
    p.set_defaults(func=cmd_serve)
    global _SERVE_PARSER
    _SERVE_PARSER = p

    p = subparsers.add_parser(
        "client",
        help="synthesize through a running server to an audio file",
        description="Stream a synthesis from `tts serve`, write the audio file when done (atomically), print "
        "TTFA and RTF.",
    )
    p.add_argument("text", nargs="?", help=TEXT_HELP)
    add_output_args(p)
    p.add_argument(
        "--server",
        default=f"127.0.0.1:{DEFAULT_PORT}",
        help=f"HOST:PORT of the server (default 127.0.0.1:{DEFAULT_PORT}, `tts serve`'s)",
    )
    p.add_argument("--text-file", help="read the text from this UTF-8 file (- = stdin)")
    p.add_argument(
        "--voice",
        help="a voice the server knows: a preset or a registered voice (its ListVoices call or GET "
        "/v1/audio/voices lists them)",
    )
    p.add_argument(
        "--reference-audio", help="WAV, FLAC, MP3 or Ogg clip of the voice to clone (with --reference-text)"
    )
    p.add_argument("--reference-text", help="transcript of --reference-audio")
    add_normalize_arg(p)
    p.add_argument(
        "--encoding",
        choices=["pcm16", "float32"],
        default="pcm16",
        help="wire (and WAV / PCM file) sample format",
    )
    p.add_argument(
        "--first-chunk-frames",
        type=int,
        default=0,
        help="frames in the first two chunks (0 = server default)",
    )
    p.add_argument(
        "--chunk-frames",
        type=int,
        default=0,
        help="chunks after the first two double up to this many frames (0 = server default)",
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default none)")
    p.add_argument(
        "--api-key",
        default=None,
        help="the server's API key (sent as 'authorization: Bearer KEY'; default: the environment's "
        "TTS_API_KEY)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    add_sampling_args(p)
    p.set_defaults(func=cmd_client)


def add_admission_args(p: argparse.ArgumentParser) -> None:
    from tts.params import (
        DEFAULT_MAX_PREFILL_TOKENS,
        DEFAULT_REALTIME_MARGIN,
        DEFAULT_REALTIME_MAX_WAIT,
        RIDE_ALONG_TOKENS,
    )

    g = p.add_argument_group("admission (when a waiting request joins the batch)")
    g.add_argument(
        "--realtime-admission",
        choices=["auto", "on", "off"],
        default="auto",
        help="admit a waiting request only while every stream already playing keeps --realtime-margin of "
        "audio ahead of its player after paying for the newcomer's prefill and the slower frame step, "
        "and only while the step is fast enough for a new stream's chunks to come in time (the frame "
        "steps run on meanwhile and the streams get ahead); off: admit whenever a row and KV blocks are "
        "free. auto: on on CUDA, off on a CPU (default auto)",
    )
    g.add_argument(
        "--realtime-margin",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_REALTIME_MARGIN,
        help="seconds of audio each playing stream must keep ahead of its player when a request is "
        f"admitted (default {DEFAULT_REALTIME_MARGIN:g})",
    )
    g.add_argument(
        "--realtime-max-wait",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_REALTIME_MAX_WAIT,
        help="seconds a request waits for the streams' margin at most: then it is admitted anyway (its time "
        "to first audio is at stake too). A request also joins, margin or not, a prefill pass that runs "
        f"anyway in its iteration (another's, of its kind) while the pass holds at most {RIDE_ALONG_TOKENS} "
        "prompt tokens. A batch too slow for one more stream "
        f"still takes none until one ends (default {DEFAULT_REALTIME_MAX_WAIT:g})",
    )
    g.add_argument(
        "--prefill-gather-ms",
        type=float,
        metavar="MS",
        default=0.0,
        help="CUDA, with real-time admission: a new request that would open a prefill pass of its own "
        "while streams play waits up to this long (below --realtime-max-wait) for later ones to share the "
        "pass (a pass stops every stream for about as long with one short prompt as with four); costs the "
        "first of them that much time to first audio (default 0: off)",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="prompt tokens prefilled per engine iteration at most (at least one request), so that a burst "
        f"of new requests holds the running streams' next frame back by a bounded time (default "
        f"{DEFAULT_MAX_PREFILL_TOKENS})",
    )


def realtime_admission(args: argparse.Namespace, device_type: str) -> bool:
    """`--realtime-admission`: on, off, or auto (on on CUDA). Why off on a CPU by default: there the
    prefill and the frame step share the cores with the codec stage and the fronts, so the measured times
    that the policy predicts from swing with everything else, and small batches run near real time, where
    it would mostly make requests wait."""
    choice = getattr(args, "realtime_admission", "off")
    return choice == "on" or (choice == "auto" and device_type == "cuda")


def engine_admission_kwargs(args: argparse.Namespace, device_type: str) -> dict:
    """The EngineConfig fields of the admission options."""
    return {
        "realtime_admission": realtime_admission(args, device_type),
        "realtime_margin": args.realtime_margin,
        "realtime_max_wait": args.realtime_max_wait,
        "prefill_gather": getattr(args, "prefill_gather_ms", 0.0) / 1000.0,
        "max_prefill_tokens": args.max_prefill_tokens,
    }


# ---- option checks ---------------------------------------------------------------------------------------

# gRPC message sizes are int32: the receive limit (reference clip + 1 MiB) must stay below 2 GiB.
MAX_REFERENCE_MB = 2046
# A later chunk carries 186-744 ms of audio (4-16 frames at 21.5 frames/s): a gathering bound of more
# than a second would starve the players it is meant to serve.
MAX_CODEC_GATHER_MS = 1000
MAX_PREFILL_GATHER_MS = 1000


def check_seconds(option: str, value: float | None, *, zero_ok: bool) -> None:
    """`value` (None: unset) is a finite number of seconds, > 0 or >= 0; raises UserError."""
    if value is not None and not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise UserError(f"{option} must be a number of seconds {'>=' if zero_ok else '>'} 0, got {value:g}")


def check_sampling_options(args: argparse.Namespace) -> None:
    """The sampling values given on the command line are valid (the server's defaults fill the rest);
    raises InvalidRequest naming the field, as the server would."""
    from tts.engine import SamplingParams

    given = {k: v for k, v in sampling_kwargs(args).items() if v is not None}
    SamplingParams(**given).validate()


def check_server_address(server: str) -> None:
    """A HOST:PORT (or [V6]:PORT) `--server` has a port in 1..65535 (gRPC would silently take it modulo
    65536); other target forms (dns:///..., unix:...) pass as they are. Raises UserError."""
    m = re.fullmatch(r"(\[[^\]]*\]|[^:/\[\]]*):(\d+)", server)
    if m and not 1 <= int(m.group(2)) <= 65535:
        raise UserError(f"--server {server}: the port must be in 1..65535")


def listen_problem(host: str, port: int, port_option: str, host_option: str, purpose: str = "") -> str | None:
    """Why a socket cannot listen on host:port now (a trial bind, SO_REUSEADDR as gRPC and the metrics
    server use), as `127.0.0.1:9464 for metrics: address already in use (--metrics-port)`; None when it
    can."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as trial:
            trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            trial.bind(sockaddr)
    except OSError as exc:
        option = host_option if isinstance(exc, socket.gaierror) else port_option
        return f"{address}{purpose}: {os_error_reason(exc)} ({option})"
    return None


def check_all_listen(fronts: list[tuple[str, int, str, str, str]]) -> None:
    """`listen_problem` for every (host, port, port option, host option, purpose) at once: one UserError
    naming every address that cannot be listened on (a second `tts serve` hears of all its busy ports
    in one go, not one per attempt)."""
    taken: dict[tuple[str, int], str] = {}
    for host, port, option, _, _ in fronts:
        if port > 0 and (host, port) in taken:  # (each trial bind alone would pass)
            raise UserError(f"{option} {port} is also {taken[host, port]}: give each front a port of its own")
        taken.setdefault((host, port), option)
    problems = [p for p in (listen_problem(*front) for front in fronts) if p is not None]
    if problems:
        raise UserError("cannot listen on " + "; on ".join(problems))


def check_serve_ports(args: argparse.Namespace) -> None:
    """The gRPC and (unless off) the metrics and HTTP addresses can be listened on; raises one UserError
    naming every one that cannot."""
    fronts = [(args.host, args.port, "--port", "--host", "")]
    if args.metrics_port >= 0:
        fronts.append(
            (args.metrics_host, args.metrics_port, "--metrics-port", "--metrics-host", " for metrics")
        )
    if args.http_port >= 0:  # (HTTP listens on --host, beside gRPC)
        fronts.append((args.host, args.http_port, "--http-port", "--host", " for HTTP"))
    if args.wyoming_port >= 0:
        fronts.append((args.host, args.wyoming_port, "--wyoming-port", "--host", " for Wyoming"))
    check_all_listen(fronts)


# ---- serve ---------------------------------------------------------------------------------------------

# `tts serve --max-batch` without a number: sized from memory on CUDA, this on a CPU.
CPU_MAX_BATCH = 8


def max_batch_arg(value: str) -> int | str:
    """`--max-batch`: a number of rows, or "auto"."""
    return "auto" if value == "auto" else int(value)


def serve_max_batch(args: argparse.Namespace, bundle) -> int:
    """The engine's max batch: `--max-batch`, or for "auto" on CUDA the largest bucket whose streams'
    KV (AUTO_STREAM_TOKENS each) fits the pool `--kv-memory-fraction` of the free memory gives
    (`max_batch_for_memory`), on a CPU CPU_MAX_BATCH."""
    if args.max_batch != "auto":
        return args.max_batch
    from tts.engine.engine import max_batch_for_memory

    if bundle.device.type != "cuda":
        return CPU_MAX_BATCH
    return max_batch_for_memory(bundle.model, args.kv_memory_fraction, buckets=args.buckets)


def check_serve_options(args: argparse.Namespace) -> None:
    """`tts serve`'s option checks that need no model and no device (those of one replica and of
    `--devices` alike); raises UserError naming the option."""

    require(0 <= args.port <= 65535, f"--port must be in 0..65535 (0 = any free port), got {args.port}")
    require(
        args.metrics_port == -1 or 0 <= args.metrics_port <= 65535,
        f"--metrics-port must be -1 (off) or in 0..65535 (0 = any free port), got {args.metrics_port}",
    )
    require(
        args.max_batch == "auto" or args.max_batch >= 1, f"--max-batch must be >= 1, got {args.max_batch}"
    )
    require(args.max_waiting >= 0, f"--max-waiting must be >= 0, got {args.max_waiting}")
    require(args.max_sessions >= 0, f"--max-sessions must be >= 0, got {args.max_sessions}")
    require(args.max_queued_chunks >= 1, f"--max-queued-chunks must be >= 1, got {args.max_queued_chunks}")
    check_seconds("--realtime-margin", args.realtime_margin, zero_ok=True)
    check_seconds("--realtime-max-wait", args.realtime_max_wait, zero_ok=True)
    require(args.max_prefill_tokens >= 1, f"--max-prefill-tokens must be >= 1, got {args.max_prefill_tokens}")
    require(
        math.isfinite(args.prefill_gather_ms) and 0 <= args.prefill_gather_ms <= MAX_PREFILL_GATHER_MS,
        f"--prefill-gather-ms must be in 0..{MAX_PREFILL_GATHER_MS}, got {args.prefill_gather_ms:g}",
    )
    from service.cluster import parse_devices

    # (the replicas' devices with --devices)
    on_cuda = all(
        d.startswith("cuda") for d in (parse_devices(args.devices) if args.devices else [args.device])
    )
    require(args.codec_sms >= 0, f"--codec-sms must be >= 0, got {args.codec_sms}")
    require(not args.codec_sms or on_cuda, "--codec-sms needs CUDA")
    require(
        not (args.codec_sms and args.codec_graphs == "on"),
        "--codec-sms launches the codec's kernels one by one: it cannot be had with --codec-graphs on",
    )
    if args.prefill_gather_ms:
        require(
            on_cuda,
            "--prefill-gather-ms needs CUDA (where prompts share a prefill pass; a CPU prefills each alone)",
        )
        require(
            realtime_admission(args, "cuda"),
            "--prefill-gather-ms needs real-time admission (--realtime-admission auto or on)",
        )
        require(
            args.prefill_gather_ms < 1000 * args.realtime_max_wait,
            f"--prefill-gather-ms must be below --realtime-max-wait ({1000 * args.realtime_max_wait:g} ms), "
            f"got {args.prefill_gather_ms:g}",
        )
    check_seconds("--grace", args.grace, zero_ok=True)
    require(
        math.isfinite(args.max_reference_mb) and 0 < args.max_reference_mb <= MAX_REFERENCE_MB,
        f"--max-reference-mb must be in (0, {MAX_REFERENCE_MB}], got {args.max_reference_mb:g}",
    )
    check_threads(args)
    check_seconds("--pause-timeout", args.pause_timeout, zero_ok=True)
    check_seconds("--http-read-timeout", args.http_read_timeout, zero_ok=False)
    for option, least in CONNECTION_CAP_LEAST.items():
        n = getattr(args, _dest(option))
        require(n >= least, f"{option} must be >= {least}, got {n}")
    check_seconds("--wyoming-idle-timeout", args.wyoming_idle_timeout, zero_ok=True)
    check_seconds("--max-prepare-seconds", args.max_prepare_seconds, zero_ok=False)
    check_seconds("--max-audio-seconds", args.max_audio_seconds, zero_ok=True)
    require(
        math.isfinite(args.codec_gather_ms) and 0 <= args.codec_gather_ms <= MAX_CODEC_GATHER_MS,
        f"--codec-gather-ms must be in 0..{MAX_CODEC_GATHER_MS}, got {args.codec_gather_ms:g}",
    )
    require(
        math.isfinite(args.reference_cache_mb) and args.reference_cache_mb >= 0,
        f"--reference-cache-mb must be >= 0, got {args.reference_cache_mb:g}",
    )
    require(args.max_text_bytes >= 1, f"--max-text-bytes must be >= 1, got {args.max_text_bytes}")
    require(
        args.http_port == -1 or 0 <= args.http_port <= 65535,
        f"--http-port must be -1 (off) or in 0..65535 (0 = any free port), got {args.http_port}",
    )
    require(
        args.wyoming_port == -1 or 0 <= args.wyoming_port <= 65535,
        f"--wyoming-port must be -1 (off) or in 0..65535 (0 = any free port), got {args.wyoming_port}",
    )
    check_seconds("--drain-delay", args.drain_delay, zero_ok=True)
    check_seconds("--max-connection-age", args.max_connection_age, zero_ok=True)
    check_seconds("--max-connection-age-grace", args.max_connection_age_grace, zero_ok=True)
    check_seconds("--max-connection-idle", args.max_connection_idle, zero_ok=True)
    if args.max_connection_age_grace is not None and not args.max_connection_age:
        raise UserError("--max-connection-age-grace needs --max-connection-age")
    if args.replica_name is not None and not REPLICA_NAME.fullmatch(args.replica_name):
        raise UserError(
            f"--replica-name must be 1-100 characters of letters, digits and ._:@/- (starting with a letter "
            f"or digit), got {args.replica_name!r}"
        )


# Each connection cap's smallest value (HTTP's cap counts the connection it answers 503, so 2 serves one).
CONNECTION_CAP_LEAST = {
    "--max-http-connections": 2,
    "--max-grpc-connections": 1,
    "--max-wyoming-connections": 1,
}


def _dest(option: str) -> str:
    """The argparse attribute of a long option: `--max-http-connections` -> `max_http_connections`."""
    return option[2:].replace("-", "_")


# Files a server holds beside its clients' gRPC, HTTP and Wyoming connections: the model's and the
# voices' files, CUDA's device files, the listening sockets, the metrics port's clients (an idle server on
# a CPU holds 17).
OPEN_FILES_RESERVE = 256


def fit_open_files(caps: dict[str, tuple[int, int]]) -> tuple[dict[str, int], str | None]:
    """Make room in the process's open-file limit (RLIMIT_NOFILE) for the connection caps `caps` (option
    name -> (cap, smallest cap it takes), e.g. `{"--max-http-connections": (4096, 2)}`) and
    OPEN_FILES_RESERVE more files: a soft limit below that is raised, up to the hard limit. Returns the
    caps that fit (as asked, or where the limit is lower, each scaled down in proportion, not below its
    smallest) and, where they had to come down, the warning line to print (else None). Without the limit
    (`resource` is POSIX-only), the caps as asked."""
    asked = {name: cap for name, (cap, _) in caps.items()}
    try:
        import resource
    except ImportError:
        return asked, None
    unlimited = resource.RLIM_INFINITY
    total = sum(asked.values())
    want = total + OPEN_FILES_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != unlimited and soft < want:
        target = want if hard == unlimited else min(want, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):  # (a container may refuse even what the hard limit allows)
                pass
    if soft == unlimited or soft >= want:
        return asked, None
    room = max(0, soft - OPEN_FILES_RESERVE)
    fitted = {name: max(least, cap * room // total) for name, (cap, least) in caps.items()}
    return fitted, (
        f"warning: the open-file limit ({soft}) holds {room} connections beside the server's own files, not "
        f"{total}: {', '.join(f'{name} {cap}' for name, cap in fitted.items())} "
        f"(raise the limit: ulimit -n {want})"
    )


def fit_connection_caps(args: argparse.Namespace) -> None:
    """The connection caps of the ports that are on, fitted to the open-file limit (`fit_open_files`):
    lowered in `args` where it cannot hold them, with the warning printed."""
    off = {
        "--max-http-connections": args.http_port == -1,
        "--max-wyoming-connections": args.wyoming_port == -1,
    }
    caps = {
        option: (getattr(args, _dest(option)), least)
        for option, least in CONNECTION_CAP_LEAST.items()
        if not off.get(option, False)
    }
    fitted, warning = fit_open_files(caps)
    for option, cap in fitted.items():
        setattr(args, _dest(option), cap)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)


def check_codec_sms(device: str, sms: int) -> None:
    """`--codec-sms N` can be had on `device` (a green context of N SMs made and let go), before the
    model loads. Raises UserError naming the option."""
    if not sms:
        return
    import torch

    from tts.runtime.codec_stage import codec_stream

    try:
        codec_stream(torch.device(device), sms)
    except (ValueError, RuntimeError) as exc:
        raise UserError(f"--codec-sms {sms}: {exc}") from exc


def device_memory_note(device) -> str:
    """The serving line's `, device memory 7.9 GiB (peak 8.2 GiB)` for a CUDA `device` (torch.device):
    what torch's allocator holds there now and at most so far (weights, KV pool, graph pools; the CUDA
    context's few hundred MiB come on top), what an operator sizing a smaller card needs; "" for any
    other device."""
    if device.type != "cuda":
        return ""
    import torch

    held, peak = torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)
    return f", device memory {held / 2**30:.1f} GiB (peak {peak / 2**30:.1f} GiB)"


def cmd_serve(args: argparse.Namespace) -> int:
    from service.server import MiB, ServiceLimits
    from tts.checkpoints.load import load_bundle
    from tts.engine import EngineConfig

    check_serve_options(args)
    access = serve_access(args)
    # A server logs each request and its start-up at INFO (tts -v: everything at DEBUG).
    if not getattr(args, "verbose", False):
        for name in ("service", "tts"):
            logging.getLogger(name).setLevel(logging.INFO)
    resolve_graphs_arg(args)  # (before the replicas get the options: the deprecated ones, resolved)
    if args.devices is not None:
        from service.cluster import run_cluster

        assert _SERVE_PARSER is not None  # add_parser made the parser these args came from
        devices = check_cluster_options(args)
        pick_public_ports(args)
        warning = unauthenticated_warning(args.host, access)
        if warning is not None:
            print(warning, file=sys.stderr, flush=True)
        return run_cluster(args, _SERVE_PARSER, devices)
    check_device(args.device)
    check_codec_sms(args.device, args.codec_sms)
    check_serve_ports(args)  # before the model loads: a busy port is found in a moment
    fit_connection_caps(args)
    t0 = time.perf_counter()
    bundle = load_bundle(
        args.model,
        device=args.device,
        dtype=torch_dtype(args.dtype),
        codec_dtype=torch_dtype(args.codec_dtype),
        weights=args.weights,
    )
    apply_threads(args, bundle)
    print(
        f"model: {bundle.describe()} (loaded in {time.perf_counter() - t0:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    engine_config = EngineConfig(
        max_batch=serve_max_batch(args, bundle),
        **engine_kwargs(args),
        **engine_admission_kwargs(args, bundle.device.type),
    )
    voices_dir = None if (args.voices_dir or "").lower() == "none" else args.voices_dir
    if args.voices_dir is None:
        from tts.runtime.voices import default_voices_dir

        voices_dir = default_voices_dir(bundle.name)
    limits = ServiceLimits(
        max_waiting=args.max_waiting,
        max_queued_chunks=args.max_queued_chunks,
        max_reference_bytes=int(args.max_reference_mb * MiB),
        pause_timeout=args.pause_timeout or None,
        max_audio_seconds=args.max_audio_seconds or None,
        max_text_bytes=args.max_text_bytes,
        reference_cache_bytes=int(args.reference_cache_mb * MiB),
        voices_dir=voices_dir,
        max_connection_age=args.max_connection_age or None,
        max_connection_idle=args.max_connection_idle or None,
        max_grpc_connections=args.max_grpc_connections,
        max_connection_age_grace=args.max_connection_age_grace,
        http_read_timeout=args.http_read_timeout,
        max_http_connections=args.max_http_connections,
        max_wyoming_connections=args.max_wyoming_connections,
        wyoming_idle_timeout=args.wyoming_idle_timeout or None,
        max_prepare_seconds=args.max_prepare_seconds,
        max_sessions=args.max_sessions,
    )
    # Three threads share the GIL: the engine thread (a frame every few ms), the codec stage's worker and
    # the asyncio thread of the fronts. A thread waiting for the GIL gets it within the switch interval;
    # 1 ms instead of Python's 5 keeps a frame step from waiting several ms behind the others' Python.
    sys.setswitchinterval(0.001)
    return asyncio.run(_serve(args, bundle, engine_config, limits, access, started=t0))


async def _serve(args, bundle, engine_config, limits, access, started: float | None = None) -> int:
    from service.server import SERVICE_NAME, TTSServer

    metrics_port = None if args.metrics_port < 0 else args.metrics_port
    http_port = None if args.http_port < 0 else args.http_port
    wyoming_port = None if args.wyoming_port < 0 else args.wyoming_port
    server = TTSServer(
        bundle,
        engine_config,
        limits,
        metrics_host=args.metrics_host,
        metrics_port=metrics_port,
        http_port=http_port,
        codec_graphs=args.codec_graphs != "off",
        codec_gather=args.codec_gather_ms / 1000.0,
        codec_sms=args.codec_sms,
        replica=args.replica_name,
        wyoming_port=wyoming_port,
        access=access,
    )
    warning = unauthenticated_warning(args.host, access)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    if wyoming_port is not None and not _loopback(args.host):  # (API keys do not cover Wyoming)
        print(
            f"warning: Wyoming has no authentication: anyone who can reach {args.host} can synthesize "
            "through --wyoming-port (keep it on a trusted network)",
            file=sys.stderr,
            flush=True,
        )
    try:
        port = await server.start(args.host, args.port)
    except (RuntimeError, OSError) as exc:
        await server.stop(0)
        check_serve_ports(args)  # taken since the check before loading: name the port and the option
        raise UserError(str(exc)) from exc
    stop = asyncio.Event()
    received: list[signal.Signals] = []
    aio_loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, on_signal, sig)
    ready = asyncio.ensure_future(server.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        if ready.exception() is not None:
            await server.stop(0)
            raise RuntimeError(str(ready.exception()))
        metrics = (
            f"; metrics on http://{args.metrics_host}:{server.metrics_port}/metrics"
            if metrics_port is not None
            else ""
        )
        assert server.loop.engine is not None  # the server is ready: its engine is built
        graphs = server.loop.engine.graphs.enabled
        scheme = "https" if access.tls else "http"
        http = f"; HTTP on {scheme}://{args.host}:{server.http_port}/" if http_port is not None else ""
        if wyoming_port is not None:
            http += f"; Wyoming on tcp://{args.host}:{server.wyoming_port}"
        # (from the model's load to the first request it can take: what a restart costs)
        ready_in = f", ready in {time.perf_counter() - started:.1f} s" if started is not None else ""
        print(
            f"serving {SERVICE_NAME} on {args.host}:{port} (replica {server.replica}, max batch "
            f"{engine_config.max_batch}, graphs {'on' if graphs else 'off'}{ready_in}"
            f"{device_memory_note(bundle.device)}){http}{metrics}",
            file=sys.stderr,
            flush=True,
        )
    else:
        ready.cancel()
    await stopped
    # SIGTERM (a balancer, Kubernetes, the replicas' supervisor) waits --drain-delay for balancers to see
    # NOT_SERVING; Ctrl-C at a terminal does not.
    delay = (args.drain_delay or 0.0) if received and received[0] == signal.SIGTERM else 0.0
    print(f"shutting down (drain delay {delay:g} s, grace {args.grace:g} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    await server.stop(args.grace, drain_delay=delay)
    print(f"stopped in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0


# ---- client --------------------------------------------------------------------------------------------


def add_access_args(p: argparse.ArgumentParser) -> None:
    """`tts serve`'s options of who may call it (service/access.py)."""
    g = p.add_argument_group("access (docs/operations.md: Securing the server)")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key clients must send (gRPC metadata / HTTP header 'authorization: Bearer KEY'); repeat for "
        "several; also from the environment's TTS_API_KEYS (comma-separated). Without any key the server is "
        "open to whoever reaches it",
    )
    g.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="FILE",
        help="a file of keys, one a line (blank lines and # comments skipped); repeatable",
    )
    g.add_argument(
        "--metrics-auth",
        action="store_true",
        help="/metrics and /load on the HTTP port need a key too (default: open, like /health; the separate "
        "--metrics-port has no authentication: keep it on loopback or off)",
    )
    g.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="an origin (https://app.example) whose web pages may call the HTTP API (CORS) and send it "
        "state-changing requests; repeatable or comma-separated; * = any (default: none)",
    )
    g.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name the HTTP front answers besides localhost/127.0.0.1/::1 while bound to loopback "
        "(a reverse proxy's public name); repeatable or comma-separated; * = any (default: none)",
    )
    g.add_argument(
        "--tls-cert", metavar="PEM", help="serve gRPC and HTTP over TLS with this certificate chain"
    )
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")


def _listed(values: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for value in values for v in value.split(",") if v.strip()))


def serve_access(args: argparse.Namespace):
    """The `service.access.Access` of `tts serve`'s options (keys from --api-key, TTS_API_KEYS and
    --api-key-file); raises UserError naming the option at fault."""
    import os

    from service.access import KEYS_ENV, Access, parse_keys

    try:
        keys = parse_keys(args.api_key, os.environ.get(KEYS_ENV), args.api_key_file)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together")
    for option, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None:
            try:
                with open(path, "rb") as f:
                    if b"-----BEGIN" not in f.read():
                        raise UserError(f"{option} {path}: not a PEM file")
            except OSError as exc:
                raise UserError(f"{option} {path}: {os_error_reason(exc)}") from exc
    for origin in _listed(args.cors_origin):
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin.rstrip("/")):
            raise UserError(
                f"--cors-origin must be an origin like https://app.example (or *), got {origin!r}"
            )
    return Access(
        api_keys=keys,
        metrics_auth=args.metrics_auth,
        cors_origins=_listed(args.cors_origin),
        allowed_hosts=_listed(args.allowed_host),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def _loopback(host: str) -> bool:
    from service.access import is_loopback

    return is_loopback(host)


def unauthenticated_warning(host: str, access) -> str | None:
    """The start-up warning of a server open to a network: no key, bound beyond loopback."""
    from service.access import is_loopback

    if access.api_keys or is_loopback(host):
        return None
    return (
        f"warning: no API key: anyone who can reach {host} can synthesize, read metrics and add, replace or "
        "delete voices (give --api-key or TTS_API_KEYS, or listen on 127.0.0.1)"
    )


def check_chunk_options(args: argparse.Namespace) -> None:
    """--first-chunk-frames and --chunk-frames are >= 0 (0 = the server's default) and, when given, within
    a request's audio chunk bounds (`tts.runtime.request.check_chunk_frames`, the rule the server applies);
    raises UserError."""
    from tts.runtime.request import check_chunk_frames

    for option in ("--first-chunk-frames", "--chunk-frames"):
        value = getattr(args, _dest(option))
        require(value >= 0, f"{option} must be >= 0 (0 = server default), got {value}")
    request_rule(check_chunk_frames, args.first_chunk_frames or 1, args.chunk_frames or 1)


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from service.client import build_request, error_field, rpc_error_line
    from tts.runtime.request import check_voice_source
    from tts.text.policy import check_speakable

    text = read_text_arg(args)
    check_speakable(text)  # (every model refuses it: no need to ask a server)
    check_server_address(args.server)
    check_seconds("--timeout", args.timeout, zero_ok=False)
    check_chunk_options(args)
    check_sampling_options(args)
    out = check_output_path(args.output)
    fmt = output_format(args)
    if (args.reference_audio is None) != (args.reference_text is None):
        raise UserError("--reference-audio and --reference-text go together")
    request_rule(check_voice_source, args.voice, args.reference_audio is not None)
    reference = None
    if args.reference_audio is not None:  # read and decoded here, so a bad file is named
        reference = read_reference_file(args.reference_audio)[0]
    request = build_request(
        text,
        voice=args.voice,
        reference_audio=reference,
        reference_text=args.reference_text,
        encoding=args.encoding,
        first_chunk_frames=args.first_chunk_frames,
        chunk_frames=args.chunk_frames,
        normalize=None if args.normalize else False,
        **sampling_kwargs(args),
    )
    try:
        result = asyncio.run(_client(args.server, request, args.timeout, args.api_key))
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            raise UserError(as_options(exc.details() or "", error_field(exc))) from exc
        print(f"tts: error: {rpc_error_line(args.server, exc, args.timeout)}", file=sys.stderr)
        return 1
    end = result.end
    header_warnings = list(result.header.warnings)
    from service.grpc_gen.v1 import tts_pb2 as pb

    short = pb.FINISH_REASON_SHORT in end.text_chunk_finish_reasons
    if refuse_partial(args, short, header_warnings + [w for w in end.warnings if w not in header_warnings]):
        return EXIT_INCOMPLETE
    write_output(out, result.audio, result.sample_rate, fmt, pcm_float=args.encoding == "float32")
    # Before the `wrote` line, as `tts synthesize` prints them: the summary line comes last.
    for warning in header_warnings + [w for w in end.warnings if w not in header_warnings]:
        print(f"warning: {warning}", file=sys.stderr)
    reasons = {
        pb.FINISH_REASON_STOP: "stop",
        pb.FINISH_REASON_LENGTH: "length",
        pb.FINISH_REASON_SHORT: "short",
        pb.FINISH_REASON_LOOP: "loop",
    }
    ttfa = f"{result.ttfa * 1000:.0f} ms" if result.ttfa is not None else "-"
    print(
        f"wrote {'stdout' if args.output == '-' else out} ({fmt.name}): {end.frames} frames, "
        f"{result.audio_seconds:.2f} s audio at {fmt.rate or result.sample_rate} Hz in "  # (opus: 48 kHz)
        f"{len(result.chunks)} chunks; TTFA {ttfa}, RTF {result.rtf:.3f} "
        f"(server: TTFA {end.time_to_first_audio_seconds * 1000:.0f} ms, RTF {end.rtf:.3f}), "
        f"finish {reasons.get(end.finish_reason, '?')}, seed {result.header.seed}",
        file=summary_stream(args),
    )
    return 0


async def _client(server: str, request, timeout: float | None, api_key: str | None = None):
    from service.client import aio_channel, synthesize_stream
    from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc

    async with aio_channel(server, api_key) as channel:
        return await synthesize_stream(pb_grpc.TextToSpeechStub(channel), request, timeout=timeout)


def check_cluster_options(args: argparse.Namespace) -> list[str]:
    """The checks `tts serve --devices` makes before starting anything (besides `tts serve`'s own): the
    proxy binary, the devices, the cluster options and the public ports. Returns the devices; raises
    UserError."""
    from service.cluster import find_proxy, parse_devices

    find_proxy()
    devices = parse_devices(args.devices)
    if args.device != "cpu":
        raise UserError("give --device or --devices, not both")
    if args.replica_name is not None:
        raise UserError("--replica-name does not go with --devices (the replicas are named r0, r1, ...)")
    if args.wyoming_port >= 0:
        raise UserError("--wyoming-port does not go with --devices (HAProxy does not carry Wyoming yet)")
    if args.tls_cert is not None:
        raise UserError("--tls-cert does not go with --devices: terminate TLS in a proxy in front")
    for device in dict.fromkeys(devices):
        check_device(device)
    check_seconds("--check-interval", args.check_interval, zero_ok=False)
    base, n = args.replica_base_port, len(devices)
    if base and not 1024 <= base <= 65536 - 3 * n:
        raise UserError(
            f"--replica-base-port must be 0 or in 1024..{65536 - 3 * n} for {n} replicas, got {base}"
        )
    if args.drain_delay is None:
        args.drain_delay = 5.0 * args.check_interval
    return devices


def pick_public_ports(args: argparse.Namespace) -> None:
    """Check the public ports (busy: one UserError naming every busy one and its option) and replace 0 by
    a free port."""
    fronts = [("port", "--port", args.host, "--host", "")]
    if args.http_port >= 0:
        fronts.append(("http_port", "--http-port", args.host, "--host", " for HTTP"))
    if args.metrics_port >= 0:
        fronts.append(("metrics_port", "--metrics-port", args.metrics_host, "--metrics-host", " for metrics"))
    check_all_listen(
        [
            (host, getattr(args, dest), option, host_option, purpose)
            for dest, option, host, host_option, purpose in fronts
        ]
    )
    for dest, _, host, _, _ in fronts:
        port = getattr(args, dest)
        if port == 0:
            from service.cluster import free_ports

            setattr(args, dest, free_ports(host, 1)[0])
