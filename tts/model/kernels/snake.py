"""The modded DAC decoder's elementwise work in Triton: the Snake activation with the conv bias before
it, and the residual sum with the conv bias before it, one pass each.

Why: in torch, `Snake1d` is five full-size kernels (`alpha * x`, `sin`, `pow`, a multiply, an add), a
conv's bias is one more pass (`add_`) and the residual sum another. Measured on an H200 for 64 streams
x 16 frames of the S2-Pro-size decoder (docs/benchmarks.md, "The batched DAC decode"), those
elementwise kernels took 55% (float32) and 66% (bfloat16) of the device time; the convolutions took
the rest. Each function here reads its inputs once and writes once.

Math (descript-audio-codec's `snake`, docs/fish_dual_ar.md §5.1): `snake(x) = x + sin(alpha x)^2 /
(alpha + 1e-9)`, alpha per channel. Computed in float32 whatever the activation dtype (one rounding at
the store), so a bfloat16 decode is closer to float32 than torch's op-by-op rounding; in float32 it
agrees with the torch formula to float32 rounding (not bit for bit: Triton's `sin` is not torch's).

Tensors are `[B, C, T]` with unit stride along T (the conv outputs, possibly sliced along T); outputs are
new contiguous `[B, C, T]` tensors of the input's dtype. Reference and CPU path: the torch formula
(`tts.codec.dac.net.Snake1d`); tested against it in tests/kernel_checks.py (Triton interpreter) and
tests/test_dac_batched.py (`test_cuda_snake_kernels_match_the_torch_formula`, the GPU). On an H200 the
S2-Pro-size decode of the same codes gave an audio RMS of 0.5971255 fused and 0.5971247 unfused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_T = 1024


@triton.jit
def _snake_kernel(
    x_ptr, bias_ptr, res_ptr, alpha_ptr, sum_ptr, out_ptr,
    C, T, stride_xb, stride_xc, stride_rb, stride_rc,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr, SNAKE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # b * C + c (64-bit: an offline decode can pass 2^31 samples)
    b = row // C
    c = row % C
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = t < T
    y = tl.load(x_ptr + b * stride_xb + c * stride_xc + t, mask=keep, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + c).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + b * stride_rb + c * stride_rc + t, mask=keep, other=0.0).to(tl.float32)
    if STORE_SUM:
        tl.store(sum_ptr + row * T + t, y.to(sum_ptr.dtype.element_ty), mask=keep)
    if SNAKE:
        alpha = tl.load(alpha_ptr + c).to(tl.float32)
        s = tl.sin(alpha * y)
        y = y + s * s / (alpha + 1e-9)
        tl.store(out_ptr + row * T + t, y.to(out_ptr.dtype.element_ty), mask=keep)


def _rows(x: Tensor) -> Tensor:
    if x.dim() != 3:
        raise ValueError(f"expected [B, C, T], got shape {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def _launch(
    x: Tensor, bias: Tensor | None, res: Tensor | None, alpha: Tensor | None, store_sum: bool
) -> tuple[Tensor | None, Tensor | None]:
    x = _rows(x)
    B, C, T = x.shape
    r = _rows(res) if res is not None else x
    if res is not None and r.shape != x.shape:
        raise ValueError(f"residual shape {tuple(r.shape)} != input shape {tuple(x.shape)}")
    total = torch.empty_like(x, memory_format=torch.contiguous_format) if store_sum else None
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if alpha is not None else None
    if B * C * T:
        _snake_kernel[(B * C, triton.cdiv(T, BLOCK_T))](
            x, bias if bias is not None else x, r, alpha if alpha is not None else x,
            total if total is not None else x, out if out is not None else x,
            C, T, x.stride(0), x.stride(1), r.stride(0), r.stride(1),
            HAS_BIAS=bias is not None, HAS_RES=res is not None, STORE_SUM=store_sum, SNAKE=alpha is not None,
            BLOCK=BLOCK_T, num_warps=4,
        )  # fmt: skip
    return total, out


def snake(x: Tensor, alpha: Tensor, bias: Tensor | None = None) -> Tensor:
    """`snake(x + bias)`: x `[B, C, T]`, alpha any shape of C elements (`Snake1d.alpha` is `[1, C, 1]`),
    bias `[C]` or None. Returns `[B, C, T]` in x's dtype."""
    out = _launch(x, bias, None, alpha, store_sum=False)[1]
    assert out is not None
    return out


def add_snake(
    x: Tensor, bias: Tensor | None, residual: Tensor | None = None, alpha: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """`h = x + bias (+ residual)` and, when `alpha` is given, `snake(h)` from the same pass: a conv's
    output completed with its bias (and, closing a residual unit, the unit's input), together with the
    activation the next module applies to it. Returns `(h, snake(h) or None)`, each `[B, C, T]` in x's
    dtype."""
    total, out = _launch(x, bias, residual, alpha, store_sum=True)
    assert total is not None
    return total, out
