"""Random-weight modded DACs (tts/codec/dac_net.py) for tests, benchmarks and tiny checkpoints: a tiny
config with the real rates and codebooks (`tiny_dac_config`), and deterministic random weights in any
of a checkpoint's storage forms (`random_codec_state`; `tts.fish.checkpoint` writes them as `codec.pth`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn

from .dac_net import CausalConv1d, CausalConvTranspose1d, DACConfig, ModdedDAC


def tiny_dac_config(**overrides) -> DACConfig:
    """A small modded DAC with the real sample rate, strides, frame length and codebook sizes but narrow
    layers (tests and tiny checkpoints)."""
    cfg = DACConfig(
        encoder_dim=8,
        latent_dim=128,
        decoder_dim=64,
        encoder_transformer_layers=(0, 0, 0, 1),
        pre_transformer_layers=2,
        post_transformer_layers=2,
    )
    return replace(cfg, **overrides)


def _weight_norm_modules(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """conv path -> (storage form, conv module) for every conv that fish-speech weight-normalizes."""
    out = {}
    for name, module in model.named_modules():
        form = getattr(module, "weight_norm", None)
        if form is None:
            continue
        conv = module.conv if isinstance(module, CausalConv1d | CausalConvTranspose1d) else module
        out[f"{name}.conv" if conv is not module else name] = (form, conv)
    return out


def random_codec_state(cfg: DACConfig, seed: int = 0, form: str = "fish") -> dict[str, Tensor]:
    """Random float32 codec weights in a checkpoint's storage form, deterministic in `seed`.

    form: "fish" (as fish-speech's modules store them: encoder and decoder convs as
    `parametrizations.weight.original0/1`, quantizer projections as `weight_g/weight_v`), "old" (every
    weight-normed conv as `weight_g/weight_v`) or "fused" (plain `weight`). Weight-norm magnitudes keep
    each output channel's weight norm near 1 and residual branches small, so random codecs produce
    finite, non-saturated audio.
    """
    from ..randinit import random_like_init, random_weight_norm

    if form not in ("fish", "old", "fused"):
        raise ValueError(f"unknown codec storage form {form!r}")
    with torch.device("meta"):
        model = ModdedDAC(cfg)
    wn = _weight_norm_modules(model)
    state: dict[str, Tensor] = {}
    for key, p in model.state_dict().items():
        base, _, leaf = key.rpartition(".")
        shape = tuple(p.shape)
        if base in wn and leaf == "weight":
            storage, _ = wn[base]  # how fish-speech's module stores it: "parametrization" or "old"
            storage = "fused" if form == "fused" else storage if form == "fish" else "old"
            state.update(random_weight_norm(key, shape, seed, storage))
        elif leaf == "alpha":
            state[key] = random_like_init(shape, seed, key, std=0.25, mean=1.0)
        elif leaf == "gamma":
            state[key] = random_like_init(shape, seed, key, std=0.02, mean=0.1)
        elif leaf == "bias":
            state[key] = random_like_init(shape, seed, key, std=0.02)
        elif key.endswith("norm.weight"):
            state[key] = random_like_init(shape, seed, key, std=0.05, mean=1.0)
        elif key.endswith("codebook.weight"):
            state[key] = random_like_init(shape, seed, key, std=1.0)
        else:  # plain Linear / conv weights: unit-variance outputs
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            state[key] = random_like_init(shape, seed, key, std=1.0 / math.sqrt(fan_in))
    return state
