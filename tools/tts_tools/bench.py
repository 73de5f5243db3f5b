"""`tts bench`: the TPS benchmark (frames per second) of the engine's decode loop.

For each mode (eager, graph) and batch size, the benchmark builds an engine, captures its graphs at
start-up (graph mode), submits `batch` requests whose prompts hold `--prompt-tokens` tokens (text
tokens with a semantic column every 4th position, like a voice-conditioned prompt), runs warm-up
frames (admission and prefill happen there), then times `--frames` engine iterations. The engine is
sized for `--max-context` tokens per request (default: the model's maximum, as `tts serve` runs; on a
GPU the graphs' attention reads block tables that wide). The end token
is never sampled (`ignore_eos`), so every request produces exactly the frames asked for.

Reported per (mode, batch): per-stream frames/s, aggregate frames/s, decode-step latency p50/p99 (one
`Engine.step()`: the frame step plus reading its outputs back to the host), replay share, capture
seconds, graph pool and KV memory, peak GPU memory, and time per frame against the weight-bandwidth
floor. The run fails if a capture happens inside a timed window. Method and versions go into the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: `tts --help` loads this module)
    import torch


from tts.runtime.errors import UserError

# Datasheet HBM bandwidth (bytes/s) of known GPUs, by what `torch.cuda.get_device_name` says: the first
# row whose words all occur in the lower-cased name. The floor of a frame at batch 1 is the weights it
# reads over this rate (a device reaches somewhat less: a device-to-device copy measured 4.3e12 on an
# H200 here). A GPU not listed has no floor unless --bandwidth gives one.
GPU_BANDWIDTH: tuple[tuple[tuple[str, ...], float, str], ...] = (
    (("h200",), 4.8e12, "H200"),
    (("h100", "pcie"), 2.0e12, "H100 PCIe"),
    (("h100", "nvl"), 3.9e12, "H100 NVL"),
    (("h100",), 3.35e12, "H100 SXM"),
    (("a100", "80gb", "pcie"), 1.935e12, "A100 80GB PCIe"),
    (("a100", "80gb"), 2.039e12, "A100 80GB SXM"),
    (("a100",), 1.555e12, "A100 40GB"),
    (("b200",), 8.0e12, "B200"),
    (("l40s",), 0.864e12, "L40S"),
    (("a10",), 0.6e12, "A10"),  # (after the A100 rows, whose names contain "a10")
    (("l4",), 0.3e12, "L4"),
    (("rtx 4090",), 1.008e12, "RTX 4090"),
)


def gpu_bandwidth(name: str) -> tuple[float, str] | None:
    """(bytes/s, the GPU's label) of the first GPU_BANDWIDTH row matching the device name `name` (e.g.
    "NVIDIA H100 80GB HBM3"), or None for a GPU not listed."""
    lowered = name.lower()
    for words, bandwidth, label in GPU_BANDWIDTH:
        if all(w in lowered for w in words):
            return bandwidth, label
    return None


def _prompt(model, tokens: int, seed: int) -> torch.Tensor:
    import torch

    c = model.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.zeros(tokens, 1 + c.num_codebooks, dtype=torch.int64)
    prompt[:, 0] = torch.randint(0, min(c.semantic_begin_id, 50_000), (tokens,), generator=g)
    for t in range(0, tokens, 4):
        codes = torch.randint(0, c.codebook_size, (c.num_codebooks,), generator=g)
        prompt[t, 0], prompt[t, 1:] = c.semantic_begin_id + codes[0], codes
    return prompt


CPU_SHAPE_LIMIT = 1_000_000_000  # parameters: a random shape above this is for GPUs only


def check_out_dir(out: Path) -> None:
    """Raise UserError unless the results folder `out` exists as a writable folder or could be made
    (its nearest existing ancestor is a writable folder); makes nothing."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"cannot write results to --out {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write results to --out {out}: {existing} is not writable")


def check_shape_device(name: str, cuda: bool) -> None:
    """Raise UserError for a random shape too large for a CPU benchmark (it would run for hours)."""
    from tts.model.shapes import SHAPES, shape_parameters

    if name in SHAPES and not cuda and (n := shape_parameters(name)) > CPU_SHAPE_LIMIT:
        small = ", ".join(s for s in SHAPES if shape_parameters(s) <= CPU_SHAPE_LIMIT)
        raise UserError(
            f"--model {name} has {n / 1e9:.2f} B parameters of random weights, for GPU benchmarks: give "
            f"--device cuda, or on a CPU bench {small or 'a preset'} or the default voice"
        )


def load_bench_model(name: str, device: str, dtype, weights: str | None = None):
    """A model for benchmarking: a random-weight shape (`s2-pro-shape`, ...), a preset, or a directory;
    with `weights` ("fp8", "int8") its linear layers quantized (tts.model.quant)."""
    import torch

    from tts.checkpoints.load import load_bundle
    from tts.model.quant import quantize_model
    from tts.model.shapes import SHAPES, build_random_model, shape_config

    if name in SHAPES:
        model = build_random_model(shape_config(name), device, dtype or torch.bfloat16)
    else:
        model = load_bundle(name, device=device, dtype=dtype).model
    if weights is not None:
        quantize_model(model, weights)
    return model


def bench_one(model, mode: str, batch: int, args) -> dict:
    """Run one (mode, batch) point; returns its measurements."""
    import torch

    from tts.engine import Engine, EngineConfig, SamplingParams

    device = model.embeddings.weight.device
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()  # the previous batch's engine (its graphs hold reference cycles) frees its memory now
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # + batch: the iterations admission may take (each prefills a bounded number of prompt tokens)
    budget = args.warmup_frames + args.frames + 1 + batch
    engine = Engine(
        model,
        EngineConfig(
            max_batch=batch,
            max_waiting=batch,  # every request is submitted before the first step
            graphs="startup" if mode == "graph" else "off",
            buckets=args.buckets,
            max_context=args.max_context,
            ignore_eos=True,
        ),
    )
    capture_seconds = engine.graphs.stats.capture_seconds_total
    params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_new_frames=budget, seed=0)
    for i in range(batch):
        engine.submit(_prompt(model, args.prompt_tokens, seed=i), params)
    for _ in range(batch):
        if engine.num_running == batch:
            break
        engine.step()
    for _ in range(args.warmup_frames):
        engine.step()
    assert engine.num_running == batch, "every request must be running before the timed window"
    captured_before = dict(engine.graphs.stats.capture_seconds)
    replays0, eager0 = engine.graphs.stats.replays, engine.graphs.stats.eager_steps
    step_ms = []
    t0 = time.perf_counter()
    for _ in range(args.frames):
        s = time.perf_counter()
        engine.step()  # ends with a device-to-host copy of the frame: synchronous
        step_ms.append((time.perf_counter() - s) * 1e3)
    wall = time.perf_counter() - t0
    stats = engine.graphs.stats
    if stats.capture_seconds != captured_before:
        raise RuntimeError("a graph was captured inside the timed window")
    replays, eager = stats.replays - replays0, stats.eager_steps - eager0
    fps = args.frames / wall
    step_ms.sort()
    result = {
        "mode": mode,
        "batch": batch,
        "frames_per_s_per_stream": fps,
        "frames_per_s_aggregate": fps * batch,
        "step_ms_p50": statistics.median(step_ms),
        "step_ms_p99": step_ms[min(len(step_ms) - 1, int(0.99 * len(step_ms)))],
        "replay_share": replays / max(1, replays + eager),
        "capture_seconds": capture_seconds,
        "graph_pool_bytes": stats.pool_bytes,
        "kv_bytes": engine.kv.nbytes,
        # the blocks the requests held at the end of the timed window (taken as they grow)
        "kv_used_bytes": engine.kv_usage()[0] * engine.kv.nbytes // engine.kv.num_blocks,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else 0,
        "failed_captures": stats.as_dict()["failed_captures"],
    }
    del engine
    return result


