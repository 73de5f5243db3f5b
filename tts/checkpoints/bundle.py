"""A servable model: the dual-AR weights plus codec, tokenizer, prompt format, voices and defaults.

`load_bundle(spec)` accepts a preset name (`tiny`, `default`) or a checkpoint directory. Our own
directory format is a Fish-style directory with one extra config key:

    config.json                    `model_type: dual_ar` fields + "tts_runtime": {codec, prompt_format,
                                   sampling, chunk_length, name}
    model.safetensors              or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json                 Hugging Face tokenizers file with <|semantic:i|> tokens
    codec.json (+ codec.safetensors)
    voices/NAME.safetensors        reference codes [N, T] with the transcript in the metadata

"tts_runtime" may also name a text `frontend` (tts/frontend.py; absent = the normalized text itself):
the default model reads espeak-ng IPA phonemes ("espeak-ipa:en-us"); a `text_policy` (tts/textpolicy.py;
absent = "english", the English normalizer); a `default_voice`, the preset used when a request names
none (absent = no reference, as for Fish models); and an `aligner`, `{"layer": L, "heads": [h, ...]}`:
slow-AR attention heads that follow the text, which the loop guard reads (tts/engine/aligner.py; absent =
no loop guard).

Directories without "tts_runtime" are Fish checkpoints, handed to `tts.checkpoints.fish`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tts.codec import Codec, WaveTableCodec
from tts.codec.melrvq import MelRVQCodec
from tts.codec.melvq import MelVQCodec
from tts.model.config import AlignerSpec, ConfigError, ModelArgs
from tts.model.transformer import DualARTransformer
from tts.params import FrameConvention, SamplingParams
from tts.text.phonemes import get_frontend
from tts.text.policy import get_text_policy
from tts.text.prompt import PromptFormat, S2PromptFormat, VoiceReference
from tts.text.tokenizer import TextTokenizer, TokenizerLike, build_byte_tokenizer

log = logging.getLogger(__name__)

RUNTIME_KEY = "tts_runtime"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_MODEL_DIR = ASSETS / "default"
PRESETS = ("default", "tiny")
MAX_SHARD_BYTES = 15 * 1024 * 1024  # shipped shards stay under 16 MB


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded (missing files, bad keys or shapes)."""


@dataclass
class ModelBundle:
    name: str
    family: str
    model: DualARTransformer
    codec: Codec
    tokenizer: TokenizerLike
    prompt_format: PromptFormat
    voices: dict[str, VoiceReference] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chunk_length: int = 200  # UTF-8 bytes of text per generation chunk (Fish API default)
    path: Path | None = None
    default_voice: str | None = None  # preset used when a request names no voice (None: no reference)
    # Which generated frames become audio (fish-speech 1.5 drops the first and keeps the end frame).
    frames: FrameConvention = field(default_factory=FrameConvention)
    # How the repetition penalty reads the recent frames (tts.engine.model_runner.REPETITION_MODES):
    # "fish-1.5", "s1", or None where the family has no penalty (the request's value is then ignored).
    repetition: str | None = None
    # Attention heads that follow the text, for the loop guard (tts.engine.aligner); None: no guard.
    aligner: AlignerSpec | None = None

    @property
    def device(self) -> torch.device:
        return self.model.embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embeddings.weight.dtype

    def num_parameters(self) -> int:
        """Parameters, a quantized layer's weights included (tts.model.quant: buffers, not parameters)."""
        from tts.model.quant import QuantLinear

        quantized = sum(m.qweight.numel() for m in self.model.modules() if isinstance(m, QuantLinear))
        return sum(p.numel() for p in self.model.parameters()) + quantized

    def describe(self) -> str:
        """One line: name, family, parameter count, dtype (and quantized linear weights), weight memory,
        device, codec rate."""
        from tts.model.quant import quantized_format, weight_bytes

        params = self.num_parameters()
        fmt = quantized_format(self.model)
        mem = (
            weight_bytes(self.model)
            if fmt
            else sum(p.numel() * p.element_size() for p in self.model.parameters())
        )
        dtype = str(self.dtype).removeprefix("torch.") + (f" ({fmt} linear weights)" if fmt else "")
        return (
            f"{self.name} ({self.family}): {params / 1e6:.1f} M parameters, {dtype}, "
            f"{mem / 2**20:.1f} MiB on {self.device}; codec {self.codec.sample_rate} Hz, "
            f"{self.codec.frame_rate:.2f} frames/s, {self.codec.num_codebooks} codebooks"
        )


