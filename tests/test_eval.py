"""`tts eval` pieces that need no ASR: the speaker-similarity check and its espeak-ng speakers."""

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchaudio
from helpers import sysfs_mounted
from tts_tools import evaluate as tts_eval

from tts.cli.main import main
from tts.text.normalize import normalize_text

ROOT = Path(__file__).resolve().parents[1]


def test_espeak_speakers_are_the_corpus_speakers():
    sys.path.insert(0, str(ROOT / "training"))
    from corpus import SPEAKERS

    assert tts_eval.ESPEAK_SPEAKERS == {s["name"]: (s["voice"], s["rate"], s["pitch"]) for s in SPEAKERS}
    assert tts_eval.ESPEAK_DEFAULT == tts_eval.ESPEAK_SPEAKERS[SPEAKERS[0]["name"]]


def test_flite_speakers_are_the_corpus_flite_speakers():
    sys.path.insert(0, str(ROOT / "training"))
    from corpus import FLITE_SPEAKERS

    assert tts_eval.FLITE_SPEAKERS == {s["name"]: (s["voice"], s["stretch"], s["f0"]) for s in FLITE_SPEAKERS}


class _FakeTTS:
    """Stands in for `tts.api.TTS`: every voice's preset clip is `teacher` reading one fixed sentence
    with that voice's speaker; `synthesize` speaks with `speaks(voice)`'s speaker."""

    def __init__(self, speaks, teacher="espeak"):
        self.speaks = speaks
        _, self.speakers, self.speak = tts_eval.VOICE_TEACHERS[teacher]
        self.bundle = SimpleNamespace(codec=SimpleNamespace(decode=self._decode, sample_rate=22050))

    def voice(self, name):
        return [SimpleNamespace(codes=name)]

    def _decode(self, name):
        audio, sr = self.speak("The preset clip has other words in it.", *self.speakers[name])
        return torchaudio.functional.resample(torch.as_tensor(audio), sr, 22050)

    def synthesize(self, text, voice, seed):
        audio, sr = self.speak(normalize_text(text), *self.speakers[self.speaks(voice)])
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
        _FakeTTS(lambda v: v), sentences, names, lambda _: None, same_text=False
    )
    assert preset_only["gate_reference"] == "preset" and "closest_is_own_same_text_espeak" not in preset_only


@pytest.mark.skipif(shutil.which("flite") is None, reason="needs the flite binary")
def test_the_voice_check_of_a_flite_trained_model_speaks_its_references_with_flite():
    names, sentences = ["ava", "ben", "finn"], ["Please call Stella and ask her to bring these things."]
    good = tts_eval.voice_similarity(
        _FakeTTS(lambda v: v, "flite"), sentences, names, lambda _: None, teacher="flite"
    )
    assert (
        good["gate_reference"] == "flite" and good["closest_is_own_same_text_flite"] == 1.0 and good["pass"]
    )
    assert "closest_is_own_same_text_espeak" not in good
    bad = tts_eval.voice_similarity(
        _FakeTTS(lambda v: "ava", "flite"), sentences, names, lambda _: None, teacher="flite"
    )
    assert bad["closest_is_own_same_text_flite"] == pytest.approx(1 / 3) and not bad["pass"]


def test_the_voice_check_speaks_with_the_teacher_the_model_folder_records(tmp_path):
    """`--voice-teacher` left out: the teacher export.py wrote into train_state.json; espeak where the
    folder records none or one the check cannot speak."""
    for state, teacher in (
        ({"step": 1, "teacher": "flite"}, "flite"),
        ({"step": 1}, "espeak"),
        ({"step": 1, "teacher": "festival"}, "espeak"),
    ):
        (tmp_path / "train_state.json").write_text(json.dumps(state))
        assert tts_eval.model_teacher(str(tmp_path)) == teacher
    assert tts_eval.model_teacher(str(tmp_path / "missing")) == "espeak"
    (tmp_path / "train_state.json").write_text(json.dumps({"teacher": "flite"}))
    assert tts_eval.voice_teacher(SimpleNamespace(voice_teacher=None, model=str(tmp_path))) == "flite"
    assert tts_eval.voice_teacher(SimpleNamespace(voice_teacher="espeak", model=str(tmp_path))) == "espeak"
    # The embedded model: the teacher it records is the one its family string names.
    from tts.checkpoints.bundle import DEFAULT_MODEL_DIR

    family = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["tts_runtime"]["family"]
    named = tts_eval.VOICE_TEACHERS[tts_eval.model_teacher("default")][0]
    assert f"trained on {named} speech" in family


