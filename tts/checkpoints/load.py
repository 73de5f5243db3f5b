"""Load any model: a preset (`default`, `tiny`), a checkpoint of our own format, or a Fish checkpoint.

`load_bundle` gives the whole model (weights, codec, tokenizer, prompt format); `load_text_model` only its
text side, without weights or codec.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tts.checkpoints.bundle import (
    DEFAULT_MODEL_DIR,
    RUNTIME_KEY,
    ModelBundle,
    TextModel,
    _load_own_bundle,
    _own_text_side,
    build_tiny_bundle,
    log,
    read_config,
)
from tts.checkpoints.fish.loader import (
    FAMILIES,
    detect_family,
    fish_model_args,
    load_fish_bundle,
    load_fish_tokenizer,
)


def load_bundle(
    spec: str | Path = "default",
    device: str | torch.device = "cpu",
    dtype=None,
    codec_dtype=None,
    weights: str | None = None,
) -> ModelBundle:
    """Load a preset (`default`, `tiny`) or a checkpoint directory onto `device`.

    dtype defaults to float32 on CPU and bfloat16 on CUDA. The codec runs on `device` too (its decode
    path in `codec_dtype` where the codec supports another than float32: the modded DAC's bfloat16).
    `weights` ("fp8", "int8"; None: as loaded) quantizes the transformer's linear layers
    (`tts.model.quant`: fp8 becomes int8 on a GPU without FP8), each as its weight is read from a
    checkpoint, so the device's peak is the quantized model plus one layer, not the 16-bit model.
    Raises CheckpointError / ConfigError with a one-line reason for anything that cannot be loaded,
    ValueError for an unknown `weights`.
    """
    device = torch.device(device)
    if weights is not None:
        from tts.model.quant import quantize_model, resolve_weight_format

        weights = resolve_weight_format(weights, device)
    bundle = _load_bundle(spec, device, dtype, codec_dtype, weights)
    if weights is not None:
        quantize_model(bundle.model, weights)  # (what the load left: w1 and w3 fused; a preset whole)
    return bundle


def _load_bundle(
    spec: str | Path, device: torch.device, dtype, codec_dtype, weights: str | None
) -> ModelBundle:
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if str(spec) == "tiny":
        return build_tiny_bundle(device=device, dtype=dtype)
    if str(spec) == "default":
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            log.warning("the trained default model is not installed; using the random-weight tiny model")
            return build_tiny_bundle(device=device, dtype=dtype)
        spec = DEFAULT_MODEL_DIR
    directory, raw = read_config(spec)
    if RUNTIME_KEY not in raw:
        return load_fish_bundle(directory, raw, device, dtype, codec_dtype=codec_dtype, weights=weights)
    return _load_own_bundle(directory, raw, device, dtype, weights)


def load_text_model(spec: str | Path = "default") -> TextModel:
    """The tokenizer, prompt format and chunk length of a preset or checkpoint directory, read without
    loading weights or codec (a Fish checkpoint's tokenizer and config only). Raises CheckpointError /
    ConfigError / TokenizerError as `load_bundle` does."""
    if str(spec) == "tiny" or (str(spec) == "default" and not (DEFAULT_MODEL_DIR / "config.json").is_file()):
        b = build_tiny_bundle()
        return TextModel(b.name, b.family, b.tokenizer, b.prompt_format, b.chunk_length)
    directory, raw = read_config(DEFAULT_MODEL_DIR if str(spec) == "default" else spec)
    if RUNTIME_KEY in raw:
        runtime = raw[RUNTIME_KEY]
        _, tokenizer, prompt_format = _own_text_side(directory, raw)
        return TextModel(
            runtime.get("name", directory.name),
            runtime.get("family", "dual_ar"),
            tokenizer,
            prompt_format,
            runtime.get("chunk_length", 200),
        )
    family = detect_family(raw)
    spec_ = FAMILIES[family]
    fish_tokenizer = load_fish_tokenizer(directory, family)
    args = fish_model_args(raw, family, fish_tokenizer)
    return TextModel(
        directory.resolve().name,
        f"{spec_.display} ({raw['model_type']})",
        fish_tokenizer,
        spec_.prompt_format(fish_tokenizer, args.num_codebooks),
        spec_.chunk_length,
    )
