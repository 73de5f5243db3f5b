"""Batched streaming decode of the default voice's codec (`MelVQCodec.batched_stream`) against the
per-stream `codec.stream().push` it replaces in the codec stage.

    python tools/microbench/melvq_batched.py --out melvq_cpu.json                 # CPU, 1 torch thread
    python tools/microbench/melvq_batched.py --device cuda --out melvq_cuda.json  # + CUDA-graph replay

For every B (streams per call) and T (frames per stream per call) it times, on the same random codes:

* `stream`: B `codec.stream()` decoders, each pushed T frames per round, one after another (what a
  per-stream codec stage does; each push re-decodes `context_frames` frames of left context);
* `batched`: one `decoder.decode(slots, codes, lengths)` per round for all B streams (state per slot,
  only the new frames decoded);
* `graph` (CUDA, when the decoder is `graph_safe`): the same call captured once in a CUDA graph for
  this (B, T) and replayed with the inputs copied into its static buffers.

Each variant runs `--warmup` rounds, then rounds until `--seconds` have passed (at least `--rounds`),
and reports the median and minimum seconds per round and frames/s = B * T / median (the real-time
stream count is frames/s / 21.53). A variant that fails records its error and the others still run.
Run it against another checkout (`PYTHONPATH=/path/to/checkout`) to time that checkout's codec; on a
checkout without a batched implementation `batched` times the base class's looped default.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_rounds(step, device, warmup: int, rounds: int, seconds: float) -> tuple[list[float], list[float]]:
    """Wall seconds and this thread's CPU seconds of each timed round."""
    for _ in range(warmup):
        step()
    _sync(device)
    wall: list[float] = []
    cpu: list[float] = []
    start = time.perf_counter()
    while len(wall) < rounds or time.perf_counter() - start < seconds:
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        _sync(device)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        if len(wall) >= 1000:
            break
    return wall, cpu


def _summary(times: tuple[list[float], list[float]], B: int, T: int) -> dict:
    """Per-round statistics. On a shared CPU the thread's CPU time (`cpu_*`; with one torch thread all
    the decode work runs on the calling thread) is steadier than wall time; `frames_per_s` uses wall."""
    wall, cpu = times
    med, cpu_med = statistics.median(wall), statistics.median(cpu)
    return {
        "rounds": len(wall),
        "median_s": med,
        "min_s": min(wall),
        "cpu_median_s": cpu_med,
        "frames_per_s": B * T / med,
        "ms_per_frame": 1e3 * med / (B * T),
        "cpu_ms_per_frame": 1e3 * cpu_med / (B * T),
    }


def bench_point(codec, device, B: int, T: int, args, codes_pool: torch.Tensor) -> dict:
    """All variants for one (B, T); codes_pool `[B, N, frames]` int64 on the CPU."""
    N = codec.num_codebooks
    out: dict = {"B": B, "T": T}
    position = {"i": 0}

    def next_codes() -> torch.Tensor:  # the next T frames of each stream, cycling through the pool
        i = position["i"]
        position["i"] = (i + T) % (codes_pool.shape[-1] - T)
        return codes_pool[:, :, i : i + T]

    # stream: one StreamingDecoder per stream, pushed in turn
    if not args.skip_stream:
        try:
            streams = [codec.stream() for _ in range(B)]

            def stream_step():
                c = next_codes()
                for b in range(B):
                    streams[b].push(c[b])

            out["stream"] = _summary(
                _time_rounds(stream_step, device, args.warmup, args.rounds, args.seconds), B, T
            )
        except Exception as exc:  # noqa: BLE001 - a benchmark records failures and goes on
            out["stream"] = {"error": repr(exc), "trace": traceback.format_exc(limit=3)}

    slots = torch.arange(B, device=device)
    lengths = torch.full((B,), T, dtype=torch.int64, device=device)
    try:
        dec = codec.batched_stream(B)
        dec.reset(slots)

        def batched_step():
            dec.decode(slots, next_codes().to(device), lengths)

        out["batched"] = _summary(
            _time_rounds(batched_step, device, args.warmup, args.rounds, args.seconds), B, T
        )
        out["graph_safe"] = bool(getattr(dec, "graph_safe", False))
        out["decoder"] = type(dec).__name__
    except Exception as exc:  # noqa: BLE001
        out["batched"] = {"error": repr(exc), "trace": traceback.format_exc(limit=3)}
        dec = None

    if device.type == "cuda" and dec is not None and getattr(dec, "graph_safe", False):
        try:
            static_codes = torch.zeros(B, N, T, dtype=torch.int64, device=device)
            static_codes.copy_(next_codes())
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up (cuFFT plans, allocator) on the capture stream
                for _ in range(2):
                    dec.decode(slots, static_codes, lengths)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph):
                static_out = dec.decode(slots, static_codes, lengths)
            out["graph_capture_s"] = time.perf_counter() - t0

            def graph_step():
                static_codes.copy_(next_codes(), non_blocking=True)
                graph.replay()

            out["graph"] = _summary(
                _time_rounds(graph_step, device, args.warmup, args.rounds, args.seconds), B, T
            )
            out["graph"]["output_shape"] = list(static_out.shape)
            del graph
        except Exception as exc:  # noqa: BLE001
            out["graph"] = {"error": repr(exc), "trace": traceback.format_exc(limit=3)}
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.detach().cpu(), b.detach().cpu()
    d = a - b
    return {
        "max_abs": float(d.abs().max()) if d.numel() else 0.0,
        "rel_rms": float(d.pow(2).mean().sqrt() / b.pow(2).mean().sqrt()) if d.numel() else 0.0,
    }


