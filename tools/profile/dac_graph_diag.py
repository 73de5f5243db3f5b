"""Diagnose why a CUDA-graph replay of the batched DAC decode differs from eager (H200, 2026-12-01).

Runs tests/test_dac_batched.py's schedule through a graph captured at (B, T) = (5, 16) next to an eager
twin, per variant (default; SDPA forced to the math backend; cuDNN off; both), and prints per call the
rows' lengths, slots and the largest |replay - eager| per row, so the first diverging call and the
stage responsible show.
"""

import contextlib
import sys

import torch

sys.path[:0] = ["tests", "tools/microbench"]
from dac_batched import capture_decode  # noqa: E402
from test_dac_batched import _codec, run_schedule  # noqa: E402


def variant_context(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stack = contextlib.ExitStack()
    if "math" in name:
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    if "nocudnn" in name:
        stack.enter_context(torch.backends.cudnn.flags(enabled=False))
    return stack


def run_variant(name: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with variant_context(name):
        codec = _codec(dtype=torch.float32, device="cuda")
        B, T = 5, 16
        dec, ref = codec.batched_stream(3), codec.batched_stream(3)
        s_slots = torch.full((B,), dec.scratch_slot, dtype=torch.int64, device="cuda")
        s_codes = torch.zeros(B, 10, T, dtype=torch.int64, device="cuda")
        s_len = torch.zeros(B, dtype=torch.int64, device="cuda")
        g, s_out, _ = capture_decode(dec, s_slots, s_codes, s_len)
        log = []

        def replay(slots, codes, lengths):
            b, _, t = codes.shape
            s_slots.fill_(dec.scratch_slot)
            s_len.zero_()
            s_slots[:b].copy_(slots)
            s_codes[:b, :, :t].copy_(codes)
            s_len[:b].copy_(lengths)
            pos = dec.positions.clone()
            eager = ref.decode(s_slots.clone(), s_codes.clone(), s_len.clone())
            g.replay()
            out = s_out[:b, : t * dec.frame_length].clone()
            worst = [
                float(
                    (
                        out[i, : int(lengths[i]) * dec.frame_length]
                        - eager[i, : int(lengths[i]) * dec.frame_length]
                    )
                    .abs()
                    .max()
                )
                if int(lengths[i])
                else 0.0
                for i in range(b)
            ]
            log.append((t, slots.tolist(), lengths.tolist(), pos.tolist(), [f"{w:.2g}" for w in worst]))
            return out

        def reset(slots):
            dec.reset(slots)
            ref.reset(slots)

        try:
            run_schedule(dec, device="cuda", decode=replay, reset=reset)
        except AssertionError as exc:
            log.append(("assert", str(exc)[:200]))
        print(f"== {name}")
        for i, entry in enumerate(log):
            print(i, entry)


for variant in ("default", "math", "nocudnn", "math+nocudnn"):
    run_variant(variant)
