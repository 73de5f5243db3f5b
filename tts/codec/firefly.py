"""Firefly-GAN with grouped FSQ: the codec of fish-speech 1.5 (docs/fish_dual_ar.md §5.2).

`firefly-gan-vq-fsq-8x1024-21hz-generator.pth`, fish-speech v1.5.1's `firefly_gan_vq.yaml`:

* encoder: a log-mel spectrogram (44.1 kHz, 160 mels, n_fft = window = 2048, hop 512, slaney mels, log
  of the magnitude clamped at 1e-5; the audio is reflect-padded by 768 samples on each side and the STFT
  is not centred, so `L` samples give `L // 512` mel frames), then a ConvNeXt encoder (depths 3, 3, 9,
  3; widths 128, 256, 384, 512; causal depthwise convs k7; channels-first LayerNorms between stages);
* quantizer (`DownsampleFiniteScalarQuantize`): two (causal conv k = stride = 2 + ConvNeXt block)
  downsampling stages (one token frame = 4 mel frames = 2048 samples, 21.53 Hz), then
  vector-quantize-pytorch's `GroupedResidualFSQ`: the 512 channels in 8 groups of 64, each group
  projected to 4 values (`project_in`, Linear 64 -> 4), bounded, rounded to the levels (8, 5, 5, 5) and
  numbered `l0 + 8 l1 + 40 l2 + 200 l3` (1000 codes per group); one code per group gives 8 codebooks;
* decoder: each code back to its 4 level values in [-1, 1] -> `project_out` (Linear 4 -> 64) per
  group -> two (transposed conv k = stride = 2 + ConvNeXt block) upsampling stages -> a causal HiFi-GAN
  generator: conv k13 (512 -> 512), five (SiLU -> transposed conv with strides 8, 8, 2, 2, 2 and
  kernels 16, 16, 4, 4, 4, halving the channels -> the mean of three ResBlock1s with kernels 3, 7, 11
  at dilations 1, 3, 5, each pair `x + conv(silu(conv(silu(x))))`), SiLU, conv k13 to one channel, tanh.

Every convolution is causal (`FishConvNet`: `kernel - stride` zeros on the left; `FishTransConvNet`:
`kernel - stride` samples trimmed on the right), so the decoder streams with state like the modded DAC's
(`tts/codec/dac.py`): `FireflyStreamingDecoder` keeps each conv's left context and each overlapping
transposed conv's last input frame, and the concatenated stream equals an offline `decode` of all codes
to float rounding (tests/test_firefly.py: within 1e-6). `FireflyCodec.batched_stream` keeps that state for
many streams in buffers and continues them all in one call (`BatchedFireflyDecoder`, CUDA-graph safe).

Codes at or above 1000 have no FSQ entry (fish-speech's lookup would fail on them; the 1.5 language
model's codebooks have 1024 entries): they are clamped to 999, as the modded DAC clamps its codes.

Module and parameter names follow fish-speech (`backbone.stages.{i}.{j}.dwconv.conv.weight`,
`quantizer.residual_fsq.rvqs.{g}.project_in.weight`, `head.resblocks.{i}.blocks.{j}.convs1.{k}.conv...`),
so the generator file loads by name; weight-normed convs (the HiFi-GAN's) may be stored as PyTorch
parametrizations, as `weight_g/weight_v` or fused (`tts.codec.dac.weights.fuse_weight_norm`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.codec.base import BatchedStreamDecoder, Codec, CodecCheckpointError, StatefulStreamingDecoder
from tts.codec.dac.net import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    StreamSequential,
    StreamState,
)
from tts.codec.dac.random_init import random_weight_normed_state
from tts.codec.dac.weights import fuse_weight_norm, load_state_strict, read_codec_state
from tts.codec.torchaudio_load import torchaudio

FIREFLY_FILE = "firefly-gan-vq-fsq-8x1024-21hz-generator.pth"


@dataclass(frozen=True)
class FireflyConfig:
    """Sizes of a Firefly-GAN codec. Defaults are fish-speech v1.5.1's `firefly_gan_vq.yaml`.

    The quantizer and the decoder's input have the encoder's last width (`encoder_dims[-1]`); each of
    the `n_groups` FSQ groups holds one quantizer (the yaml's `n_codebooks: 1`), so there are `n_groups`
    codebooks of `prod(levels)` codes.
    """

    sample_rate: int = 44100
    n_mels: int = 160
    n_fft: int = 2048
    hop_length: int = 512
    win_length: int = 2048
    encoder_depths: tuple[int, ...] = (3, 3, 9, 3)
    encoder_dims: tuple[int, ...] = (128, 256, 384, 512)
    levels: tuple[int, ...] = (8, 5, 5, 5)
    n_groups: int = 8
    downsample_factor: tuple[int, ...] = (2, 2)
    upsample_rates: tuple[int, ...] = (8, 8, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[int, ...] = (1, 3, 5)
    upsample_initial_channel: int = 512
    pre_conv_kernel_size: int = 13
    post_conv_kernel_size: int = 13

    @property
    def latent_dim(self) -> int:
        return self.encoder_dims[-1]

    @property
    def frame_length(self) -> int:
        """Audio samples per token frame (hop length times the quantizer's downsampling)."""
        return self.hop_length * math.prod(self.downsample_factor)

    @property
    def codebook_size(self) -> int:
        return math.prod(self.levels)

    def check(self) -> None:
        """Raise CodecCheckpointError if the sizes cannot form a codec."""
        if math.prod(self.upsample_rates) != self.hop_length:
            raise CodecCheckpointError(
                f"upsample rates {self.upsample_rates} do not give the hop length {self.hop_length}"
            )
        if self.latent_dim % self.n_groups:
            raise CodecCheckpointError(
                f"latent width {self.latent_dim} is not divisible by {self.n_groups} groups"
            )
        if len(self.encoder_depths) != len(self.encoder_dims):
            raise CodecCheckpointError("encoder depths and widths differ in length")
        if len(self.upsample_rates) != len(self.upsample_kernel_sizes):
            raise CodecCheckpointError("upsample rates and kernel sizes differ in length")
        if self.upsample_initial_channel % 2 ** len(self.upsample_rates):
            raise CodecCheckpointError(
                "the HiFi-GAN's first width does not halve through every upsampling stage"
            )


def tiny_firefly_config(**overrides) -> FireflyConfig:
    """A small Firefly-GAN with the real sample rate, mel frontend, strides, kernels and FSQ levels but
    narrow layers (tests and tiny checkpoints)."""
    cfg = FireflyConfig(
        encoder_depths=(1, 1, 2, 1), encoder_dims=(16, 16, 32, 64), upsample_initial_channel=64
    )
    return replace(cfg, **overrides)


# ---- building blocks ---------------------------------------------------------------------------------


class ChannelsFirstLayerNorm(nn.Module):
    """fish-speech's `LayerNorm(data_format="channels_first")` over x `[B, C, T]`, with its arithmetic
    (mean, biased variance, `(x - u) / sqrt(s + eps)`, then the affine), eps 1e-6."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None] * x + self.bias[:, None]


class SiLU(nn.Module):
    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return F.silu(x)


class ResBlock1(nn.Module):
    """HiFi-GAN's ResBlock1 with causal convs: for each dilation d, `x = x + c2(silu(c1(silu(x))))`
    (c1 dilated by d, c2 too, both kernel k, weight-normed). Keys `convs1.{i}`, `convs2.{i}`."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        wn = dict(weight_norm="parametrization")
        self.convs1 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=d, **wn) for d in dilations
        )
        self.convs2 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=d, **wn) for d in dilations
        )

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        for c1, c2 in zip(self.convs1, self.convs2, strict=True):
            x = c2(F.silu(c1(F.silu(x), state)), state) + x
        return x


