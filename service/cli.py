"""`tts serve`, `tts client` and `tts bench-server`: registered into the `tts` command by tts/cli.py.

Imports of grpc, the generated API and the server happen inside the commands, so `tts --help` and the
engine-only commands never need grpcio-health-checking or grpcio-reflection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from tts.cli import (
    UserError,
    add_engine_args,
    add_model_args,
    add_output_args,
    add_sampling_args,
    apply_threads,
    check_device,
    check_output_path,
    engine_kwargs,
    output_format,
    read_text_arg,
    sampling_kwargs,
    summary_stream,
    torch_dtype,
)  # fmt: skip

log = logging.getLogger("tts.serve")

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_PORT = 8000  # the OpenAI-compatible HTTP front (service/http.py)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run the synthesis server (gRPC and OpenAI-compatible HTTP)",
        description="Serve tts.v1.TextToSpeech over gRPC and the OpenAI-compatible HTTP API (--http-port) from "
        "one engine with continuous batching. Health reports NOT_SERVING (HTTP /health: 503) until the engine "
        "has warmed up. SIGTERM or Ctrl-C shut down gracefully.",
    )  # fmt: skip
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)"
    )
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT}; 0 = any free)"
    )
    p.add_argument(
        "--http-port", type=int, default=DEFAULT_HTTP_PORT,
        help=f"HTTP port of the OpenAI-compatible API, /health, /metrics and the playground on the same host "
        f"(default {DEFAULT_HTTP_PORT}; 0 = any free; -1 = off)",
    )  # fmt: skip
    add_model_args(p)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument(
        "--max-waiting", type=int, default=16, help="requests queued beyond --max-batch (default 16)"
    )
    add_engine_args(p)
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the Prometheus endpoint")
    p.add_argument(
        "--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
        help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0 = any free; -1 = off)",
    )  # fmt: skip
    p.add_argument(
        "--grace", type=float, default=10.0, help="seconds open streams get at shutdown (default 10)"
    )
    p.add_argument(
        "--max-reference-mb", type=float, default=10.0, help="reference clip size limit (default 10)"
    )
    p.add_argument("--max-queued-chunks", type=int, default=8, help="unread chunks before a stream pauses")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser(
        "client", help="synthesize through a running server to an audio file",
        description="Stream a synthesis from `tts serve`, write the audio file when done (atomically), print "
        "TTFA and RTF.",
    )  # fmt: skip
    p.add_argument("text", nargs="?", help="text to speak (or use --text-file)")
    add_output_args(p)
    p.add_argument("--server", default=f"127.0.0.1:{DEFAULT_PORT}", help="HOST:PORT of the server")
    p.add_argument("--text-file", help="read the text from this UTF-8 file (- = stdin)")
    p.add_argument("--voice", help="preset voice name (see `tts voices`)")
    p.add_argument("--reference-audio", help="WAV/FLAC clip of the voice to clone (with --reference-text)")
    p.add_argument("--reference-text", help="transcript of --reference-audio")
    p.add_argument(
        "--encoding",
        choices=["pcm16", "float32"],
        default="pcm16",
        help="wire (and WAV / PCM file) sample format",
    )
    p.add_argument(
        "--first-chunk-frames", type=int, default=0, help="frames in the first chunk (0 = server default)"
    )
    p.add_argument("--chunk-frames", type=int, default=0, help="frames in later chunks (0 = server default)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default none)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    add_sampling_args(p)
    p.set_defaults(func=cmd_client)

    from .loadtest import add_arguments

    p = subparsers.add_parser(
        "bench-server", help="closed-loop load benchmark of a running server",
        description="Closed-loop load benchmark: req/s, audio s/s, TTFA p50/p95/p99, RTF p50/p95 and the "
        "longest gap between chunks at each concurrency level; prints a table and writes JSON.",
    )  # fmt: skip
    add_arguments(p)
    p.set_defaults(func=cmd_bench_server)


# ---- serve ---------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from tts.bundle import load_bundle
    from tts.engine import EngineConfig

    from .server import MiB, ServiceLimits

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if not -1 <= args.http_port <= 65535:
        raise UserError(f"--http-port must be in 0..65535 or -1 (off), got {args.http_port}")
    if args.max_batch < 1 or args.max_waiting < 0 or args.max_queued_chunks < 1:
        raise UserError("--max-batch and --max-queued-chunks must be >= 1, --max-waiting >= 0")
    if args.grace < 0 or args.max_reference_mb <= 0:
        raise UserError("--grace must be >= 0 and --max-reference-mb > 0")
    check_device(args.device)
    t0 = time.perf_counter()
    bundle = load_bundle(args.model, device=args.device, dtype=torch_dtype(args.dtype))
    apply_threads(args, bundle)
    print(
        f"model: {bundle.describe()} (loaded in {time.perf_counter() - t0:.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    engine_config = EngineConfig(max_batch=args.max_batch, **engine_kwargs(args))
    limits = ServiceLimits(
        max_waiting=args.max_waiting, max_queued_chunks=args.max_queued_chunks,
        max_reference_bytes=int(args.max_reference_mb * MiB),
    )  # fmt: skip
    return asyncio.run(_serve(args, bundle, engine_config, limits))


async def _serve(args, bundle, engine_config, limits) -> int:
    from .server import SERVICE_NAME, TTSServer

    metrics_port = None if args.metrics_port < 0 else args.metrics_port
    http_port = None if args.http_port < 0 else args.http_port
    server = TTSServer(
        bundle, engine_config, limits, metrics_host=args.metrics_host, metrics_port=metrics_port,
        http_port=http_port,
    )  # fmt: skip
    try:
        port = await server.start(args.host, args.port)
    except (RuntimeError, OSError) as exc:
        await server.stop(0)
        raise UserError(str(exc)) from exc
    stop = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, stop.set)
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
        graphs = server.loop.engine.graphs.enabled
        http = f"; HTTP on http://{args.host}:{server.http_port}/" if http_port is not None else ""
        print(
            f"serving {SERVICE_NAME} on {args.host}:{port} (max batch {engine_config.max_batch}, "
            f"graphs {'on' if graphs else 'off'}){http}{metrics}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    else:
        ready.cancel()
    await stopped
    print(f"shutting down (grace {args.grace:g} s)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    await server.stop(args.grace)
    print(f"stopped in {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)
    return 0


# ---- client --------------------------------------------------------------------------------------------


def cmd_client(args: argparse.Namespace) -> int:
    import grpc

    from tts.audio_formats import write_audio_file

    from .client import build_request

    text = read_text_arg(args)
    out = check_output_path(args.output)
    fmt = output_format(args)
    if (args.reference_audio is None) != (args.reference_text is None):
        raise UserError("--reference-audio and --reference-text go together")
    if args.voice is not None and args.reference_audio is not None:
        raise UserError("give --voice or --reference-audio, not both")
    reference = None
    if args.reference_audio is not None:
        try:
            reference = Path(args.reference_audio).read_bytes()
        except OSError as exc:
            raise UserError(f"cannot read --reference-audio: {exc}") from exc
    if args.first_chunk_frames < 0 or args.chunk_frames < 0:
        raise UserError("chunk sizes must be >= 0 (0 = server default)")
    request = build_request(
        text, voice=args.voice, reference_audio=reference, reference_text=args.reference_text,
        encoding=args.encoding, first_chunk_frames=args.first_chunk_frames, chunk_frames=args.chunk_frames,
        **sampling_kwargs(args),
    )  # fmt: skip
    try:
        result = asyncio.run(_client(args.server, request, args.timeout))
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            raise UserError(exc.details()) from exc
        print(f"tts: error: {args.server}: {code.name}: {exc.details()}", file=sys.stderr)
        return 1
    write_audio_file(out, result.audio, result.sample_rate, fmt, pcm_float=args.encoding == "float32")
    end = result.end
    reasons = {1: "stop", 2: "length"}
    ttfa = f"{result.ttfa * 1000:.0f} ms" if result.ttfa is not None else "-"
    print(
        f"wrote {'stdout' if args.output == '-' else out} ({fmt.name}): {end.frames} frames, "
        f"{result.audio_seconds:.2f} s audio at {result.sample_rate} Hz in "
        f"{len(result.chunks)} chunks; TTFA {ttfa}, RTF {result.rtf:.3f} "
        f"(server: TTFA {end.time_to_first_audio_seconds * 1000:.0f} ms, RTF {end.rtf:.3f}), "
        f"finish {reasons.get(end.finish_reason, '?')}, seed {result.header.seed}",
        file=summary_stream(args),
    )
    return 0


async def _client(server: str, request, timeout: float | None):
    from proto.tts.v1 import tts_pb2_grpc as pb_grpc

    from .client import aio_channel, synthesize_stream

    async with aio_channel(server) as channel:
        return await synthesize_stream(pb_grpc.TextToSpeechStub(channel), request, timeout=timeout)


# ---- bench-server ----------------------------------------------------------------------------------------


def cmd_bench_server(args: argparse.Namespace) -> int:
    from .loadtest import run_from_args

    return run_from_args(args)
