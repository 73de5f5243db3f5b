"""The shipped default model (tts/assets/default): loads through load_bundle("default") and runs."""

import json

import pytest
import torch

from tts.api import TTS
from tts.checkpoints.bundle import DEFAULT_MODEL_DIR, weight_files
from tts.checkpoints.load import load_bundle
from tts.codec.melvq import MelVQCodec
from tts.engine import EngineConfig
from tts.text.phonemes import PhonemeFrontend

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the default model is not installed"
)


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("default")


def test_default_bundle_shape(bundle):
    assert bundle.name == "default"
    assert bundle.num_parameters() <= 30_000_000
    assert isinstance(bundle.codec, MelVQCodec)
    assert bundle.codec.frame_rate == pytest.approx(21.53, abs=0.01)
    assert bundle.model.config.num_codebooks == bundle.codec.num_codebooks
    assert bundle.model.config.codebook_size == bundle.codec.codebook_size
    assert isinstance(bundle.prompt_format.frontend, PhonemeFrontend)
    assert bundle.dtype == torch.float32  # bf16 shards, cast on load for the CPU


def test_shipped_files_are_small_enough():
    for f in [*weight_files(DEFAULT_MODEL_DIR), DEFAULT_MODEL_DIR / "codec.safetensors"]:
        assert f.stat().st_size < 16 * 1024 * 1024, f
    runtime = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["tts_runtime"]
    assert runtime["frontend"] == "espeak-ipa:en-us"


def test_preset_voices(bundle):
    assert len(bundle.voices) >= 4
    for voice in bundle.voices.values():
        assert voice.codes.shape[0] == bundle.codec.num_codebooks
        assert 50 <= voice.codes.shape[1] <= 110  # 2.5-5 s of reference
        assert voice.text


def test_generates_frames_with_a_voice(bundle):
    tts = TTS(bundle, EngineConfig(max_batch=1))
    name = sorted(bundle.voices)[0]
    result = tts.synthesize("Hello.", voice=name, seed=1, max_new_frames=6)
    assert 1 <= result.frames <= 6
    assert result.audio.shape == (result.frames * bundle.codec.frame_length,)
    assert result.sample_rate == 22050
