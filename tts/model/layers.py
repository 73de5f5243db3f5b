"""Layers shared by the slow / fast transformer (`tts.model.transformer`) and the modded DAC's window
transformer (`tts.codec.dac.net`): RMSNorm, the RoPE table and rotation, the embedding constructor. A leaf
module: it imports only torch and the kernels, so both sides import it without importing each other.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tts.model.kernels import fused_kernels_enabled, fused_ops


def rms_norm_fp32(x: Tensor, eps: float, weight: Tensor) -> Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim, fp32: the op sequence of nn.RMSNorm on a
    CPU and of `RMSNorm` below without its (no-op) casts."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    """fish-speech's RMSNorm: normalize in fp32, cast back, then scale (docs/fish_dual_ar.md §1.2)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if fused_kernels_enabled(x, self.weight):
            return fused_ops().rmsnorm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # the same ops without the no-op casts (the CPU path is op-bound)
            return rms_norm_fp32(x, self.eps, self.weight)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """`h = x + residual`, then `(norm(h), h)`; one kernel on CUDA."""
        if fused_kernels_enabled(x, residual, self.weight):
            return fused_ops().add_rmsnorm(x, residual, self.weight, self.eps)
        h = x + residual
        return self.forward(h), h


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000.0) -> Tensor:
    """RoPE table `[seq_len, n_elem // 2, 2]` (cos, sin), built in fp32 and stored as bf16
    (docs/fish_dual_ar.md §1.2).

    The bf16 rounding is deliberate: Fish models were trained with it, and an fp32 table garbles long outputs
    (sglang-omni's finding, docs/fish_dual_ar.md §1.2, §7 item 1). The fp32 values come from `torch.polar`, as
    in fish-speech: separately computed cos/sin differ from it in the last bit often enough that a few entries
    round to a different bf16 value (2 of 4.2 M for S2's table), which breaks bit-exact parity. Row p depends
    only on p, so a slice of a longer table equals the shorter table.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    angles = torch.outer(torch.arange(seq_len), inv_freq)
    rotation = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([rotation.real, rotation.imag], dim=-1).to(torch.bfloat16)


class Rope:
    """A RoPE table slice (`[T, D/2, 2]` or per-row `[B, T, D/2, 2]`, bf16) with its torch-path factors.

    The factors are built on first use and shared by every layer of a forward: `cos = [c0, c0, c1, c1,
    ...]` and `sin = [-s0, s0, -s1, s1, ...]` in fp32, `[B|1, T, 1, D]`. The fused CUDA path reads
    `table` and never builds them.
    """

    __slots__ = ("table", "_factors")

    def __init__(self, table: Tensor):
        self.table = table
        self._factors: tuple[Tensor, Tensor] | None = None

    @staticmethod
    def of(freqs_cis: Tensor | Rope) -> Rope:
        return freqs_cis if isinstance(freqs_cis, Rope) else Rope(freqs_cis)

    def factors(self) -> tuple[Tensor, Tensor]:
        if self._factors is None:
            f = self.table.float()
            if f.dim() == 3:
                f = f.unsqueeze(0)
            c, s = f.unsqueeze(2).unbind(-1)  # [B|1, T, 1, D/2] each
            self._factors = torch.stack([c, c], -1).flatten(-2), torch.stack([-s, s], -1).flatten(-2)
        return self._factors


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor | Rope) -> Tensor:
    """Rotate adjacent pairs `(x[2i], x[2i+1])` (GPT-J / interleaved convention, not NeoX;
    docs/fish_dual_ar.md §1.2).

    x: `[B, T, H, D]`; freqs_cis: `[T, D/2, 2]` or per-row `[B, T, D/2, 2]` (bf16 table), or a `Rope` of
    one. The rotation is computed in fp32 and cast back to x's dtype:
    `(x0 c - x1 s, x1 c + x0 s)`, evaluated as `x * cos + swap(x) * sin` with the sign folded into `sin`
    (`a - b*s` and `a + b*(-s)` round identically, so this is bit-exact to the pairwise form).
    """
    cos, sin = Rope.of(freqs_cis).factors()
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos + swapped * sin).type_as(x)


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, except that under a `torch.device("meta")` context (how loaders build models) its
    N(0, 1) init is skipped: PyTorch runs it through a slow reference path there (about 5 s for S2-Pro's
    vocabulary table), and meta weights are replaced by the checkpoint anyway."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight) if weight.is_meta else nn.Embedding(num, dim)
