"""The dual-AR transformer: a slow AR over frames and a fast AR over the codebooks of one frame.

Follows docs/fish_dual_ar.md §1 and §2. Module and parameter names are fish-speech's
flat names (`embeddings`, `codebook_embeddings`, `layers.{i}.attention.wqkv`, `fast_layers.{j}...`,
`fast_output`, ...), so a Fish state dict loads by key mapping alone.

The layers know nothing about caches: every attention call goes through an `attend(q, k, v)` callable
that the caller supplies (dense causal SDPA for training and reference forwards, the paged KV cache for
serving, the static fast-AR cache for the codebook loop). One set of layer code serves them all.

Shapes use B = batch rows, T = positions, N = num_codebooks, H / Hkv = query / KV heads, D = head_dim.
A *frame column* is `[token, c_0, ..., c_{N-1}]` (1 + N integers, docs/fish_dual_ar.md §1.1); sequences
of them are `[B, T, 1 + N]` int64 (fish-speech stores the transpose, `(N + 1, T)`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.model.config import ModelArgs
from tts.model.kernels import fused_kernels_enabled, fused_ops, kernel_head_dim_ok
from tts.model.layers import RMSNorm, Rope, apply_rotary_emb, embedding, precompute_freqs_cis

# attend(q [B, T, H, D], k [B, T, Hkv, D], v [B, T, Hkv, D]) -> [B, T, H, D]
AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class KVDest(NamedTuple):
    """Where a decode step's K and V rows go, for the fused CUDA kernel to write them directly: K/V of
    row r, head h to `k[row_offset[r] + h * head_stride : ... + head_dim]` (flat element offsets)."""

    k: Tensor  # flat view of the K destination storage
    v: Tensor
    row_offset: Tensor  # [B] int64 element offset of each row's slot
    head_stride: int


class Attend(NamedTuple):
    """A layer's attention over a cache the caller owns: `fn(q, k, v) -> [B, T, H, D]`, and where a
    decode step's K/V go (`kv_dest`) when the fused kernel writes them itself; `fn` then receives
    `k = v = None`. A plain `AttendFn` is an `Attend` without a destination."""

    fn: Callable[[Tensor, Tensor | None, Tensor | None], Tensor]
    kv_dest: KVDest | None = None

    def __call__(self, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        return self.fn(q, k, v)


class Attention(nn.Module):
    """GQA attention with a fused `wqkv` split `[q | k | v]`, optional qk-norm before RoPE
    (docs/fish_dual_ar.md §1.2)."""

    def __init__(
        self,
        dim: int,
        n_head: int,
        n_local_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        eps: float,
    ):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = n_head, n_local_heads, head_dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=o_bias)
        self.qk_norm = qk_norm
        self.fusable = kernel_head_dim_ok(head_dim)  # otherwise the torch path, also on CUDA
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, eps=eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=eps)

    def forward(self, x: Tensor, freqs_cis: Tensor | Rope, attend: AttendFn | Attend) -> Tensor:
        B, T, _ = x.shape
        q_size = self.n_head * self.head_dim
        qkv = self.wqkv(x)
        # decode: split, qk-norm and RoPE in one kernel
        if T == 1 and self.fusable and fused_kernels_enabled(qkv):
            dest = attend.kv_dest if isinstance(attend, Attend) else None
            table = freqs_cis.table if isinstance(freqs_cis, Rope) else freqs_cis
            q, k, v = fused_ops().qk_norm_rope(
                qkv,
                self.n_head,
                self.n_local_heads,
                self.head_dim,
                table,
                self.q_norm.weight if self.qk_norm else None,
                self.k_norm.weight if self.qk_norm else None,
                self.q_norm.eps if self.qk_norm else 0.0,
                kv_dest=dest,
            )
            return self.wo(attend(q, k, v).reshape(B, T, q_size))
        q, k, v = self._split_norm_rotate(qkv, freqs_cis)
        y = attend(q, k, v)
        return self.wo(y.reshape(B, T, q_size))

    def kv_only(self, x: Tensor, freqs_cis: Tensor | Rope) -> tuple[Tensor, Tensor]:
        """K and V of `x [B, T, dim]` only, exactly as `forward`'s torch path computes them (no
        attention, no `wo`): for positions whose K/V are read later but whose output is not.

        It runs `forward`'s own torch path (`_split_norm_rotate`), so the values are bit-identical
        wherever `forward` takes that path: always for T > 1 (prefill; at T == 1 the fused CUDA decode
        kernel may round differently). q is computed as there, and dropped.
        """
        _, k, v = self._split_norm_rotate(self.wqkv(x), freqs_cis)
        return k, v

    def _split_norm_rotate(self, qkv: Tensor, freqs_cis: Tensor | Rope) -> tuple[Tensor, Tensor, Tensor]:
        """The torch path from `wqkv`'s output `[B, T, (H + 2 Hkv) D]` to q `[B, T, H, D]` and k, v
        `[B, T, Hkv, D]`: split, q/k RMSNorm, RoPE."""
        B, T, _ = qkv.shape
        q_size = self.n_head * self.head_dim
        kv_size = self.n_local_heads * self.head_dim
        v = qkv[..., q_size + kv_size :].view(B, T, self.n_local_heads, self.head_dim)
        q = qkv[..., :q_size].view(B, T, self.n_head, self.head_dim)
        k = qkv[..., q_size : q_size + kv_size].view(B, T, self.n_local_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        return q, k, v

    def qk_norm_weight(self) -> Tensor:
        """`[H + Hkv, D]`: the q-norm weight for each query head, then the k-norm weight for each KV
        head (for norming q and k heads as one tensor, as the CPU frame step does: `cpu_decode`). Kept
        between calls without autograd, rebuilt when either weight changes."""
        qw, kw = self.q_norm.weight, self.k_norm.weight
        if torch.is_grad_enabled():
            return torch.cat([qw.expand(self.n_head, -1), kw.expand(self.n_local_heads, -1)])
        key = (qw.data_ptr(), qw._version, kw.data_ptr(), kw._version)
        cached = self.__dict__.get("_qk_weight")
        if cached is None or cached[0] != key:
            cached = key, torch.cat([qw.expand(self.n_head, -1), kw.expand(self.n_local_heads, -1)])
            self.__dict__["_qk_weight"] = cached
        return cached[1]


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`, no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def fuse_weights(self, column_major: bool = False) -> None:
        """Store w1 and w3 as one `[2 * hidden, dim]` matrix (w1, w3 become views of it) so serving
        runs one GEMM for both. With `column_major` the matrix is the transpose of a contiguous
        `[dim, 2 * hidden]` one (see `DualARTransformer.use_cpu_decode_layout`). The state dict keeps
        its keys and values. A no-op once the weights are quantized (`tts.model.quant`: w13 is fused
        there)."""
        if "w13_quant" in self._modules:
            return
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, even if called under it
            w13 = torch.cat([self.w1.weight.data, self.w3.weight.data])
            if column_major:
                w13 = w13.t().contiguous().t()
        hidden = self.w1.weight.shape[0]
        self.w1.weight.data, self.w3.weight.data = w13[:hidden], w13[hidden:]
        self.w13 = w13
        self._w13_views = self.w1.weight.data_ptr(), self.w3.weight.data_ptr()

    def fused_w13(self) -> Tensor | None:
        """`w13` while w1 and w3 are still its views (`.to()` or `load_state_dict(assign=True)` give
        them new storage, and the fused copy is then stale), else None."""
        w13 = getattr(self, "w13", None)
        if w13 is None or self._w13_views != (self.w1.weight.data_ptr(), self.w3.weight.data_ptr()):
            return None
        return w13

    def forward(self, x: Tensor) -> Tensor:
        quant = self._modules.get("w13_quant")  # weight-only quantized w1/w3 (tts.model.quant)
        if quant is not None:
            y = quant(x)
            if fused_kernels_enabled(y):
                return self.w2(fused_ops().silu_mul(y))
            gate, up = y.chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        w13 = None if torch.is_grad_enabled() else self.fused_w13()  # (autograd: gradients go to w1, w3)
        if w13 is not None and fused_kernels_enabled(x, w13):
            return self.w2(fused_ops().silu_mul(F.linear(x, w13)))
        if w13 is not None:  # one GEMM for w1 and w3 (also CUDA's torch path, with the kernels off)
            gate, up = F.linear(x, w13).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: `h = x + attn(norm(x))`, `out = h + ffn(norm(h))`."""

    def __init__(self, dim, n_head, n_local_heads, head_dim, hidden, qkv_bias, o_bias, qk_norm, eps):
        super().__init__()
        self.attention = Attention(dim, n_head, n_local_heads, head_dim, qkv_bias, o_bias, qk_norm, eps)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(self, x: Tensor, freqs_cis: Tensor | Rope, attend: AttendFn | Attend) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attend)
        return h + self.feed_forward(self.ffn_norm(h))


