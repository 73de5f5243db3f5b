"""The sampler of tts/sampling.py as one Triton kernel per draw (one program per row).

Same algorithm and the same counter-based noise as the torch implementation (see its docstring):
sort the row descending (ties: lower token id first), untempered softmax and cumulative sum, drop
ranks >= top_k and ranks whose cumulative mass exceeds top_p (rank 0 always kept), then the
exponential race in log space, `argmax(logit / T - log E)`, E = -log U with U from
`hash(seed, step, stream, token id)`. Temperature 0 takes rank 0. With `RAS`, a second draw at
temperature 1.0 / top-p 0.9 replaces the first when the first is a semantic index already in the row's
window (docs/fish_dual_ar.md §4.1).

The sort packs each logit (as an order-preserving int32) and its token id into one int64 key, so a
single `tl.sort` yields values and ids together. Sorting a whole 4096-entry row in one program is the
slow part (~150 us on an H200), so when the caller promises every row has 0 < top_k <= `top_k_cap`
and the logits are bf16, each logit and its id are packed into a unique int32 key (16-bit value,
16-bit id), `torch.topk` selects that many keys, and only they are sorted; the softmax normalizer still
covers the whole row, so the draws are exactly those of the full sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tts.params import MIN_TEMPERATURE, RAS_HIGH_TEMPERATURE, RAS_HIGH_TOP_P

MIN_T = tl.constexpr(MIN_TEMPERATURE)


@triton.jit
def _hash32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed, step, stream):
    k = _hash32(seed & 0xFFFFFFFF)
    k = _hash32(k ^ ((seed >> 32) & 0xFFFFFFFF))
    k = _hash32(k ^ (step & 0xFFFFFFFF))
    return _hash32(k ^ stream)


@triton.jit
def _race(sval, sidx, rank, cum, V, temperature, top_p, k_eff, key):
    """Index of the token drawn from the sorted row (see module docstring)."""
    remove = ((cum > top_p) | (rank >= k_eff) | (rank >= V)) & (rank > 0)
    h = _hash32((key + sidx.to(tl.int64) * 0x61C88647) & 0xFFFFFFFF)
    h = _hash32(h ^ 0x5BD1E995)
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    t = tl.maximum(temperature, MIN_T)
    score = tl.where(remove, float("-inf"), sval / t - tl.log(-tl.log(u)))
    chosen = tl.argmax(score, axis=0)
    sampled = tl.sum(tl.where(rank == chosen, sidx, 0), axis=0)
    greedy = tl.sum(tl.where(rank == 0, sidx, 0), axis=0)
    return tl.where(temperature > 0, sampled, greedy)


@triton.jit
def _pack_sort(val, ids):
    """Sort (value desc, id asc) pairs via one int64 key; returns sorted (values fp32, ids int32)."""
    bits = val.to(tl.int32, bitcast=True)
    key32 = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # order-preserving for IEEE floats
    packed = (key32.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    packed = tl.sort(packed, descending=True)
    sidx = (0x7FFFFFFF - (packed & 0xFFFFFFFF)).to(tl.int32)
    skey = (packed >> 32).to(tl.int32)
    return (skey ^ ((skey >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), sidx


@triton.jit
def _pack16_kernel(logits_ptr, keys_ptr, stride_l, stride_k, V, BLOCK: tl.constexpr):
    """bf16 logits -> unique int32 keys ordered like (value desc, id asc): order-preserving 16-bit
    value in the high half, `0xFFFF - id` in the low half (ids < 65536)."""
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < V
    bits = (
        tl.load(logits_ptr + row * stride_l + idx, mask=mask, other=0.0)
        .to(tl.int16, bitcast=True)
        .to(tl.int32)
    )
    key16 = bits ^ ((bits >> 15) & 0x7FFF)  # order-preserving for bf16, sign-extended
    tl.store(keys_ptr + row * stride_k + idx, (key16 << 16) | (0xFFFF - idx), mask=mask)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_l, V, cand_keys_ptr, stride_c, temp_ptr, top_p_ptr, top_k_ptr, seed_ptr,
    step_ptr, out_ptr, stream, window_ptr, window_len_ptr, stride_w, n_semantic, high_stream,
    VP2: tl.constexpr, KC: tl.constexpr, RAS: tl.constexpr, W: tl.constexpr, WP2: tl.constexpr,
    HIGH_T: tl.constexpr, HIGH_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    idx = tl.arange(0, VP2)
    x = tl.load(logits_ptr + row * stride_l + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    z = tl.sum(tl.where(idx < V, tl.exp(x - m), 0.0), axis=0)
    if KC > 0:
        # Every row has top_k <= KC: only the KC largest (value, id) keys can be drawn, and they are
        # exactly the candidates (keys are unique, so ties resolve as in the full sort). The cumulative
        # mass of the top ranks equals the full sort's (z covers the whole row).
        c = tl.arange(0, KC)
        keys = tl.sort(tl.load(cand_keys_ptr + row * stride_c + c), descending=True)
        sidx = 0xFFFF - (keys & 0xFFFF)
        key16 = keys >> 16
        bf16_bits = (key16 ^ ((key16 >> 15) & 0x7FFF)).to(tl.int16)
        sval = bf16_bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
        n_valid = KC
        rank = c
    else:
        sval, sidx = _pack_sort(x, idx)
        n_valid = V
        rank = idx
    p = tl.where(rank < n_valid, tl.exp(sval - m), 0.0) / z
    cum = tl.cumsum(p, axis=0)

    temperature = tl.load(temp_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    k_eff = tl.where(top_k > 0, top_k, V)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    token = _race(sval, sidx, rank, cum, n_valid, temperature, top_p, k_eff, _row_key(seed, step, stream))
    if RAS:
        high = _race(sval, sidx, rank, cum, n_valid, HIGH_T, HIGH_P, k_eff, _row_key(seed, step, high_stream))
        w = tl.arange(0, WP2)
        window = tl.load(window_ptr + row * stride_w + w, mask=w < W, other=-1)
        counted = (w >= W - tl.load(window_len_ptr + row)) & (w < W)
        repeated = tl.sum(tl.where(counted & (window == token), 1, 0), axis=0) > 0
        use_high = repeated & (token < n_semantic) & (temperature > 0)
        token = tl.where(use_high, high, token)
    tl.store(out_ptr + row, token.to(tl.int64))


def _launch(
    logits, temperature, top_p, top_k, seeds, steps, stream, window=None, window_len=None, n_sem=0, high=0,
    top_k_cap=None,
):  # fmt: skip
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    vp2 = triton.next_power_of_2(V)
    ras = window is not None
    kc = 0
    cand_keys = logits  # unused unless kc > 0
    if top_k_cap is not None and top_k_cap < V and logits.dtype == torch.bfloat16 and V <= 65536:
        kc = triton.next_power_of_2(top_k_cap)
        keys = torch.empty(B, V, dtype=torch.int32, device=logits.device)
        _pack16_kernel[(B, triton.cdiv(V, 1024))](
            logits, keys, logits.stride(0), keys.stride(0), V, BLOCK=1024
        )
        cand_keys = torch.topk(keys, kc, dim=-1, sorted=False).values
    _sample_kernel[(B,)](
        logits, logits.stride(0), V, cand_keys, cand_keys.stride(0), temperature, top_p, top_k, seeds,
        steps, out, stream, window if ras else out, window_len if ras else out,
        window.stride(0) if ras else 0,
        n_sem, high, VP2=vp2, KC=kc, RAS=ras, W=window.shape[1] if ras else 1,
        WP2=triton.next_power_of_2(window.shape[1]) if ras else 1, HIGH_T=RAS_HIGH_TEMPERATURE,
        HIGH_P=RAS_HIGH_TOP_P, num_warps=8 if (kc == 0 and vp2 >= 8192) else 4,
    )  # fmt: skip
    return out


def triton_sample(logits, temperature, top_p, top_k, seeds, steps, stream: int, top_k_cap=None) -> Tensor:
    """Drop-in for `tts.model.sampling.sample` on CUDA tensors."""
    return _launch(logits, temperature, top_p, top_k, seeds, steps, stream, top_k_cap=top_k_cap)


def triton_sample_main_token(
    logits, temperature, top_p, top_k, seeds, steps, window, window_len, n_semantic: int, high_stream: int,
    top_k_cap=None,
) -> Tensor:  # fmt: skip
    """Drop-in for `tts.model.sampling.sample_main_token` where the semantic indices are `[0, n_semantic)`."""
    return _launch(
        logits,
        temperature,
        top_p,
        top_k,
        seeds,
        steps,
        0,
        window,
        window_len,
        n_semantic,
        high_stream,
        top_k_cap,
    )
