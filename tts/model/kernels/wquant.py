"""Weight-only quantized linear layers as Triton kernels: `y = (x @ q.T) * scale + bias`.

`q [N, K]` holds FP8 E4M3 (`torch.float8_e4m3fn`, Hopper and Ada) or int8 weights, `scale [N]` float32
one per output channel, `x [M, K]` the activations in their own dtype (bf16 when serving). Each weight
byte is read once and widened in registers; the product accumulates in fp32, the channel's scale (and
the bias) applies to the accumulator, and the result is rounded once to x's dtype. The torch
counterpart (and test reference) is `tts.model.quant.reference_linear`.

Two kernels, chosen by M (rows = batch rows x positions):

* M <= `GEMV_MAX_ROWS` (the decode step of small batches, bandwidth bound): a program owns a few output
  channels and walks K in wide chunks, multiply-adds in fp32 registers, and reduces once at the end;
  no tensor cores, no split-K (so no atomics: results are deterministic and replay bit-identically);
* larger M (batched decode, prefill): tiles through `tl.dot`, the weight tile widened to x's dtype in
  registers first.

**Decoding fp8.** Widening E4M3 with the conversion instructions (e4m3x2 -> f16x2, then to f32 or
bf16) costs two conversions a weight, and conversions issue at a fraction of the rate of integer and
float arithmetic: on an H100 that, not the memory, bounded the kernels (1.3-1.9 TB/s of weights). So
fp8 codes are decoded by bit arithmetic instead (`decode="bits"`): E4M3's sign, exponent and mantissa
moved into a bf16 / fp16 / fp32 bit pattern whose value is the code times a fixed power of two (2^-120
for bf16 and fp32, whose exponent bias is 127 against E4M3's 7; 2^-8 for fp16), exact for every code,
subnormals included; the power of two goes back with the channel's scale. For bf16 and fp32 the
activations are multiplied by 2^64 first (exact) so that no product falls below the normal range.
`decode="asm"` does the same in inline PTX, four codes per 32-bit register (byte permutes, shifts and
masks: about two instructions a code to bf16, three to fp32); `decode="cvt"` is the conversion path.
int8 codes always convert.

Neither allocates anything but the output, and neither synchronizes with the host: both can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

GEMV_MAX_ROWS = 4
DECODES = ("cvt", "bits", "asm")
FP8_DECODE = "cvt"  # how fp8 codes are widened on a GPU (module docstring); tools may override it
_DECODE_ID = {name: i for i, name in enumerate(DECODES)}
_UNSHIFT_BF16 = 2.0**56  # 2^120 / 2^64: what the accumulator of shifted products is short of
_UNSHIFT_FP16 = 2.0**8

# Four E4M3 codes in one 32-bit register ($2) to four bf16 values of code * 2^-120 in two ($0, $1):
# prmt spreads bytes 0, 1 (then 2, 3) to 0x00b1_00b0; each code's sign goes to bit 15 of its half, its
# exponent and mantissa to bits 4-10.
_FP8_TO_BF16_ASM = """{
.reg .b32 z, lo, hi, s, m;
mov.b32 z, 0;
prmt.b32 lo, $2, z, 0x4140;
prmt.b32 hi, $2, z, 0x4342;
shl.b32 s, lo, 8;
and.b32 s, s, 0x80008000;
shl.b32 m, lo, 4;
and.b32 m, m, 0x07F007F0;
or.b32 $0, s, m;
shl.b32 s, hi, 8;
and.b32 s, s, 0x80008000;
shl.b32 m, hi, 4;
and.b32 m, m, 0x07F007F0;
or.b32 $1, s, m;
}"""

# The same to four float32 values of code * 2^-120 ($0-$3): each byte moved to the top of its own
# register, its sign kept at bit 31, its exponent and mantissa shifted down to bits 20-26.
_FP8_TO_F32_ASM = """{
.reg .b32 z, t, s;
mov.b32 z, 0;
prmt.b32 t, $4, z, 0x0444;
shr.u32 s, t, 4;
and.b32 s, s, 0x07F00000;
and.b32 t, t, 0x80000000;
or.b32 $0, t, s;
prmt.b32 t, $4, z, 0x1444;
shr.u32 s, t, 4;
and.b32 s, s, 0x07F00000;
and.b32 t, t, 0x80000000;
or.b32 $1, t, s;
prmt.b32 t, $4, z, 0x2444;
shr.u32 s, t, 4;
and.b32 s, s, 0x07F00000;
and.b32 t, t, 0x80000000;
or.b32 $2, t, s;
prmt.b32 t, $4, z, 0x3444;
shr.u32 s, t, 4;
and.b32 s, s, 0x07F00000;
and.b32 t, t, 0x80000000;
or.b32 $3, t, s;
}"""


@triton.jit
def _decode_fp8(w, DECODE: tl.constexpr, OUT: tl.constexpr):
    """E4M3 codes loaded as uint8 -> OUT (tl.bfloat16 / tl.float16 / tl.float32) holding code * 2^-120
    (bf16, fp32) or code * 2^-8 (fp16), exactly. DECODE 1: integer arithmetic; 2: inline PTX (bf16,
    fp32)."""
    if DECODE == 2 and OUT == tl.float32:
        return tl.inline_asm_elementwise(
            _FP8_TO_F32_ASM, "=r,=r,=r,=r,r", [w], dtype=tl.float32, is_pure=True, pack=4
        )
    elif DECODE == 2:
        return tl.inline_asm_elementwise(
            _FP8_TO_BF16_ASM, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4
        )
    elif OUT == tl.float32:
        u = w.to(tl.uint32)
        return (((u & 0x80) << 24) | ((u & 0x7F) << 20)).to(tl.float32, bitcast=True)
    elif OUT == tl.float16:
        u = w.to(tl.uint16)
        return (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True)
    else:
        u = w.to(tl.uint16)
        return (((u & 0x80) << 8) | ((u & 0x7F) << 4)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _load_x(x_ptrs, mask, X_SHIFT: tl.constexpr):
    """An activation tile in its own dtype (bf16 or fp32 where X_SHIFT), times 2^64 (exact) where the
    codes are decoded to code * 2^-120."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if X_SHIFT:
        x = (x.to(tl.float32) * 18446744073709551616.0).to(x_ptrs.dtype.element_ty)
    return x


