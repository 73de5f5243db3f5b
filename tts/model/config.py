"""Model configuration for dual-AR TTS models.

`ModelArgs` uses the flat field names of fish-speech's `DualARModelArgs` (docs/fish_dual_ar.md §2.1) so a
`config.json` of `model_type: dual_ar` maps onto it field by field. The nested S2-Pro form
(`model_type: fish_qwen3_omni`, docs/fish_dual_ar.md §2.2) is flattened the way fish-speech's
`_from_fish_qwen3_omni` does it. Unknown keys are ignored, as fish-speech does.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _unset(size: int | None) -> bool:
    """A size `ModelArgs.__post_init__` derives: the -1 default, or None (a `null` in config.json)."""
    return size is None or size == -1


@dataclass
class ModelArgs:
    """Architecture of a dual-AR model (slow AR + fast AR), docs/fish_dual_ar.md §1 and §2.

    Defaults follow fish-speech's dataclass defaults where a key is absent: `n_local_heads = n_head`,
    `intermediate_size = round_up(int(8 * dim / 3), 256)`, `head_dim = 64`, and every `fast_*` field
    falls back to its slow counterpart.

    A derived size is -1 (or None, e.g. a `null` in config.json) until `__post_init__` resolves it, so
    after construction every size field is an int.
    """

    model_type: str = "dual_ar"
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = -1
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_word_embeddings: bool = True
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    attention_qk_norm: bool = False
    # Audio codes.
    codebook_size: int = 160
    num_codebooks: int = 4
    semantic_begin_id: int = 0
    semantic_end_id: int = 0
    scale_codebook_embeddings: bool = False
    # fish-speech 1.5: when false, every codebook indexes `codebook_embeddings` without an offset.
    share_codebook_embeddings: bool = True
    norm_fastlayer_input: bool = False
    # Fast AR ("audio decoder").
    n_fast_layer: int = 4
    fast_dim: int = -1
    fast_n_head: int = -1
    fast_n_local_heads: int = -1
    fast_head_dim: int = -1
    fast_intermediate_size: int = -1
    fast_attention_qkv_bias: bool | None = None
    fast_attention_qk_norm: bool | None = None
    fast_attention_o_bias: bool | None = None
    # Not a fish-speech field: the id of `<|im_end|>`, which ends a request. Fish checkpoints get it from
    # the tokenizer (S2's config.json has it as `eos_token_id`); our own checkpoints store it here.
    eos_token_id: int | None = None
    # Not a fish-speech field: sample residual codebooks c_1.. from the first `residual_codebook_size`
    # fast logits only (S1-era fish-speech slices them to the codec's 1024 residual codes; S2 code does
    # not, docs/fish_dual_ar.md §4.1). None = all `codebook_size` logits.
    residual_codebook_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.n_local_heads == -1 or self.n_local_heads is None:
            self.n_local_heads = self.n_head
        if _unset(self.intermediate_size):
            self.intermediate_size = _round_up(int(8 * self.dim / 3), 256)
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if _unset(self.fast_dim):
            self.fast_dim = self.dim
        if _unset(self.fast_n_head):
            self.fast_n_head = self.n_head
        if _unset(self.fast_n_local_heads):
            self.fast_n_local_heads = self.n_local_heads
        if _unset(self.fast_head_dim):
            self.fast_head_dim = self.head_dim
        if _unset(self.fast_intermediate_size):
            self.fast_intermediate_size = self.intermediate_size
        if self.fast_attention_qkv_bias is None:
            self.fast_attention_qkv_bias = self.attention_qkv_bias
        if self.fast_attention_qk_norm is None:
            self.fast_attention_qk_norm = self.attention_qk_norm
        if self.fast_attention_o_bias is None:
            self.fast_attention_o_bias = self.attention_o_bias
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError if the fields cannot form a model."""
        if self.n_head % self.n_local_heads:
            raise ConfigError(f"n_head={self.n_head} is not a multiple of n_local_heads={self.n_local_heads}")
        if self.fast_n_head % self.fast_n_local_heads:
            raise ConfigError(
                f"fast_n_head={self.fast_n_head} is not a multiple of "
                f"fast_n_local_heads={self.fast_n_local_heads}"
            )
        if self.head_dim % 2 or self.fast_head_dim % 2:
            raise ConfigError("head_dim and fast_head_dim must be even for RoPE")
        if self.num_codebooks < 1 or self.codebook_size < 2:
            raise ConfigError("num_codebooks must be >= 1 and codebook_size >= 2")
        if (
            self.residual_codebook_size is not None
            and not 1 <= self.residual_codebook_size <= self.codebook_size
        ):
            raise ConfigError(
                f"residual_codebook_size={self.residual_codebook_size} must be in [1, {self.codebook_size}]"
            )
        n_sem = self.semantic_end_id - self.semantic_begin_id + 1
        if n_sem < 1 or self.semantic_end_id >= self.vocab_size:
            raise ConfigError(
                f"semantic id range [{self.semantic_begin_id}, {self.semantic_end_id}] does not fit "
                f"vocab_size={self.vocab_size}"
            )

    @property
    def num_semantic_tokens(self) -> int:
        return self.semantic_end_id - self.semantic_begin_id + 1

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelArgs:
        """Build from a parsed config.json, flat (`dual_ar`) or nested (`fish_qwen3_omni`).

        Raises ConfigError for a missing or unknown `model_type`.
        """
        model_type = raw.get("model_type")
        if model_type == "fish_qwen3_omni":
            raw = _flatten_fish_qwen3_omni(raw)
        elif model_type != "dual_ar":
            raise ConfigError(
                f"unsupported model_type {model_type!r} (expected 'dual_ar' or 'fish_qwen3_omni')"
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        try:
            return cls(**known, extra=extra)
        except TypeError as exc:  # a field of the wrong type deep in __post_init__
            raise ConfigError(f"bad config: {exc}") from exc

    @classmethod
    def from_json(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)


def _flatten_fish_qwen3_omni(raw: dict[str, Any]) -> dict[str, Any]:
    """Flatten the nested S2-Pro config the way fish-speech's `_from_fish_qwen3_omni` does
    (docs/fish_dual_ar.md §2.2)."""
    text = raw.get("text_config")
    audio = raw.get("audio_decoder_config")
    if not isinstance(text, dict) or not isinstance(audio, dict):
        raise ConfigError("fish_qwen3_omni config needs 'text_config' and 'audio_decoder_config' objects")
    flat: dict[str, Any] = {"model_type": "fish_qwen3_omni"}
    for key in (
        "vocab_size",
        "n_layer",
        "n_head",
        "dim",
        "intermediate_size",
        "n_local_heads",
        "head_dim",
        "rope_base",
        "norm_eps",
        "max_seq_len",
        "tie_word_embeddings",
        "attention_qkv_bias",
        "attention_o_bias",
        "attention_qk_norm",
    ):
        if key in text:
            flat[key] = text[key]
    flat["codebook_size"] = audio["vocab_size"]
    flat["num_codebooks"] = audio["num_codebooks"]
    flat["n_fast_layer"] = audio["n_layer"]
    for key in (
        "dim",
        "n_head",
        "n_local_heads",
        "head_dim",
        "intermediate_size",
        "attention_qkv_bias",
        "attention_qk_norm",
        "attention_o_bias",
    ):
        if key in audio:
            flat[f"fast_{key}"] = audio[key]
    flat["semantic_begin_id"] = raw["semantic_start_token_id"]
    flat["semantic_end_id"] = raw["semantic_end_token_id"]
    if "eos_token_id" in raw:
        flat["eos_token_id"] = raw["eos_token_id"]
    flat["scale_codebook_embeddings"] = True
    flat["norm_fastlayer_input"] = True
    return flat


@dataclass(frozen=True)
class AlignerSpec:
    """A model's aligner heads: slow-AR `layer` and its query `heads` (indices into its n_head)."""

    layer: int
    heads: tuple[int, ...]

    @classmethod
    def from_config(cls, raw, n_layer: int, n_head: int) -> AlignerSpec | None:
        """`{"layer": L, "heads": [h, ...]}` from a model's config (None: no aligner). Raises ValueError
        for a layer or head the model does not have."""
        if raw is None:
            return None
        try:
            layer, heads = int(raw["layer"]), tuple(int(h) for h in raw["heads"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f'aligner must be {{"layer": int, "heads": [int, ...]}}, got {raw!r}') from exc
        if not 0 <= layer < n_layer or not heads or any(not 0 <= h < n_head for h in heads):
            raise ValueError(f"aligner {raw!r} names a layer or head the model lacks ({n_layer} x {n_head})")
        return cls(layer, heads)
