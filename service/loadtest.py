"""Closed-loop load benchmark of a running synthesis server (`tts bench-server --server HOST:PORT`).

At each concurrency level c (default 1, 4, 16, 64), c workers each send one streaming request at a time,
back to back, until the level's request count is reached; every request has its own text (a sentence
from a fixed pool with the request number spoken in it) and its own seed. Reported per level:

* req/s (completed requests / level wall time) and audio seconds per second (the throughput);
* TTFA p50/p95/p99: from just before the call is sent to the first response holding PCM (client side);
* RTF p50/p95: per request, (end message time - send time) / audio seconds (client side);
* the longest gap between consecutive audio chunks of any request, and the p95 of per-request longest
  gaps (how smooth streaming is under load);
* errors by gRPC status (RESOURCE_EXHAUSTED counts: the server's admission bound was hit).

The table goes to stdout and everything (with the server's GetInfo) to a JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please remember to bring your umbrella, it may rain this afternoon.",
    "Our train leaves the station at a quarter past seven every morning.",
    "She opened the old wooden box and found a stack of yellowed letters.",
    "A gentle breeze carried the smell of fresh bread down the narrow street.",
    "The committee will announce the results of the competition next week.",
    "He tuned the guitar carefully before the concert started in the hall.",
    "Bright stars filled the sky above the quiet mountain village tonight.",
    "Could you tell me the way to the nearest library, please?",
    "The children laughed as the puppy chased its tail around the garden.",
    "Fresh vegetables from the market make the best soup in winter.",
    "Scientists observed a rare bird nesting on the northern cliffs.",
]


def request_text(i: int) -> str:
    """A distinct text for request i (the number is spoken, so every prompt differs)."""
    return f"Request {i}. {SENTENCES[i % len(SENTENCES)]}"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    req_per_s: float = 0.0
    audio_s_per_s: float = 0.0
    frames_per_s: float = 0.0
    audio_s_mean: float = 0.0
    ttfa_ms: dict[str, float | None] = field(default_factory=dict)
    rtf: dict[str, float | None] = field(default_factory=dict)
    max_gap_ms: float | None = None
    gap_p95_ms: float | None = None


async def _run_level(stub, concurrency: int, total: int, counter, options: dict, timeout: float | None):
    import grpc

    from .client import build_request, synthesize_stream

    result = LevelResult(concurrency=concurrency, requests=total)
    ttfa: list[float] = []
    rtf: list[float] = []
    max_gaps: list[float] = []
    audio_s: list[float] = []
    frames = 0
    issued = itertools.count()

    async def worker():
        nonlocal frames
        while next(issued) < total:
            i = next(counter)
            request = build_request(request_text(i), seed=options["seed"] + i, **options["request"])
            try:
                r = await synthesize_stream(stub, request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                name = exc.code().name
                result.errors[name] = result.errors.get(name, 0) + 1
                continue
            result.ok += 1
            frames += r.end.frames
            audio_s.append(r.audio_seconds)
            if r.ttfa is not None:
                ttfa.append(r.ttfa)
            if r.audio_seconds > 0:
                rtf.append(r.rtf)
            max_gaps.append(r.max_gap)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - t0
    result.req_per_s = result.ok / result.wall_s
    result.audio_s_per_s = sum(audio_s) / result.wall_s
    result.frames_per_s = frames / result.wall_s
    result.audio_s_mean = sum(audio_s) / len(audio_s) if audio_s else 0.0
    result.ttfa_ms = {f"p{q}": _ms(percentile(ttfa, q)) for q in (50, 95, 99)}
    result.rtf = {f"p{q}": percentile(rtf, q) for q in (50, 95)}
    result.max_gap_ms = _ms(max(max_gaps, default=None))
    result.gap_p95_ms = _ms(percentile(max_gaps, 95))
    return result


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


async def run_loadtest(
    server: str, concurrency: list[int], *, requests: int | None = None, seed: int = 1000,
    warmup: int = 1, timeout: float | None = None, progress=None, **request_options,
) -> dict:  # fmt: skip
    """Run the benchmark; returns the report dict (see `format_table`). `requests`: per level (default
    max(8, 4 * concurrency)); `request_options`: build_request keywords (voice, temperature, top_p,
    top_k, max_new_frames, encoding, first_chunk_frames, chunk_frames)."""
    from google.protobuf.json_format import MessageToDict

    from proto.tts.v1 import tts_pb2 as pb
    from proto.tts.v1 import tts_pb2_grpc as pb_grpc

    from .client import aio_channel, build_request, synthesize_stream

    async with aio_channel(server) as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        info = await stub.GetInfo(pb.GetInfoRequest(), timeout=30)
        counter = itertools.count()
        for _ in range(warmup):
            i = next(counter)
            await synthesize_stream(
                stub, build_request(request_text(i), seed=seed + i, **request_options), timeout
            )
        levels = []
        options = {"seed": seed, "request": request_options}
        for c in concurrency:
            n = requests if requests is not None else max(8, 4 * c)
            level = await _run_level(stub, c, n, counter, options, timeout)
            levels.append(level)
            if progress is not None:
                progress(level)
        info_after = await stub.GetInfo(pb.GetInfoRequest(), timeout=30)
    return {
        "server": server,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "info": MessageToDict(info, preserving_proto_field_name=True),
        "replay_share_after": info_after.replay_share,
        "settings": {"requests_per_level": requests, "seed": seed, "warmup": warmup, **request_options},
        "levels": [asdict(level) for level in levels],
    }


def format_table(report: dict) -> str:
    """A fixed-width table of the report's levels."""
    head = (
        f"{'conc':>5} {'reqs':>5} {'ok':>5} {'err':>4} {'req/s':>7} {'audio s/s':>9} {'frames/s':>8} "
        f"{'TTFA p50':>9} {'p95':>8} {'p99':>8} {'RTF p50':>8} {'p95':>7} {'max gap':>8}"
    )
    lines = [head, "-" * len(head)]

    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    for lv in report["levels"]:
        t, r = lv["ttfa_ms"], lv["rtf"]
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests']:>5} {lv['ok']:>5} {sum(lv['errors'].values()):>4} "
            f"{lv['req_per_s']:>7.2f} {lv['audio_s_per_s']:>9.2f} {lv['frames_per_s']:>8.1f} "
            f"{f(t['p50'], '>7.0f')}ms {f(t['p95'], '>6.0f')}ms {f(t['p99'], '>6.0f')}ms "
            f"{f(r['p50'], '>8.3f')} {f(r['p95'], '>7.3f')} {f(lv['max_gap_ms'], '>6.0f')}ms"
        )
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(
            f"concurrency levels must be positive integers like 1,4,16; got {text!r}"
        )
    return levels


