"""Where does a training step of `train.py` spend its time? Batch building vs. the GPU step.

Prints (CUDA only):
* batches/s that the `--workers` DataLoader processes deliver alone (no training);
* steps/s of forward + backward + AdamW on one pre-built batch held on the device (no loader), and
  of the two together (what `train.py` runs), with cuDNN attention on and then off;
* `torch.profiler` top ops of the pre-built-batch step, by device time;
* with `--compile`: the compile time and the compiled step's steps/s, both ways.

    python training/profile_train.py --data training/work/codes --codec training/work/codec --limit 4000
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import Corpus, batch_loader, compute_loss, model_config  # noqa: E402

from tts.model.transformer import DualARTransformer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--codec", type=Path, required=True)
    p.add_argument("--size", default="fast")
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--limit", type=int, default=4000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the loss")
    a = p.parse_args()
    dev = torch.device("cuda")
    n = json.loads((a.codec / "codec.json").read_text())
    corpus = Corpus(a.data, n["num_codebooks"], a.limit)
    model = DualARTransformer(
        model_config(corpus.tokenizer, n["num_codebooks"], n["codebook_size"], a.size)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    batches = batch_loader(corpus, 0, a.batch_tokens, a.workers)
    next(batches)
    t = time.time()
    for _ in range(a.steps):
        next(batches)
    print(f"loader alone: {a.steps / (time.time() - t):.1f} batches/s with {a.workers} workers", flush=True)

    b = corpus.batch(random.Random(0), a.batch_tokens, dev)
    print(f"batch: frames {tuple(b['frames'].shape)}, target positions {int(b['mask'].sum())}", flush=True)

    def step(loss_fn, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = loss_fn(model, batch["frames"], batch["mask"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def timed(loss_fn, label, from_loader=False):
        for _ in range(3):
            step(loss_fn, b)
        torch.cuda.synchronize()
        t = time.time()
        for _ in range(a.steps):
            batch = {k: v.to(dev, non_blocking=True) for k, v in next(batches).items()} if from_loader else b
            step(loss_fn, batch)
        torch.cuda.synchronize()
        print(f"{label}: {a.steps / (time.time() - t):.2f} steps/s", flush=True)

    timed(compute_loss, "eager step, fixed batch")
    timed(compute_loss, "eager step, from loader", from_loader=True)
    torch.backends.cuda.enable_cudnn_sdp(False)  # what train.py does: no per-shape cuDNN plans
    timed(compute_loss, "eager step without cuDNN attention, fixed batch")
    timed(compute_loss, "eager step without cuDNN attention, from loader", from_loader=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(compute_loss, b)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    if a.compile:
        compiled = torch.compile(compute_loss, dynamic=True)
        t = time.time()
        step(compiled, b)
        torch.cuda.synchronize()
        print(f"compile: {time.time() - t:.0f} s", flush=True)
        timed(compiled, "compiled step, fixed batch")
        timed(compiled, "compiled step, from loader", from_loader=True)


if __name__ == "__main__":
    main()
