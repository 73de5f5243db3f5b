"""Weight-only quantized linear layers as Triton kernels: `y = (x @ q.T) * scale + bias`.

`q [N, K]` holds FP8 E4M3 (`torch.float8_e4m3fn`, Hopper and Ada) or int8 weights, `scale [N]` float32
one per output channel, `x [M, K]` the activations in their own dtype (bf16 when serving). Each weight
byte is read once and widened in registers; the product accumulates in fp32, the channel's scale (and
the bias) applies to the accumulator, and the result is rounded once to x's dtype. The torch
counterpart (and test reference) is `tts.model.quant.reference_linear`.

Two kernels, chosen by M (rows = batch rows x positions) and N:

* M <= `GEMV_MAX_ROWS` and N <= `GEMV_MAX_CHANNELS` (the decode step of small batches, bandwidth
  bound): a program owns a few output channels and walks K in wide chunks, multiply-adds in fp32
  registers, and reduces once at the end; no tensor cores, no split-K (so no atomics: results are
  deterministic and replay bit-identically);
* larger M (batched decode, prefill), or a wide layer: tiles through `tl.dot`, the weight tile widened
  to x's dtype in registers first. (At one row on an H100, S2-Pro's fused 19,456-channel `w13` took
  21.0 us a layer this way, with the default tiles, against the small-M kernel's 26.9 with its best;
  the 6,144-channel `wqkv` was within 7% either way and the 2,560-channel layers 50% slower:
  docs/benchmarks.md.)

Neither allocates anything but the output, and neither synchronizes with the host: both can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

GEMV_MAX_ROWS = 4
GEMV_MAX_CHANNELS = 8192


@triton.jit
def _wq_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        # (a masked load of fp8 takes no `other`: lanes past K are zeroed after widening; lanes of rows
        # past N hold anything and only reach outputs that are never stored)
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None]).to(tl.float32)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K))
            w = tl.where(kk[None, :] < K, w.to(tl.float32), 0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2) * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _wq_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None]).to(tl.float32).to(x.dtype)
        else:
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K))
            w = tl.where(kk[None, :] < K, w.to(tl.float32), 0.0).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    y = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _pow2_divisor(k: int, limit: int) -> int:
    """The largest power of two <= limit dividing k (1 if k is odd)."""
    d = 1
    while d * 2 <= limit and k % (d * 2) == 0:
        d *= 2
    return d


def gemv_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the small-M kernel (num_stages: Triton's
    software pipelining of the K loop's loads, 3 its default): rows padded to a power of two,
    few channels per program so that even a 2,560-channel layer spreads over several programs per
    multiprocessor, up to 1 KiB of each weight row per step (16-byte loads), a step that divides K
    where one of at least 256 does (no masks in the loop)."""
    block_m = triton.next_power_of_2(max(M, 1))
    block_n = 4  # (wider layers take the tensor-core kernel: uses_small_m_kernel)
    limit = 1024 // block_m
    block_k = _pow2_divisor(K, limit)
    if block_k < min(256, limit):
        block_k = min(limit, triton.next_power_of_2(K))
    return block_m, block_n, max(block_k, 16), 4, 3


def gemm_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the tensor-core kernel. Up to 64 rows (a
    batched decode step, still bound by the weights' bandwidth) the rows padded to a power of two and
    tiles of 32 output channels by 128 of K (on an H100, `python -m tts_tools.quant_check --kernel-bench
    --sweep`, at 8 and 64 rows: 2-26% less time than the narrower tiles before them on three of S2-Pro's
    four slow-layer shapes, the same on the fourth); beyond (a prefill) square-ish tiles."""
    if M <= 64:
        return max(16, triton.next_power_of_2(M)), 32, 128, 4, 4
    return 64, 128, 64, 4, 3


def uses_small_m_kernel(M: int, N: int) -> bool:
    """Whether `quant_linear` of M rows and N output channels runs the small-M kernel (else the
    tensor-core one): M <= `GEMV_MAX_ROWS` and N <= `GEMV_MAX_CHANNELS`."""
    return M <= GEMV_MAX_ROWS and N <= GEMV_MAX_CHANNELS


def quant_linear(
    x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None = None, config: tuple | None = None
) -> Tensor:
    """`(x @ qweight.T) * scale + bias` rounded to x's dtype.

    x: `[..., K]` float (bf16 / fp16 / fp32; its last dimension contiguous), qweight: `[N, K]`
    float8_e4m3fn or int8 with contiguous rows, scale: `[N]` float32, bias: `[N]` or None.
    Returns `[..., N]` in x's dtype (a new tensor: the only allocation). `config` overrides the
    kernel's tile choice (`gemv_config` / `gemm_config`'s tuple, for whichever kernel
    `uses_small_m_kernel` selects): for tuning sweeps (tts_tools.quant_check).
    """
    K = x.shape[-1]
    N = qweight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else scale
    if uses_small_m_kernel(M, N):
        bm, bn, bk, warps, stages = config or gemv_config(M, N, K)
        _wq_gemv_kernel[(triton.cdiv(N, bn),)](
            x2, qweight, scale, b, out, M, N, K, x2.stride(0), qweight.stride(0), out.stride(0),
            HAS_BIAS=has_bias, EVEN_K=K % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    else:
        bm, bn, bk, warps, stages = config or gemm_config(M, N, K)
        _wq_gemm_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
            x2, qweight, scale, b, out, M, N, K, x2.stride(0), qweight.stride(0), out.stride(0),
            HAS_BIAS=has_bias, EVEN_K=K % bk == 0, IEEE=x.dtype == torch.float32, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.view(*x.shape[:-1], N)