# ---- codecs by type ----------------------------------------------------------------------------------

CodecLoader = Callable[[Path, dict], Codec]
CODEC_LOADERS: dict[str, CodecLoader] = {
    "wavetable": lambda directory, cfg: WaveTableCodec(**{k: v for k, v in cfg.items() if k != "type"}),
}


def _load_dac(directory: Path, cfg: dict) -> Codec:
    """`{"type": "modded_dac", "file": "codec.pth"}`: Fish's modded DAC (tts.codec.dac.codec)."""
    from tts.codec.base import CodecCheckpointError
    from tts.codec.dac.codec import DACCodec

    try:
        return DACCodec.from_file(directory / cfg.get("file", "codec.pth"))
    except CodecCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc


CODEC_LOADERS["modded_dac"] = _load_dac


def register_codec(codec_type: str, loader: CodecLoader) -> None:
    """Make `codec.json` files of `codec_type` loadable."""
    CODEC_LOADERS[codec_type] = loader


register_codec("mel_rvq", lambda directory, cfg: MelRVQCodec.load(directory, cfg))


def _load_melvq(directory: Path, cfg: dict) -> Codec:
    """`{"type": "mel_vqvae", ...}`: the default model's codec (tts.codec.melvq), with its vocoder."""
    from tts.codec.base import CodecCheckpointError

    try:
        return MelVQCodec.load(directory, cfg)
    except CodecCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc


register_codec("mel_vqvae", _load_melvq)


def _load_firefly(directory: Path, cfg: dict) -> Codec:
    """`{"type": "firefly_gan", "file": ...}`: fish-speech 1.5's Firefly-GAN (tts.codec.firefly)."""
    from tts.codec.base import CodecCheckpointError
    from tts.codec.firefly import FIREFLY_FILE, FireflyCodec

    try:
        return FireflyCodec.from_file(directory / cfg.get("file", FIREFLY_FILE))
    except CodecCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc


register_codec("firefly_gan", _load_firefly)


def load_codec(directory: Path) -> Codec:
    path = directory / "codec.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no codec.json")
    cfg = json.loads(path.read_text())
    loader = CODEC_LOADERS.get(cfg.get("type"))
    if loader is None:
        raise CheckpointError(f"unknown codec type {cfg.get('type')!r} in {path}")
    return loader(directory, cfg)


# ---- weights -----------------------------------------------------------------------------------------