@triton.jit
def _wq_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, unshift,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None])
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K))
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
            x = x.to(tl.float32)
        if DECODE > 0:
            w = _decode_fp8(w, DECODE, tl.float32)
            x = x * 18446744073709551616.0  # 2^64, exact (module docstring)
        else:
            w = w.to(tl.float32)
        if not EVEN_K:
            w = tl.where(kk[None, :] < K, w, 0.0)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2) * (tl.load(s_ptr + rn, mask=n_ok, other=0.0) * unshift)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _wq_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, unshift,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, DECODE: tl.constexpr,
    X_SHIFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
            x = _load_x(x_rows + kk[None, :], m_ok[:, None], X_SHIFT)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None])
        else:
            x = _load_x(x_rows + kk[None, :], m_ok[:, None] & (kk[None, :] < K), X_SHIFT)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K))
        if DECODE > 0:
            w = _decode_fp8(w, DECODE, x.dtype)
        else:
            w = w.to(tl.float32).to(x.dtype)
        if not EVEN_K:
            w = tl.where(kk[None, :] < K, w, 0.0).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    y = acc * (tl.load(s_ptr + rn, mask=n_ok, other=0.0) * unshift)[None, :]
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
    block_n = 4 if N <= 8192 else 8
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


def _decode(qweight: Tensor, x_dtype: torch.dtype, decode: str | None, dot: bool) -> tuple[int, float]:
    """(the kernels' DECODE, the factor the accumulator is short of) for these codes and activations."""
    decode = decode or FP8_DECODE
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    if qweight.dtype != torch.float8_e4m3fn or decode == "cvt":
        return 0, 1.0
    if decode == "asm" and dot and x_dtype == torch.float16:
        decode = "bits"  # (the PTX writes bf16 and fp32)
    if dot and x_dtype == torch.float16:
        return _DECODE_ID[decode], _UNSHIFT_FP16
    return _DECODE_ID[decode], _UNSHIFT_BF16


