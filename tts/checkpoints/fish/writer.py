"""Random-weight Fish checkpoints in the real on-disk formats (`tts write-checkpoint`).

A written directory has the file names, key names, dtypes, config fields and tokenizer file formats of
the real release, with random weights and a small synthetic BPE vocabulary:

* `s2-pro` (docs/fish_dual_ar.md §2.2, §2.5): nested `fish_qwen3_omni` config.json with S2-Pro's sizes
  (4,561,852,416 parameters, bf16), `model-00001-of-00002.safetensors` + `model-00002-of-00002.safetensors` +
  index, `tokenizer.json` whose special tokens sit at S2's real ids (`<|im_end|>` 151645, `<|semantic:0|>`
  151678 ... 155773), `tokenizer_config.json`, and a full-size modded-DAC `codec.pth`.
* `s1-mini` (docs/fish_dual_ar.md §2.4, sizes approximate: a Qwen3-0.6B-like slow AR, 28 x 1024, 10 codebooks
  of 4096): flat `dual_ar` config.json, `model.pth`, `tokenizer.tiktoken`, `special_tokens.json`, `codec.pth`.
* `fish-1.5` (docs/fish_dual_ar.md §2.3): flat config.json, `model.pth` with an untied `output`,
  `tokenizer.tiktoken` (1.5's special-token list), and the Firefly-GAN generator
  `firefly-gan-vq-fsq-8x1024-21hz-generator.pth` (fish-speech's `firefly_gan_vq.yaml` sizes; `tiny-1.5`:
  `tts.codec.firefly.tiny_firefly_config`).
* `tiny-s2`, `tiny-s1`, `tiny-1.5`: the same formats with small widths (and a narrow codec), used by the
  tests and the parity goldens. Their weights are a pure function of the seed (`tts.model.randinit`), so a
  test regenerates exactly the checkpoint the goldens were computed from.

Large shapes are written shard by shard (S2) or tensor by tensor into one `model.pth`, never holding
more than one shard plus one tensor at a time, into a temporary directory that is renamed to `out` only
when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import regex
import torch
from safetensors.torch import save_file

from tts.checkpoints.fish.tokenizer import (
    FISH15_SPECIAL_TOKENS,
    FISH_TIKTOKEN_PATTERN,
    S1_SPECIAL_TOKENS,
    write_tiktoken_ranks,
)
from tts.codec.dac.net import DACConfig
from tts.codec.dac.random_init import random_codec_state, tiny_dac_config
from tts.codec.firefly import FIREFLY_FILE, FireflyConfig, random_firefly_state, tiny_firefly_config
from tts.model.config import ModelArgs
from tts.model.randinit import random_like_init
from tts.model.shapes import S2_PRO_CONFIG
from tts.model.transformer import DualARTransformer

# Qwen2/3's pre-tokenization pattern, used in S2's tokenizer.json.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)

# Added tokens of S2's tokenizer from <|endoftext|> (151643) on: Qwen3's specials, then Fish's
# (docs/fish_dual_ar.md §3.1; the names between <|im_end|> and <|pad|> are Qwen3's and only fill ids).
S2_ADDED_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>", "<|pad|>", "<|phoneme_start|>", "<|phoneme_end|>", "<|text|>",
    "<|voice|>", "<|interleave|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
]  # fmt: skip
S2_BASE_VOCAB = 151643  # Qwen3's BPE vocabulary size: the id of <|endoftext|>

# Text the synthetic BPE vocabularies are trained on: the prompt framing plus ordinary English.
CORPUS = (
    "convert the provided text to speech reference to the following:\n\nText:\n"
    "\n\nSpeech:\nSpeak out the provided text. Hello there, this is a test of the speech runtime. "
    "The quick brown fox jumps over the lazy dog. It's a sunny day; we'll read 12 numbers and 3 dates. "
    'She said: "I don\'t think so!" Then they went home, and the rain started again. '
    "Reference voices help the model speak in the same voice as the speaker. "
) * 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE (tokenizer.json)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def train_byte_bpe(corpus: str, pattern: str, num_merges: int) -> list[tuple[bytes, bytes]]:
    """A small, deterministic byte-level BPE: pre-tokenize with `pattern`, then repeatedly merge the most
    frequent adjacent pair (ties broken by the pair's bytes). Returns the merges in order."""
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(pattern, corpus))
    merges: list[tuple[bytes, bytes]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        if pairs[best] < 2:
            break
        merges.append(best)
        joined = best[0] + best[1]
        new_words: Counter = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    return merges


def tiktoken_ranks(num_merges: int = 200) -> dict[bytes, int]:
    """Mergeable ranks for a synthetic fish-speech tiktoken vocabulary: 256 bytes, then the merges."""
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in train_byte_bpe(CORPUS, FISH_TIKTOKEN_PATTERN, num_merges):
        ranks.setdefault(a + b, len(ranks))
    return ranks


def s2_tokenizer_json(num_semantic: int, base_vocab: int | None = None, num_merges: int = 200) -> dict:
    """A Qwen-style `tokenizer.json` (NFC, the Qwen split pattern, byte-level BPE) with S2's added tokens
    and `<|semantic:0..num_semantic-1|>`. With `base_vocab` the BPE vocabulary is padded with
    unreachable filler entries so the added tokens get S2's real ids (`<|endoftext|>` = base_vocab)."""
    table = bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {table[b]: b for b in range(256)}
    merges = []
    for a, b in train_byte_bpe(CORPUS, QWEN_PATTERN, num_merges):
        if enc(a + b) not in vocab:
            vocab[enc(a + b)] = len(vocab)
            merges.append(f"{enc(a)} {enc(b)}")
    if base_vocab is not None:
        for i in range(len(vocab), base_vocab):
            vocab[f"<|filler_{i}|>"] = i
    added = S2_ADDED_TOKENS + [f"<|semantic:{i}|>" for i in range(num_semantic)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(vocab) + i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in enumerate(added)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": QWEN_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


# ---- shapes ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One writable checkpoint shape. `config` holds the config.json body (nested for S2) without the
    vocabulary-dependent fields, which `write_checkpoint` fills in from the tokenizer."""

    name: str
    family: str  # "s2-pro" | "s1" | "fish-1.5"
    config: dict
    dtype: torch.dtype
    codec: str  # default codec: "full" | "tiny" | "none"
    init_std: float = 0.02
    num_semantic: int = 4096
    vocab_size: int | None = None  # fixed vocab (real shapes); None = tokenizer size rounded up to 64
    real_token_ids: bool = False  # S2 only: pad the BPE vocabulary so special tokens get S2's real ids
    notes: str = ""
    extra: dict = field(default_factory=dict)


def _s2_config(text: dict, audio: dict) -> dict:
    return {
        "model_type": "fish_qwen3_omni",
        "architectures": ["FishQwen3OmniForCausalLM"],
        "dtype": "bfloat16",
        "text_config": {"model_type": "fish_qwen3", **text},
        "audio_decoder_config": {"model_type": "fish_qwen3_audio_decoder", **audio},
    }


# S2-Pro's sizes come from tts/shapes.py (one copy); the released config.json also carries training
# leftovers, written here for fidelity.
S2_TEXT = {
    **{k: v for k, v in S2_PRO_CONFIG["text_config"].items() if k not in ("model_type", "vocab_size")},
    "use_moe": False, "num_experts": 1, "audio_hidden_dim": 5120, "initializer_range": 0.02,
}  # fmt: skip
S2_AUDIO = {
    **{k: v for k, v in S2_PRO_CONFIG["audio_decoder_config"].items() if k != "model_type"},
    "attention_qkv_bias": False, "attention_o_bias": False,
}  # fmt: skip
TINY_TEXT = dict(
    dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128, max_seq_len=1024,
    rope_base=1000000, norm_eps=1e-6, attention_qk_norm=True, attention_qkv_bias=False,
    attention_o_bias=False,
    tie_word_embeddings=True,
)  # fmt: skip
TINY_AUDIO = dict(
    dim=64, text_dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128,
    num_codebooks=10, vocab_size=4096, max_seq_len=11, attention_qk_norm=False, rope_base=1000000,
    norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip

SHAPES: dict[str, Shape] = {
    "s2-pro": Shape(
        "s2-pro", "s2-pro", _s2_config(S2_TEXT, S2_AUDIO), torch.bfloat16, "full", vocab_size=155776,
        real_token_ids=True, notes="Fish Audio S2-Pro's exact sizes (4,561,852,416 parameters)",
    ),
    "tiny-s2": Shape("tiny-s2", "s2-pro", _s2_config(TINY_TEXT, TINY_AUDIO), torch.bfloat16, "tiny", 0.1),
    "s1-mini": Shape(
        "s1-mini", "s1",
        dict(
            model_type="dual_ar", dim=1024, n_layer=28, n_head=16, n_local_heads=8, head_dim=128,
            intermediate_size=3072, max_seq_len=8192, rope_base=1000000, norm_eps=1e-6,
            attention_qk_norm=True,
            tie_word_embeddings=True, codebook_size=4096, num_codebooks=10, n_fast_layer=4, fast_dim=1024,
            fast_n_head=16, fast_n_local_heads=8, fast_head_dim=64, fast_intermediate_size=3072,
            fast_attention_qk_norm=False, scale_codebook_embeddings=False,
        ),
        torch.bfloat16, "full", vocab_size=155776,
        notes="approximate OpenAudio S1-mini sizes (its config.json is not public here): a Qwen3-0.6B-like "
        "slow AR, 700,654,592 parameters with the Qwen-sized vocabulary",
    ),
    "tiny-s1": Shape(
        "tiny-s1", "s1",
        dict(
            model_type="dual_ar", dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=16,
            intermediate_size=128, max_seq_len=1024, rope_base=1000000, norm_eps=1e-6, attention_qk_norm=True,
            tie_word_embeddings=True, codebook_size=4096, num_codebooks=10, n_fast_layer=2, fast_dim=64,
            fast_n_head=4, fast_n_local_heads=2, fast_head_dim=16, fast_intermediate_size=128,
            fast_attention_qk_norm=False,
        ),
        torch.bfloat16, "tiny", 0.1,
    ),
    "fish-1.5": Shape(
        "fish-1.5", "fish-1.5",
        dict(
            model_type="dual_ar", dim=1024, n_layer=24, n_head=16, n_local_heads=2, head_dim=64,
            intermediate_size=4096, max_seq_len=8192, rope_base=1000000.0, norm_eps=1e-6,
            tie_word_embeddings=False, codebook_size=1024, num_codebooks=8, n_fast_layer=4, fast_dim=1024,
            fast_n_head=16, fast_n_local_heads=2, fast_head_dim=64, fast_intermediate_size=4096,
            attention_qkv_bias=False, dropout=0.1, use_gradient_checkpointing=True, initializer_range=0.02,
        ),
        torch.bfloat16, "full", vocab_size=102048, num_semantic=1024,
        notes="fish-speech 1.5's sizes (from a mirror of its config.json), 637,921,280 parameters",
    ),
    "tiny-1.5": Shape(
        "tiny-1.5", "fish-1.5",
        dict(
            model_type="dual_ar", dim=64, n_layer=2, n_head=4, n_local_heads=2, head_dim=16,
            intermediate_size=128, max_seq_len=1024, rope_base=1000000.0, norm_eps=1e-6,
            tie_word_embeddings=False, codebook_size=1024, num_codebooks=8, n_fast_layer=2, fast_dim=64,
            fast_n_head=4, fast_n_local_heads=2, fast_head_dim=16, fast_intermediate_size=128,
        ),
        torch.bfloat16, "tiny", 0.1, num_semantic=1024,
    ),
}  # fmt: skip


# ---- writing -----------------------------------------------------------------------------------------


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _tokenizer_files(shape: Shape, out: Path) -> tuple[int, int, int, int]:
    """Write the tokenizer files; returns (token count, semantic begin id, semantic end id, im_end id)."""
    if shape.family == "s2-pro":
        body = s2_tokenizer_json(shape.num_semantic, S2_BASE_VOCAB if shape.real_token_ids else None)
        (out / "tokenizer.json").write_text(json.dumps(body, ensure_ascii=False), encoding="utf-8")
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": "<|im_end|>",
                    "pad_token": "<|pad|>",
                    "clean_up_tokenization_spaces": False,
                    "model_max_length": 32768,
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        ids = {t["content"]: t["id"] for t in body["added_tokens"]}
        n = len(body["model"]["vocab"]) + len(ids)
    else:
        ranks = tiktoken_ranks()
        write_tiktoken_ranks(out / "tokenizer.tiktoken", ranks)
        specials = S1_SPECIAL_TOKENS if shape.family == "s1" else FISH15_SPECIAL_TOKENS
        ids = {t: len(ranks) + i for i, t in enumerate(specials)}
        if shape.family == "s1":
            (out / "special_tokens.json").write_text(json.dumps(ids, indent=2), encoding="utf-8")
        n = len(ranks) + len(specials)
    return n, ids["<|semantic:0|>"], ids[f"<|semantic:{shape.num_semantic - 1}|>"], ids["<|im_end|>"]


def _model_args(shape: Shape, cfg: dict) -> ModelArgs:
    args = ModelArgs.from_dict(cfg)
    if shape.family == "fish-1.5":  # fish-speech 1.5 derives head_dim from dim / n_head
        args.head_dim = args.dim // args.n_head
        args.fast_head_dim = args.fast_dim // args.fast_n_head
    return args


def _init_tensor(key: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    if key.endswith("norm.weight"):  # RMSNorm gains near 1, perturbed so a wrong key mapping shows
        return random_like_init(shape, seed, key, std=0.05, mean=1.0)
    if key.endswith(".bias"):
        return random_like_init(shape, seed, key, std=std * 0.1)
    return random_like_init(shape, seed, key, std=std)


def _s2_disk_key(key: str) -> str:
    """Inverse of fish-speech's S2 key remapping (docs/fish_dual_ar.md §2.5)."""
    if key.startswith("codebook_embeddings."):
        return "audio_decoder." + key
    if key.startswith("fast_"):
        return "audio_decoder." + key[len("fast_") :]
    return "text_model.model." + key


@dataclass
class WriteResult:
    path: Path
    num_parameters: int
    weight_bytes: int
    files: list[str]


def write_checkpoint(
    shape: str | Shape,
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    codec: str | None = None,
    codec_config: DACConfig | None = None,
    num_shards: int = 2,
    overwrite: bool = False,
) -> WriteResult:
    """Write a random-weight checkpoint of `shape` (a key of SHAPES) into the new directory `out`.

    dtype: weight dtype (default: the shape's, bf16); codec: "full" (fish-speech's sizes: the modded DAC,
    or Firefly-GAN for 1.5), "tiny" (tiny_dac_config / tiny_firefly_config) or "none" (default: the
    shape's); codec_config: a DACConfig or FireflyConfig overriding those sizes; num_shards: safetensors
    shards for S2 shapes. Raises FileExistsError if `out` exists and is not empty (unless overwrite),
    ValueError for an unknown shape or codec. Writes into a sibling temporary directory first, so `out` holds
    either nothing new or a complete checkpoint.
    """
    spec = SHAPES[shape] if isinstance(shape, str) and shape in SHAPES else shape
    if not isinstance(spec, Shape):
        raise ValueError(f"unknown checkpoint shape {shape!r} (known: {', '.join(SHAPES)})")
    codec = codec or spec.codec
    if codec not in ("full", "tiny", "none"):
        raise ValueError(f"codec must be 'full', 'tiny' or 'none', got {codec!r}")
    dtype = dtype or spec.dtype
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"directory {out.parent} does not exist")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        result = _write(spec, tmp, dtype, seed, codec, codec_config, num_shards)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.path = out
    return result


def _write(
    spec: Shape, out: Path, dtype, seed: int, codec: str, codec_config, num_shards: int
) -> WriteResult:
    n_tokens, sem_begin, sem_end, im_end = _tokenizer_files(spec, out)
    vocab = spec.vocab_size or _round_up(n_tokens, 64)
    cfg = json.loads(json.dumps(spec.config))
    if spec.family == "s2-pro":
        cfg["text_config"]["vocab_size"] = vocab
        cfg.update(eos_token_id=im_end, semantic_start_token_id=sem_begin, semantic_end_token_id=sem_end)
        cfg.update(pad_token_id=im_end + 24, audio_pad_token_id=sem_begin - 1)
    else:
        cfg["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    args = _model_args(spec, cfg)
    args.semantic_begin_id, args.semantic_end_id = sem_begin, sem_end
    with torch.device("meta"):
        model = DualARTransformer(args)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    files: list[str] = ["config.json"]
    total = 0

    def tensor(key: str) -> torch.Tensor:
        return _init_tensor(key, shapes[key], seed, spec.init_std).to(dtype)

    if spec.family == "s2-pro":
        keys = sorted(shapes, key=_s2_disk_key)
        sizes = [math.prod(shapes[k]) * torch.finfo(dtype).bits // 8 for k in keys]
        per_shard = sum(sizes) / num_shards
        groups: list[list[str]] = [[]]
        acc = 0.0
        for k, s in zip(keys, sizes, strict=True):
            if groups[-1] and acc + s > per_shard * len(groups) and len(groups) < num_shards:
                groups.append([])
            groups[-1].append(k)
            acc += s
        weight_map = {}
        for i, group in enumerate(groups, 1):
            name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            shard = {_s2_disk_key(k): tensor(k) for k in group}
            total += sum(t.numel() * t.element_size() for t in shard.values())
            save_file(shard, str(out / name), metadata={"format": "pt"})
            del shard
            weight_map.update({_s2_disk_key(k): name for k in group})
            files.append(name)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
        files.append("model.safetensors.index.json")
    else:
        state = {k: tensor(k) for k in shapes}
        total = sum(t.numel() * t.element_size() for t in state.values())
        torch.save(state, out / "model.pth")
        del state
        files.append("model.pth")
    files += (
        ["tokenizer.json", "tokenizer_config.json"] if spec.family == "s2-pro" else ["tokenizer.tiktoken"]
    )
    if spec.family == "s1":
        files.append("special_tokens.json")
    if codec != "none" and spec.family == "fish-1.5":
        ff = codec_config or (FireflyConfig() if codec == "full" else tiny_firefly_config())
        if ff.n_groups != args.num_codebooks:
            raise ValueError("the codec's codebooks do not match the model's")
        torch.save(random_firefly_state(ff, seed), out / FIREFLY_FILE)
        files.append(FIREFLY_FILE)
    elif codec != "none":
        dac = codec_config or (DACConfig() if codec == "full" else tiny_dac_config())
        if dac.num_codebooks != args.num_codebooks or dac.semantic_codebook_size != args.num_semantic_tokens:
            raise ValueError("the codec's codebooks do not match the model's")
        torch.save(random_codec_state(dac, seed), out / "codec.pth")
        files.append("codec.pth")
    (out / "random_weights.json").write_text(
        json.dumps(
            {
                "shape": spec.name,
                "seed": seed,
                "dtype": str(dtype).removeprefix("torch."),
                "codec": codec,
                "note": "random weights, not a trained model; written by `tts write-checkpoint`. "
                + spec.notes,
            },
            indent=2,
        ),
        encoding="utf-8",
    )
    files.append("random_weights.json")
    return WriteResult(out, sum(math.prod(s) for s in shapes.values()), total, files)