def save_weights(
    state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """Write `model.safetensors`, or shards `model-0000k-of-0000n.safetensors` plus the Hugging Face
    style `model.safetensors.index.json` when the weights exceed `max_shard_bytes`."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"))
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in order (index first, then a single file)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / f for f in dict.fromkeys(weight_map.values())]
    elif (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    else:
        raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"missing weight shard {f}")
    return files


def load_weights_into(
    model: DualARTransformer,
    files: list[Path],
    device,
    dtype,
    key_map: Callable[[str], str | None] = lambda k: k,
    weights: str | None = None,
) -> None:
    """Load safetensors shards one at a time straight into `model` (built on the meta device) on
    `device` in `dtype`, never holding two copies. `key_map` renames checkpoint keys (None drops one).
    `weights` ("fp8", "int8", resolved for the device) quantizes each linear layer's weight as it
    arrives (`tts.model.quant.weight_quantizer`; the caller then runs `quantize_model`).

    Raises CheckpointError naming the first missing or unexpected key, or a shape mismatch.
    """
    assign = weight_assigner(model, weights)
    expected = dict(model.state_dict())
    seen: set[str] = set()
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device=str(device))
        except Exception as exc:
            raise CheckpointError(f"cannot read {f}: {exc}") from exc
        with handle:
            for raw_key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                key = key_map(raw_key)
                if key is None:
                    continue
                if key not in expected:
                    raise CheckpointError(f"unexpected key {raw_key!r} in {f.name}")
                try:
                    t = handle.get_tensor(raw_key)
                except Exception as exc:
                    raise CheckpointError(f"cannot read tensor {raw_key!r} from {f.name}: {exc}") from exc
                if tuple(t.shape) != tuple(expected[key].shape):
                    raise CheckpointError(
                        f"shape mismatch for {raw_key!r}: checkpoint {tuple(t.shape)}, "
                        f"model {tuple(expected[key].shape)}"
                    )
                assign(key, t.to(dtype))
                seen.add(key)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"missing key {missing[0]!r} ({len(missing)} missing in all)")


def _assign(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, param_name = key.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, param_name, torch.nn.Parameter(value, requires_grad=False))


def weight_assigner(model: DualARTransformer, weights: str | None) -> Callable[[str, torch.Tensor], None]:
    """`assign(key, tensor)` for a loader filling `model` (built on the meta device): puts the tensor
    in as the parameter `key` names, or, with `weights` ("fp8", "int8"), a linear layer's weight as a
    quantized layer (`tts.model.quant.weight_quantizer`)."""
    if weights is None:
        return lambda key, value: _assign(model, key, value)
    from tts.model.quant import weight_quantizer

    take = weight_quantizer(model, weights)

    def assign(key: str, value: torch.Tensor) -> None:
        if not take(key, value):
            _assign(model, key, value)

    return assign


# ---- voices ------------------------------------------------------------------------------------------


def save_voice(path: Path, voice: VoiceReference) -> None:
    save_file({"codes": voice.codes.to(torch.int64).contiguous()}, str(path), metadata={"text": voice.text})


def load_voices(directory: Path) -> dict[str, VoiceReference]:
    voices = {}
    for f in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        with safe_open(str(f), framework="pt") as h:
            voices[f.stem] = VoiceReference(codes=h.get_tensor("codes"), text=h.metadata().get("text", ""))
    return voices


# ---- our directory format ----------------------------------------------------------------------------


def save_bundle(bundle: ModelBundle, directory: str | Path, codec_config: dict | None = None) -> Path:
    """Write `bundle` in our directory format (see the module docstring); returns the directory."""
    # Our format: a tokenizer.json and an S2 prompt whose frontend is named in config.json.
    assert isinstance(bundle.tokenizer, TextTokenizer), "our directory format stores a tokenizer.json"
    assert isinstance(bundle.prompt_format, S2PromptFormat), "our directory format uses the S2 prompt"
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    s = bundle.sampling
    cfg = bundle.model.config.to_dict()
    cfg[RUNTIME_KEY] = {
        "name": bundle.name,
        "family": bundle.family,
        "prompt_format": bundle.prompt_format.name,
        "frontend": getattr(bundle.prompt_format.frontend, "spec", "text"),
        "text_policy": bundle.prompt_format.text_policy,
        "default_voice": bundle.default_voice,
        "chunk_length": bundle.chunk_length,
        "sampling": {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "max_new_frames": s.max_new_frames,
        },
    }
    if bundle.aligner is not None:
        cfg[RUNTIME_KEY]["aligner"] = {"layer": bundle.aligner.layer, "heads": list(bundle.aligner.heads)}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    save_weights(bundle.model.state_dict(), directory)
    bundle.tokenizer.save(directory / "tokenizer.json")
    codec_config = codec_config or bundle.codec.config()
    (directory / "codec.json").write_text(json.dumps(codec_config, indent=2))
    if bundle.voices:
        (directory / "voices").mkdir(exist_ok=True)
        for name, voice in bundle.voices.items():
            save_voice(directory / "voices" / f"{name}.safetensors", voice)
    return directory


def read_config(spec: str | Path) -> tuple[Path, dict]:
    """(directory, its parsed config.json) of a checkpoint directory; raises CheckpointError naming the
    problem (not a directory, no config.json, not valid JSON)."""
    directory = Path(spec)
    if not directory.is_dir():
        raise CheckpointError(f"{spec} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    try:
        return directory, json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc


def _own_text_side(directory: Path, raw: dict) -> tuple[ModelArgs, TextTokenizer, S2PromptFormat]:
    """The model arguments, tokenizer and prompt format (frontend, text policy) of our own directory."""
    runtime = raw[RUNTIME_KEY]
    args = ModelArgs.from_dict(raw)
    tokenizer = TextTokenizer.from_file(directory / "tokenizer.json")
    if (tokenizer.semantic_begin_id, tokenizer.semantic_end_id) != (
        args.semantic_begin_id,
        args.semantic_end_id,
    ):
        raise ConfigError("config.json semantic id range disagrees with tokenizer.json")
    try:
        frontend = get_frontend(runtime.get("frontend"))
        text_policy = runtime.get("text_policy", "english")
        get_text_policy(text_policy)
    except ValueError as exc:
        raise ConfigError(f"{directory / 'config.json'}: {exc}") from exc
    return args, tokenizer, S2PromptFormat(tokenizer, args.num_codebooks, frontend, text_policy)


def _load_own_bundle(directory: Path, raw: dict, device, dtype, weights: str | None = None) -> ModelBundle:
    runtime = raw[RUNTIME_KEY]
    args, tokenizer, prompt_format = _own_text_side(directory, raw)
    args.eos_token_id = tokenizer.eos_id
    with torch.device("meta"):
        model = DualARTransformer(args)
    load_weights_into(model, weight_files(directory), device, dtype, weights=weights)
    model.init_buffers(device)
    sampling_cfg = dict(runtime.get("sampling", {}))
    if "max_new_tokens" in sampling_cfg:  # the key's name before 2026-12
        sampling_cfg.setdefault("max_new_frames", sampling_cfg.pop("max_new_tokens"))
    sampling = SamplingParams(**sampling_cfg)
    voices = load_voices(directory / "voices")
    default_voice = runtime.get("default_voice")
    if default_voice is not None and default_voice not in voices:
        raise ConfigError(f"{directory / 'config.json'}: default_voice {default_voice!r} is not in voices/")
    try:
        aligner = AlignerSpec.from_config(runtime.get("aligner"), args.n_layer, args.n_head)
    except ValueError as exc:
        raise ConfigError(f"{directory / 'config.json'}: {exc}") from exc
    codec = load_codec(directory)
    if torch.device(device).type != "cpu" and hasattr(codec, "to"):
        codec.to(device)  # decode and encode on the model's device (the codec stage's batched decode too)
    return ModelBundle(
        name=runtime.get("name", directory.name),
        family=runtime.get("family", "dual_ar"),
        model=model.eval(),
        codec=codec,
        tokenizer=tokenizer,
        prompt_format=prompt_format,
        voices=voices,
        sampling=sampling,
        chunk_length=runtime.get("chunk_length", 200),
        path=directory,
        default_voice=default_voice,
        aligner=aligner,
    )


@dataclass
class TextModel:
    """The text side of a model: what planning text needs (`tts text`), without weights or codec."""

    name: str
    family: str
    tokenizer: TokenizerLike
    prompt_format: PromptFormat
    chunk_length: int


# ---- the tiny preset ---------------------------------------------------------------------------------


def tiny_config(tokenizer: TextTokenizer, codec: Codec) -> ModelArgs:
    """A 2+2-layer, 64-wide dual-AR model with every S2 feature switched on (qk-norm, tied head,
    scaled codebook embeddings, post-norm fast input, GQA)."""
    return ModelArgs(
        model_type="dual_ar",
        vocab_size=tokenizer.vocab_size,
        n_layer=2,
        n_head=4,
        n_local_heads=2,
        head_dim=16,
        dim=64,
        intermediate_size=128,
        rope_base=1e6,
        norm_eps=1e-6,
        max_seq_len=1024,
        tie_word_embeddings=True,
        attention_qk_norm=True,
        codebook_size=codec.codebook_size,
        num_codebooks=codec.num_codebooks,
        semantic_begin_id=tokenizer.semantic_begin_id,
        semantic_end_id=tokenizer.semantic_end_id,
        scale_codebook_embeddings=True,
        norm_fastlayer_input=True,
        n_fast_layer=2,
        eos_token_id=tokenizer.eos_id,
    )


def build_tiny_bundle(device="cpu", dtype=torch.float32, seed: int = 0) -> ModelBundle:
    """The tiny test model: random weights fixed by `seed`, the wave-table codec, a byte tokenizer.
    It produces audio-shaped noise, not speech; it exists so every path runs in seconds on a CPU."""
    codec = WaveTableCodec(sample_rate=16000, frame_length=640, num_codebooks=4, codebook_size=64, seed=seed)
    tokenizer = build_byte_tokenizer(codec.codebook_size)
    args = tiny_config(tokenizer, codec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DualARTransformer(args)
        for p in model.parameters():  # small weights keep the random model's logits soft
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.05)
    model = model.to(device=device, dtype=dtype).eval()
    model.init_buffers(device)
    voices = {}
    for i, name in enumerate(("alpha", "beta")):
        t = torch.arange(codec.sample_rate) / codec.sample_rate
        tone = 0.3 * torch.sin(2 * torch.pi * (180 + 120 * i) * t)
        voices[name] = VoiceReference(
            codes=codec.encode(tone, codec.sample_rate), text=f"This is voice {name}."
        )
    return ModelBundle(
        name="tiny",
        family="tiny (random weights)",
        model=model,
        codec=codec,
        tokenizer=tokenizer,
        prompt_format=S2PromptFormat(tokenizer, args.num_codebooks, text_policy="english"),
        voices=voices,
        sampling=SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_new_frames=100),
    )