def _blocks(layers: nn.ModuleList) -> Sequence[TransformerBlock]:
    """`layers` as what it holds: torch's stubs type a ModuleList's items as plain `nn.Module`."""
    return cast("Sequence[TransformerBlock]", layers)


def run_layers(
    layers: nn.ModuleList,
    final_norm: RMSNorm,
    x: Tensor,
    freqs_cis: Tensor | Rope,
    attend_layer: Callable[[int], AttendFn | Attend],
) -> tuple[Tensor, Tensor]:
    """Run pre-norm blocks, fusing each residual add into the next norm (the last into `final_norm`).

    Same math as calling `TransformerBlock.forward` layer by layer and then `final_norm`: the residual
    stream is rounded to the activation dtype after every add, exactly where the unfused block rounds.
    Returns `(hidden before final_norm, hidden after final_norm)`.
    """
    blocks = _blocks(layers)
    rope = Rope.of(freqs_cis)  # RoPE factors built once for all layers
    normed, residual = blocks[0].attention_norm(x), x
    for i, layer in enumerate(blocks):
        a = layer.attention(normed, rope, attend_layer(i))
        normed, residual = layer.ffn_norm.add_forward(a, residual)
        f = layer.feed_forward(normed)
        next_norm = blocks[i + 1].attention_norm if i + 1 < len(blocks) else final_norm
        normed, residual = next_norm.add_forward(f, residual)
    return residual, normed