class _WordsASR:
    """Stands in for the Whisper ASR: hears the sentence in anything longer than half a second."""

    def __init__(self, sentence):
        self.sentence = sentence

    def transcribe(self, audio, sample_rate):
        return self.sentence if len(audio) > sample_rate // 2 else ""


def _sentence_wer(refs, hyps):
    """jiwer's WER (the tools extra, not installed for the tests) where each hypothesis is its reference
    or empty: the share of reference words deleted."""
    assert all(h in (r, "") for r, h in zip(refs, hyps, strict=True))
    return sum(len(r.split()) for r, h in zip(refs, hyps, strict=True) if not h) / sum(
        len(r.split()) for r in refs
    )


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs the espeak-ng binary")
def test_each_voice_wer_is_held_against_its_own_espeak_speaker(monkeypatch):
    monkeypatch.setattr(tts_eval, "wer", _sentence_wer)
    names, sentence = ["ava", "ben"], "Please call Stella and ask her to bring these things."
    heard = tts_eval.voice_similarity(
        _FakeTTS(lambda v: v), [sentence], names, lambda _: None, asr=_WordsASR(sentence)
    )
    assert heard["wer_per_voice"] == heard["espeak_wer_per_voice"] == {"ava": 0.0, "ben": 0.0}
    assert heard["wer_per_voice_pass"]
    assert [(s["voice"], s["transcript"]) for s in heard["voice_samples"]] == [
        ("ava", sentence),
        ("ben", sentence),
    ]

    class _SilentBen(_FakeTTS):  # ben's outputs are empty: all 10 words deleted
        def synthesize(self, text, voice, seed):
            r = super().synthesize(text, voice, seed)
            return SimpleNamespace(
                audio=r.audio[:0] if voice == "ben" else r.audio, sample_rate=r.sample_rate
            )

    silent = tts_eval.voice_similarity(
        _SilentBen(lambda v: v), [sentence], names, lambda _: None, asr=_WordsASR(sentence)
    )
    assert (
        silent["wer_per_voice"] == {"ava": 0.0, "ben": 1.0} and silent["espeak_wer_per_voice"]["ben"] == 0.0
    )
    assert not silent["wer_per_voice_pass"]


@pytest.mark.parametrize(
    "gates, code, line",
    [
        ({"wer": True, "runaway": True, "duration": True}, 0, ""),
        ({"wer": False, "runaway": True, "duration": False}, 3,
         "tts eval: gates failed: wer, duration (exit code 3)"),
        ({"runaway": False}, 3, "tts eval: gates failed: runaway (exit code 3)"),
    ],
)  # fmt: skip
def test_eval_exits_3_when_a_gate_fails_and_0_only_when_all_pass(
    tmp_path, capsys, monkeypatch, gates, code, line
):
    monkeypatch.setattr(tts_eval, "evaluate", lambda args: {"wer": 0.4, "gates": gates, "samples": []})
    out = tmp_path / "eval.json"
    assert main(["eval", "--out", str(out)]) == code
    assert capsys.readouterr().err.strip() == line
    assert json.loads(out.read_text())["gates"] == gates  # the report is written either way


