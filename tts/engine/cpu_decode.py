"""The frame step's transformer layers on a CPU, with as little Python per op as the math allows.

A CPU has no CUDA graphs, so every op *and every line of Python* of the frame step is paid again each
frame. Through the modules (`model.run_layers`) a fast-AR position of the default model costs about
twice its ops' own time: module calls, kernel and dtype checks, RoPE objects, attend closures. Here
each block's weights are gathered once into a `BlockWeights` (views of the modules' own tensors) and a
decode position (one token per row) runs as plain torch calls: 2.1-2.5 ms a frame for the default
model's fast AR against 4.4-4.5 ms through the modules (docs/benchmarks.md).

The values are those of `model.run_layers` in fp32, bit for bit (tests/test_cpu_decode.py): the same
ops in the same order with the same operands (norms as `rms_norm_fp32`, w1/w3 as one GEMM, each
residual add where the modules round it), except two that give the same values with fewer calls: q and
k heads are normed and rotated as one tensor (per-head math is unchanged; tests/test_model.py), and the
RoPE pair swap is one gather (`pair_swap_index`) instead of a flip.
Shapes: x `[B, dim]` (the modules' `[B, 1, dim]` without the position axis), q `[B, H, D]`, k and v
`[B, Hkv, D]`, RoPE factors `cos, sin` `[B|1, 1, D]` fp32 (`model.Rope.factors` without its T axis).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.model.layers import RMSNorm, rms_norm_fp32
from tts.model.transformer import TransformerBlock

# attend(i, q [B, H, D], k [B, Hkv, D], v [B, Hkv, D]) -> [B, H, D]: write layer i's K/V of this
# position wherever the caller keeps them, and attend over the row's context.
LayerAttend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


_PAIR_SWAP: dict[int, Tensor] = {}


def pair_swap_index(d: int) -> Tensor:
    """CPU `[1, 0, 3, 2, ...]` of length d: `x.index_select(-1, it)` swaps adjacent pairs, the values of
    `layers.apply_rotary_emb`'s flip in one gather. Made outside inference mode (cached across calls)."""
    index = _PAIR_SWAP.get(d)
    if index is None:
        with torch.inference_mode(False):
            index = _PAIR_SWAP[d] = torch.arange(d, device="cpu").view(-1, 2).flip(-1).flatten()
    return index


class BlockWeights(NamedTuple):
    """One `TransformerBlock`'s tensors and sizes for `decode_layers`."""

    attention_norm: Tensor  # [dim]
    wqkv: Tensor  # [(H + 2 Hkv) D, dim]
    wqkv_bias: Tensor | None
    # () -> [H + Hkv, D]: the q-norm weight per query head, then the k-norm weight per KV head
    # (`Attention.qk_norm_weight`, which rebuilds it when either weight changes); None: no qk-norm
    qk_norm: Callable[[], Tensor] | None
    wo: Tensor  # [dim, H D]
    wo_bias: Tensor | None
    ffn_norm: Tensor  # [dim]
    w13: Tensor  # [2 hidden, dim]: w1 rows, then w3 rows
    w2: Tensor  # [dim, hidden]
    n_head: int
    n_kv: int
    head_dim: int
    eps: float  # of every norm in the block (checked equal)


# What `block_weights` gathers for one AR: its blocks, and its final norm's weight.
LayerWeights = tuple[list[BlockWeights], Tensor]


def block_weights(layers: nn.ModuleList, final_norm: RMSNorm) -> LayerWeights | None:
    """The blocks' weights and `final_norm`'s weight, or None where this module does not apply (not
    fp32 on a CPU, norms with different eps, w1/w3 not fused): the caller then uses the modules."""
    if not len(layers) or final_norm.weight.dtype != torch.float32 or final_norm.weight.device.type != "cpu":
        return None
    # `DualARTransformer.layers` / `.fast_layers`: an nn.ModuleList (typed as holding any Module) of
    # TransformerBlocks.
    blocks_in = cast("list[TransformerBlock]", list(layers))
    norms: list[RMSNorm | nn.RMSNorm] = [final_norm]
    norms += [n for layer in blocks_in for n in (layer.attention_norm, layer.ffn_norm)]
    eps = final_norm.eps
    blocks = []
    for layer in blocks_in:
        att, ff = layer.attention, layer.feed_forward
        if att.qk_norm:
            norms += [att.q_norm, att.k_norm]
        w13 = ff.fused_w13()
        if w13 is None or any(n.eps != eps or n.weight is None for n in norms):
            return None
        blocks.append(
            BlockWeights(
                layer.attention_norm.weight,
                att.wqkv.weight,
                att.wqkv.bias,
                att.qk_norm_weight if att.qk_norm else None,
                att.wo.weight,
                att.wo.bias,
                layer.ffn_norm.weight,
                w13,
                ff.w2.weight,
                att.n_head,
                att.n_local_heads,
                att.head_dim,
                eps,
            )
        )
    return blocks, final_norm.weight


def _qkv(w: BlockWeights, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q `[B, H, D]`, k and v `[B, Hkv, D]` of normed `x [B, dim]`: `Attention._split_norm_rotate`'s
    values, with q and k normed and rotated as one tensor."""
    B = x.shape[0]
    qk_size = (w.n_head + w.n_kv) * w.head_dim
    qkv = F.linear(x, w.wqkv, w.wqkv_bias)
    qk = qkv[:, :qk_size].view(B, w.n_head + w.n_kv, w.head_dim)
    if w.qk_norm is not None:
        qk = rms_norm_fp32(qk, w.eps, w.qk_norm())
    qk = qk * cos + qk.index_select(-1, pair_swap_index(w.head_dim)) * sin
    q, k = qk.split([w.n_head, w.n_kv], dim=1)
    return q, k, qkv[:, qk_size:].view(B, w.n_kv, w.head_dim)


def decode_layers(
    blocks: list[BlockWeights], final_norm: Tensor, x: Tensor, cos: Tensor, sin: Tensor, attend: LayerAttend
) -> tuple[Tensor, Tensor]:
    """`model.run_layers` for one position per row: x `[B, dim]` -> (hidden before the final norm,
    after it), each `[B, dim]`."""
    eps = blocks[0].eps
    normed, residual = rms_norm_fp32(x, eps, blocks[0].attention_norm), x
    for i, w in enumerate(blocks):
        attended = attend(i, *_qkv(w, normed, cos, sin)).reshape(x.shape[0], -1)
        residual = F.linear(attended, w.wo, w.wo_bias) + residual
        normed = rms_norm_fp32(residual, eps, w.ffn_norm)
        gate, up = F.linear(normed, w.w13).chunk(2, dim=-1)
        residual = F.linear(F.silu(gate) * up, w.w2) + residual
        next_norm = blocks[i + 1].attention_norm if i + 1 < len(blocks) else final_norm
        normed = rms_norm_fp32(residual, eps, next_norm)
    return residual, normed


def decode_layers_kv_only(
    blocks: list[BlockWeights],
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    attend: LayerAttend,
    write_kv: Callable[[int, Tensor, Tensor], None],
) -> None:
    """`model.run_layers_kv_only` for one position per row: every block but the last in full, the
    last only projects its K/V and hands them to `write_kv(i, k [B, Hkv, D], v)`."""
    last = len(blocks) - 1
    w = blocks[last]
    if last:
        _, normed = decode_layers(blocks[:last], w.attention_norm, x, cos, sin, attend)
    else:
        normed = rms_norm_fp32(x, w.eps, w.attention_norm)
    _, k, v = _qkv(w, normed, cos, sin)
    write_kv(last, k, v)
