"""`tts eval` pieces that need no ASR: the speaker-similarity check and its espeak-ng speakers."""

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tts import eval as tts_eval
from tts.text import normalize_text

ROOT = Path(__file__).resolve().parents[1]


def test_espeak_speakers_are_the_corpus_speakers():
    sys.path.insert(0, str(ROOT / "training"))
    from corpus import SPEAKERS

    assert tts_eval.ESPEAK_SPEAKERS == {s["name"]: (s["voice"], s["rate"], s["pitch"]) for s in SPEAKERS}
    assert tts_eval.ESPEAK_DEFAULT == tts_eval.ESPEAK_SPEAKERS[SPEAKERS[0]["name"]]


class _FakeTTS:
    """Stands in for `tts.api.TTS`: every voice's preset clip is espeak-ng reading one fixed sentence
    with that voice's speaker; `synthesize` speaks with `speaks(voice)`'s speaker."""

    def __init__(self, speaks):
        self.speaks = speaks
        self.bundle = SimpleNamespace(codec=SimpleNamespace(decode=self._decode, sample_rate=22050))

    def voice(self, name):
        return [SimpleNamespace(codes=name)]

    def _decode(self, name):
        audio, _ = tts_eval.espeak_audio(
            "The preset clip has other words in it.", *tts_eval.ESPEAK_SPEAKERS[name]
        )
        return torch.as_tensor(audio)

    def synthesize(self, text, voice, seed):
        audio, sr = tts_eval.espeak_audio(normalize_text(text), *tts_eval.ESPEAK_SPEAKERS[self.speaks(voice)])
        return SimpleNamespace(audio=audio, sample_rate=sr)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs the espeak-ng binary")
def test_voice_similarity_passes_a_model_that_speaks_each_voice_and_fails_one_that_does_not():
    names, sentences = ["ava", "ben", "hank"], ["Please call Stella and ask her to bring these things."]
    good = tts_eval.voice_similarity(_FakeTTS(lambda v: v), sentences, names, lambda _: None)
    assert (
        good["gate_reference"] == "espeak" and good["closest_is_own_same_text_espeak"] == 1.0 and good["pass"]
    )
    bad = tts_eval.voice_similarity(_FakeTTS(lambda v: "ava"), sentences, names, lambda _: None)
    assert bad["closest_is_own_same_text_espeak"] == pytest.approx(1 / 3) and not bad["pass"]
    preset_only = tts_eval.voice_similarity(
        _FakeTTS(lambda v: v), sentences, names, lambda _: None, espeak=False
    )
    assert preset_only["gate_reference"] == "preset" and "closest_is_own_same_text_espeak" not in preset_only
