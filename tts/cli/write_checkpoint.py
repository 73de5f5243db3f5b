"""`tts write-checkpoint`: write a random-weight Fish checkpoint in the real on-disk format.

tts write-checkpoint --shape s2-pro --out /data/s2-pro-random          # 9.1 GB of bf16 + codec.pth
tts write-checkpoint --shape tiny-s2 --out /tmp/tiny-s2 --dtype fp32
tts info --model /data/s2-pro-random
"""

from __future__ import annotations

import argparse
import time

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def cmd_write_checkpoint(args: argparse.Namespace) -> int:
    import torch

    from tts.checkpoints.fish.writer import SHAPES, write_checkpoint
    from tts.cli.main import UserError

    if args.shards < 1:
        raise UserError("--shards must be >= 1")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    t0 = time.perf_counter()
    try:
        result = write_checkpoint(
            args.shape,
            args.out,
            dtype=dtype,
            seed=args.seed,
            codec=args.codec,
            num_shards=args.shards,
            overwrite=args.force,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    spec = SHAPES[args.shape]
    print(
        f"wrote {result.path}: {spec.name} ({spec.family}), {result.num_parameters:,} parameters, "
        f"{result.weight_bytes / 2**30:.2f} GiB of weights, files {', '.join(result.files)} "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    return 0


# The keys of tts.checkpoints.fish.writer.SHAPES, listed here so that building the parser imports no torch.
SHAPE_NAMES = ("s2-pro", "tiny-s2", "s1-mini", "tiny-s1", "fish-1.5", "tiny-1.5")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "write-checkpoint",
        help="write a random-weight Fish checkpoint in the real format",
        description="Write a Fish checkpoint directory with random weights in the real on-disk format: same "
        "file names, key names, dtypes and config fields. s2-pro: Fish Audio S2-Pro's exact sizes "
        "(4,561,852,416 parameters, sharded safetensors, full codec.pth); s1-mini: approximate OpenAudio "
        "S1-mini sizes (model.pth, tiktoken); fish-1.5: fish-speech 1.5's sizes (Firefly-GAN codec); "
        "tiny-*: the "
        "same formats with small widths, for tests.",
    )
    p.add_argument("--shape", required=True, choices=SHAPE_NAMES, help="which model to imitate")
    p.add_argument("--out", required=True, help="new (or empty) directory to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weight dtype (default: bf16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--codec",
        choices=["full", "tiny", "none"],
        default=None,
        help="codec to write (codec.pth, or 1.5's Firefly-GAN generator): fish-speech's full size, a tiny "
        "one, or none (default: full for real shapes, tiny for tiny-*)",
    )
    p.add_argument("--shards", type=int, default=2, help="safetensors shards for S2 shapes (default 2)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out directory")
    p.set_defaults(func=cmd_write_checkpoint)
