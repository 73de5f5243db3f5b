"""Loading Fish Audio checkpoint directories (docs/fish_dual_ar.md §2, §3 and §5).

Three families, told apart by `config.json`:

| family | `model_type` | weights | tokenizer | codec |
|---|---|---|---|---|
| S2-Pro | `fish_qwen3_omni` (nested) | `model-0000k-of-0000n.safetensors` + index (or `model.safetensors`) | `tokenizer.json` | `codec.pth` (modded DAC) |
| OpenAudio S1 | `dual_ar`, 10 codebooks | `model.pth` | `tokenizer.tiktoken` + `special_tokens.json` | `codec.pth` (modded DAC) |
| fish-speech 1.5 | `dual_ar`, 8 codebooks | `model.pth` | `tokenizer.tiktoken` | Firefly-GAN (`firefly-gan-vq-fsq-8x1024-21hz-generator.pth`) |

Weights load one tensor at a time straight to the target device and dtype into a model built on the meta
device, so no second copy is ever held: safetensors shard by shard
(`tts.checkpoints.bundle.load_weights_into`), `model.pth` memory-mapped
(`torch.load(mmap=True, weights_only=True)`). Key mapping follows fish-speech:
S2's `text_model.model.X -> X`, `audio_decoder.codebook_embeddings.* -> codebook_embeddings.*`, other
`audio_decoder.Y -> fast_Y`; `model.pth` may be wrapped in a Lightning `state_dict` and prefixed with
`model.`, keys containing `audio_` are dropped, and separate `wq/wk/wv` are concatenated into `wqkv`.
Every missing or unexpected key and every shape mismatch is an error that names the key.
"""  # noqa: E501 (a Markdown table; its rows cannot wrap)

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tts.checkpoints.bundle import (
    CheckpointError,
    ModelBundle,
    load_voices,
    load_weights_into,
    weight_assigner,
    weight_files,
)
from tts.checkpoints.fish.prompts import Fish15PromptFormat, S1PromptFormat, S2PromptFormat
from tts.checkpoints.fish.tokenizer import FISH15_SPECIAL_TOKENS, S1_SPECIAL_TOKENS, TiktokenTokenizer
from tts.codec.base import Codec, CodecCheckpointError
from tts.codec.dac.codec import DACCodec
from tts.codec.firefly import FIREFLY_FILE, FireflyCodec
from tts.model.config import AlignerSpec, ConfigError, ModelArgs
from tts.model.transformer import DualARTransformer
from tts.params import FrameConvention, SamplingParams
from tts.text.tokenizer import TextTokenizer, TokenizerError, TokenizerLike

log = logging.getLogger(__name__)

S2 = "s2-pro"
S1 = "s1"
FISH15 = "fish-1.5"

# S1-era fish-speech samples residual codebooks from the first 1024 fast logits (the codec's residual
# codebook size); S2 code samples all of them (docs/fish_dual_ar.md §4.1, §4.3).
S1_RESIDUAL_CODEBOOK_SIZE = 1024


@dataclass(frozen=True)
class FamilySpec:
    """What differs between Fish families at serving time (docs/fish_dual_ar.md §3 and §4)."""

    key: str
    display: str
    prompt_format: type
    sampling: SamplingParams
    chunk_length: int  # UTF-8 bytes per generation chunk; 0 = the whole text at once
    frames: FrameConvention = FrameConvention()  # which generated frames are audio
    repetition: str | None = None  # how the repetition penalty reads recent frames; None: no penalty


FAMILIES = {
    # fish-speech main's HTTP API defaults: temperature 0.8, top_p 0.8, top_k 30, RAS window 10,
    # max_new_tokens (frames) 1024, chunk_length 200 (its repetition_penalty is accepted and ignored).
    S2: FamilySpec(
        S2, "Fish Audio S2-Pro", S2PromptFormat,
        SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_new_frames=1024, ras_window=10), 200,
    ),
    # S1-era defaults: temperature 0.8, top_p 0.8, repetition penalty 1.1 over 16 frames (read as
    # fish-speech d3df505 reads it, see tts.engine.model_runner), no top-k, no RAS; the whole text in one
    # piece.
    S1: FamilySpec(
        S1, "OpenAudio S1", S1PromptFormat,
        SamplingParams(temperature=0.8, top_p=0.8, top_k=0, max_new_frames=1024, ras_window=0,
                       repetition_penalty=1.1), 0, repetition="s1",
    ),
    # fish-speech 1.5 CLI defaults: temperature 0.7, top_p 0.7, repetition penalty 1.2 over 16 frames,
    # chunk_length 100, no top-k, no RAS; its output drops the first frame and keeps the end frame.
    FISH15: FamilySpec(
        FISH15, "fish-speech 1.5", Fish15PromptFormat,
        SamplingParams(temperature=0.7, top_p=0.7, top_k=0, max_new_frames=1024, ras_window=0,
                       repetition_penalty=1.2), 100,
        frames=FrameConvention(drop_first=True, keep_end=True), repetition="fish-1.5",
    ),
}  # fmt: skip


