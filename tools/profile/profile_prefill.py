"""Time and profile the engine's prefill, alone and packed, the way `Engine._start` runs it.

    python tools/profile/profile_prefill.py --model s2-pro-shape --device cuda --out prefill.txt

For each prompt length in --tokens, with the prefill's attention as the engine runs it (no cuDNN
attention: `engine.disable_cudnn_attention`) and with cuDNN attention allowed (torch's default, what
the engine did before; on CUDA in 16 bits the packed prefill uses flash varlen attention either way, so
its two rows measure the same kernels): host wall time of `ModelRunner.prefill` (one request) and of
`ModelRunner.prefill_packed` of --packed requests, each followed by a device synchronization. "cold" is
the first prefill at a length this process has not run yet (each variant gets its own lengths: T and
T + 1), "warm" the median of --reps calls after it. Then one profiled warm call of each: device ops per
call, device time, and the top operators by host (CPU) time. On a GPU the service measured 70-90 ms of
prefill per request at one client and 0.36 s per packed pass at 16 clients (docs/benchmarks.md); this shows
whether that is per-shape set-up (cuDNN builds an execution plan per new attention shape), launches,
or device work.
"""

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tts_tools.bench import _prompt, load_bench_model  # noqa: E402

from tts.engine import Engine, EngineConfig  # noqa: E402
from tts.model.kv_cache import blocks_needed  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> tuple[float, float]:
    """Host wall seconds of `fn()` followed by a device synchronization: the first one, and the median
    of `reps` calls after it."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    cold = time.perf_counter() - t0
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - t0)
    return cold, statistics.median(seconds)


def profiled(fn, device: torch.device, label: str) -> str:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    device_us = sum(e.device_time_total for e in kernels) if kernels else 0.0
    head = f"== {label}: {len(kernels)} device ops, {device_us / 1e3:.2f} ms device time"
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    return head + "\n" + table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="s2-pro-shape", help="a shape (random weights), a preset or a directory"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="64,128,256", help="comma list of prompt lengths")
    ap.add_argument("--packed", type=int, default=16, help="requests per packed prefill")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="prefill.txt")
    args = ap.parse_args()
    device = torch.device(args.device)
    model = load_bench_model(args.model, args.device, torch.bfloat16 if device.type == "cuda" else None)
    lengths = [int(t) for t in args.tokens.split(",")]
    engine = Engine(model, EngineConfig(max_batch=args.packed, graphs="off"))
    runner, allocator, bs = engine.runner, engine.scheduler.allocator, engine.config.block_size
    lines = [f"{args.model} on {device}, block size {bs}, context {engine.max_context}"]
    variants = {"engine (no cuDNN attention)": False, "cuDNN attention allowed": True}

    def run(T: int, label: str) -> None:
        prompts = [_prompt(model, T + 1, seed=i) for i in range(args.packed)]
        tables = [allocator.allocate(blocks_needed(T + 1, bs)) for _ in prompts]
        one_fn = partial(runner.prefill, prompts[0], tables[0])
        packed_fn = partial(runner.prefill_packed, prompts, tables)
        (one_cold, one), (packed_cold, packed) = (
            timed(one_fn, device, args.reps),
            timed(packed_fn, device, args.reps),
        )
        lines.append(
            f"{T} tokens, {label}: one request cold {one_cold * 1e3:.1f} ms, warm {one * 1e3:.2f} ms; "
            f"{args.packed} packed cold {packed_cold * 1e3:.1f} ms, warm {packed * 1e3:.2f} ms "
            f"({packed / args.packed * 1e3:.2f} ms per request)"
        )
        print(lines[-1], flush=True)
        if label.startswith("engine"):
            lines.append(profiled(one_fn, device, f"{T} tokens, one request"))
            lines.append(profiled(packed_fn, device, f"{T} tokens, packed"))
        for table in tables:
            allocator.free(table)

    run(lengths[0] - 3, "warm-up (Triton compiles)")
    for T in lengths:
        for offset, (label, cudnn) in enumerate(variants.items()):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            run(T + offset, label)
    Path(args.out).write_text("\n\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
