"""One-row matrix products (`x [1, in] @ W.T`) on a CPU in the two weight layouts, over a working set
as big as the default model's weights, so the weights come from DRAM as in a decode step.

    python tools/microbench/gemv_layout.py            # 1 torch thread, as `tts synthesize` on a CPU

Layouts: `rows` is nn.Linear's own `[out, in]` contiguous weight; `columns` is the same matrix stored
as the transpose of a contiguous `[in, out]` one (what `DualARTransformer.use_cpu_decode_layout` does
for projections wider than their input). Prints microseconds per product and GB/s of weight bytes.
Results and method: docs/benchmarks.md, "The CPU frame step".
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (in, out) of the default model's decode-step projections: slow wqkv, wo, w13, w2, semantic head;
# fast wqkv, wo, w13, w2, fast_output.
SHAPES = [
    (384, 640),
    (384, 384),
    (384, 2048),
    (1024, 384),
    (384, 1025),
    (256, 512),
    (256, 256),
    (256, 1536),
    (768, 256),
    (256, 1024),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copies", type=int, default=4, help="copies of each shape cycled (working set)")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = {s: [torch.randn(s[1], s[0]) for _ in range(a.copies)] for s in SHAPES}
    layouts = {"rows": rows, "columns": {s: [w.t().contiguous().t() for w in ws] for s, ws in rows.items()}}
    xs = {s: torch.randn(1, s[0]) for s in SHAPES}
    total_mb = 2 * sum(s[0] * s[1] * 4 * a.copies for s in SHAPES) / 1e6
    print(f"working set {total_mb:.0f} MB fp32, {a.threads} thread(s), torch {torch.__version__}")
    seconds = {name: dict.fromkeys(SHAPES, 0.0) for name in layouts}
    with torch.inference_mode():
        for r in range(a.rounds + 10):  # the first 10 rounds warm up
            for name, weights in layouts.items():  # interleaved, so both see the same machine state
                for s in SHAPES:
                    w = weights[s][r % a.copies]
                    t = time.perf_counter()
                    F.linear(xs[s], w)
                    if r >= 10:
                        seconds[name][s] += time.perf_counter() - t
    print(f"{'in x out':>12} {'rows us':>8} {'GB/s':>5} {'columns us':>10} {'GB/s':>5}")
    for s in SHAPES:
        mb = s[0] * s[1] * 4 / 1e3  # kB -> GB/s with microseconds
        us = {n: seconds[n][s] / a.rounds * 1e6 for n in layouts}
        print(
            f"{s[0]:>5} x {s[1]:<5} {us['rows']:8.0f} {mb / us['rows']:5.1f} {us['columns']:10.0f} "
            f"{mb / us['columns']:5.1f}"
        )


if __name__ == "__main__":
    main()
