"""The modded DAC's batched streaming decoder (`DACCodec.batched_stream`) on one GPU: eager vs CUDA-graph
replay, float32 vs bfloat16, over a grid of batch sizes B (streams per call) and chunk lengths T (frames).

    python tools/microbench/dac_batched.py --device cuda                       # S2-Pro-size DAC, ~5 min
    python tools/microbench/dac_batched.py --device cpu --tiny --batches 1,4 --frames 4 --iters 3

The codec is the S2-Pro-size modded DAC (`DACConfig()`) with random weights
(`random_codec_state(cfg, seed=0)`), written to a temporary codec.pth and loaded by
`DACCodec.from_file` in each dtype (or `--codec PATH` for a real one). For every (cudnn.benchmark mode,
dtype, B, T) it times `decode(slots, codes, lengths)` of B streams of T frames each:

* eager: the call as the codec stage would make it without graphs;
* graph: the same call captured once in a `torch.cuda.CUDAGraph` on static inputs (warm-up on a side
  stream first, as torch documents), then replayed (CUDA only);

with CUDA events around each call (synchronized per call, so a number is one call's latency), after
warm-up, as the median of `--iters` calls (fewer when a call is slow: `--variant-seconds`). It also times
the per-stream `DACStreamingDecoder.push` at B=1, T=16 (what the service did per request before; it
returns CPU samples, so its time includes the copy back), measures bfloat16 vs float32 output error and
float32 streamed vs offline error on the same codes, checks graph replay against eager, and profiles
one eager call per dtype (top kernels), which is where a slow dtype shows its cause.

Every variant runs in its own try/except: a failure is printed and recorded, and the run goes on. The
JSON (`--out`, default bench-out/dac_batched.json) is rewritten after every variant, so an interrupted
run keeps what it measured; `--time-budget` skips what is left once it is spent (default 500 s, under
a 10-minute job limit).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# Run this checkout's code, not whatever `tts` an environment has installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tts.codec.dac.codec import DACCodec  # noqa: E402
from tts.codec.dac.net import DACConfig  # noqa: E402
from tts.codec.dac.random_init import random_codec_state, tiny_dac_config  # noqa: E402
from tts.model.randinit import hashed_randint  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny test DAC instead of the S2-Pro size")
    p.add_argument("--codec", help="a real codec.pth to load instead of random weights")
    p.add_argument("--batches", type=_ints, default=[1, 4, 16, 64], help="B values, comma-separated")
    p.add_argument("--frames", type=_ints, default=[4, 16], help="T values (frames per call)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--cudnn-benchmark",
        choices=["off", "on", "both"],
        default="both",
        help="torch.backends.cudnn.benchmark",
    )
    p.add_argument("--iters", type=int, default=30, help="timed calls per variant (at most)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variant-seconds", type=float, default=4.0, help="fewer timed calls when calls are slow")
    p.add_argument("--time-budget", type=float, default=500.0, help="seconds; later variants are skipped")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--accuracy-only", action="store_true", help="only the accuracy comparison, no timing")
    p.add_argument("--out", default="bench-out/dac_batched.json")
    a = p.parse_args(argv)
    a.dtypes = [d for d in a.dtypes.split(",") if d]
    for d in a.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r} (float32, bfloat16)")
    return a


def call_ms(fn, cuda: bool) -> float:
    """One call of fn() in ms: between CUDA events, synchronized, on a GPU; by the wall clock on a CPU."""
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def capture_decode(dec, slots, codes, lengths) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, float]:
    """A CUDA graph of `dec.decode(slots, codes, lengths)` on these static inputs, after three calls on a
    side stream (cuDNN plans, the allocator) as torch documents: (graph, its output, capture seconds)."""
    device = slots.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            dec.decode(slots, codes, lengths)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    t = time.perf_counter()
    with torch.cuda.graph(graph):
        out = dec.decode(slots, codes, lengths)
    return graph, out, time.perf_counter() - t


class Bench:
    """Runs the variants, collects results and errors, and writes the JSON after each one."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.start = time.perf_counter()
        self.report: dict = {
            "env": self.env(),
            "args": {k: v for k, v in vars(args).items()},
            "results": [],
            "per_stream_reference": [],
            "accuracy": {},
            "profiles": [],
            "errors": [],
            "skipped": [],
        }

    def env(self) -> dict:
        env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(self.device)}
        if self.device.type == "cuda":
            env.update(
                gpu=torch.cuda.get_device_name(self.device),
                cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(),
                cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            )
        else:
            env["threads"] = torch.get_num_threads()
        return env

    def save(self) -> None:
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.report, indent=2))

    def over_budget(self, what: str) -> bool:
        if time.perf_counter() - self.start < self.args.time_budget:
            return False
        self.report["skipped"].append(what)
        print(f"skipped (time budget spent): {what}")
        return True

    def guarded(self, what: str, fn, *a, **kw):
        """fn(*a, **kw), or None after printing and recording its error (the run goes on)."""
        if self.over_budget(what):
            return None
        try:
            return fn(*a, **kw)
        except Exception as exc:  # one failing variant must not end the run
            msg = f"{type(exc).__name__}: {exc}"
            print(f"FAILED {what}: {msg}")
            traceback.print_exc(limit=3)
            self.report["errors"].append({"what": what, "error": msg})
            if self.cuda:
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
                torch.cuda.empty_cache()
            return None
        finally:
            self.save()

    # ---- timing ----------------------------------------------------------------------------------------

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_calls(self, fn) -> dict:
        """Latency of fn() in ms: warm-up, then up to --iters calls (fewer if a call is slow), each
        synchronized; CUDA events on a GPU, perf_counter on a CPU."""
        a = self.args
        t0 = time.perf_counter()
        for _ in range(max(1, a.warmup)):
            fn()
        self.sync()
        per_call = (time.perf_counter() - t0) / max(1, a.warmup)
        iters = max(3, min(a.iters, int(a.variant_seconds / max(per_call, 1e-6))))
        ms = sorted(call_ms(fn, self.cuda) for _ in range(iters))
        return {
            "ms_median": statistics.median(ms),
            "ms_p10": ms[int(0.1 * (len(ms) - 1))],
            "ms_p90": ms[int(0.9 * (len(ms) - 1))],
            "iters": iters,
        }

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_mb(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else None


def codes_for(codec: DACCodec, B: int, T: int, seed: int) -> torch.Tensor:
    """Valid codes `[B, num_codebooks, T]` int64, a function of the seed (same for every dtype)."""
    c = codec.cfg
    semantic = hashed_randint((B, 1, T), seed, "semantic", c.semantic_codebook_size)
    residual = hashed_randint((B, c.n_codebooks, T), seed, "residual", c.codebook_size)
    return torch.cat([semantic, residual], dim=1)


def record(bench: Bench, row: dict, codec: DACCodec) -> dict:
    frames = row["B"] * row["T"]
    seconds = row["ms_median"] / 1e3
    row["frames_per_s"] = frames / seconds
    row["audio_s_per_s"] = frames * codec.frame_length / codec.sample_rate / seconds
    row["peak_mem_mb"] = bench.peak_mb()
    bench.report["results"].append(row)
    return row


def run_eager(bench: Bench, codec: DACCodec, dec, dtype: str, cudnn_bm: bool, B: int, T: int) -> dict:
    slots = torch.arange(B, device=bench.device)
    codes = codes_for(codec, B, T, seed=B * 100 + T).to(bench.device)
    lengths = torch.full((B,), T, dtype=torch.int64, device=bench.device)
    dec.reset(slots)
    bench.reset_peak()
    timing = bench.time_calls(lambda: dec.decode(slots, codes, lengths))
    row = dict(variant="eager", dtype=dtype, cudnn_benchmark=cudnn_bm, B=B, T=T, **timing)
    return record(bench, row, codec)


def run_graph(bench: Bench, codec: DACCodec, dec, dtype: str, cudnn_bm: bool, B: int, T: int) -> dict:
    device = bench.device
    static_slots = torch.arange(B, device=device)
    static_codes = codes_for(codec, B, T, seed=B * 100 + T).to(device)
    static_lengths = torch.full((B,), T, dtype=torch.int64, device=device)
    dec.reset(static_slots)
    bench.reset_peak()
    graph, static_out, capture_s = capture_decode(dec, static_slots, static_codes, static_lengths)
    # Replay vs eager from the same (fresh) state: the graph must compute what eager computes.
    dec.reset(static_slots)
    graph.replay()
    replayed = static_out.clone()
    dec.reset(static_slots)
    eager = dec.decode(static_slots, static_codes, static_lengths)
    graph_vs_eager = float((replayed - eager).abs().max())
    dec.reset(static_slots)
    timing = bench.time_calls(graph.replay)
    row = dict(
        variant="graph",
        dtype=dtype,
        cudnn_benchmark=cudnn_bm,
        B=B,
        T=T,
        capture_s=capture_s,
        graph_vs_eager_max_abs=graph_vs_eager,
        **timing,
    )
    row = record(bench, row, codec)
    del graph, static_out
    torch.cuda.empty_cache()
    return row


def run_per_stream(bench: Bench, codec: DACCodec, dtype: str, cudnn_bm: bool, T: int = 16) -> dict:
    """The old path: one DACStreamingDecoder, `push(codes [N, T])` returning CPU samples."""
    stream = codec.stream()
    codes = codes_for(codec, 1, T, seed=7)[0]
    bench.reset_peak()
    t0 = time.perf_counter()
    for _ in range(max(1, bench.args.warmup)):
        stream.push(codes)
    per_call = (time.perf_counter() - t0) / max(1, bench.args.warmup)
    iters = max(3, min(bench.args.iters, int(bench.args.variant_seconds / max(per_call, 1e-6))))
    ms = []
    for _ in range(iters):
        t = time.perf_counter()
        stream.push(codes)  # synchronous: it returns CPU samples
        ms.append((time.perf_counter() - t) * 1e3)
    row = dict(
        variant="per_stream_push",
        dtype=dtype,
        cudnn_benchmark=cudnn_bm,
        B=1,
        T=T,
        ms_median=statistics.median(ms),
        ms_p10=sorted(ms)[int(0.1 * (iters - 1))],
        ms_p90=sorted(ms)[int(0.9 * (iters - 1))],
        iters=iters,
    )
    frames = T
    row["frames_per_s"] = frames / (row["ms_median"] / 1e3)
    row["audio_s_per_s"] = frames * codec.frame_length / codec.sample_rate / (row["ms_median"] / 1e3)
    row["peak_mem_mb"] = bench.peak_mb()
    bench.report["per_stream_reference"].append(row)
    return row


def run_accuracy(bench: Bench, codecs: dict[str, DACCodec], B: int = 4, T: int = 16, chunks: int = 4) -> dict:
    """Same codes through fresh batched decoders in each dtype: bf16 vs fp32 error, and each dtype's
    stream vs its own offline decode (row 0)."""
    device = bench.device
    any_codec = next(iter(codecs.values()))
    codes = codes_for(any_codec, B, T * chunks, seed=12345)
    slots = torch.arange(B, device=device)
    lengths = torch.full((B,), T, dtype=torch.int64, device=device)
    outs, acc = {}, {"B": B, "T": T, "chunks": chunks}
    for name, codec in codecs.items():
        dec = codec.batched_stream(B)
        dec.reset(slots)
        pieces = [
            dec.decode(slots, codes[..., i * T : (i + 1) * T].to(device), lengths) for i in range(chunks)
        ]
        outs[name] = torch.cat(pieces, dim=1).cpu()
        offline = codec.decode(codes[0])
        acc[f"{name}_stream_vs_offline_max_abs"] = float((outs[name][0] - offline).abs().max())
        acc[f"{name}_audio_rms"] = float(outs[name].pow(2).mean().sqrt())
        del dec
    if "float32" in outs and "bfloat16" in outs:
        acc.update(_error("bf16_vs_fp32", outs["bfloat16"], outs["float32"]))
    if "float32" in codecs and bench.cuda:
        # What fish-speech's own server does: the float32 codec's offline decode of the whole clip under
        # torch.autocast(bfloat16) (`get_audio_segment`), against the same decode without autocast.
        # Our bfloat16 decode should not be further from float32 than that.
        model = codecs["float32"].model
        with torch.inference_mode():
            full = codes.to(device)
            fp32 = model.decode(full)[:, 0].float().cpu()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                autocast = model.decode(full)[:, 0].float().cpu()
        acc.update(_error("autocast_bf16_offline_vs_fp32_offline", autocast, fp32))
        if "bfloat16" in outs:
            acc.update(_error("bf16_stream_vs_fp32_offline", outs["bfloat16"], fp32))
    bench.report["accuracy"] = acc
    return acc


def _error(name: str, x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max absolute error, relative RMS error and its SNR in dB of `x` against `ref`."""
    err = x - ref
    rel = float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    return {
        f"{name}_max_abs": float(err.abs().max()),
        f"{name}_rel_rms": rel,
        f"{name}_snr_db": float(-20 * torch.log10(torch.tensor(max(rel, 1e-12)))),
    }


def run_profile(bench: Bench, codec: DACCodec, dec, dtype: str, cudnn_bm: bool, B: int, T: int) -> dict:
    """One eager call under torch.profiler: the top ops/kernels by self time (device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    slots = torch.arange(B, device=bench.device)
    codes = codes_for(codec, B, T, seed=3).to(bench.device)
    lengths = torch.full((B,), T, dtype=torch.int64, device=bench.device)
    dec.reset(slots)
    for _ in range(2):
        dec.decode(slots, codes, lengths)
    bench.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    with profile(activities=activities) as prof:
        dec.decode(slots, codes, lengths)
        bench.sync()

    def self_time(evt) -> float:
        if not bench.cuda:
            return float(evt.self_cpu_time_total)
        return float(getattr(evt, "self_device_time_total", 0) or 0)

    def summary(events) -> tuple[float, list[dict]]:
        rows = sorted(((e.key, self_time(e), e.count) for e in events), key=lambda r: -r[1])
        rows = [r for r in rows if r[1] > 0]
        total = sum(r[1] for r in rows)
        return total, [
            {"name": n[:160], "self_us": us, "count": c, "share": us / total if total else 0.0}
            for n, us, c in rows[:15]
        ]

    averages = prof.key_averages()
    # A GPU kernel's time shows twice: as a kernel (device events; names tell the algorithm) and as the
    # self device time of the aten op that launched it (host events; names tell the operation).
    is_host = lambda e: "CPU" in str(getattr(e, "device_type", "CPU"))  # noqa: E731
    total, ops = summary([e for e in averages if is_host(e)])
    out = dict(dtype=dtype, cudnn_benchmark=cudnn_bm, B=B, T=T, total_self_us=total, top_ops=ops)
    if bench.cuda:
        out["kernels_total_us"], out["top_kernels"] = summary([e for e in averages if not is_host(e)])
    bench.report["profiles"].append(out)
    unit = "device" if bench.cuda else "CPU"
    print(f"\nprofile {dtype} cudnn.benchmark={cudnn_bm} B={B} T={T}: {total / 1e3:.2f} ms {unit} time")
    for e in ops[:10]:
        print(f"  {e['self_us'] / 1e3:8.3f} ms {100 * e['share']:5.1f}% x{e['count']:<4} {e['name'][:90]}")
    for e in out.get("top_kernels", [])[:6]:
        print(
            f"  kernel {e['self_us'] / 1e3:8.3f} ms {100 * e['share']:5.1f}% x{e['count']:<4} "
            f"{e['name'][:80]}"
        )
    return out


def load_codecs(bench: Bench, tmp: Path) -> dict[str, DACCodec]:
    a = bench.args
    if a.codec:
        path = Path(a.codec)
    else:
        cfg = tiny_dac_config() if a.tiny else DACConfig()
        t = time.perf_counter()
        state = random_codec_state(cfg, seed=0)
        path = tmp / "codec.pth"
        torch.save(state, path)
        del state
        print(f"random {'tiny' if a.tiny else 'S2-Pro-size'} DAC written in {time.perf_counter() - t:.1f} s")
    codecs = {}
    for name in a.dtypes:
        codecs[name] = DACCodec.from_file(path, device=bench.device, dtype=DTYPES[name])
    c = next(iter(codecs.values()))
    params = sum(p.numel() for p in c.model.parameters())
    bench.report["codec"] = {
        "params": params,
        "config": repr(c.cfg),
        "source": str(a.codec or "random seed 0"),
    }
    return codecs


def print_table(bench: Bench) -> None:
    rows = bench.report["results"]
    by_key = {(r["variant"], r["dtype"], r["cudnn_benchmark"], r["B"], r["T"]): r for r in rows}
    print(
        f"\n{'cudnn.bm':>8} {'dtype':>8} {'B':>3} {'T':>3} {'eager ms':>9} {'graph ms':>9} {'x':>5} "
        f"{'graph frames/s':>14} {'audio s/s':>9} {'peak MB':>8}"
    )
    seen = sorted({k[1:] for k in by_key}, key=lambda k: (k[1], k[0], k[2], k[3]))
    for dtype, bm, B, T in seen:
        e, g = by_key.get(("eager", dtype, bm, B, T)), by_key.get(("graph", dtype, bm, B, T))
        best = g or e
        print(
            f"{str(bm):>8} {dtype:>8} {B:3d} {T:3d} "
            f"{e['ms_median'] if e else float('nan'):9.3f} {g['ms_median'] if g else float('nan'):9.3f} "
            f"{(e['ms_median'] / g['ms_median']) if e and g else float('nan'):5.2f} "
            f"{best['frames_per_s']:14.1f} {best['audio_s_per_s']:9.1f} {best['peak_mem_mb'] or 0:8.0f}"
        )
    for r in bench.report["per_stream_reference"]:
        print(
            f"per-stream DACStreamingDecoder.push, {r['dtype']}, cudnn.benchmark={r['cudnn_benchmark']}, "
            f"B=1 T={r['T']}: {r['ms_median']:.3f} ms ({r['frames_per_s']:.1f} frames/s)"
        )
    if bench.report["accuracy"]:
        print("accuracy:", json.dumps(bench.report["accuracy"]))
    if bench.report["errors"]:
        print(f"{len(bench.report['errors'])} variant(s) failed; see 'errors' in the JSON")


def run_all(bench: Bench, codecs: dict[str, DACCodec], modes: list[bool]) -> None:
    a = bench.args
    max_streams = max(a.batches)
    decoders = {}
    for name, codec in codecs.items():
        decoders[name] = bench.guarded(f"batched_stream {name}", codec.batched_stream, max_streams)
        if decoders[name] is not None:
            bench.report.setdefault("state_bytes", {})[name] = decoders[name].state_bytes()
    bench.guarded("accuracy", run_accuracy, bench, codecs)
    if a.accuracy_only:
        return
    for bm in modes:
        torch.backends.cudnn.benchmark = bm
        for name, codec in codecs.items():
            dec = decoders[name]
            if dec is None:
                continue
            for B in a.batches:
                for T in a.frames:
                    tag = f"{name} cudnn.benchmark={bm} B={B} T={T}"
                    r = bench.guarded(f"eager {tag}", run_eager, bench, codec, dec, name, bm, B, T)
                    if r:
                        print(f"eager {tag}: {r['ms_median']:.3f} ms")
                    if bench.cuda:
                        r = bench.guarded(f"graph {tag}", run_graph, bench, codec, dec, name, bm, B, T)
                        if r:
                            print(
                                f"graph {tag}: {r['ms_median']:.3f} ms (vs eager "
                                f"{r['graph_vs_eager_max_abs']:.2g})"
                            )
            bench.guarded(f"per-stream {name} {bm}", run_per_stream, bench, codec, name, bm)
            if not a.no_profile:
                for B in sorted({min(a.batches), max(a.batches)}):
                    bench.guarded(
                        f"profile {name} {bm} B={B}",
                        run_profile,
                        bench,
                        codec,
                        dec,
                        name,
                        bm,
                        B,
                        max(a.frames),
                    )


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up as they happen in a job log
    bench = Bench(a)
    print(json.dumps(bench.report["env"]))
    modes = {"off": [False], "on": [True], "both": [False, True]}[a.cudnn_benchmark]
    if not bench.cuda:
        modes = [False]  # cuDNN does not run on a CPU
    # The temporary codec.pth stays until the end: a CPU codec's float32 weights are mapped from it.
    with tempfile.TemporaryDirectory() as tmp:
        codecs = bench.guarded("load codecs", load_codecs, bench, Path(tmp))
        if not codecs:
            bench.save()
            raise SystemExit("could not build the codec; see the error above")
        run_all(bench, codecs, modes)
    torch.backends.cudnn.benchmark = False
    bench.report["wall_s"] = time.perf_counter() - bench.start
    bench.save()
    print_table(bench)
    print(f"\nwrote {a.out} ({bench.report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
