"""The phoneme frontend of the default model and its hook in the prompt path."""

import pytest
import torch

from tts.text.phonemes import PhonemeFrontend, apply_frontend, get_frontend, identity
from tts.text.prompt import S2PromptFormat, Turn, VoiceReference
from tts.text.tokenizer import build_byte_tokenizer


@pytest.fixture(scope="module")
def frontend():
    return PhonemeFrontend("en-us")


def test_phonemes_of_a_sentence(frontend):
    # espeak-ng IPA with primary stress marks; punctuation and word boundaries kept.
    assert frontend("Hello there, friend.") == "həlˈoʊ ðˈɛɹ, fɹˈɛnd."
    assert frontend("Is it ten?") == "ɪz ɪt tˈɛn?"


def test_batch_matches_single_calls(frontend):
    texts = ["The cat sat on the mat.", "Twenty two dollars and five cents!"]
    assert frontend.phonemize_batch(texts) == [frontend(t) for t in texts]


def test_special_tokens_pass_through(frontend):
    out = apply_frontend(frontend, "<|speaker:1|>Good morning.")
    assert out == "<|speaker:1|>" + frontend("Good morning.")
    assert apply_frontend(identity, "<|speaker:1|>Good morning.") == "<|speaker:1|>Good morning."


def test_get_frontend():
    assert get_frontend(None) is identity and get_frontend("text") is identity
    f = get_frontend("espeak-ipa:en-us")
    assert isinstance(f, PhonemeFrontend) and f.spec == "espeak-ipa:en-us"
    with pytest.raises(ValueError, match="unknown text frontend"):
        get_frontend("festival")


def test_prompt_reads_phonemes_everywhere(frontend):
    """Target text, reference transcript and earlier turns all go through the frontend."""
    tok = build_byte_tokenizer(16)
    plain = S2PromptFormat(tok, 2)
    phon = S2PromptFormat(tok, 2, frontend)
    ref = VoiceReference(torch.zeros(2, 3, dtype=torch.int64), "A reference clip.")
    turn = Turn("An earlier chunk.", torch.ones(2, 2, dtype=torch.int64))
    built = phon.build("Say this now.", [ref], [turn])
    expected = plain.build(
        frontend("Say this now."),
        [VoiceReference(ref.codes, frontend(ref.text))],
        [Turn(frontend(turn.text), turn.codes)],
    )
    assert torch.equal(built, expected)
    assert "sˈeɪ ðɪs nˈaʊ." in tok.decode(built[:, 0].tolist())


def test_phonemes_of_a_text_seen_before_come_from_the_cache(monkeypatch):
    # A session's prompt repeats its earlier turns for every chunk: each text goes to espeak once.
    f = PhonemeFrontend("en-us")
    calls: list[list[str]] = []
    real = f.phonemize_batch

    def counted(texts):
        calls.append(list(texts))
        return real(texts)

    monkeypatch.setattr(f, "phonemize_batch", counted)
    monkeypatch.setattr(PhonemeFrontend, "CACHE_TEXTS", 2)
    first = f("See you tomorrow")
    assert f("See you tomorrow") == first and first.endswith(".")
    assert calls == [["See you tomorrow"]]
    f("one")
    f("two")  # the cache holds two texts: "See you tomorrow" is the oldest, and goes
    f("See you tomorrow")
    assert calls[-1] == ["See you tomorrow"] and len(calls) == 4