def run_layers_kv_only(
    layers: nn.ModuleList,
    x: Tensor,
    freqs_cis: Tensor | Rope,
    attend_layer: Callable[[int], AttendFn | Attend],
    write_kv: Callable[[int, Tensor, Tensor], None],
) -> None:
    """`run_layers` for positions whose output is never used, only their K/V: the prefill of prompts of
    2 or more positions (see `Attention.kv_only` for where the values are bit-identical).

    Every layer but the last runs in full (its output feeds the next layer's K/V); the last layer only
    projects its K/V and hands them to `write_kv(i, k, v)`: its attention, `wo`, feed-forward and the
    final norm are skipped. The K/V values are the ones `run_layers` would write (same ops, same order).
    """
    blocks = _blocks(layers)
    rope = Rope.of(freqs_cis)
    normed, residual = blocks[0].attention_norm(x), x
    last = len(blocks) - 1
    for i in range(last):
        layer = blocks[i]
        a = layer.attention(normed, rope, attend_layer(i))
        normed, residual = layer.ffn_norm.add_forward(a, residual)
        f = layer.feed_forward(normed)
        normed, residual = blocks[i + 1].attention_norm.add_forward(f, residual)
    write_kv(last, *blocks[last].attention.kv_only(normed, rope))


def dense_causal_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal SDPA over one contiguous sequence per row (prefill, training, references)."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return o.transpose(1, 2)