def scaled_mm_linear(x2: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """W8A8: each row of `x2 [M, K]` (bf16) quantized to E4M3 with its own scale (max |x| / 448), then
    cuBLAS's fp8 tensor-core product with the fp8 codes `qweight [N, K]` and their channel scales, in
    bf16 `[M, N]`. Twice the tensor cores' bf16 rate where many rows make the product compute bound,
    at the cost of rounding the activations to 3 mantissa bits too. CUDA with fp8 tensor cores
    (compute capability 8.9+), K and N multiples of 16."""
    amax = x2.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-30)
    x_scale = amax / 448.0
    xq = (x2.float() / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # (the cast does not saturate)
    return torch._scaled_mm(
        xq, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), bias=bias, out_dtype=x2.dtype
    )


def quant_linear(
    x: Tensor,
    qweight: Tensor,
    scale: Tensor,
    bias: Tensor | None = None,
    config: tuple | None = None,
    kernel: str | None = None,
    decode: str | None = None,
) -> Tensor:
    """`(x @ qweight.T) * scale + bias` rounded to x's dtype.

    x: `[..., K]` float (bf16 / fp16 / fp32; its last dimension contiguous), qweight: `[N, K]`
    float8_e4m3fn or int8 with contiguous rows, scale: `[N]` float32, bias: `[N]` or None.
    Returns `[..., N]` in x's dtype (a new tensor: the only allocation). For tuning sweeps
    (tts_tools.quant_check): `kernel` overrides the choice by M ("gemv", the small-M kernel, up to
    `GEMV_MAX_ROWS` rows, else "dot"; or "scaled_mm", `scaled_mm_linear`: fp8 codes and bf16 x only),
    `config` the tiles (`gemv_config` / `gemm_config`'s tuple for that kernel), `decode` (one of
    `DECODES`) `FP8_DECODE`. Raises ValueError for an unknown kernel or decode.
    """
    K = x.shape[-1]
    N = qweight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    kernel = kernel or ("gemv" if M <= GEMV_MAX_ROWS else "dot")
    if kernel not in ("gemv", "dot", "scaled_mm"):
        raise ValueError(f"kernel must be 'gemv', 'dot' or 'scaled_mm', got {kernel!r}")
    if kernel == "scaled_mm":
        return scaled_mm_linear(x2, qweight, scale, bias).view(*x.shape[:-1], N)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    b = bias if has_bias else scale
    dec, unshift = _decode(qweight, x.dtype, decode, dot=kernel == "dot")
    w = qweight.view(torch.uint8) if dec else qweight
    if kernel == "gemv":
        bm, bn, bk, warps, stages = config or gemv_config(M, N, K)
        _wq_gemv_kernel[(triton.cdiv(N, bn),)](
            x2, w, scale, b, out, M, N, K, x2.stride(0), qweight.stride(0), out.stride(0), unshift,
            HAS_BIAS=has_bias, EVEN_K=K % bk == 0, DECODE=dec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    else:
        bm, bn, bk, warps, stages = config or gemm_config(M, N, K)
        _wq_gemm_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
            x2, w, scale, b, out, M, N, K, x2.stride(0), qweight.stride(0), out.stride(0), unshift,
            HAS_BIAS=has_bias, EVEN_K=K % bk == 0, IEEE=x.dtype == torch.float32, DECODE=dec,
            X_SHIFT=bool(dec) and x.dtype != torch.float16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.view(*x.shape[:-1], N)
