"""The network of the "modded DAC" codec of OpenAudio S1 and Fish Audio S2-Pro
(docs/fish_dual_ar.md §5.1): its sizes (`DACConfig`), building blocks and `ModdedDAC`.

44.1 kHz mono; a causal convolutional encoder (strides 2, 4, 8, 8: 512 samples per latent) with a
windowed transformer after its last block; a quantizer that downsamples the latents x2 x2 (one token
frame = 2048 samples, 21.53 Hz), runs an 8-layer causal transformer with a 128-frame attention window,
and quantizes with one semantic codebook (4096 entries) plus 9 residual codebooks (1024 entries); and a
decoder that mirrors it: codebook lookups -> windowed transformer -> two transposed-conv + ConvNeXt
upsampling stages -> Snake/transposed-conv decoder blocks (strides 8, 8, 4, 2) -> tanh.

Module and parameter names follow fish-speech's `modded_dac.py` / `rvq.py` / descript-audio-codec, so
a `codec.pth` loads by name (tts/codec/dac_checkpoint.py); the modules hold plain fused weights. Every
stage is causal and takes an optional `StreamState`: what one stream carries between decode calls (the
left context of each convolution, the last input frame of each transposed convolution, the last keys
and values of each transformer layer at their absolute RoPE positions; see tts/codec/dac.py).

Imports run downhill: this module needs only the model's RoPE helpers and the codec base;
`dac_checkpoint`, `dac_random`, `dac` and `dac_batched` build on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.codec.base import CodecCheckpointError
from tts.model.kernels import fused_kernels_enabled, snake_ops
from tts.model.layers import Rope, apply_rotary_emb, embedding, precompute_freqs_cis

StreamState = dict  # module -> its carried state (tensors), one per stream


# ---- configuration -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DACConfig:
    """Sizes of a modded DAC. Defaults are fish-speech's `modded_dac_vq.yaml` (S1-mini and S2-Pro).

    Transformers use head_dim 64 (so `dim // 64` heads), SwiGLU width `3 * dim`, RMSNorm eps 1e-5 and
    RoPE base 1e4, as the yaml says; `encoder_window` is the encoder transformer's attention window (512
    latents: the yaml's partial config has no `window_size`, so the code default applies) and
    `transformer_window` that of the quantizer's pre/post transformers (128 frames).
    """

    sample_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 4)
    encoder_window: int = 512
    latent_dim: int = 1024
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    semantic_codebook_size: int = 4096
    codebook_size: int = 1024
    n_codebooks: int = 9
    codebook_dim: int = 8
    downsample_factor: tuple[int, ...] = (2, 2)
    pre_transformer_layers: int = 8
    post_transformer_layers: int = 8
    transformer_window: int = 128
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def hop_length(self) -> int:
        """Audio samples per encoder latent (product of the encoder strides)."""
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        """Audio samples per token frame (hop length times the quantizer's downsampling)."""
        return self.hop_length * math.prod(self.downsample_factor)

    @property
    def num_codebooks(self) -> int:
        return 1 + self.n_codebooks

    def check(self) -> None:
        """Raise CodecCheckpointError if the sizes cannot form a codec."""
        if math.prod(self.decoder_rates) * math.prod(self.downsample_factor) != self.frame_length:
            raise CodecCheckpointError(
                f"decoder strides {self.decoder_rates} x downsampling {self.downsample_factor} do not give "
                f"the encoder's {self.frame_length} samples per frame"
            )
        for name, dim in (("latent_dim", self.latent_dim),) + tuple(
            (f"encoder block {i}", self.encoder_dim * 2 ** (i + 1))
            for i, n in enumerate(self.encoder_transformer_layers)
            if n
        ):
            if dim % self.head_dim:
                raise CodecCheckpointError(f"{name} = {dim} is not a multiple of head_dim {self.head_dim}")


# ---- building blocks ---------------------------------------------------------------------------------


class WNConv:
    """Marks a conv module whose fish-speech counterpart is weight-normalized, and how it is stored:
    `parametrization` (`conv.parametrizations.weight.original0/1`) or `old` (`weight_g/weight_v`)."""

    weight_norm: str | None = None


class CausalConv1d(nn.Module, WNConv):
    """Conv1d padded with `receptive - stride` zeros on the left (causal) and, offline, just enough on
    the right to complete the last stride (fish-speech `CausalConvNet`). x: `[B, C, T]`."""

    def __init__(self, cin, cout, kernel_size, stride=1, dilation=1, groups=1, weight_norm=None):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.receptive = (kernel_size - 1) * dilation + 1
        self.padding = self.receptive - stride
        self.weight_norm = weight_norm

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        if state is None:
            extra = (-(x.shape[-1] - self.receptive + self.padding)) % self.stride
            return self.conv(F.pad(x, (self.padding, extra)))
        if self.stride != 1:
            raise NotImplementedError("streaming is only defined for stride-1 convolutions")
        prev = state.get(self)
        if prev is None:
            prev = x.new_zeros(x.shape[0], x.shape[1], self.padding)
        x = torch.cat([prev, x], dim=-1)
        state[self] = x[..., x.shape[-1] - self.padding :]
        return self.conv(x)


class CausalConvTranspose1d(nn.Module, WNConv):
    """ConvTranspose1d with the last `kernel - stride` samples trimmed (fish-speech `CausalTransConvNet`):
    T input frames give exactly `T * stride` samples, each depending on its own and earlier frames."""

    def __init__(self, cin, cout, kernel_size, stride, weight_norm=None):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride)
        self.stride = stride
        self.overlap = kernel_size - stride
        self.context = -(-self.overlap // stride)  # input frames of left context a chunk needs
        self.weight_norm = weight_norm

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        T = x.shape[-1]
        if state is None or self.context == 0:
            y = self.conv(x)
            return y[..., : y.shape[-1] - self.overlap]
        prev = state.get(self)
        xx = x if prev is None else torch.cat([prev, x], dim=-1)
        state[self] = xx[..., max(0, xx.shape[-1] - self.context) :]
        skip = 0 if prev is None else prev.shape[-1] * self.stride
        return self.conv(xx)[..., skip : skip + T * self.stride]


class Snake1d(nn.Module):
    """Snake activation `x + sin^2(alpha x) / (alpha + 1e-9)`, alpha per channel `[1, C, 1]`."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        if fused_kernels_enabled(x, self.alpha):  # one pass instead of five (tts/kernels/snake.py)
            return snake_ops().snake(x, self.alpha)
        # Same operation order as descript-audio-codec's `snake`, for bit-level agreement (off CUDA;
        # the kernel above agrees to float rounding).
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class Tanh(nn.Module):
    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return torch.tanh(x)


class Identity(nn.Module):
    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return x


class StreamSequential(nn.Sequential):
    """nn.Sequential whose children take the stream state too (names stay `0`, `1`, ...)."""

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        for module in self:
            x = module(x, state)
        return x


class ResidualUnit(nn.Module):
    """Snake -> dilated causal conv k7 -> Snake -> conv k1, plus the input (keys `block.0..3`)."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.block = StreamSequential(
            Snake1d(dim),
            CausalConv1d(dim, dim, 7, dilation=dilation, weight_norm="parametrization"),
            Snake1d(dim),
            CausalConv1d(dim, dim, 1, weight_norm="parametrization"),
        )

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return x + self.block(x, state)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv k7 -> LayerNorm (eps 1e-6) -> Linear(d, 4d) -> GELU -> Linear(4d, d) ->
    x gamma, plus the input. x: `[B, C, T]`."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return self.mix(x, self.dwconv(x, state))

    def mix(self, x: Tensor, y: Tensor) -> Tensor:
        """Everything after the depthwise conv: x the block's input, y the conv's output, both `[B, C, T]`
        (split out so that the batched streaming decoder runs the same arithmetic)."""
        y = y.permute(0, 2, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 2, 1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class _Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        self.wqkv = nn.Linear(dim, 3 * n_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TransformerLayer(nn.Module):
    def __init__(self, dim: int, head_dim: int, eps: float):
        super().__init__()
        self.attention = _Attention(dim, dim // head_dim, head_dim)
        self.feed_forward = _FeedForward(dim, 3 * dim)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.attention_layer_scale = LayerScale(dim)
        self.ffn_layer_scale = LayerScale(dim)

    def qkv(self, x: Tensor, freqs: Tensor | Rope) -> tuple[Tensor, Tensor, Tensor]:
        """x `[B, T, dim]` -> q, k, v `[B, heads, T, head_dim]`, q and k rotated by `freqs` (`[T, D/2, 2]`
        or per-row `[B, T, D/2, 2]` bf16 RoPE rows, or a `Rope` of them)."""
        a = self.attention
        B, T, _ = x.shape
        q, k, v = a.wqkv(self.attention_norm(x)).split(a.n_head * a.head_dim, dim=-1)
        q = apply_rotary_emb(q.view(B, T, a.n_head, a.head_dim), freqs).transpose(1, 2)
        k = apply_rotary_emb(k.view(B, T, a.n_head, a.head_dim), freqs).transpose(1, 2)
        return q, k, v.view(B, T, a.n_head, a.head_dim).transpose(1, 2)

    def finish(self, x: Tensor, y: Tensor) -> Tensor:
        """The rest of the block after attention: x the block's input `[B, T, dim]`, y the attention
        output `[B, heads, T, head_dim]`; returns the block's output `[B, T, dim]`."""
        a = self.attention
        B, T, _ = x.shape
        y = a.wo(y.transpose(1, 2).reshape(B, T, a.n_head * a.head_dim))
        h = x + self.attention_layer_scale(y)
        return h + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(h)))


class WindowTransformer(nn.Module):
    """fish-speech's `WindowLimitedTransformer`: pre-norm blocks with LayerScale on both branches, RoPE
    (adjacent pairs, bf16 table, base 1e4) at absolute positions, causal attention limited to the last
    `window` positions (query i sees keys i - window + 1 .. i), then a final RMSNorm.

    x: `[B, dim, T]` (channels first). `start` is the absolute position of x's first frame; `state`
    carries each layer's last `window - 1` keys and values between calls when streaming.
    """

    def __init__(self, dim: int, n_layer: int, window: int, head_dim: int, rope_base: float, eps: float):
        super().__init__()
        self.window, self.head_dim, self.rope_base = window, head_dim, rope_base
        self.layers = nn.ModuleList(_TransformerLayer(dim, head_dim, eps) for _ in range(n_layer))
        self.norm = RMSNorm(dim, eps)
        self._rope = torch.zeros(0, head_dim // 2, 2, dtype=torch.bfloat16)

    def transformer_layers(self) -> Sequence[_TransformerLayer]:
        """`layers`, typed: torch's stubs type a ModuleList's items as plain `nn.Module`."""
        return cast("Sequence[_TransformerLayer]", self.layers)

    def _freqs(self, start: int, n: int, device) -> Tensor:
        if self._rope.shape[0] < start + n:
            self._rope = precompute_freqs_cis(max(2 * (start + n), 4096), self.head_dim, self.rope_base)
        if self._rope.device != torch.device(device):
            self._rope = self._rope.to(device)
        return self._rope[start : start + n]

    def forward(self, x: Tensor, start: int = 0, state: StreamState | None = None) -> Tensor:
        x = x.transpose(1, 2)
        T = x.shape[1]
        freqs = Rope(self._freqs(start, T, x.device))  # one Rope: its fp32 factors are built once per call
        for layer in self.transformer_layers():
            q, k, v = layer.qkv(x, freqs)
            past = 0
            if state is not None:
                prev = state.get(layer)
                if prev is not None:
                    k, v = torch.cat([prev[0], k], dim=2), torch.cat([prev[1], v], dim=2)
                    past = prev[0].shape[2]
                keep = min(self.window - 1, k.shape[2])
                state[layer] = (k[:, :, k.shape[2] - keep :], v[:, :, v.shape[2] - keep :])
            qi = torch.arange(T, device=x.device).unsqueeze(1) + past
            kj = torch.arange(past + T, device=x.device).unsqueeze(0)
            mask = (kj <= qi) & (kj > qi - self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
            x = layer.finish(x, y)
        return self.norm(x).transpose(1, 2)


# ---- encoder, quantizer, decoder ---------------------------------------------------------------------


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, stride: int, n_t_layer: int, cfg: DACConfig):
        super().__init__()
        transformer = (
            WindowTransformer(dim, n_t_layer, cfg.encoder_window, cfg.head_dim, cfg.rope_base, cfg.norm_eps)
            if n_t_layer
            else None
        )
        self.block = nn.Sequential(
            ResidualUnit(dim // 2, 1),
            ResidualUnit(dim // 2, 3),
            ResidualUnit(dim // 2, 9),
            Snake1d(dim // 2),
            CausalConv1d(dim // 2, dim, 2 * stride, stride=stride, weight_norm="parametrization"),
            *([transformer] if transformer is not None else []),
        )

    def forward(self, x: Tensor) -> Tensor:
        for module in self.block:
            x = module(x)
        return x


class Encoder(nn.Module):
    """Causal conv 1 -> d -> EncoderBlocks (channels x2 per block) -> Snake -> conv k3 to the latent."""

    def __init__(self, cfg: DACConfig):
        super().__init__()
        d = cfg.encoder_dim
        blocks: list[nn.Module] = [CausalConv1d(1, d, 7, weight_norm="parametrization")]
        for stride, n_t in zip(cfg.encoder_rates, cfg.encoder_transformer_layers, strict=True):
            d *= 2
            blocks.append(EncoderBlock(d, stride, n_t, cfg))
        blocks += [Snake1d(d), CausalConv1d(d, cfg.latent_dim, 3, weight_norm="parametrization")]
        self.block = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        for module in self.block:
            x = module(x)
        return x


class VectorQuantize(nn.Module):
    """One VQ stage (descript-audio-codec): 1x1 projections around an `[entries, codebook_dim]` table,
    nearest entry by cosine similarity."""

    def __init__(self, dim: int, size: int, codebook_dim: int):
        super().__init__()
        self.in_proj = nn.Conv1d(dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, dim, 1)
        self.codebook = embedding(size, codebook_dim)
        # A plain marker attribute (see WNConv); torch's stubs only allow tensors and modules as attributes.
        self.in_proj.weight_norm = self.out_proj.weight_norm = "old"  # type: ignore[assignment]

    def decode(self, codes: Tensor) -> Tensor:
        """codes `[B, T]` -> `[B, dim, T]`."""
        return self.out_proj(F.embedding(codes, self.codebook.weight).transpose(1, 2))

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z `[B, dim, T]` -> (quantized `[B, dim, T]`, codes `[B, T]`), descript's arithmetic exactly."""
        z_e = self.in_proj(z)
        enc = F.normalize(z_e.transpose(1, 2).reshape(-1, z_e.shape[1]))
        book = F.normalize(self.codebook.weight)
        dist = enc.pow(2).sum(1, keepdim=True) - 2 * enc @ book.t() + book.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(z.shape[0], -1)
        z_q = F.embedding(codes, self.codebook.weight).transpose(1, 2)
        z_q = z_e + (z_q - z_e)  # the straight-through form, kept for identical rounding
        return self.out_proj(z_q), codes


class ResidualVQ(nn.Module):
    def __init__(self, dim: int, n: int, size: int, codebook_dim: int):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantize(dim, size, codebook_dim) for _ in range(n))

    def stages(self) -> Sequence[VectorQuantize]:
        """`quantizers`, typed: torch's stubs type a ModuleList's items as plain `nn.Module`."""
        return cast("Sequence[VectorQuantize]", self.quantizers)

    def decode(self, codes: Tensor) -> Tensor:
        """codes `[B, n, T]` -> sum of the stages' outputs `[B, dim, T]`."""
        z: Tensor | float = 0.0
        for i, q in enumerate(self.stages()):
            z = z + q.decode(codes[:, i])
        assert isinstance(z, Tensor)  # n >= 1 stages
        return z

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """z `[B, dim, T]` -> (quantized sum, codes `[B, n, T]`), each stage quantizing the residual."""
        z_q: Tensor | float = 0.0
        residual, codes = z, []
        for q in self.stages():
            z_i, c = q.encode(residual)
            z_q = z_q + z_i
            residual = residual - z_i
            codes.append(c)
        assert isinstance(z_q, Tensor)  # n >= 1 stages
        return z_q, torch.stack(codes, dim=1)


class DownsampleRVQ(nn.Module):
    """fish-speech's `DownsampleResidualVectorQuantize`: downsample x2 x2 -> pre transformer -> semantic
    VQ, residual VQ on what it leaves; decode is lookups -> post transformer -> upsample x2 x2."""

    def __init__(self, cfg: DACConfig):
        super().__init__()
        d = cfg.latent_dim
        self.semantic_quantizer = ResidualVQ(d, 1, cfg.semantic_codebook_size, cfg.codebook_dim)
        self.quantizer = ResidualVQ(d, cfg.n_codebooks, cfg.codebook_size, cfg.codebook_dim)
        self.downsample = nn.Sequential(
            *(nn.Sequential(CausalConv1d(d, d, f, stride=f), ConvNeXtBlock(d)) for f in cfg.downsample_factor)
        )
        self.upsample = nn.Sequential(
            *(
                StreamSequential(CausalConvTranspose1d(d, d, f, stride=f), ConvNeXtBlock(d))
                for f in reversed(cfg.downsample_factor)
            )
        )
        window, head_dim, rope_base, eps = cfg.transformer_window, cfg.head_dim, cfg.rope_base, cfg.norm_eps
        self.pre_module = WindowTransformer(d, cfg.pre_transformer_layers, window, head_dim, rope_base, eps)
        self.post_module = WindowTransformer(d, cfg.post_transformer_layers, window, head_dim, rope_base, eps)


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.block = StreamSequential(
            Snake1d(cin),
            CausalConvTranspose1d(cin, cout, 2 * stride, stride, weight_norm="parametrization"),
            ResidualUnit(cout, 1),
            ResidualUnit(cout, 3),
            ResidualUnit(cout, 9),
        )

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return self.block(x, state)


class Decoder(nn.Module):
    """Causal conv k7 -> DecoderBlocks (channels /2 per block) -> Snake -> conv k7 to 1 channel -> tanh."""

    def __init__(self, cfg: DACConfig):
        super().__init__()
        c = cfg.decoder_dim
        layers: list[nn.Module] = [CausalConv1d(cfg.latent_dim, c, 7, weight_norm="parametrization")]
        for i, stride in enumerate(cfg.decoder_rates):
            layers.append(DecoderBlock(c // 2**i, c // 2 ** (i + 1), stride))
        out = c // 2 ** len(cfg.decoder_rates)
        layers += [Snake1d(out), CausalConv1d(out, 1, 7, weight_norm="parametrization"), Tanh()]
        self.model = StreamSequential(*layers)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return self.model(x, state)


class ModdedDAC(nn.Module):
    """The codec network. `decode(codes [B, 1 + n, T])` -> audio `[B, 1, T * frame_length]`;
    `encode(audio [B, 1, L])` -> codes `[B, 1 + n, ceil(L / frame_length)]` (docs/fish_dual_ar.md §5.1)."""

    def __init__(self, cfg: DACConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = DownsampleRVQ(cfg)
        self.decoder = Decoder(cfg)

    def clamp_codes(self, codes: Tensor) -> Tensor:
        """Row 0 into the semantic codebook, the other rows into the residual codebooks
        (docs/fish_dual_ar.md §5.1)."""
        c = self.cfg
        return torch.cat(
            [codes[:, :1].clamp(0, c.semantic_codebook_size - 1), codes[:, 1:].clamp(0, c.codebook_size - 1)],
            dim=1,
        )

    def decode_path(self) -> tuple[nn.Module, ...]:
        """The modules that run only when decoding, after the codebook lookups: post transformer,
        upsampling stages, decoder (`DACCodec` runs these in its `dtype`; the lookups stay float32 because
        encode shares them)."""
        return self.quantizer.post_module, self.quantizer.upsample, self.decoder

    @property
    def decode_dtype(self) -> torch.dtype:
        """The dtype the decode path's weights are in (float32 unless `DACCodec` was given another)."""
        return self.quantizer.post_module.norm.weight.dtype

    def lookup(self, codes: Tensor) -> Tensor:
        """codes `[B, 1 + n, T]` int64 (clamped here) -> the summed codebook vectors `[B, latent_dim, T]`,
        computed in float32 and cast to `decode_dtype`."""
        q = self.quantizer
        codes = self.clamp_codes(codes)
        z = q.semantic_quantizer.decode(codes[:, :1]) + q.quantizer.decode(codes[:, 1:])
        return z.to(self.decode_dtype)

    def decode_latents(self, codes: Tensor, start: int = 0, state: StreamState | None = None) -> Tensor:
        """codes `[B, 1 + n, T]` -> the post-transformer latents `[B, latent_dim, T]` (frame rate)."""
        return self.quantizer.post_module(self.lookup(codes), start, state)

    def decode(self, codes: Tensor, start: int = 0, state: StreamState | None = None) -> Tensor:
        """codes `[B, 1 + n, T]` int64 -> audio `[B, 1, T * frame_length]` float. With `state`, the call
        continues a stream whose first frame here has absolute index `start`."""
        z = self.decode_latents(codes, start, state)
        for stage in self.quantizer.upsample:
            z = stage(z, state)
        return self.decoder(z, state)

    def encode(self, audio: Tensor) -> Tensor:
        """audio `[B, 1, L]` float -> codes `[B, 1 + n, ceil(L / frame_length)]` int64 (right-padded with
        zeros to whole frames first)."""
        q = self.quantizer
        L = audio.shape[-1]
        audio = F.pad(audio, (0, -L % self.cfg.frame_length))
        z = self.encoder(audio)
        # each stage is an nn.Sequential (conv, ConvNeXt block); torch's stubs type it as plain nn.Module
        for stage in cast("Sequence[nn.Sequential]", q.downsample):
            z = stage[1](stage[0](z))
        z = q.pre_module(z)
        semantic_z, semantic_codes = q.semantic_quantizer.encode(z)
        _, codes = q.quantizer.encode(z - semantic_z)
        return torch.cat([semantic_codes, codes], dim=1)

    @property
    def context_frames(self) -> int:
        """Frames of left context that bound the decoder's receptive field: the stacked attention
        windows plus the causal convolutions' context (computed, rounded up, plus one frame).

        Re-decoding that many frames of context (the `Codec` base's StreamingDecoder) is exact only if the
        window is decoded at its absolute RoPE positions (`decode(..., start=...)`): the bf16 RoPE table
        makes attention depend slightly on absolute position. `DACCodec.stream()` keeps state instead."""
        c = self.cfg
        frames = c.post_transformer_layers * (c.transformer_window - 1)
        rate = 1.0  # samples per frame at the current stage
        conv_context = 0.0
        for f in reversed(c.downsample_factor):
            rate *= f
            conv_context += 6 / rate  # ConvNeXt depthwise k7
        conv_context += 6 / rate  # decoder's first conv, k7
        for s in c.decoder_rates:
            conv_context += 1 / rate  # transposed conv k = 2s: one input sample of context
            rate *= s
            conv_context += 6 * (1 + 3 + 9) / rate  # residual units, k7 at dilations 1, 3, 9
        conv_context += 6 / rate  # final conv, k7
        return frames + math.ceil(conv_context) + 1