def packed_causal_attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Causal SDPA over several sequences packed into one row (a batched prefill).

    q: `[1, S, heads, head_dim]`, k / v: `[1, S, kv_heads, head_dim]`; mask: `[S, S]` bool, True where
    query i may attend key j (same sequence and j's position <= i's): block-diagonal and causal. Keys
    may outnumber the queries (k / v `[1, K, ...]`, mask `[S, K]`: queries that also see a cached
    prefix); every query must see at least one key.
    """
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return o.transpose(1, 2)


def varlen_causal_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    cu_seqlens_k: Tensor | None = None,
    max_len_k: int = 0,
) -> Tensor:
    """`packed_causal_attend` without a mask, for CUDA: flash attention over variable-length sequences
    (`torch.nn.attention.varlen.varlen_attn`), each sequence causal on its own.

    q: `[1, S, heads, head_dim]`, k / v: `[1, S, kv_heads, head_dim]` (bf16 or fp16 on CUDA);
    cu_seqlens: `[n + 1]` int32, the sequences' start offsets then S; max_len: the longest sequence.
    A dense `[S, S]` mask sends SDPA to the memory-efficient kernel, which measured 0.55 s of device
    time for 16 x 256 packed positions of S2-Pro on an H200; this costs about what the sequences cost
    alone. Call it only where `varlen_causal_available` says so (else torch raises, or this raises
    RuntimeError when the torch build has no varlen attention).

    cu_seqlens_k / max_len_k: key sequences longer than the query sequences (k / v `[1, K, kv_heads,
    head_dim]`, sequence i's keys at `cu_seqlens_k[i] .. cu_seqlens_k[i + 1] - 1`): the queries are the
    last positions of their sequence, and the causal mask is aligned to the bottom right (flash
    attention's convention since 2.1): query j of a sequence with q_i queries and k_i keys sees keys
    `0 .. k_i - q_i + j`. Only where `varlen_causal_available(..., cached_prefix=True)`.
    """
    fn, options = _varlen()
    if fn is None:
        raise RuntimeError("torch.nn.attention.varlen is not available in this torch build")
    q, k, v = q[0], k[0], v[0]
    if "enable_gqa" not in options:  # torch builds whose varlen_attn wants as many K/V heads as queries
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_len_k = cu_seqlens, max_len
    elif "window_size" not in options:
        raise RuntimeError("this torch build's varlen attention does not say how it aligns a causal mask")
    out = fn(q, k, v, cu_seqlens, cu_seqlens_k, max_len, max_len_k, **options)
    return out.unsqueeze(0)


def varlen_causal_available(
    device: torch.device, dtype: torch.dtype, head_dim: int, cached_prefix: bool = False
) -> bool:
    """True when `varlen_causal_attend` can run here: a torch with varlen attention, and what its flash
    kernel needs (a CUDA device of compute capability 8.0 or newer, 16-bit floats, a head size that is a
    multiple of 8 and at most 256; it does not pad heads as SDPA does).

    cached_prefix: with keys longer than the queries (`cu_seqlens_k`). Only builds that take causal as
    `window_size=(-1, 0)` qualify: that always runs the flash kernel, whose causal mask is aligned to
    the bottom right (it offsets each query by the sequence's key length minus its query length). The
    older `is_causal=True` builds may pick cuDNN instead, and SDPA's own convention is the top left (a
    query would not see the cached prefix beyond its own index): not relied on."""
    if cached_prefix and "window_size" not in _varlen()[1]:
        return False
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and _varlen()[0] is not None
    )


@functools.cache
def _varlen():
    """`(varlen_attn, keyword arguments for causal attention)`, or `(None, {})`. The signature has moved
    between torch releases: causal was `is_causal=True` when the function appeared (2.10) and is
    `window_size=(-1, 0)` since; `enable_gqa` came later still (without it, `varlen_causal_attend`
    repeats the K/V heads). Both are looked up rather than assumed for any one version."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    options: dict = {"enable_gqa": True} if "enable_gqa" in params else {}
    if "window_size" in params:
        options["window_size"] = (-1, 0)
    elif "is_causal" in params:
        options["is_causal"] = True
    else:
        return None, {}
    return varlen_attn, options


class DualARTransformer(nn.Module):
    """Slow AR (one semantic token per frame) plus fast AR (the remaining codebooks of the frame)."""

    # Non-persistent buffers made by `init_buffers` (declared for the type checker: `register_buffer`
    # attributes are `Tensor | Module` to it).
    freqs_cis: Tensor
    fast_freqs_cis: Tensor
    codebook_offsets: Tensor

    def __init__(self, config: ModelArgs):
        super().__init__()
        c = self.config = config
        self.embeddings = embedding(c.vocab_size, c.dim)
        self.codebook_embeddings = embedding(c.codebook_size * c.num_codebooks, c.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(
                c.dim,
                c.n_head,
                c.n_local_heads,
                c.head_dim,
                c.intermediate_size,
                c.attention_qkv_bias,
                c.attention_o_bias,
                c.attention_qk_norm,
                c.norm_eps,
            )
            for _ in range(c.n_layer)
        )
        self.norm = RMSNorm(c.dim, c.norm_eps)
        if not c.tie_word_embeddings:
            self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        # Identity for every known checkpoint (docs/fish_dual_ar.md §1.2); a Linear with bias only when the
        # widths differ.
        self.fast_project_in = nn.Linear(c.dim, c.fast_dim) if c.fast_dim != c.dim else nn.Identity()
        self.fast_embeddings = embedding(c.codebook_size, c.fast_dim)
        self.fast_layers = nn.ModuleList(
            TransformerBlock(
                c.fast_dim,
                c.fast_n_head,
                c.fast_n_local_heads,
                c.fast_head_dim,
                c.fast_intermediate_size,
                c.fast_attention_qkv_bias,
                c.fast_attention_o_bias,
                c.fast_attention_qk_norm,
                c.norm_eps,
            )
            for _ in range(c.n_fast_layer)
        )
        self.fast_norm = RMSNorm(c.fast_dim, c.norm_eps)
        self.fast_output = nn.Linear(c.fast_dim, c.codebook_size, bias=False)

        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create the derived, non-persistent buffers: RoPE tables and codebook offsets. Call after
        loading weights into a model built on the meta device. Tables are computed on the CPU and
        moved, so every device gets bit-identical bf16 tables."""
        c = self.config
        device = torch.device(device) if device is not None else self.embeddings.weight.device
        # Codebook i of a frame indexes rows i * codebook_size + code of `codebook_embeddings`, unless the
        # checkpoint says `share_codebook_embeddings: false` (a fish-speech 1.5 option): then no offset.
        stride = c.codebook_size if c.share_codebook_embeddings else 0
        tables = {
            "freqs_cis": lambda: precompute_freqs_cis(c.max_seq_len, c.head_dim, c.rope_base),
            # The fast AR uses the slow config's rope_base (docs/fish_dual_ar.md §1.3).
            "fast_freqs_cis": lambda: precompute_freqs_cis(c.num_codebooks, c.fast_head_dim, c.rope_base),
            "codebook_offsets": lambda: torch.arange(c.num_codebooks) * stride,
        }
        for name, make in tables.items():
            # Computed on the CPU explicitly: under a `torch.device("meta")` context (how loaders build
            # the model) new tensors would otherwise be meta tensors.
            with torch.device("cpu"):
                value = make()
            value = torch.empty_like(value, device="meta") if device.type == "meta" else value.to(device)
            self.register_buffer(name, value, persistent=False)

    # ---- slow AR -------------------------------------------------------------------------------------

    def embed(self, frames: Tensor) -> Tensor:
        """Input embedding of frame columns (docs/fish_dual_ar.md §1.1).

        frames: `[B, T, 1 + N]` int64. Returns `[B, T, dim]`: the token embedding, plus at semantic
        positions the sum of the N codebook embeddings, the sum scaled by `1/sqrt(N + 1)` when
        `scale_codebook_embeddings` is set. Text positions are neither summed nor scaled. The scale is a
        division, as in fish-speech (a multiplication by the reciprocal rounds differently).
        """
        c = self.config
        tokens = frames[..., 0]
        x = self.embeddings(tokens)
        codebook_sum = self.codebook_embeddings(frames[..., 1:] + self.codebook_offsets).sum(dim=-2)
        is_semantic = ((tokens >= c.semantic_begin_id) & (tokens <= c.semantic_end_id)).unsqueeze(-1)
        audio = x + codebook_sum
        if c.scale_codebook_embeddings:
            audio = audio / math.sqrt(c.num_codebooks + 1)
        return torch.where(is_semantic, audio, x)

    def slow_layers(
        self, x: Tensor, freqs_cis: Tensor | Rope, attend_layer: Callable[[int], AttendFn | Attend]
    ) -> tuple[Tensor, Tensor]:
        """Run the slow transformer layers and the final norm on `x [B, T, dim]`; returns the hidden
        state before and after the final norm, each `[B, T, dim]`."""
        return run_layers(self.layers, self.norm, x, freqs_cis, attend_layer)

    def lm_head_weight(self) -> Tensor:
        """`[vocab, dim]`: the tied token embedding, or the untied `output` weight
        (docs/fish_dual_ar.md §1.2)."""
        return self.embeddings.weight if self.config.tie_word_embeddings else self.output.weight

    def fast_input(self, hidden_pre_norm: Tensor, hidden_post_norm: Tensor) -> Tensor:
        """The slow hidden state handed to the fast AR: post-norm for S2, pre-norm otherwise
        (docs/fish_dual_ar.md §1.2)."""
        h = hidden_post_norm if self.config.norm_fastlayer_input else hidden_pre_norm
        return self.fast_project_in(h)

    # ---- fast AR -------------------------------------------------------------------------------------

    def fast_layers_forward(
        self, x: Tensor, freqs_cis: Tensor | Rope, attend_layer: Callable[[int], AttendFn | Attend]
    ) -> Tensor:
        """Run the fast layers and `fast_norm` on `x [B, T, fast_dim]`; returns the normed hidden state."""
        return run_layers(self.fast_layers, self.fast_norm, x, freqs_cis, attend_layer)[1]

    def fast_logits(self, x_normed: Tensor) -> Tensor:
        """`[..., codebook_size]` logits from a `fast_norm`-ed fast hidden state."""
        return self.fast_output(x_normed)

    def fuse_weights(self, column_major: bool = False) -> None:
        """Prepare for serving: fuse each SwiGLU's w1/w3 into one matrix (state dict unchanged)."""
        for layer in [*self.layers, *self.fast_layers]:
            layer.feed_forward.fuse_weights(column_major)

    def use_cpu_decode_layout(self) -> None:
        """Prepare for serving on a CPU: fuse w1/w3, and store every projection wider than its input
        (wqkv, w13, fast_output, an untied output) as the transpose of a contiguous `[in, out]` matrix.

        Why: a decode step multiplies one row by each weight (`x @ W.T`, a matrix-vector product).
        On the 2-core CI machine MKL's single-thread kernel reads a contiguous `[out, in]` W at 4-5
        GB/s when out > in, and the same matrix stored `[in, out]` at 7-9 GB/s (DRAM: about 10 GB/s);
        narrow projections (w2, a square wo) are as fast or faster as they are. Measured in
        docs/benchmarks.md ("The CPU frame step"). Values, shapes and state-dict keys do not change, only
        strides;
        results differ from the row-major layout in the last bits (another summation order).
        Idempotent. Saving needs `.contiguous()` tensors (safetensors), as `save_weights` makes.
        """
        for layer in [*self.layers, *self.fast_layers]:
            fused = layer.feed_forward.fused_w13()
            if fused is None or fused.is_contiguous():  # not fused yet, or fused row-major (CUDA's)
                layer.feed_forward.fuse_weights(column_major=True)
        wide = [m for m in self.modules() if isinstance(m, nn.Linear) and m.out_features > m.in_features]
        with torch.inference_mode(False), torch.no_grad():  # plain tensors, even if called under it
            for linear in wide:
                if linear.weight.is_contiguous():  # (w1 and w3 are already views of w13)
                    linear.weight.data = linear.weight.data.t().contiguous().t()

    # ---- whole-sequence forward (training and the reference for the serving path) -------------------

    def forward(self, frames: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced forward over whole sequences, dense causal attention (the layout of
        docs/fish_dual_ar.md §1.3).

        frames: `[B, T, 1 + N]` int64. Returns
        * slow logits `[B, T, vocab]`: position t predicts the token of position t + 1;
        * fast logits `[B, T, N, codebook_size]`: at position t, fast position k (k >= 1) predicts code
          c_k of the frame at t + 1 from the slow hidden state at t and that frame's codes c_0..c_{k-1};
          fast position 0 is the (unused) prediction of c_0. The last position has no next frame, so its
          fast logits are computed from the frame's own codes shifted by one and are only meaningful as
          a layout check.
        """
        B, T, _ = frames.shape
        x = self.embed(frames)
        h_pre, h_post = self.slow_layers(x, self.freqs_cis[:T], lambda i: dense_causal_attend)
        logits = F.linear(h_post, self.lm_head_weight())
        # Fast AR: for every position t, a length-N sequence [h_t, E(c_0), ..., E(c_{N-2})] of frame t+1.
        next_codes = torch.cat([frames[:, 1:, 1:], frames[:, -1:, 1:]], dim=1)  # [B, T, N]
        fast_in = torch.cat(
            [self.fast_input(h_pre, h_post).unsqueeze(2), self.fast_embeddings(next_codes[..., :-1])], dim=2
        )  # [B, T, N, fast_dim]
        n = self.config.num_codebooks
        y = self.fast_layers_forward(
            fast_in.reshape(B * T, n, -1), self.fast_freqs_cis[:n], lambda i: dense_causal_attend
        )
        return logits, self.fast_logits(y).reshape(B, T, n, -1)