def environment(model, args) -> dict:
    import torch

    from tts.model.quant import quantized_format, weight_bytes
    from tts.model.shapes import weight_bytes_per_frame

    c = model.config
    device = model.embeddings.weight.device
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.embeddings.weight.dtype).removeprefix("torch."),
        "weights": quantized_format(model),
        "weight_bytes": weight_bytes(model),
        "shape": {
            "slow": [c.n_layer, c.dim, c.n_head, c.n_local_heads, c.head_dim],
            "fast": [c.n_fast_layer, c.fast_dim],
            "codebooks": c.num_codebooks,
        },
        "prompt_tokens": args.prompt_tokens,
        "max_context": args.max_context or c.max_seq_len,
        "warmup_frames": args.warmup_frames,
        "timed_frames": args.frames,
        "buckets": list(args.buckets),
        "sampling": "temperature 0.8, top-p 0.8, top-k 30, RAS on, end token never sampled",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "weight_bytes_per_frame": weight_bytes_per_frame(model),
    }
    # The floor's bandwidth: --bandwidth, else the datasheet rate of this GPU (none on a CPU or an unknown
    # GPU: no floor).
    env["bandwidth_bytes_per_s"], env["bandwidth_source"] = floor_bandwidth(
        env["device"] if device.type == "cuda" else None, args.bandwidth
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    bandwidth = env["bandwidth_bytes_per_s"]
    env["floor_ms_per_frame_batch1"] = env["weight_bytes_per_frame"] / bandwidth * 1e3 if bandwidth else None
    return env


def floor_bandwidth(device_name: str | None, given: float | None = None) -> tuple[float | None, str | None]:
    """(bytes/s, where the rate came from) for the weight floor: `given` (--bandwidth) if set, else the
    datasheet rate of the GPU named `device_name` (None for a CPU); (None, None) for a GPU GPU_BANDWIDTH
    does not list."""
    if given is not None:
        return given, "--bandwidth"
    known = gpu_bandwidth(device_name) if device_name is not None else None
    if known is None:
        return None, None
    return known[0], f"datasheet HBM bandwidth of the {known[1]}"


def _floor_words(floor_ms: float, weight_bytes: int, bandwidth: float, source: str) -> str:
    gb, tbs = weight_bytes / 1e9, bandwidth / 1e12
    return f"weight floor {floor_ms:.2f} ms/frame at batch 1 ({gb:.2f} GB at {tbs:.2f} TB/s, {source})"


def floor_line(env: dict) -> str:
    """The header's words on the weight-bandwidth floor: its time and where its bandwidth came from."""
    floor = env["floor_ms_per_frame_batch1"]
    if floor is None:
        what = "unknown GPU" if env.get("on_gpu", True) else "a CPU"
        return f"no weight floor ({what}: give --bandwidth BYTES_PER_S for one)"
    return _floor_words(
        floor, env["weight_bytes_per_frame"], env["bandwidth_bytes_per_s"], env["bandwidth_source"]
    )


def profile_line(label: str, ops: float, device_ms: float, weight_bytes: int, device_name: str) -> str:
    """A frame-step profile's header: device ops and device time per frame (ms), beside the weight floor
    at batch 1 of the GPU it ran on (`device_name` as `torch.cuda.get_device_name` says; weight_bytes: a
    frame's weight reads, `tts.model.shapes.weight_bytes_per_frame`). No floor for a GPU GPU_BANDWIDTH
    does not list."""
    head = f"== {label}: {ops:.0f} device ops per frame, {device_ms:.3f} ms device time per frame"
    bandwidth, source = floor_bandwidth(device_name)
    if bandwidth is None or source is None:
        return f"{head}; no weight floor for {device_name}"
    floor = weight_bytes / bandwidth * 1e3
    return (
        f"{head}; {_floor_words(floor, weight_bytes, bandwidth, source)}: {device_ms / floor:.2f}x the floor"
    )


def x_floor(result: dict, floor: float | None) -> str:
    """A point's decode step over the floor ("-" without a floor)."""
    return f"{result['step_ms_p50'] / floor:.2f}" if floor else "-"


def print_table(results: list[dict], env: dict) -> None:
    floor = env["floor_ms_per_frame_batch1"]
    print(
        f"{env['model']} on {env['device']}, {env['dtype']}"
        + (f" with {env['weights']} linear weights" if env.get("weights") else "")
        + f", prompt {env['prompt_tokens']} tokens, "
        f"context {env['max_context']} tokens, "
        f"{env['timed_frames']} timed frames; {floor_line(env)}"
    )
    head = f"{'mode':<6} {'batch':>5} {'fps/stream':>10} {'fps total':>10} {'p50 ms':>7} {'p99 ms':>7} "
    head += f"{'x floor':>7} {'replay':>6} {'capture s':>9} {'pool MiB':>8} "
    head += f"{'KV MiB':>8} {'KV used':>8} {'peak GiB':>8}"
    print(head)
    for r in results:
        print(
            f"{r['mode']:<6} {r['batch']:>5} {r['frames_per_s_per_stream']:>10.1f} "
            f"{r['frames_per_s_aggregate']:>10.1f} "
            f"{r['step_ms_p50']:>7.2f} {r['step_ms_p99']:>7.2f} {x_floor(r, floor):>7} "
            f"{r['replay_share']:>6.2f} {r['capture_seconds']:>9.2f} {r['graph_pool_bytes'] / 2**20:>8.0f} "
            f"{r['kv_bytes'] / 2**20:>8.0f} {r['kv_used_bytes'] / 2**20:>8.0f} "
            f"{r['peak_gpu_bytes'] / 2**30:>8.1f}"
        )


def plot(results: list[dict], path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({r["mode"] for r in results}):
        rs = [r for r in results if r["mode"] == mode]
        a.plot([r["batch"] for r in rs], [r["frames_per_s_aggregate"] for r in rs], "o-", label=mode)
        b.plot([r["batch"] for r in rs], [r["frames_per_s_per_stream"] for r in rs], "o-", label=mode)
    if env.get("on_gpu", True) and env["floor_ms_per_frame_batch1"]:  # (a GPU's: meaningless on a CPU)
        b.axhline(
            1e3 / env["floor_ms_per_frame_batch1"], ls="--", c="gray", label="bandwidth floor (batch 1)"
        )
    b.axhline(21.53, ls=":", c="red", label="real time at 21.5 frames/s (Fish and default codecs)")
    for ax, title in ((a, "aggregate frames/s"), (b, "frames/s per stream")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{env['model']} on {env['device']} ({env['dtype']}, {env['prompt_tokens']}-token prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def check_service_options_absent(args: argparse.Namespace) -> None:
    """Without --server `tts bench` is the engine benchmark: raise UserError naming the service
    benchmark's mode options that were given anyway (--ramp and its options, --soak, --sessions), which
    it would otherwise ignore."""
    try:
        from tts_tools.loadtest import RAMP_OPTIONS, options_need
    except ImportError:  # (no service package: those options do not exist)
        return
    flags = [name for name in ("ramp", "soak") if getattr(args, name, False)]
    flags += [name for name in (*sorted(RAMP_OPTIONS), "sessions") if getattr(args, name, None) is not None]
    if flags:
        raise UserError(options_need(flags, "--server (the service benchmark)"))


def cmd_bench(args: argparse.Namespace) -> int:
    from tts.cli.main import check_device, set_cpu_threads, torch_dtype

    if args.server:  # the service load benchmark (service/loadtest.py)
        from tts_tools.loadtest import run_from_args

        return run_from_args(args)
    check_service_options_absent(args)
    check_device(args.device)
    cuda = args.device.startswith("cuda")
    modes = [m.strip() for m in (args.modes or ("eager,graph" if cuda else "eager")).split(",")]
    if not set(modes) <= {"eager", "graph"}:
        raise UserError(f"--modes takes eager and/or graph, got {args.modes!r}")
    for option, least in (("frames", 2), ("warmup_frames", 1), ("prompt_tokens", 1)):
        value = getattr(args, option)
        if value < least:
            raise UserError(f"--{option.replace('_', '-')} must be >= {least}, got {value}")
    out = Path(args.out)
    check_out_dir(out)  # (made only when the results are written: a refused run leaves no folder)
    check_shape_device(args.model, cuda)
    model = load_bench_model(args.model, args.device, torch_dtype(args.dtype), args.weights)
    needed = args.prompt_tokens + args.warmup_frames + args.frames + 1
    context = args.max_context or model.config.max_seq_len
    if not needed <= context <= model.config.max_seq_len:
        raise UserError(
            f"the context (--max-context, default the model's {model.config.max_seq_len} tokens) must be "
            f"between {needed} (prompt + warm-up + timed frames + 1) and {model.config.max_seq_len}, "
            f"got {context}"
        )
    if "graph" in modes and not cuda:
        print("note: graph mode needs CUDA; running eager only on this device", file=sys.stderr)
        modes = [m for m in modes if m != "graph"] or ["eager"]
    set_cpu_threads(args.threads, not cuda, sum(p.numel() for p in model.parameters()))
    env = environment(model, args)
    env["on_gpu"] = cuda
    results = []
    for mode in modes:
        for batch in args.batch_sizes:
            r = bench_one(model, mode, batch, args)
            results.append(r)
            print(
                f"  {mode} batch {batch}: {r['frames_per_s_per_stream']:.1f} frames/s per stream, "
                f"{r['frames_per_s_aggregate']:.1f} total",
                file=sys.stderr,
                flush=True,
            )
    print_table(results, env)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write results to --out {out}: {exc.strerror or exc}") from exc
    (out / "bench.json").write_text(json.dumps({"method": env, "results": results}, indent=2))
    try:
        plot(results, out / "bench.png", env)
    except ImportError:  # matplotlib comes with the tools extra; the numbers do not need it
        print(f"wrote {out / 'bench.json'} (no plot: pip install -e '.[tools]' for bench.png)")
    else:
        print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def add_parser(sub) -> None:
    from tts.cli.main import DEFAULT_BUCKETS
    from tts.cli.main import int_list as _ints

    p = sub.add_parser(
        "bench",
        help="TPS benchmark of the decode loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="default",
        help="s2-pro-shape (random weights, GPU), a preset or a directory (default: the default voice)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights' dtype (default: bf16 for a random shape, else the checkpoint's)",
    )
    p.add_argument(
        "--weights",
        choices=["fp8", "int8"],
        default=None,
        help="weight-only quantized linear layers: fp8 (E4M3, per-channel scales; int8 on a GPU without "
        "FP8) or int8 (default: unquantized)",
    )
    p.add_argument(
        "--modes", default=None, help="comma list of eager, graph (default: both on CUDA, eager elsewhere)"
    )
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16, 64], help="comma list (default 1,4,16,64)")
    p.add_argument(
        "--buckets", type=_ints, default=list(DEFAULT_BUCKETS), help="graph buckets (default: the engine's)"
    )
    p.add_argument("--prompt-tokens", type=int, default=200, help="tokens per request's prompt (default 200)")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="tokens per request the engine is sized for, prompt + frames: the width of the block tables "
        "a graph's attention reads (default: the model's maximum, as tts serve runs)",
    )
    p.add_argument("--frames", type=int, default=128, help="timed frames per point (default 128)")
    p.add_argument(
        "--warmup-frames", type=int, default=8, help="untimed frames first: admission, prefill (default 8)"
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="memory bandwidth in bytes/s for the floor (default: the GPU's datasheet HBM bandwidth, "
        "e.g. 3.35e12 for an H100 SXM, 4.8e12 for an H200; no floor for a GPU not in the table)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU intra-op threads (default: 1 for models under 100 M parameters on a CPU, as tts "
        "synthesize)",
    )
    p.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png")
    try:
        from tts_tools.loadtest import add_arguments
    except ImportError:  # the service package is not installed
        p.set_defaults(server=None)
    else:
        add_arguments(
            p.add_argument_group(
                "service load benchmark (with --server HOST:PORT; same as tts bench-server)"
            ),
            server_required=False,
        )
    p.set_defaults(func=cmd_bench)