def detect_family(raw: Mapping) -> str:
    """The family of a parsed config.json; raises ConfigError for an unsupported `model_type`."""
    model_type = raw.get("model_type")
    if model_type == "fish_qwen3_omni":
        return S2
    if model_type == "dual_ar":
        return FISH15 if raw.get("num_codebooks", 4) == 8 else S1
    raise ConfigError(f"unsupported model_type {model_type!r} (expected 'dual_ar' or 'fish_qwen3_omni')")


def load_fish_tokenizer(directory: Path, family: str) -> TokenizerLike:
    """`tokenizer.json` for S2 (and for any directory that has one), else fish-speech's tiktoken files.
    Raises TokenizerError naming the missing or bad file."""
    if family == S2 or (directory / "tokenizer.json").is_file():
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{directory} has no tokenizer.json")
        return TextTokenizer.from_file(path)
    return TiktokenTokenizer.from_dir(
        directory, FISH15_SPECIAL_TOKENS if family == FISH15 else S1_SPECIAL_TOKENS
    )


def fish_model_args(raw: Mapping, family: str, tokenizer: TokenizerLike) -> ModelArgs:
    """ModelArgs for a Fish config.json, completed the way fish-speech completes it.

    The semantic id range comes from the tokenizer (fish-speech overrides the config's with it), the end
    token is `<|im_end|>`; fish-speech 1.5 always derives head_dim as dim // n_head (and the fast AR's
    as fast_dim // fast_n_head); S1 samples residual codebooks from the first 1024 fast logits.
    """
    args = ModelArgs.from_dict(dict(raw))
    if (args.semantic_begin_id, args.semantic_end_id) not in (
        (0, 0),
        (tokenizer.semantic_begin_id, tokenizer.semantic_end_id),
    ):
        log.warning(
            "config.json semantic ids %d..%d differ from the tokenizer's %d..%d; using the tokenizer's",
            args.semantic_begin_id,
            args.semantic_end_id,
            tokenizer.semantic_begin_id,
            tokenizer.semantic_end_id,
        )
    if args.eos_token_id is not None and args.eos_token_id != tokenizer.eos_id:
        log.warning(
            "config.json eos_token_id %d is not <|im_end|> (%d); using <|im_end|>",
            args.eos_token_id,
            tokenizer.eos_id,
        )
    changes: dict = dict(
        semantic_begin_id=tokenizer.semantic_begin_id,
        semantic_end_id=tokenizer.semantic_end_id,
        eos_token_id=tokenizer.eos_id,
    )
    if family == FISH15:
        changes.update(head_dim=args.dim // args.n_head, fast_head_dim=args.fast_dim // args.fast_n_head)
    if family == S1 and args.codebook_size > S1_RESIDUAL_CODEBOOK_SIZE:
        changes["residual_codebook_size"] = S1_RESIDUAL_CODEBOOK_SIZE
    try:
        args = dataclasses.replace(args, **changes)
    except ConfigError as exc:
        raise ConfigError(f"config.json does not fit the tokenizer: {exc}") from exc
    if tokenizer.eos_id >= args.vocab_size:
        raise ConfigError(f"<|im_end|> id {tokenizer.eos_id} is outside vocab_size {args.vocab_size}")
    return args


# ---- weights -----------------------------------------------------------------------------------------


def s2_key_map(key: str) -> str:
    """fish-speech's `_remap_fish_qwen3_omni_keys` for one key (docs/fish_dual_ar.md §2.5)."""
    if key.startswith("text_model.model."):
        return key[len("text_model.model.") :]
    if key.startswith("audio_decoder."):
        suffix = key[len("audio_decoder.") :]
        return suffix if suffix.startswith("codebook_embeddings.") else "fast_" + suffix
    return key


def normalize_pth_state(state: Mapping[str, Any]) -> dict[str, Tensor]:
    """Apply fish-speech's `model.pth` conventions: unwrap a Lightning `state_dict`, strip the `model.`
    prefix, drop keys containing `audio_`, and concatenate separate `wq`/`wk`/`wv` into `wqkv`
    (`Attention.load_hook`; biases likewise). Tensors are not copied except for the concatenations."""
    if isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    keys = list(state)
    strip = bool(keys) and keys[0].startswith("model.")
    out: dict[str, Tensor] = {}
    for key in keys:
        name = key[len("model.") :] if strip and key.startswith("model.") else key
        if "audio_" in name:
            continue
        out[name] = state[key]
    for key in [k for k in out if k.endswith((".wq.weight", ".wq.bias"))]:
        prefix, leaf = key.rsplit(".wq.", 1)
        parts = [f"{prefix}.{w}.{leaf}" for w in ("wq", "wk", "wv")]
        missing = [p for p in parts if p not in out]
        if missing:
            raise CheckpointError(f"{key!r} has no matching {missing[0]!r}")
        out[f"{prefix}.wqkv.{leaf}"] = torch.cat([out.pop(p) for p in parts])
    return out


def load_state_into(
    model: DualARTransformer,
    state: Mapping[str, Tensor],
    device,
    dtype,
    source: str,
    weights: str | None = None,
) -> None:
    """Move each tensor of `state` to `device`/`dtype` into `model` (built on the meta device), one at a
    time (`weights`: quantized as they arrive, as in `load_weights_into`). Raises CheckpointError naming
    the first unexpected key, shape mismatch or missing key."""
    assign = weight_assigner(model, weights)
    expected = dict(model.state_dict())
    for key, t in state.items():
        if key not in expected:
            raise CheckpointError(f"unexpected key {key!r} in {source}")
        if not isinstance(t, Tensor):
            raise CheckpointError(f"{key!r} in {source} is not a tensor")
        if tuple(t.shape) != tuple(expected[key].shape):
            raise CheckpointError(
                f"shape mismatch for {key!r}: checkpoint {tuple(t.shape)}, model {tuple(expected[key].shape)}"
            )
        assign(key, t.to(device=device, dtype=dtype))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"missing key {missing[0]!r} in {source} ({len(missing)} missing in all)")


