"""Paged decode attention in Triton: one query token per row, K/V read through block tables.

One program per (row, KV head, split) handles the G = H / Hkv query heads that share the KV head (GQA,
repeat_interleave order: KV head j serves query heads j*G .. j*G+G-1). The row's context is cut into
chunks of `BLOCK_N` tokens dealt round-robin to the row's `SPLITS` programs (program s takes chunks s,
s + SPLITS, s + 2 * SPLITS, ...); token t maps to slot `table[t // block_size] * block_size + t %
block_size`; each program keeps an online softmax in fp32 and writes a partial (max, sum, output) that
a second small kernel combines (flash-decoding). Context lengths are read inside the kernel, so one
captured graph serves every length up to the block table's width, and the work of a row follows its
length, not the table's width.

The number of splits depends only on the launch shape (batch rows, KV heads, table width): enough
programs to fill the GPU when the batch is small, one per (row, KV head) when the batch alone fills it.
(Earlier the splits followed the table width: 256 splits for S2-Pro's 32k context, 131,072 programs per
layer at batch 64 that mostly found no token, and a batch-64 frame step 4x slower than at a short
context.)

Reference and CPU path: `tts.model.kv_cache.paged_decode_attention`. Tested against it in
tests/test_kernels.py (Triton interpreter on CPU) and tests/test_cuda_graphs.py (the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kblk, stride_kslot, stride_kh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + row)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    head = kvh * G + g
    q = tl.load(
        q_ptr + row * stride_qb + head[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0
    )

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for t0 in range(split * BLOCK_N, ctx, SPLITS * BLOCK_N):  # this program's chunks, round-robin
        t = t0 + tl.arange(0, BLOCK_N)
        valid = t < ctx
        blk = tl.load(tables_ptr + row * stride_tb + t // BLOCK_SIZE, mask=valid, other=0)
        base = blk.to(tl.int64) * stride_kblk + (t % BLOCK_SIZE) * stride_kslot + kvh * stride_kh
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    used = split * BLOCK_N < ctx  # a program without a chunk writes nothing (the combine skips it)
    o_base = row * stride_ob + head * stride_oh + split * stride_os
    tl.store(out_ptr + o_base[:, None] + d[None, :], acc, mask=(g < G)[:, None] & used)
    ml_off = (row * (tl.num_programs(1) * G) + head) * SPLITS + split
    tl.store(m_ptr + ml_off, m_i, mask=(g < G) & used)
    tl.store(l_ptr + ml_off, l_i, mask=(g < G) & used)


@triton.jit
def _combine_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr, lens_ptr, stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + row)
    s = tl.arange(0, SPLITS)
    used = s * BLOCK_N < ctx  # the programs that had at least one chunk
    ml = (row * H + h) * SPLITS + s
    m = tl.load(m_ptr + ml, mask=used, other=float("-inf"))
    lsum = tl.load(l_ptr + ml, mask=used, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(used, tl.exp(m - m_max), 0.0)
    denom = tl.sum(w * lsum, axis=0)
    d = tl.arange(0, D)
    parts = tl.load(
        part_ptr + row * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=used[:, None],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], axis=0) / denom
    tl.store(out_ptr + row * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# Programs per launch worth aiming for: a few per SM of a large GPU (an H200 has 132 SMs). Fewer leave
# SMs idle at batch 1; more only add programs that find no chunk.
TARGET_PROGRAMS = 1024
MAX_SPLITS = 128


def decode_splits(rows: int, kv_heads: int, max_tokens: int, block_n: int) -> int:
    """Programs per (row, KV head): a power of two, enough for about TARGET_PROGRAMS programs, at most
    MAX_SPLITS and at most the table width's count of `block_n`-token chunks rounded up to a power of
    two."""
    wanted = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, rows * kv_heads))
    chunks = triton.next_power_of_2(triton.cdiv(max_tokens, block_n))
    return max(1, min(wanted, MAX_SPLITS, chunks))


def triton_paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float,
    splits: int | None = None,
) -> Tensor:  # fmt: skip
    """Same contract as `tts.model.kv_cache.paged_decode_attention`: q `[B, H, D]`, one layer's pool
    `[num_blocks, block_size, Hkv, D]`, block_tables `[B, max_blocks]`, context_lens `[B]` (>= 1).
    Returns `[B, H, D]` in q's dtype; fp32 accumulation. `splits`: programs per (row, KV head), a
    power of two (None: `decode_splits`, fixed by the launch shape, so the same on every replay)."""
    B, H, D = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    G = H // n_kv
    block_n = 64 if D <= 128 else 32
    if splits is None:
        splits = decode_splits(B, n_kv, block_tables.shape[1] * block_size, block_n)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    q = q.contiguous()
    out = torch.empty_like(q)
    part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    _paged_decode_kernel[(B, n_kv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, m, lsum, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SPLITS=splits, num_warps=4,
    )  # fmt: skip
    _combine_kernel[(B, H)](
        part, m, lsum, out, context_lens, part.stride(0), part.stride(1), part.stride(2), out.stride(0),
        out.stride(1), H=H, D=D, SPLITS=splits, BLOCK_N=block_n, num_warps=1,
    )  # fmt: skip
    return out