class ParallelBlock(nn.Module):
    """The mean of one ResBlock1 per kernel size (`torch.stack(...).mean(0)`, as fish-speech computes it)."""

    def __init__(self, channels: int, kernel_sizes: tuple[int, ...], dilations: tuple[int, ...]):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock1(channels, k, dilations) for k in kernel_sizes)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return torch.stack([block(x, state) for block in self.blocks], dim=0).mean(dim=0)


class HiFiGANGenerator(nn.Module):
    """The decoder head (see the module docstring). x `[B, latent_dim, T * 4]` (mel rate) ->
    audio `[B, 1, T * frame_length]`."""

    def __init__(self, cfg: FireflyConfig):
        super().__init__()
        wn = dict(weight_norm="parametrization")
        ch = cfg.upsample_initial_channel
        self.conv_pre = CausalConv1d(cfg.latent_dim, ch, cfg.pre_conv_kernel_size, **wn)
        self.ups = nn.ModuleList(
            CausalConvTranspose1d(ch // 2**i, ch // 2 ** (i + 1), k, u, **wn)
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True))
        )
        self.resblocks = nn.ModuleList(
            ParallelBlock(ch // 2 ** (i + 1), cfg.resblock_kernel_sizes, cfg.resblock_dilations)
            for i in range(len(self.ups))
        )
        self.conv_post = CausalConv1d(ch // 2 ** len(self.ups), 1, cfg.post_conv_kernel_size, **wn)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        x = self.conv_pre(x, state)
        for up, block in zip(self.ups, self.resblocks, strict=True):
            x = block(up(F.silu(x), state), state)
        return torch.tanh(self.conv_post(F.silu(x), state))


class ConvNeXtEncoder(nn.Module):
    """fish-speech's `ConvNeXtEncoder`: stem (causal conv k7 + channels-first LayerNorm), stages of
    ConvNeXt blocks with (LayerNorm + 1x1 conv) between them, a final channels-first LayerNorm."""

    def __init__(self, cfg: FireflyConfig):
        super().__init__()
        dims = cfg.encoder_dims
        layers = [nn.Sequential(CausalConv1d(cfg.n_mels, dims[0], 7), ChannelsFirstLayerNorm(dims[0]))]
        for i in range(len(dims) - 1):
            layers.append(nn.Sequential(ChannelsFirstLayerNorm(dims[i]), nn.Conv1d(dims[i], dims[i + 1], 1)))
        self.downsample_layers = nn.ModuleList(layers)
        self.stages = nn.ModuleList(
            nn.Sequential(*(ConvNeXtBlock(d) for _ in range(n)))
            for d, n in zip(dims, cfg.encoder_depths, strict=True)
        )
        self.norm = ChannelsFirstLayerNorm(dims[-1])

    def forward(self, x: Tensor) -> Tensor:
        for down, stage in zip(self.downsample_layers, self.stages, strict=True):
            x = stage(down(x))
        return self.norm(x)


class _GroupFSQ(nn.Module):
    """One group of vector-quantize-pytorch's `ResidualFSQ` with a single quantizer: the projections
    around the finite scalar quantization (keys `project_in`, `project_out`)."""

    def __init__(self, dim: int, levels: tuple[int, ...]):
        super().__init__()
        self.project_in = nn.Linear(dim, len(levels))
        self.project_out = nn.Linear(len(levels), dim)


class GroupedFSQ(nn.Module):
    """`GroupedResidualFSQ` with one quantizer per group, in vector-quantize-pytorch 1.14.24's arithmetic."""

    def __init__(self, dim: int, groups: int, levels: tuple[int, ...]):
        super().__init__()
        self.groups = groups
        self.rvqs = nn.ModuleList(_GroupFSQ(dim // groups, levels) for _ in range(groups))
        self._levels = tuple(levels)
        self.register_buffer("levels", torch.zeros(len(levels), dtype=torch.int32), persistent=False)
        self.register_buffer("basis", torch.zeros(len(levels), dtype=torch.int32), persistent=False)
        self.init_buffers()
        self.codebook_size = math.prod(levels)

    def quantizers(self) -> Sequence[_GroupFSQ]:
        """`rvqs`, typed: torch's stubs type a ModuleList's items as plain `nn.Module`."""
        return cast("Sequence[_GroupFSQ]", self.rvqs)

    def init_buffers(self) -> None:
        """(Re)compute the level and basis buffers on the CPU (after a build on the meta device)."""
        with torch.device("cpu"):
            self._make_buffers()

    def _make_buffers(self) -> None:
        self.levels = torch.tensor(self._levels, dtype=torch.int32)
        self.basis = torch.cumprod(torch.tensor([1, *self._levels[:-1]]), dim=0, dtype=torch.int32)

    def _bound(self, z: Tensor, eps: float = 1e-3) -> Tensor:
        half_l = (self.levels - 1) * (1 + eps) / 2
        offset = torch.where(self.levels % 2 == 0, 0.5, 0.0)
        shift = (offset / half_l).atanh()
        return (z + shift).tanh() * half_l - offset

    def codes_to_values(self, codes: Tensor) -> Tensor:
        """codes `[...]` int64 in [0, codebook_size) -> level values `[..., len(levels)]`
        float32 in [-1, 1]."""
        half_width = self.levels // 2
        level_indices = (codes.unsqueeze(-1) // self.basis) % self.levels
        return (level_indices - half_width) / half_width

    def decode(self, codes: Tensor) -> Tensor:
        """codes `[B, groups, T]` int64 (clamped here) -> `[B, T, dim]` (channels last)."""
        codes = codes.clamp(0, self.codebook_size - 1)
        return torch.cat(
            [rvq.project_out(self.codes_to_values(codes[:, g])) for g, rvq in enumerate(self.quantizers())],
            dim=-1,
        )

    def encode(self, z: Tensor) -> Tensor:
        """z `[B, T, dim]` (channels last) -> codes `[B, groups, T]` int64: per group project, bound,
        bound again, round (in the straight-through form `z + (round(z) - z)`), number the levels."""
        half_width = self.levels // 2
        codes = []
        for rvq, chunk in zip(self.quantizers(), z.chunk(self.groups, dim=-1), strict=True):
            residual = self._bound(rvq.project_in(chunk))  # ResidualFSQ bounds once ...
            b = self._bound(residual / 1.0)  # ... and its FSQ layer again (scale 1 for one quantizer)
            q = b + (b.round() - b)
            zhat = q / half_width
            codes.append(((zhat * half_width + half_width) * self.basis).sum(dim=-1).to(torch.int32))
        return torch.stack(codes, dim=1).long()


class DownsampleFSQ(nn.Module):
    """fish-speech's `DownsampleFiniteScalarQuantize` (keys `residual_fsq`, `downsample`, `upsample`)."""

    def __init__(self, cfg: FireflyConfig):
        super().__init__()
        d = cfg.latent_dim
        self.residual_fsq = GroupedFSQ(d, cfg.n_groups, cfg.levels)
        self.downsample = nn.Sequential(
            *(nn.Sequential(CausalConv1d(d, d, f, stride=f), ConvNeXtBlock(d)) for f in cfg.downsample_factor)
        )
        self.upsample = nn.Sequential(
            *(
                StreamSequential(CausalConvTranspose1d(d, d, f, stride=f), ConvNeXtBlock(d))
                for f in reversed(cfg.downsample_factor)
            )
        )


class LogMelSpectrogram(nn.Module):
    """fish-speech's `LogMelSpectrogram` (no parameters): audio `[B, L]` ->
    log mels `[B, n_mels, L // hop]`."""

    # Buffers (declared for the type checker: `register_buffer` attributes are `Tensor | Module` to it).
    window: Tensor
    fb: Tensor

    def __init__(self, cfg: FireflyConfig):
        super().__init__()
        self.cfg = cfg
        with torch.device("cpu"):  # also when the model is built on the meta device
            window = torch.hann_window(cfg.win_length)
            fb = torchaudio.functional.melscale_fbanks(
                n_freqs=cfg.n_fft // 2 + 1,
                f_min=0.0,
                f_max=float(cfg.sample_rate // 2),
                n_mels=cfg.n_mels,
                sample_rate=cfg.sample_rate,
                norm="slaney",
                mel_scale="slaney",
            )
        self.register_buffer("window", window, persistent=False)
        self.register_buffer("fb", fb, persistent=False)

    def forward(self, y: Tensor) -> Tensor:
        c = self.cfg
        pad = ((c.win_length - c.hop_length) // 2, (c.win_length - c.hop_length + 1) // 2)
        y = F.pad(y.unsqueeze(1), pad, mode="reflect").squeeze(1)
        spec = torch.stft(
            y,
            c.n_fft,
            hop_length=c.hop_length,
            win_length=c.win_length,
            window=self.window,
            center=False,
            pad_mode="reflect",
            normalized=False,
            onesided=True,
            return_complex=True,
        )
        spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-6)
        mel = torch.matmul(spec.transpose(-1, -2), self.fb).transpose(-1, -2)
        return torch.log(torch.clamp(mel, min=1e-5))


# ---- the network -------------------------------------------------------------------------------------


class FireflyGAN(nn.Module):
    """The codec network (`FireflyArchitecture`): `decode(codes [B, groups, T])` -> audio
    `[B, 1, T * frame_length]`; `encode(audio [B, L])` -> codes `[B, groups, ceil(L // 512 / 4)]`."""

    def __init__(self, cfg: FireflyConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.spec_transform = LogMelSpectrogram(cfg)
        self.backbone = ConvNeXtEncoder(cfg)
        self.quantizer = DownsampleFSQ(cfg)
        self.head = HiFiGANGenerator(cfg)

    def init_buffers(self) -> None:
        """Recompute the parameter-free buffers (mel filters, window, FSQ levels) on the CPU: after a
        build on the meta device they hold no data."""
        self.quantizer.residual_fsq.init_buffers()

    def decode(self, codes: Tensor, state: StreamState | None = None) -> Tensor:
        """codes `[B, groups, T]` int64 -> audio `[B, 1, T * frame_length]` float32. With `state`, the call
        continues the stream whose state it holds."""
        z = self.quantizer.residual_fsq.decode(codes).transpose(1, 2)
        for stage in self.quantizer.upsample:
            z = stage(z, state)
        return self.head(z, state)

    def encode(self, audio: Tensor) -> Tensor:
        """audio `[B, L]` float32 (L > 768) -> codes `[B, groups, ceil((L // hop) / 4)]` int64 (fish-speech's
        `FireflyArchitecture.encode` with full lengths: its masks are all ones)."""
        mels = self.spec_transform(audio)
        z = self.backbone(mels)
        for stage in self.quantizer.downsample:
            z = stage(z)
        return self.quantizer.residual_fsq.encode(z.transpose(1, 2))


# ---- checkpoints -------------------------------------------------------------------------------------


def _indices(keys, prefix: str) -> list[int]:
    return sorted({int(k[len(prefix) :].split(".", 1)[0]) for k in keys if k.startswith(prefix)})


def infer_firefly_config(shapes: dict[str, tuple[int, ...]]) -> FireflyConfig:
    """Read a FireflyConfig off the (fused-weight) key names and shapes of a generator state dict.
    FSQ levels, strides, resblock kernel sizes and dilations and the mel settings are not visible in
    the weights and keep the yaml's values unless the shapes contradict them. Raises CodecCheckpointError
    naming the first key it needs and cannot find."""

    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CodecCheckpointError(f"not a Firefly-GAN generator: missing key {key!r}")
        return shapes[key]

    stages = _indices(shapes, "backbone.stages.")
    if not stages:
        raise CodecCheckpointError("not a Firefly-GAN generator: no backbone.stages.* keys")
    depths = tuple(len(_indices(shapes, f"backbone.stages.{i}.")) for i in stages)
    dims = tuple(shape(f"backbone.stages.{i}.0.dwconv.conv.weight")[0] for i in stages)
    n_mels = shape("backbone.downsample_layers.0.0.conv.weight")[1]
    groups = len(_indices(shapes, "quantizer.residual_fsq.rvqs."))
    n_levels = shape("quantizer.residual_fsq.rvqs.0.project_in.weight")[0]
    levels = FireflyConfig.levels
    if n_levels != len(levels):
        raise CodecCheckpointError(
            f"FSQ groups project to {n_levels} values; expected {len(levels)} (levels {levels})"
        )
    down = tuple(
        shape(f"quantizer.downsample.{i}.0.conv.weight")[2] for i in _indices(shapes, "quantizer.downsample.")
    )
    ups = _indices(shapes, "head.ups.")
    if len(ups) != len(FireflyConfig.upsample_rates):
        raise CodecCheckpointError(
            f"the generator has {len(ups)} upsampling stages; fish-speech 1.5's has "
            f"{len(FireflyConfig.upsample_rates)}"
        )
    kernels = tuple(shape(f"head.ups.{i}.conv.weight")[2] for i in ups)
    res_kernels = tuple(
        shape(f"head.resblocks.0.blocks.{j}.convs1.0.conv.weight")[2]
        for j in _indices(shapes, "head.resblocks.0.blocks.")
    )
    return FireflyConfig(
        n_mels=n_mels,
        encoder_depths=depths,
        encoder_dims=dims,
        n_groups=groups,
        downsample_factor=down,
        upsample_kernel_sizes=kernels,
        resblock_kernel_sizes=res_kernels,
        upsample_initial_channel=shape("head.conv_pre.conv.weight")[0],
        pre_conv_kernel_size=shape("head.conv_pre.conv.weight")[2],
        post_conv_kernel_size=shape("head.conv_post.conv.weight")[2],
    )


def random_firefly_state(cfg: FireflyConfig, seed: int = 0, form: str = "fish") -> dict[str, Tensor]:
    """Random float32 generator weights in a checkpoint's storage form, deterministic in `seed`.

    form: "fish" (the HiFi-GAN's weight-normed convs as `parametrizations.weight.original0/1`, as
    fish-speech's modules store them), "old" (`weight_g/weight_v`) or "fused" (plain `weight`).
    Weight-norm magnitudes keep each output channel's norm near 1, LayerNorm gains near 1 and the
    ConvNeXt layer scales small, so a random codec gives finite, non-saturated audio.
    """
    with torch.device("meta"):
        model = FireflyGAN(cfg)

    def init(key: str, leaf: str, shape: tuple[int, ...]) -> tuple[float, float] | None:
        if leaf == "gamma":
            return 0.02, 0.1
        if leaf != "bias" and len(shape) == 1:  # LayerNorm gains
            return 0.05, 1.0
        return None

    return random_weight_normed_state(model, seed, form, lambda base: "parametrization", init)


# ---- the Codec --------------------------------------------------------------------------------------


class FireflyCodec(Codec):
    """Firefly-GAN behind the `Codec` interface: 44.1 kHz mono, 2048 samples per frame, 8 codebooks of
    1000 FSQ codes (out-of-range codes are clamped to [0, 999]). Runs in float32 on `device`; `decode`,
    `encode` and `stream()` return CPU tensors, `batched_stream` float32 samples on `device`.

    `encode` follows fish-speech: `L` samples give `ceil((L // 512) / 4)` frames (at most
    `ceil(L / 2048)`, the `Codec` contract's bound); the clip must be longer than 768 samples (the
    reflect padding of the spectrogram).
    """

    def __init__(self, model: FireflyGAN, device: str | torch.device = "cpu"):
        self.model = model.to(device=device, dtype=torch.float32).eval()
        c = model.cfg
        self.cfg = c
        self.device = torch.device(device)
        self.sample_rate = c.sample_rate
        self.frame_length = c.frame_length
        self.num_codebooks = c.n_groups
        self.codebook_size = c.codebook_size
        self.context_frames = 0  # stream() keeps state instead of re-decoding context

    @classmethod
    def from_file(cls, path: str | Path, device: str | torch.device = "cpu") -> FireflyCodec:
        """Load a fish-speech 1.5 generator file (any weight-norm storage form; sizes read off the shapes).
        Raises CodecCheckpointError naming the problem."""
        state = fuse_weight_norm(read_codec_state(path))
        cfg = infer_firefly_config({k: tuple(v.shape) for k, v in state.items()})
        try:
            cfg.check()
            with torch.device("meta"):
                model = FireflyGAN(cfg)
        except CodecCheckpointError as exc:
            raise CodecCheckpointError(f"{path}: {exc}") from exc
        load_state_strict(model, state, Path(path).name)
        model.init_buffers()  # the non-persistent buffers were made on the meta device
        return cls(model, device)

    def to(self, device) -> FireflyCodec:
        """Move the codec to `device` (returns self)."""
        self.model.to(device)
        self.device = torch.device(device)
        return self

    def config(self) -> dict:
        return {"type": "firefly_gan", "file": FIREFLY_FILE}

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        codes = self.check_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        return self.model.decode(codes.unsqueeze(0).to(self.device))[0, 0].cpu()

    @torch.inference_mode()
    def encode_audio(self, audio: Tensor) -> Tensor:
        x = torch.as_tensor(audio, dtype=torch.float32).reshape(1, -1).to(self.device)
        if x.shape[1] <= (self.cfg.win_length - self.cfg.hop_length) // 2:
            raise ValueError(
                f"Firefly-GAN needs more than {(self.cfg.win_length - self.cfg.hop_length) // 2} samples"
            )
        return self.model.encode(x)[0].cpu()

    def stream(self) -> FireflyStreamingDecoder:
        return FireflyStreamingDecoder(self)

    def batched_stream(self, max_streams: int) -> BatchedFireflyDecoder:
        """A `BatchedFireflyDecoder` for up to `max_streams` streams (state allocated on `device`)."""
        return BatchedFireflyDecoder(self, max_streams)


class FireflyStreamingDecoder(StatefulStreamingDecoder):
    """`FireflyCodec.stream()`: Firefly's stateful incremental decode (`StatefulStreamingDecoder`)."""

    codec: FireflyCodec

    def _decode(self, codes: Tensor) -> Tensor:
        return self.codec.model.decode(codes.to(self.codec.device), self.state)


def load_firefly(path: str | Path, device: str | torch.device = "cpu") -> FireflyCodec:
    """`FireflyCodec.from_file` (the name the bundle loaders use)."""
    return FireflyCodec.from_file(path, device)


# ---- batched streaming decode ------------------------------------------------------------------------


class BatchedFireflyDecoder(BatchedStreamDecoder):
    """Streaming decode of up to `max_streams` Firefly streams in one call (see `BatchedStreamDecoder`
    for the contract: slots, the scratch slot `max_streams`, ragged `lengths`, output
    `[B, T * frame_length]` float32 on `device`).

    State, in buffers allocated once on the codec's device (one slot per stream plus the scratch slot):
    every causal conv of the decode path with left context keeps its last `padding` input samples,
    `[S + 1, C, padding]`, and every overlapping transposed conv its last `context` input frames. A call
    prepends each row's state to its input at every stage and keeps, as the row's new state, the window
    that ends at the row's own valid end (`lengths[i]` frames at that stage's rate), so pad frames never
    reach the state and a row of length 0 keeps its old state. There is no attention, so no positions.
    `decode` makes no host sync and no data-dependent Python branch (`graph_safe`).

    Raises ValueError for `max_streams` below 1, and in `decode` / `reset` (host-side checks only) for
    inputs of the wrong rank, size, dtype or device.
    """

    graph_safe = True

    def __init__(self, codec: FireflyCodec, max_streams: int):
        from tts.codec.dac.batched import _window

        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        self._window = _window
        self.codec = codec
        self.model = codec.model
        self.max_streams = max_streams
        self.device = codec.device
        slots = max_streams + 1
        self._state: dict[nn.Module, Tensor] = {}
        for module in (*self.model.quantizer.upsample.modules(), *self.model.head.modules()):
            if isinstance(module, CausalConv1d) and module.padding:
                self._state[module] = torch.zeros(
                    slots, module.conv.in_channels, module.padding, device=self.device
                )
            elif isinstance(module, CausalConvTranspose1d) and module.context:
                self._state[module] = torch.zeros(
                    slots, module.conv.in_channels, module.context, device=self.device
                )

    def state_bytes(self) -> int:
        """Bytes of state held for all slots."""
        return sum(t.numel() * t.element_size() for t in self._state.values())

    @torch.inference_mode()
    def reset(self, slots: Tensor) -> None:
        """Start fresh streams in `slots` (`[k]` int64 on `device`): zero their state."""
        slots = self.check_slots(slots)
        for buf in self._state.values():
            buf.index_fill_(0, slots, 0)

    @torch.inference_mode()
    def decode(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        """Continue the streams in `slots` by `lengths` frames each (see the class docstring).

        slots `[B]` int64; codes `[B, groups, T]` int64 (clamped into the codebooks); lengths `[B]`
        int64 in `[0, T]`; all on `device`. Returns `[B, T * frame_length]` float32 on `device`.
        Raises ValueError for a wrong shape, dtype or device (T = 0 included)."""
        self.check_inputs(slots, codes, lengths, self.codec.num_codebooks)
        rows = [slots, lengths, 1]  # slots, valid frames, samples per frame at the current stage
        z = self.model.quantizer.residual_fsq.decode(codes).transpose(1, 2)
        for stage in self.model.quantizer.upsample:
            z = self._run(stage, z, rows)
        return self._run(self.model.head, z, rows)[:, 0]

    def _run(self, module: nn.Module, x: Tensor, rows: list) -> Tensor:
        if isinstance(module, StreamSequential):
            for child in module:
                x = self._run(child, x, rows)
            return x
        if isinstance(module, ConvNeXtBlock):
            return module.mix(x, self._conv(module.dwconv, x, rows))
        if isinstance(module, HiFiGANGenerator):
            x = self._conv(module.conv_pre, x, rows)
            # (torch's stubs type a ModuleList's items as plain nn.Module)
            ups = cast("Sequence[CausalConvTranspose1d]", module.ups)
            for up, block in zip(ups, module.resblocks, strict=True):
                x = self._run(block, self._conv_transpose(up, F.silu(x), rows), rows)
            return torch.tanh(self._conv(module.conv_post, F.silu(x), rows))
        if isinstance(module, ParallelBlock):
            return torch.stack([self._run(b, x, rows) for b in module.blocks], dim=0).mean(dim=0)
        if isinstance(module, ResBlock1):
            convs1 = cast("Sequence[CausalConv1d]", module.convs1)  # (typed as above)
            convs2 = cast("Sequence[CausalConv1d]", module.convs2)
            for c1, c2 in zip(convs1, convs2, strict=True):
                x = self._conv(c2, F.silu(self._conv(c1, F.silu(x), rows)), rows) + x
            return x
        if isinstance(module, CausalConvTranspose1d):
            return self._conv_transpose(module, x, rows)
        raise TypeError(f"no batched streaming rule for {type(module).__name__}")

    def _conv(self, module: CausalConv1d, x: Tensor, rows: list) -> Tensor:
        """Stride-1 causal conv: the row's last `padding` samples in front instead of zeros."""
        state = self._state.get(module)
        if state is None:
            return module.conv(x)
        slots, lengths, rate = rows
        x = torch.cat([state.index_select(0, slots), x], dim=-1)
        state.index_copy_(0, slots, self._window(x, lengths * rate, module.padding, dim=2))
        return module.conv(x)

    def _conv_transpose(self, module: CausalConvTranspose1d, x: Tensor, rows: list) -> Tensor:
        """Causal transposed conv: with overlap, the row's last `context` input frames in front and only the
        new frames' `T * stride` samples kept; then the stage's rate grows by the stride."""
        T, stride = x.shape[-1], module.stride
        slots, lengths, rate = rows
        state = self._state.get(module)
        if state is None:
            y = module.conv(x)
            y = y[..., : y.shape[-1] - module.overlap]
        else:
            x = torch.cat([state.index_select(0, slots), x], dim=-1)
            state.index_copy_(0, slots, self._window(x, lengths * rate, module.context, dim=2))
            skip = module.context * stride
            y = module.conv(x)[..., skip : skip + T * stride]
        rows[2] = rate * stride
        return y
