"""Loading Fish checkpoint directories: formats, key mapping, and every bad input the issue lists."""

import json
import logging
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tts.checkpoints.bundle import CheckpointError
from tts.checkpoints.fish.loader import load_fish_model, normalize_pth_state
from tts.checkpoints.fish.prompts import Fish15PromptFormat, S1PromptFormat, S2PromptFormat
from tts.checkpoints.fish.tokenizer import TiktokenTokenizer
from tts.checkpoints.load import load_bundle
from tts.codec.dac.random_init import random_codec_state, tiny_dac_config
from tts.codec.firefly import FIREFLY_FILE, FireflyCodec
from tts.model.config import ConfigError
from tts.text.tokenizer import TextTokenizer, TokenizerError


@pytest.fixture
def copy_of(fish_checkpoints, tmp_path):
    def make(fam: str):
        dst = tmp_path / fam
        shutil.copytree(fish_checkpoints[fam], dst)
        return dst

    return make


def test_s2_directory_has_the_real_layout_and_loads(fish_checkpoints):
    d = fish_checkpoints["s2"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    keys = set(index["weight_map"])
    assert set(index["weight_map"].values()) == {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert "text_model.model.layers.0.attention.wqkv.weight" in keys
    assert "text_model.model.layers.0.attention.q_norm.weight" in keys
    assert (
        "audio_decoder.codebook_embeddings.weight" in keys
        and "audio_decoder.layers.1.attention.wo.weight" in keys
    )
    assert "audio_decoder.output.weight" in keys and not any(
        "lm_head" in k or "output" in k for k in keys if "text_model" in k
    )
    with safe_open(str(d / "model-00001-of-00002.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "fish_qwen3_omni" and config["audio_decoder_config"]["num_codebooks"] == 10

    bundle = load_bundle(d, device="cpu")
    c = bundle.model.config
    assert isinstance(bundle.tokenizer, TextTokenizer) and isinstance(bundle.prompt_format, S2PromptFormat)
    assert (c.semantic_begin_id, c.semantic_end_id) == (
        config["semantic_start_token_id"],
        config["semantic_end_token_id"],
    )
    assert c.eos_token_id == config["eos_token_id"] == bundle.tokenizer.token_id("<|im_end|>")
    assert (
        c.tie_word_embeddings
        and c.norm_fastlayer_input
        and c.scale_codebook_embeddings
        and c.attention_qk_norm
    )
    assert not c.fast_attention_qk_norm and c.residual_codebook_size is None
    assert bundle.sampling.top_k == 30 and bundle.sampling.ras_window == 10 and bundle.chunk_length == 200
    assert bundle.dtype == torch.float32 and bundle.codec.sample_rate == 44100
    assert bundle.codec.model.decode_dtype == torch.float32  # on a CPU; bfloat16 by default on CUDA
    text = bundle.describe()
    assert "Fish Audio S2-Pro" in text and "M parameters" in text and "float32" in text and "MiB" in text
    # The model's weights are the checkpoint's, key-mapped: compare two of them directly.
    with safe_open(str(d / index["weight_map"]["audio_decoder.embeddings.weight"]), "pt") as f:
        assert torch.equal(
            bundle.model.fast_embeddings.weight, f.get_tensor("audio_decoder.embeddings.weight").float()
        )
    with safe_open(str(d / index["weight_map"]["text_model.model.norm.weight"]), "pt") as f:
        assert torch.equal(bundle.model.norm.weight, f.get_tensor("text_model.model.norm.weight").float())


def test_s2_loads_in_bf16_and_from_a_single_safetensors_file(copy_of):
    d = copy_of("s2")
    merged = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with safe_open(str(d / name), "pt") as f:
            merged.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
        (d / name).unlink()
    (d / "model.safetensors.index.json").unlink()
    save_file(merged, str(d / "model.safetensors"))
    model, _, family = load_fish_model(d, "cpu", torch.bfloat16)
    assert family == "s2-pro" and model.embeddings.weight.dtype == torch.bfloat16


def test_the_dac_decodes_in_bfloat16_by_default_on_cuda_only():
    from tts.checkpoints.fish.loader import default_dac_dtype

    assert default_dac_dtype("cuda") == default_dac_dtype(torch.device("cuda", 1)) == torch.bfloat16
    assert default_dac_dtype("cpu") == default_dac_dtype(torch.device("cpu")) == torch.float32


def test_s1_directory_loads_with_tiktoken_and_s1_settings(fish_checkpoints):
    d = fish_checkpoints["s1"]
    assert {p.name for p in d.iterdir()} >= {
        "config.json",
        "model.pth",
        "tokenizer.tiktoken",
        "special_tokens.json",
        "codec.pth",
    }
    bundle = load_bundle(d)
    c = bundle.model.config
    assert isinstance(bundle.tokenizer, TiktokenTokenizer) and isinstance(
        bundle.prompt_format, S1PromptFormat
    )
    assert c.residual_codebook_size == 1024 and c.codebook_size == 4096 and not c.norm_fastlayer_input
    assert bundle.sampling.ras_window == 0 and bundle.sampling.top_k == 0 and bundle.chunk_length == 0
    assert "OpenAudio S1" in bundle.describe()


def test_fish15_loads_with_its_firefly_codec(fish_checkpoints, tmp_path):
    d = fish_checkpoints["fish-1.5"]
    model, tokenizer, family = load_fish_model(d)
    c = model.config
    assert family == "fish-1.5" and not c.tie_word_embeddings and model.output.weight.shape[0] == c.vocab_size
    assert c.head_dim == c.dim // c.n_head and c.num_codebooks == 8
    assert tokenizer.token_id("<|placeholder:0|>") == tokenizer.token_id("<|im_end|>") + 1
    assert isinstance(Fish15PromptFormat(tokenizer, 8).build("Hi."), torch.Tensor)
    bundle = load_bundle(d)
    assert isinstance(bundle.codec, FireflyCodec) and bundle.codec.num_codebooks == 8
    assert isinstance(bundle.prompt_format, Fish15PromptFormat) and "fish-speech 1.5" in bundle.describe()
    assert bundle.frames.drop_first and bundle.frames.keep_end
    # A checkpoint directory without the generator file names it.
    shutil.copytree(d, tmp_path / "no-codec")
    (tmp_path / "no-codec" / FIREFLY_FILE).unlink()
    with pytest.raises(CheckpointError, match=FIREFLY_FILE):
        load_bundle(tmp_path / "no-codec")


def test_lightning_wrapper_prefix_audio_keys_and_split_qkv_are_accepted(copy_of):
    d = copy_of("s1")
    state = torch.load(d / "model.pth", weights_only=True)
    reference, _, _ = load_fish_model(d)
    wrapped = {}
    for k, v in state.items():
        if k.endswith("attention.wqkv.weight"):
            c = reference.config
            q, kv = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
            if k.startswith("fast_"):
                q, kv = c.fast_n_head * c.fast_head_dim, c.fast_n_local_heads * c.fast_head_dim
            wq, wk, wv = v.split([q, kv, kv])
            base = k[: -len("wqkv.weight")]
            wrapped.update(
                {f"model.{base}wq.weight": wq, f"model.{base}wk.weight": wk, f"model.{base}wv.weight": wv}
            )
        else:
            wrapped[f"model.{k}"] = v
    wrapped["model.audio_projector.weight"] = torch.zeros(3, 3)  # dropped, as fish-speech drops audio_ keys
    torch.save({"state_dict": wrapped, "epoch": 3}, d / "model.pth")
    model, _, _ = load_fish_model(d)
    for (name, a), (_, b) in zip(reference.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="has no matching 'layers.0.attention.wk.weight'"):
        normalize_pth_state({"layers.0.attention.wq.weight": torch.zeros(2, 2)})


# ---- bad input ---------------------------------------------------------------------------------------


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_bundle(tmp_path)


def test_unknown_model_type(copy_of):
    d = copy_of("s1")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "naive"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'naive'"):
        load_bundle(d)


def test_truncated_safetensors_shard(copy_of):
    d = copy_of("s2")
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_bundle(d)


def test_missing_shard(copy_of):
    d = copy_of("s2")
    (d / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing weight shard"):
        load_bundle(d)


def test_truncated_model_pth(copy_of):
    d = copy_of("s1")
    p = d / "model.pth"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    with pytest.raises(CheckpointError, match="cannot read model.pth"):
        load_bundle(d)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda s: s.pop("layers.1.ffn_norm.weight"), "missing key 'layers.1.ffn_norm.weight'"),
        (
            lambda s: s.update({"layers.9.ffn_norm.weight": torch.ones(64)}),
            "unexpected key 'layers.9.ffn_norm.weight'",
        ),
        (lambda s: s.update({"fast_norm.weight": torch.ones(32)}), "shape mismatch for 'fast_norm.weight'"),
    ],
)
def test_key_and_shape_errors_name_the_key_pth(copy_of, edit, message):
    d = copy_of("s1")
    state = torch.load(d / "model.pth", weights_only=True)
    edit(state)
    torch.save(state, d / "model.pth")
    with pytest.raises(CheckpointError, match=message):
        load_bundle(d)


def test_key_errors_name_the_key_safetensors(copy_of):
    d = copy_of("s2")
    name = "model-00002-of-00002.safetensors"
    with safe_open(str(d / name), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    victim = sorted(state)[0]
    state[victim] = state[victim][:1]
    save_file(state, str(d / name))
    with pytest.raises(CheckpointError, match=f"shape mismatch for '{victim}'"):
        load_bundle(d)


def test_codec_that_does_not_match_the_model(copy_of):
    d = copy_of("s2")
    torch.save(random_codec_state(tiny_dac_config(n_codebooks=7), seed=0), d / "codec.pth")
    with pytest.raises(CheckpointError, match="codec.pth does not match the model: it has 8 codebooks"):
        load_bundle(d)


def test_corrupt_or_missing_codec(copy_of):
    d = copy_of("s2")
    (d / "codec.pth").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="codec.pth: cannot read"):
        load_bundle(d)
    (d / "codec.pth").unlink()
    with pytest.raises(CheckpointError, match="has no codec.pth"):
        load_bundle(d)


def test_missing_or_bad_tokenizer(copy_of):
    d = copy_of("s2")
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_bundle(d)
    d1 = copy_of("s1")
    (d1 / "tokenizer.tiktoken").write_text("not base64!! 1\n")
    with pytest.raises(TokenizerError, match="tokenizer.tiktoken:1"):
        load_bundle(d1)


def test_config_that_does_not_fit_the_tokenizer(copy_of):
    d = copy_of("s1")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 100
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="does not fit the tokenizer"):
        load_bundle(d)


def test_special_tokens_json_gives_order_not_ids(copy_of, caplog):
    d = copy_of("s1")
    specials = json.loads((d / "special_tokens.json").read_text())
    first = next(iter(specials))
    specials[first] = 5  # a wrong id: fish-speech ignores written ids and uses positions
    (d / "special_tokens.json").write_text(json.dumps(specials))
    with caplog.at_level(logging.WARNING):
        tok = TiktokenTokenizer.from_dir(d, [])
    assert tok.token_id(first) == len(tok.ranks) and "disagree with their position" in caplog.text


def test_modded_dac_is_a_registered_codec_type(fish_checkpoints, tmp_path):
    from tts.checkpoints.bundle import load_codec

    shutil.copy(fish_checkpoints["s2"] / "codec.pth", tmp_path / "codec.pth")
    (tmp_path / "codec.json").write_text(json.dumps({"type": "modded_dac", "file": "codec.pth"}))
    codec = load_codec(tmp_path)
    assert codec.num_codebooks == 10 and codec.config() == {"type": "modded_dac", "file": "codec.pth"}
    (tmp_path / "codec.pth").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_codec(tmp_path)