def read_model_pth(path: Path) -> dict[str, Tensor]:
    """Memory-map a `model.pth` and normalize its keys; CheckpointError if it cannot be read."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # truncated zip, pickle errors, non-tensor payloads
        raise CheckpointError(f"cannot read {path.name}: {exc}") from exc
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path.name} does not hold a state dict")
    return normalize_pth_state(state)


def load_fish_weights(
    model: DualARTransformer, directory: Path, device, dtype, weights: str | None = None
) -> None:
    """Load weights in fish-speech's order of preference: sharded safetensors (index), a single
    `model.safetensors`, then `model.pth` (`weights`: quantized as they arrive, see `load_weights_into`)."""
    if (directory / "model.safetensors.index.json").is_file() or (directory / "model.safetensors").is_file():
        load_weights_into(model, weight_files(directory), device, dtype, key_map=s2_key_map, weights=weights)
    elif (directory / "model.pth").is_file():
        state = read_model_pth(directory / "model.pth")
        load_state_into(model, state, device, dtype, "model.pth", weights=weights)
    else:
        raise CheckpointError(f"{directory} has no model.safetensors(.index.json) or model.pth")


def read_config(directory: Path) -> dict:
    """Parsed config.json of a checkpoint directory; CheckpointError if missing or not JSON."""
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def _build_model(
    directory: Path, args: ModelArgs, device, dtype, weights: str | None = None
) -> DualARTransformer:
    with torch.device("meta"):
        model = DualARTransformer(args)
    load_fish_weights(model, directory, torch.device(device), dtype, weights)
    model.init_buffers(device)
    return model.eval()


def load_fish_model(
    directory: str | Path, device="cpu", dtype=torch.float32
) -> tuple[DualARTransformer, TokenizerLike, str]:
    """Load the language model of a Fish checkpoint directory (any family, 1.5 included).

    Returns `(model in eval mode on device/dtype, tokenizer, family)`. Raises CheckpointError,
    ConfigError or TokenizerError with a one-line reason.
    """
    directory = Path(directory)
    raw = read_config(directory)
    family = detect_family(raw)
    tokenizer = load_fish_tokenizer(directory, family)
    args = fish_model_args(raw, family, tokenizer)
    return _build_model(directory, args, device, dtype), tokenizer, family


def default_dac_dtype(device: str | torch.device) -> torch.dtype:
    """The modded DAC's decode dtype when none is asked for: bfloat16 on CUDA (what fish-speech's own
    server decodes in, under autocast; 1.3-1.6x the float32 decode's speed on a GPU, docs/benchmarks.md,
    at 31.7 dB SNR against it), float32 elsewhere (a CPU has no fast bfloat16 convs)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_fish_codec(directory: Path, args: ModelArgs, family: str, device, dtype=None) -> Codec:
    """The family's codec, checked against the model's codebooks: the modded DAC from `codec.pth` (its
    decode path in `dtype`, default `default_dac_dtype(device)`) or, for 1.5, Firefly-GAN from its
    generator file (float32 always: `dtype` other than float32 is ignored with a warning). Raises
    CheckpointError."""
    if family == FISH15:
        return _load_firefly(directory, args, device, dtype)
    path = directory / "codec.pth"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no codec.pth")
    try:
        codec = DACCodec.from_file(path, device=device, dtype=dtype or default_dac_dtype(device))
    except CodecCheckpointError as exc:
        raise CheckpointError(f"codec.pth: {exc}") from exc
    if codec.num_codebooks != args.num_codebooks or codec.codebook_size != args.num_semantic_tokens:
        raise CheckpointError(
            f"codec.pth does not match the model: it has {codec.num_codebooks} codebooks with "
            f"{codec.codebook_size} semantic codes, the model {args.num_codebooks} with "
            f"{args.num_semantic_tokens} semantic tokens"
        )
    return codec