def add_arguments(p: argparse.ArgumentParser, server_required: bool = True) -> None:
    """The load benchmark's options (shared by `tts bench-server` and `tts bench --server`, which passes
    server_required=False and calls `run_from_args` when --server is given)."""
    p.add_argument("--server", required=server_required, help="HOST:PORT of a running `tts serve`")
    p.add_argument(
        "--concurrency", type=parse_levels, default=[1, 4, 16, 64], help="levels (default 1,4,16,64)"
    )
    p.add_argument(
        "--requests", type=int, default=None, help="requests per level (default max(8, 4 x level))"
    )
    p.add_argument(
        "--json", default="bench_server.json", help="write the report here (default bench_server.json)"
    )
    p.add_argument("--warmup", type=int, default=1, help="requests before the first level (default 1)")
    p.add_argument("--timeout", type=float, default=None, help="deadline per request in seconds")
    p.add_argument("--seed", type=int, default=1000, help="request i uses seed + i (default 1000)")
    p.add_argument("--voice", default=None, help="preset voice for every request")
    p.add_argument("--max-new-frames", type=int, default=None, help="frame budget per request")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--first-chunk-frames", type=int, default=0, help="0 = server default")
    p.add_argument("--chunk-frames", type=int, default=0, help="0 = server default")
    p.add_argument("--encoding", choices=["pcm16", "float32"], default="pcm16")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark from parsed `add_arguments` options; prints the table, writes the JSON."""
    import grpc

    out = Path(args.json)
    if not (out.parent if str(out.parent) else Path(".")).is_dir():
        print(f"tts: error: directory of --json {out} does not exist", file=sys.stderr)
        return 2
    if args.requests is not None and args.requests < 1:
        print("tts: error: --requests must be >= 1", file=sys.stderr)
        return 2
    request_options = {
        "voice": args.voice, "max_new_frames": args.max_new_frames, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k, "first_chunk_frames": args.first_chunk_frames,
        "chunk_frames": args.chunk_frames, "encoding": args.encoding,
    }  # fmt: skip

    def progress(level: LevelResult) -> None:
        errors = f", errors {level.errors}" if level.errors else ""
        print(
            f"concurrency {level.concurrency}: {level.ok}/{level.requests} ok in {level.wall_s:.1f} s{errors}",
            file=sys.stderr,
        )

    try:
        report = asyncio.run(
            run_loadtest(
                args.server, args.concurrency, requests=args.requests, seed=args.seed, warmup=args.warmup,
                timeout=args.timeout, progress=progress, **request_options,
            )
        )  # fmt: skip
    except grpc.aio.AioRpcError as exc:
        print(f"tts: error: {args.server}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else 1
    info = report["info"]
    print(
        f"server {args.server}: model {info.get('model')} on {info.get('device')}, max batch {info.get('max_batch')}, "
        f"graphs {'on' if info.get('graphs') else 'off'}, replay share {report['replay_share_after']:.3f}"
    )
    print(format_table(report))
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0
