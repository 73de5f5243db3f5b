"""Random-weight modded DACs (tts/codec/dac_net.py) for tests, benchmarks and tiny checkpoints: a tiny
config with the real rates and codebooks (`tiny_dac_config`), and deterministic random weights in any
of a checkpoint's storage forms (`random_codec_state`; `tts.checkpoints.fish.writer` writes them as
`codec.pth`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from tts.codec.dac.net import CausalConv1d, CausalConvTranspose1d, DACConfig, ModdedDAC


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
    with torch.device("meta"):
        model = ModdedDAC(cfg)

    def init(key: str, leaf: str, shape: tuple[int, ...]) -> tuple[float, float] | None:
        if leaf == "alpha":
            return 0.25, 1.0
        if leaf == "gamma":
            return 0.02, 0.1
        if leaf != "bias" and key.endswith("norm.weight"):
            return 0.05, 1.0
        if key.endswith("codebook.weight"):
            return 1.0, 0.0
        return None

    wn = _weight_norm_modules(model)
    return random_weight_normed_state(model, seed, form, lambda base: wn[base][0], init)


def random_weight_normed_state(
    model: nn.Module,
    seed: int,
    form: str,
    fish_storage: Callable[[str], str],
    init: Callable[[str, str, tuple[int, ...]], tuple[float, float] | None],
) -> dict[str, Tensor]:
    """Random float32 weights for a codec `model` (built on the meta device), deterministic in `seed`, in
    a checkpoint's storage `form` ("fish", "old" or "fused"; raises ValueError otherwise).

    Weight-normalized convs (`_weight_norm_modules`) go through `random_weight_norm`, stored in form
    "fish" as `fish_storage(module path)` says ("parametrization" or "old"). Every other tensor is
    `random_like_init` with the `(std, mean)` that `init(key, leaf name, shape)` gives; where it gives
    None, a bias gets std 0.02 and a weight std 1 / sqrt(fan-in) (unit-variance outputs).
    """
    from tts.model.randinit import random_like_init, random_weight_norm

    if form not in ("fish", "old", "fused"):
        raise ValueError(f"unknown codec storage form {form!r}")
    wn = _weight_norm_modules(model)
    state: dict[str, Tensor] = {}
    for key, p in model.state_dict().items():
        base, _, leaf = key.rpartition(".")
        shape = tuple(p.shape)
        if base in wn and leaf == "weight":
            storage = fish_storage(base) if form == "fish" else form
            state.update(random_weight_norm(key, shape, seed, storage))
            continue
        std_mean = init(key, leaf, shape)
        if std_mean is None and leaf == "bias":
            std_mean = 0.02, 0.0
        elif std_mean is None:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            std_mean = 1.0 / math.sqrt(fan_in), 0.0
        state[key] = random_like_init(shape, seed, key, std=std_mean[0], mean=std_mean[1])
    return state