def _load_firefly(directory: Path, args: ModelArgs, device, dtype) -> FireflyCodec:
    path = directory / FIREFLY_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {FIREFLY_FILE} (fish-speech 1.5's codec)")
    if dtype not in (None, torch.float32):
        log.warning("the Firefly-GAN codec runs in float32; ignoring codec dtype %s", dtype)
    try:
        codec = FireflyCodec.from_file(path, device=device)
    except CodecCheckpointError as exc:
        raise CheckpointError(f"{FIREFLY_FILE}: {exc}") from exc
    if codec.num_codebooks != args.num_codebooks:
        raise CheckpointError(
            f"{FIREFLY_FILE} does not match the model: it has {codec.num_codebooks} codebooks, the model "
            f"{args.num_codebooks}"
        )
    return codec


def load_fish_bundle(
    directory: str | Path, raw: Mapping, device, dtype, codec_dtype=None, weights: str | None = None
) -> ModelBundle:
    """A servable bundle for a Fish checkpoint directory (called by `tts.checkpoints.load.load_bundle`
    for any directory whose config.json has no "tts_runtime" key; `weights`: the linear layers quantized
    as they load, see `load_weights_into`). Raises CheckpointError / ConfigError / TokenizerError with a
    one-line reason."""
    directory = Path(directory)
    family = detect_family(raw)
    spec = FAMILIES[family]
    tokenizer = load_fish_tokenizer(directory, family)
    args = fish_model_args(raw, family, tokenizer)
    # Check the codec first: it is cheaper than the weights and a mismatch makes the model useless.
    codec = load_fish_codec(directory, args, family, device, codec_dtype)
    model = _build_model(directory, args, device, dtype, weights)
    # The family's frame budget, at most a quarter of the context: a small checkpoint (the tiny shapes'
    # 1024 tokens) keeps room for its prompt (S1 puts the whole text into one); the released models'
    # contexts (8192, 32768) are far larger than 4x their budget of 1024.
    sampling = dataclasses.replace(
        spec.sampling, max_new_frames=min(spec.sampling.max_new_frames, args.max_seq_len // 4)
    )
    return ModelBundle(
        name=directory.resolve().name,
        family=f"{spec.display} ({raw['model_type']})",
        model=model,
        codec=codec,
        tokenizer=tokenizer,
        prompt_format=spec.prompt_format(tokenizer, args.num_codebooks),
        voices=load_voices(directory / "voices"),
        sampling=sampling,
        chunk_length=spec.chunk_length,
        path=directory,
        frames=spec.frames,
        repetition=spec.repetition,
        aligner=_fish_aligner(directory, raw, args),
    )


# Where `tts probe-aligner` records a Fish checkpoint's aligner heads in its config.json (a key of its
# own: the rest of the file keeps fish-speech's shape).
FISH_ALIGNER_KEY = "tts_aligner"


def _fish_aligner(directory: Path, raw: Mapping, args: ModelArgs) -> AlignerSpec | None:
    try:
        return AlignerSpec.from_config(raw.get(FISH_ALIGNER_KEY), args.n_layer, args.n_head)
    except ValueError as exc:
        raise ConfigError(f"{directory / 'config.json'}: {exc}") from exc
