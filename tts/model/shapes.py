"""Model shapes of the Fish family with random weights: the benchmark models (no download).

`s2-pro-shape` is the S2-Pro architecture of docs/fish_dual_ar.md §2.2 (4.56 B parameters, the same kernels
and bytes moved as the real model). `fish-1.5-shape` follows docs/fish_dual_ar.md §2.3. Random weights are
drawn directly on the target device in the target dtype (normal, std 0.02; norms 1), so building the S2-Pro
shape on an H200 takes seconds and never holds a CPU copy.
"""

from __future__ import annotations

from typing import Any

import torch

from tts.model.config import ModelArgs
from tts.model.transformer import DualARTransformer

S2_PRO_CONFIG: dict[str, Any] = {
    "model_type": "fish_qwen3_omni",
    "eos_token_id": 151645,
    "pad_token_id": 151669,
    "audio_pad_token_id": 151677,
    "semantic_start_token_id": 151678,
    "semantic_end_token_id": 155773,
    "text_config": {
        "model_type": "fish_qwen3", "dim": 2560, "n_layer": 36, "n_head": 32, "n_local_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "max_seq_len": 32768, "rope_base": 1000000,
        "norm_eps": 1e-6, "attention_qk_norm": True, "attention_qkv_bias": False, "attention_o_bias": False,
        "tie_word_embeddings": True, "vocab_size": 155776,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder", "dim": 2560, "text_dim": 2560, "n_layer": 4, "n_head": 32,
        "n_local_heads": 8, "head_dim": 128, "intermediate_size": 9728, "num_codebooks": 10,
        "vocab_size": 4096, "max_seq_len": 11, "attention_qk_norm": False, "rope_base": 1000000,
        "norm_eps": 1e-6, "tie_word_embeddings": False,
    },
}  # fmt: skip

FISH_15_CONFIG: dict[str, Any] = {
    "model_type": "dual_ar", "dim": 1024, "n_layer": 24, "n_head": 16, "n_local_heads": 2, "head_dim": 64,
    "intermediate_size": 4096, "max_seq_len": 8192, "rope_base": 1e6, "norm_eps": 1e-6,
    "tie_word_embeddings": False, "vocab_size": 102048, "codebook_size": 1024, "num_codebooks": 8,
    "n_fast_layer": 4, "fast_dim": 1024, "fast_n_head": 16, "fast_n_local_heads": 2, "fast_head_dim": 64,
    "fast_intermediate_size": 4096, "semantic_begin_id": 101024, "semantic_end_id": 102047,
    "eos_token_id": 4,
}  # fmt: skip

# A small S2-like shape for GPU tests: every S2 feature, seconds to build and capture.
SMALL_S2_CONFIG: dict[str, Any] = {
    **S2_PRO_CONFIG,
    "text_config": {**S2_PRO_CONFIG["text_config"], "dim": 512, "n_layer": 4, "n_head": 8, "n_local_heads": 2,
                    "head_dim": 64, "intermediate_size": 1024, "max_seq_len": 4096},
    "audio_decoder_config": {**S2_PRO_CONFIG["audio_decoder_config"], "dim": 512, "text_dim": 512,
                             "n_layer": 2, "n_head": 8, "n_local_heads": 2, "head_dim": 64,
                             "intermediate_size": 1024},
}  # fmt: skip

SHAPES = {"s2-pro-shape": S2_PRO_CONFIG, "fish-1.5-shape": FISH_15_CONFIG, "small-s2-shape": SMALL_S2_CONFIG}


def shape_config(name: str) -> ModelArgs:
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    return ModelArgs.from_dict(SHAPES[name])


def shape_parameters(name: str) -> int:
    """The parameter count of shape `name`, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = DualARTransformer(shape_config(name))
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def build_random_model(
    config: ModelArgs, device: str | torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> DualARTransformer:
    """A model of `config` with random weights drawn on `device` in `dtype`."""
    with torch.device("meta"):
        model = DualARTransformer(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # norm weights (and biases, of which these shapes have none)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    model.init_buffers(device)
    return model.eval()


def weight_bytes_per_frame(model: DualARTransformer) -> int:
    """Bytes of weights one frame must read at least once per pass (the bandwidth floor at batch 1):
    every slow layer once, the semantic slice of the head once, every fast layer once per fast
    position (N positions) and the fast head once per sampled codebook (N - 1). Embedding lookups read
    a few rows only and are left out. Quantized layers (tts.model.quant) count their codes and scales."""
    c = model.config

    def nbytes(module):
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    per_elem = model.embeddings.weight.element_size()
    slow = sum(nbytes(layer) for layer in model.layers) + nbytes(model.norm)
    head = (c.num_semantic_tokens + 1) * c.dim * per_elem
    fast = sum(nbytes(layer) for layer in model.fast_layers) + nbytes(model.fast_norm)
    return slow + head + c.num_codebooks * fast + (c.num_codebooks - 1) * nbytes(model.fast_output)