def test_eval_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eval", "--help"])
    assert info.value.code == 0
    assert "Exit codes: 0 when every gate passes; 3 when a gate fails" in " ".join(
        capsys.readouterr().out.split()
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0,x"], "--seeds must be comma-separated integers or ranges A-B, got '0,x'"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--asr-beam-size", "0"], "--asr-beam-size must be >= 1, got 0"),
        (["--ras-window", "11"], "--ras-window must be in [0, 10], got 11"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be in (0, 2) (1 = off), got 0.0"),
        pytest.param(
            ["--out", "/sys/eval.json"], "cannot write /sys/eval.json: permission denied",
            marks=pytest.mark.skipif(
                not sysfs_mounted(), reason="needs /sys (sysfs): nobody can write there"
            ),
        ),
    ],
)  # fmt: skip
def test_eval_bad_options_fail_before_the_evaluation(capsys, monkeypatch, argv, message):
    def never(args):
        raise AssertionError("evaluated before the options were checked")

    monkeypatch.setattr(tts_eval, "evaluate", never)
    assert main(["eval", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"tts: error: {message}"


@pytest.mark.parametrize(
    "text, transcript, expected",
    [
        ("we saw the top", "we saw the top and the top and the top", ["the top and x2"]),
        ("it was cold", "the cold the cold the cold", ["the cold x3"]),
        ("watch this", "watch the watch the watch", ["watch the x2"]),
        ("go", "go go go", ["go x3"]),
        ("x", "a b a b c c c d", ["a b x2", "c x3"]),
        # what the text itself repeats is not a loop; two of one word is not either (ASR stutter)
        ("very very good", "very very good", []),
        ("that that is", "that that is", []),
        ("the end", "the the end", []),
        ("so so so so", "so so so so", []),
        ("so so so", "so so so so so", ["so x5"]),
    ],
)
def test_loops_finds_repetition_the_text_does_not_have(text, transcript, expected):
    assert tts_eval.loops(text, transcript) == expected


def test_long_mode_reads_paragraphs_and_the_shipped_passages_are_long(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("# comment\nFirst line of one\npassage.\n\n\nSecond passage.\n", encoding="utf-8")
    assert tts_eval.read_sentences(path, None, passages=True) == [
        "First line of one passage.",
        "Second passage.",
    ]
    assert tts_eval.read_sentences(path, None) == ["First line of one", "passage.", "Second passage."]
    shipped = tts_eval.read_sentences(tts_eval.PASSAGES, None, passages=True)
    assert len(shipped) >= 3 and all(150 <= len(p.split()) <= 300 for p in shipped)


def test_a_loop_sample_shows_how_the_asr_hears_espeak_ng_read_the_same_text(tmp_path, capsys, monkeypatch):
    """A transcript loop is reported with the ASR's transcript of espeak-ng reading the same sentence,
    so a loop the ASR also makes of the reference (a rare word it mishears) is told from the model's.
    The ASR and espeak-ng are stand-ins: the tiny model's audio is "heard" as a loop, espeak-ng's (at
    its own sample rate) as a mishearing without one."""
    espeak_rate = 12345

    class ScriptedASR:
        def __init__(self, threads, beam_size):
            assert beam_size == 1  # (greedy unless --asr-beam-size: how the gates are measured)

        def transcribe(self, audio, sample_rate):
            return "The fig leaf eye." if sample_rate == espeak_rate else "The fig, the fig, the fig."

    from service_helpers import EndTokenNever

    from tts.engine import model_runner

    monkeypatch.setattr(model_runner, "F", EndTokenNever())  # 4 frames of audio at every seed
    monkeypatch.setattr(tts_eval, "ASR", ScriptedASR)
    monkeypatch.setattr(tts_eval, "wer", lambda refs, hyps: 1.0)  # (jiwer is in the tools extra only)
    monkeypatch.setattr(tts_eval, "missing_words", lambda ref, hyp: [])  # (likewise)
    monkeypatch.setattr(tts_eval, "espeak_audio", lambda *a: (torch.zeros(espeak_rate).numpy(), espeak_rate))
    monkeypatch.setattr(tts_eval, "shutil", SimpleNamespace(which=lambda name: f"/usr/bin/{name}"))
    sentences = tmp_path / "s.txt"
    sentences.write_text("The signifier is linked to the signified.\n")
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", "tiny", "--sentences", str(sentences), "--seeds", "0", "--out", str(out), "-q"]
    assert main([*argv, "--max-new-frames", "4"]) == 3  # the loops gate fails
    capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["asr_beam_size"] == 1
    # the tiny model has no aligner heads: no loop guard ran, so its loop went unflagged
    assert (result["loop_guard"], result["loop_repeats"], result["loop_finishes"]) == (False, 0, 0)
    assert result["unflagged_loops"] == 1
    assert result["loops"] == 1 and result["loop_samples"] == [
        {
            "seed": 0,
            "text": "The signifier is linked to the signified.",
            "loops": ["the fig x3"],
            "espeak_transcript": "The fig leaf eye.",
            "espeak_loops": [],
        }
    ]


def test_words_the_asr_also_loses_on_espeak_are_not_the_models():
    from tts_tools.evaluate import beyond_asr

    assert beyond_asr(["an"], ["an"]) == []  # the ASR hears "and agent" on espeak-ng too
    assert beyond_asr(["three", "an"], ["an"]) == ["three"]
    assert beyond_asr(["the", "the"], ["the"]) == ["the"]  # counted: one of two is the ASR's
    assert beyond_asr([], ["an"]) == []
    assert beyond_asr(["of", "costs"], []) == ["of", "costs"]
