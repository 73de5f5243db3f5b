"""Checkpoint I/O of the modded DAC (tts/codec/dac_net.py): reading a fish-speech `codec.pth`, fusing
its weight norms, reading its sizes off the shapes, and loading it strictly into a `ModdedDAC`.

Module and parameter names follow fish-speech's `modded_dac.py` / `rvq.py` / descript-audio-codec
(`encoder.block.{i}...`, `quantizer.semantic_quantizer.quantizers.0.codebook.weight`,
`quantizer.post_module.layers.{i}.attention.wqkv.weight`, `decoder.model.{i}...`), so a `codec.pth`
loads by name. Weight-normalized convolutions are stored in a checkpoint as
`conv.parametrizations.weight.original0/1` (PyTorch parametrizations, encoder and decoder), as
`weight_g/weight_v` (old-style, the quantizer projections), or already fused as `weight`; all three load
(fused with `torch._weight_norm`, the function both weight-norm forms evaluate), and the network holds
plain fused weights. `read_codec_state`, `fuse_weight_norm` and `load_state_strict` serve the
Firefly-GAN codec (tts/codec/firefly.py) too. Problems raise `CodecCheckpointError` (tts/codec/base.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from tts.codec.base import CodecCheckpointError
from tts.codec.dac.net import DACConfig

# Stale buffers some fish-speech codec checkpoints carry; recomputed here, never loaded.
IGNORED_BUFFERS = ("freqs_cis", "causal_mask")


def _indices(keys, prefix: str) -> list[int]:
    found = {int(k[len(prefix) :].split(".", 1)[0]) for k in keys if k.startswith(prefix)}
    return sorted(found)


def infer_config(shapes: dict[str, tuple[int, ...]]) -> DACConfig:
    """Read a DACConfig off the (fused-weight) key names and shapes of a codec state dict.

    Strides come from kernel sizes (`2 * stride` in encoder and decoder blocks, `factor` in the
    quantizer's resampling convs), widths from weight shapes, layer counts from key indices. Raises
    CodecCheckpointError naming the first key it needs and cannot find.
    """

    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CodecCheckpointError(f"not a modded-DAC codec: missing key {key!r}")
        return shapes[key]

    enc_blocks = _indices(shapes, "encoder.block.")
    if len(enc_blocks) < 4:
        raise CodecCheckpointError("not a modded-DAC codec: no encoder.block.* keys")
    n_enc = len(enc_blocks) - 3  # first conv, the blocks, Snake, last conv
    encoder_dim = shape("encoder.block.0.conv.weight")[0]
    enc_rates, enc_layers = [], []
    for i in range(1, n_enc + 1):
        enc_rates.append(shape(f"encoder.block.{i}.block.4.conv.weight")[2] // 2)
        enc_layers.append(len(_indices(shapes, f"encoder.block.{i}.block.5.layers.")))
    latent_dim = shape(f"encoder.block.{n_enc + 2}.conv.weight")[0]
    dec = _indices(shapes, "decoder.model.")
    n_dec = len(dec) - 3  # first conv, the blocks, Snake, last conv (tanh has no weights)
    decoder_dim = shape("decoder.model.0.conv.weight")[0]
    dec_rates = [shape(f"decoder.model.{i}.block.1.conv.weight")[2] // 2 for i in range(1, n_dec + 1)]
    sem = shape("quantizer.semantic_quantizer.quantizers.0.codebook.weight")
    n_res = len(_indices(shapes, "quantizer.quantizer.quantizers."))
    res = shape("quantizer.quantizer.quantizers.0.codebook.weight")
    down = [
        shape(f"quantizer.downsample.{i}.0.conv.weight")[2] for i in _indices(shapes, "quantizer.downsample.")
    ]
    enc_window = DACConfig.encoder_window
    return DACConfig(
        encoder_dim=encoder_dim,
        encoder_rates=tuple(enc_rates),
        encoder_transformer_layers=tuple(enc_layers),
        encoder_window=enc_window,
        latent_dim=latent_dim,
        decoder_dim=decoder_dim,
        decoder_rates=tuple(dec_rates),
        semantic_codebook_size=sem[0],
        codebook_size=res[0],
        n_codebooks=n_res,
        codebook_dim=sem[1],
        downsample_factor=tuple(down),
        pre_transformer_layers=len(_indices(shapes, "quantizer.pre_module.layers.")),
        post_transformer_layers=len(_indices(shapes, "quantizer.post_module.layers.")),
    )


def _weight_norm_dim(g: Tensor) -> int:
    dims = [d for d, n in enumerate(g.shape) if n != 1]
    return dims[0] if len(dims) == 1 else 0


def fuse_weight_norm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Replace each weight-norm pair by the fused weight `g * v / ||v||` (torch._weight_norm, the function
    both of PyTorch's weight-norm forms evaluate): `X.parametrizations.weight.original0/1` and
    `X.weight_g/X.weight_v` become `X.weight`. Other keys pass through; stale buffers are dropped.
    Raises CodecCheckpointError for half a pair."""
    out: dict[str, Tensor] = {}
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in state.items():
        if key.rsplit(".", 1)[-1] in IGNORED_BUFFERS:
            continue
        for g_suffix, v_suffix in (
            (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
            (".weight_g", ".weight_v"),
        ):
            if key.endswith(g_suffix):
                pairs.setdefault(key[: -len(g_suffix)], {})["g"] = t
                break
            if key.endswith(v_suffix):
                pairs.setdefault(key[: -len(v_suffix)], {})["v"] = t
                break
        else:
            out[key] = t
    for base, pair in pairs.items():
        if set(pair) != {"g", "v"}:
            raise CodecCheckpointError(
                f"weight-norm pair of {base!r} is incomplete (has only {sorted(pair)})"
            )
        g, v = pair["g"].float(), pair["v"].float()
        out[f"{base}.weight"] = torch._weight_norm(v, g, _weight_norm_dim(g))
    return out


def read_codec_state(path: str | Path) -> dict[str, Tensor]:
    """Load a `codec.pth` (plain state dict, a `state_dict` wrapper, or `generator.`-prefixed keys as
    in training checkpoints) with `torch.load(weights_only=True)`, memory-mapped where the file allows.
    Raises CodecCheckpointError for a missing or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise CodecCheckpointError(f"no codec file at {path}")
    try:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CodecCheckpointError(f"cannot read {path}: {exc}") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CodecCheckpointError(f"{path} does not hold a state dict of tensors")
    if any(k.startswith("generator.") for k in state):
        state = {k[len("generator.") :]: v for k, v in state.items() if k.startswith("generator.")}
    return state


def load_state_strict(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Copy `state` into `model` (built on the meta device) as fp32 on the CPU, naming the first
    missing or unexpected key or shape mismatch in a CodecCheckpointError."""
    expected = model.state_dict()
    for key in sorted(state):
        if key not in expected:
            raise CodecCheckpointError(f"unexpected key {key!r} in {source}")
        if tuple(state[key].shape) != tuple(expected[key].shape):
            raise CodecCheckpointError(
                f"shape mismatch for {key!r} in {source}: file {tuple(state[key].shape)}, "
                f"codec {tuple(expected[key].shape)}"
            )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CodecCheckpointError(f"missing key {missing[0]!r} in {source} ({len(missing)} missing in all)")
    model.load_state_dict({k: v.float() for k, v in state.items()}, assign=True)
