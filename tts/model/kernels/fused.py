"""Small fused Triton kernels for the decode step on CUDA (fewer launches per frame).

Each kernel computes exactly the formula of its torch counterpart in tts/model.py, in the same
precision steps (fp32 math, a cast to the activation dtype where fish-speech casts):

* `rmsnorm` / `add_rmsnorm`: `norm(x)` and `h = x + residual; norm(h)` in one pass (docs/fish_dual_ar.md §1.2
  RMSNorm: normalize in fp32, cast to the input dtype, multiply by the weight);
* `qk_norm_rope`: split the fused qkv projection, per-head RMSNorm of q and k (optional), adjacent-pair
  RoPE with the bf16 table (docs/fish_dual_ar.md §1.2), in one launch over all heads;
* `silu_mul`: SwiGLU's `silu(a) * b` on the fused `[a | b]` projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, eps, N,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # h = x + residual, rounded like torch
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * stride_o + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask
    )


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fish-speech RMSNorm of the last dimension of `x` (any leading shape)."""
    x2 = _rows(x)
    out = torch.empty_like(x2)
    N = x2.shape[1]
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, x2, weight, out, out, x2.stride(0), 0, out.stride(0), 0, eps, N, HAS_RESIDUAL=False,
        BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 4096 else 8,
    )  # fmt: skip
    return out.view(x.shape)


def add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`h = x + residual` and `rmsnorm(h)`; returns `(normed, h)`."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty_like(x2)
    h = torch.empty_like(x2)
    N = x2.shape[1]
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, h, x2.stride(0), r2.stride(0), out.stride(0), h.stride(0), eps, N,
        HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 4096 else 8,
    )  # fmt: skip
    return out.view(x.shape), h.view(x.shape)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, qw_ptr, kw_ptr, freqs_ptr, q_out, k_out, v_out, row_off_ptr, stride_qkv, stride_f, eps,
    head_stride, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    TO_CACHE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1 query heads, H..H+HKV-1 key heads, then value heads
    half = tl.arange(0, D // 2)
    base = qkv_ptr + row * stride_qkv + head * D
    if head < H + HKV:
        x0 = tl.load(base + 2 * half).to(tl.float32)
        x1 = tl.load(base + 2 * half + 1).to(tl.float32)
        dt = qkv_ptr.dtype.element_ty
        if QK_NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(x0 * x0, axis=0) + tl.sum(x1 * x1, axis=0)) / D + eps)
            is_q = head < H
            w0 = tl.where(is_q, tl.load(qw_ptr + 2 * half), tl.load(kw_ptr + 2 * half)).to(tl.float32)
            w1 = tl.where(is_q, tl.load(qw_ptr + 2 * half + 1), tl.load(kw_ptr + 2 * half + 1)).to(tl.float32)
            x0 = ((x0 * rstd).to(dt).to(tl.float32) * w0).to(dt).to(tl.float32)
            x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        cos = tl.load(freqs_ptr + row * stride_f + 2 * half).to(tl.float32)
        sin = tl.load(freqs_ptr + row * stride_f + 2 * half + 1).to(tl.float32)
        y0 = (x0 * cos - x1 * sin).to(dt)
        y1 = (x1 * cos + x0 * sin).to(dt)
        if head < H:
            dst = q_out + (row * H + head) * D
        elif TO_CACHE:
            dst = k_out + tl.load(row_off_ptr + row) + (head - H) * head_stride
        else:
            dst = k_out + (row * HKV + head - H) * D
        tl.store(dst + 2 * half, y0)
        tl.store(dst + 2 * half + 1, y1)
    else:
        d = tl.arange(0, D)
        if TO_CACHE:
            dst = v_out + tl.load(row_off_ptr + row) + (head - H - HKV) * head_stride
        else:
            dst = v_out + (row * HKV + head - H - HKV) * D
        tl.store(dst + d, tl.load(base + d))


def qk_norm_rope(
    qkv: Tensor, n_head: int, n_kv: int, head_dim: int, freqs: Tensor, q_weight: Tensor | None,
    k_weight: Tensor | None, eps: float, kv_dest=None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """Split `qkv [B, (H + 2 Hkv) * D]` (one token per row), qk-norm q and k when weights are given,
    rotate with `freqs [B, D/2, 2]` (bf16 table rows for each row's position). Returns q `[B, 1, H, D]`,
    k and v `[B, 1, Hkv, D]`, matching `Attention.forward`'s layout; with `kv_dest` (a
    `tts.model.transformer.KVDest`) K and V go straight into the cache instead and None is returned for them.
    """
    B = qkv.shape[0]
    qkv = qkv.reshape(B, -1)
    q = torch.empty(B, 1, n_head, head_dim, dtype=qkv.dtype, device=qkv.device)
    if kv_dest is not None:
        k, v, row_off, head_stride = kv_dest.k, kv_dest.v, kv_dest.row_offset, kv_dest.head_stride
    else:
        k = torch.empty(B, 1, n_kv, head_dim, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        row_off, head_stride = q, 0
    freqs = freqs.reshape(-1, head_dim)  # [B or 1, D]: one row per batch row, or shared by all rows
    stride_f = 0 if freqs.shape[0] == 1 else freqs.stride(0)
    qk_norm = q_weight is not None
    _qk_norm_rope_kernel[(B, n_head + 2 * n_kv)](
        qkv, q_weight if qk_norm else qkv, k_weight if qk_norm else qkv, freqs, q, k, v, row_off,
        qkv.stride(0),
        stride_f, eps, head_stride, H=n_head, HKV=n_kv, D=head_dim, QK_NORM=qk_norm,
        TO_CACHE=kv_dest is not None, num_warps=1,
    )  # fmt: skip
    if kv_dest is not None:
        return q, None, None
    return q, k, v


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    b = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    af = a.to(tl.float32)
    silu = (af / (1.0 + tl.exp(-af))).to(a.dtype)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * b.to(tl.float32)).to(a.dtype), mask=mask)


def silu_mul(x: Tensor) -> Tensor:
    """`silu(a) * b` for `x = [a | b]` along the last dimension; returns `[..., N]`."""
    x2 = _rows(x)
    N = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    BLOCK = 1024
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(N, BLOCK))](
        x2, out, N, x2.stride(0), out.stride(0), BLOCK=BLOCK
    )
    return out.view(*x.shape[:-1], N)
