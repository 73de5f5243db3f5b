"""Profile one frame step of a model on CUDA: kernel count and time by kernel, eager and replayed.

    python tools/profile/profile_step.py --model s2-pro-shape --batch 1 --out profile.txt
    python tools/profile/profile_step.py --batch 64 --weights fp8 --graph-only --out fp8_64.txt

Writes a table of the top kernels by total CUDA time for one eager step and for one graph replay
(averaged over --steps), headed by the device ops and the device time per frame beside the weight floor
at batch 1 of the GPU it ran on (`tts_tools.bench.profile_line`).
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tts_tools.bench import _prompt, load_bench_model, profile_line  # noqa: E402

from tts.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tts.model.quant import quantize_model  # noqa: E402
from tts.model.shapes import weight_bytes_per_frame  # noqa: E402


def profile_engine(engine, batch, steps, label, out):
    for _ in range(3):
        engine.step()
    while engine.num_running < batch:  # every request admitted and prefilled: only frame steps timed
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0
    ]
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in events)
    model = engine.model
    lines = [
        profile_line(
            label,
            len(kernels) / steps,
            total_us / steps / 1e3,
            weight_bytes_per_frame(model),
            torch.cuda.get_device_name(),
        )
    ]
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=40, max_name_column_width=90
    )
    lines.append(table)
    text = "\n".join(lines)
    print(text[:6000])
    out.write(text + "\n\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="s2-pro-shape")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="engine context in tokens (default: the model's, as served)",
    )
    ap.add_argument("--graph-only", action="store_true", help="skip the eager step's profile")
    ap.add_argument(
        "--weights", choices=["bf16", "fp8", "int8"], default="bf16", help="the linear layers' weights"
    )
    ap.add_argument("--out", default="profile.txt")
    args = ap.parse_args()
    model = load_bench_model(args.model, "cuda", torch.bfloat16)
    if args.weights != "bf16":
        quantize_model(model, args.weights)
    with open(args.out, "w") as out:
        for mode in ("graph",) if args.graph_only else ("graph", "eager"):
            engine = Engine(
                model,
                EngineConfig(
                    max_batch=args.batch,
                    max_waiting=args.batch,  # the whole batch is submitted before the first step
                    graphs="startup" if mode == "graph" else "off",
                    buckets=[args.batch],
                    max_context=args.max_context,
                    ignore_eos=True,
                ),
            )
            params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_new_frames=200, seed=0)
            for i in range(args.batch):
                engine.submit(_prompt(model, 200, i), params)
            profile_engine(engine, args.batch, args.steps, f"{mode} batch {args.batch}", out)
            del engine


if __name__ == "__main__":
    main()
