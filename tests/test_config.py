import json

import pytest

from tts.model.config import ConfigError, ModelArgs

S2_CONFIG = {
    "model_type": "fish_qwen3_omni",
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "pad_token_id": 151669,
    "semantic_start_token_id": 151678,
    "semantic_end_token_id": 155773,
    "text_config": {
        "model_type": "fish_qwen3", "dim": 2560, "n_layer": 36, "n_head": 32, "n_local_heads": 8,
        "head_dim": 128, "intermediate_size": 9728, "max_seq_len": 32768, "rope_base": 1000000,
        "norm_eps": 1e-6, "attention_qk_norm": True, "attention_qkv_bias": False, "attention_o_bias": False,
        "tie_word_embeddings": True, "vocab_size": 155776, "use_moe": False,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder", "dim": 2560, "text_dim": 2560, "n_layer": 4, "n_head": 32,
        "n_local_heads": 8, "head_dim": 128, "intermediate_size": 9728, "num_codebooks": 10,
        "vocab_size": 4096, "max_seq_len": 11, "attention_qk_norm": False, "rope_base": 1000000,
        "norm_eps": 1e-6, "tie_word_embeddings": False,
    },
}  # fmt: skip


def test_nested_s2_config_flattens_like_fish_speech():
    a = ModelArgs.from_dict(S2_CONFIG)
    assert a.model_type == "fish_qwen3_omni"
    assert (a.n_layer, a.dim, a.n_head, a.n_local_heads, a.head_dim) == (36, 2560, 32, 8, 128)
    assert (a.n_fast_layer, a.fast_dim, a.fast_n_head, a.fast_n_local_heads) == (4, 2560, 32, 8)
    assert a.attention_qk_norm and not a.fast_attention_qk_norm
    assert (a.codebook_size, a.num_codebooks) == (4096, 10)
    assert (a.semantic_begin_id, a.semantic_end_id, a.eos_token_id) == (151678, 155773, 151645)
    assert a.scale_codebook_embeddings and a.norm_fastlayer_input and a.tie_word_embeddings
    assert a.num_semantic_tokens == 4096


def test_flat_dual_ar_defaults_fall_back_to_slow_values(tmp_path):
    raw = {
        "model_type": "dual_ar",
        "dim": 1024,
        "n_layer": 24,
        "n_head": 16,
        "n_local_heads": 2,
        "vocab_size": 102048,
        "codebook_size": 1024,
        "num_codebooks": 8,
        "semantic_begin_id": 100,
        "semantic_end_id": 1123,
        "unknown_key": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    a = ModelArgs.from_json(tmp_path / "config.json")
    assert a.intermediate_size == 2816  # round_up(int(8 * 1024 / 3), 256)
    assert a.head_dim == 64 and a.fast_dim == 1024 and a.fast_n_local_heads == 2
    assert not a.norm_fastlayer_input and not a.scale_codebook_embeddings
    assert a.extra == {"unknown_key": 1}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "naive"}, "unsupported model_type"),
        ({}, "unsupported model_type"),
        ({"model_type": "fish_qwen3_omni"}, "text_config"),
        ({"model_type": "dual_ar", "n_head": 6, "n_local_heads": 4}, "multiple"),
    ],
)
def test_bad_configs_are_clear_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        ModelArgs.from_dict(raw)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelArgs.from_json(tmp_path / "config.json")