def accuracy(codec, cpu_codec, device, seed: int = 0) -> dict:
    """How far the device's decodes are from the CPU's offline `decode` (and, on CUDA, a graph replay
    from eager): max |difference| in samples and RMS of the difference over the signal's RMS, for one
    60-frame stream decoded in chunks of 4 alone (B=1) and in chunks of 16 among 3 other streams."""
    g = torch.Generator().manual_seed(seed)
    K, N = codec.codebook_size, codec.num_codebooks
    codes = torch.randint(0, K, (N, 60), generator=g)
    ref = cpu_codec.decode(codes)
    out: dict = {"offline_on_device": _diff(codec.decode(codes), ref)}
    for B, T in ((1, 4), (4, 16)):
        dec = codec.batched_stream(B)
        slots = torch.arange(B, device=device)
        dec.reset(slots)
        pieces = []
        for start in range(0, 60, T):
            n = min(T, 60 - start)
            batch = torch.randint(0, K, (B, N, T), generator=g)
            batch[0, :, :n] = codes[:, start : start + n]
            lengths = torch.full((B,), T, dtype=torch.int64)
            lengths[0] = n
            pieces.append(
                dec.decode(slots, batch.to(device), lengths.to(device))[0, : n * codec.frame_length]
            )
        out[f"batched_B{B}_T{T}"] = _diff(torch.cat(pieces), ref)
    if device.type == "cuda":
        B, T = 4, 4
        graphed, eager = codec.batched_stream(B), codec.batched_stream(B)
        slots = torch.arange(B, device=device)
        static_codes = torch.zeros(B, N, T, dtype=torch.int64, device=device)
        static_lengths = torch.full((B,), T, dtype=torch.int64, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            graphed.decode(slots, static_codes, torch.zeros_like(static_lengths))  # length 0: no state change
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = graphed.decode(slots, static_codes, static_lengths)
        worst = {"max_abs": 0.0, "rel_rms": 0.0}
        for _ in range(10):
            c = torch.randint(0, K, (B, N, T), generator=g).to(device)
            static_codes.copy_(c)
            graph.replay()
            d = _diff(static_out, eager.decode(slots, c, static_lengths))
            worst = {k: max(worst[k], d[k]) for k in worst}
        out["graph_vs_eager_B4_T4_10_calls"] = worst
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="default", help="a bundle spec whose codec is timed")
    p.add_argument("--batch", default="1,4,16,64", help="streams per call (comma-separated)")
    p.add_argument("--frames", default="4,16", help="frames per stream per call (comma-separated)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the codec thread uses 1)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="at least this many timed rounds")
    p.add_argument("--seconds", type=float, default=2.0, help="and at least this long per variant")
    p.add_argument("--skip-stream", action="store_true", help="time only the batched decoder")
    p.add_argument("--no-check", action="store_true", help="skip the accuracy check against the CPU")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()

    from tts.checkpoints.load import load_bundle

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    codec = load_bundle(args.model).codec
    if device.type != "cpu":
        if not hasattr(codec, "to"):
            sys.exit(f"{type(codec).__name__} cannot move to {device}")
        codec.to(device)
    meta = {
        "device": str(device),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "codec": type(codec).__name__,
        "context_frames": codec.context_frames,
        "frame_rate": codec.frame_rate,
        "tts_path": str(Path(sys.modules["tts"].__file__).parent),
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(meta))
    checks = None
    if not args.no_check:
        try:
            checks = accuracy(codec, load_bundle(args.model).codec, device)
        except Exception as exc:  # noqa: BLE001
            checks = {"error": repr(exc), "trace": traceback.format_exc(limit=3)}
        print(json.dumps({"accuracy": checks}))
    g = torch.Generator().manual_seed(0)
    results = []
    for B in [int(x) for x in args.batch.split(",")]:
        pool = torch.randint(0, codec.codebook_size, (B, codec.num_codebooks, 256), generator=g)
        for T in [int(x) for x in args.frames.split(",")]:
            r = bench_point(codec, device, B, T, args, pool)
            results.append(r)
            cells = [f"B={B:3d} T={T:2d}"]
            for k in ("stream", "batched", "graph"):
                if k in r:
                    v = r[k]
                    cells.append(
                        f"{k} {v['frames_per_s']:9.1f} fps ({v['ms_per_frame']:.3f} ms/frame wall, "
                        f"{v['cpu_ms_per_frame']:.3f} cpu)"
                        if "error" not in v
                        else f"{k} ERROR {v['error'][:80]}"
                    )
            print("  ".join(cells), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "accuracy": checks, "results": results}, indent=2))


if __name__ == "__main__":
    main()
