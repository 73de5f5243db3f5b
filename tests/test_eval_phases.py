"""`tts eval --batch`, `--synthesize-only --audio-dir` and `--from-audio`, and `--seeds` ranges, on the tiny
random-weight model with stand-ins for the ASR (what the weights generate is never asserted: only that
the paths agree with each other)."""

import argparse
import json
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from tts_tools import evaluate as tts_eval

from tts.api import TTS
from tts.cli.main import main

TEXTS = "Hello there.\nA second, longer sentence to read.\nThird one.\n"


def eval_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tts_eval.add_parser(parser.add_subparsers())
    return parser.parse_args(["eval", *argv])


@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text(TEXTS)
    return path


class NoASR:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the ASR was loaded")


class ScriptedASR:
    """Stands in for the Whisper ASR: "hears" the transcripts of SCRIPT in turn (one a loop, two missing
    words of every text), and keeps what it was given: (sample rate, the samples' bytes)."""

    SCRIPT = ["Hello there.", "a second sentence", "there there there"]
    calls: list[tuple[int, bytes]] = []

    def __init__(self, threads, beam_size):
        pass

    def transcribe(self, audio, sample_rate):
        ScriptedASR.calls.append((sample_rate, np.asarray(audio, np.float32).tobytes()))
        return self.SCRIPT[len(ScriptedASR.calls) % 3]


def set_scoring_stand_ins(monkeypatch):
    """The stand-in ASR, word scoring without jiwer (the tools extra) and espeak-ng (8000 samples at 8 kHz
    per text), so the report's every part runs the same way on any machine."""
    monkeypatch.setattr(tts_eval, "ASR", ScriptedASR)
    monkeypatch.setattr(
        tts_eval, "wer", lambda refs, hyps: sum(r != h for r, h in zip(refs, hyps, strict=True)) / len(refs)
    )
    monkeypatch.setattr(
        tts_eval, "missing_words", lambda ref, hyp: [w for w in ref.split() if w not in hyp.split()]
    )
    monkeypatch.setattr(tts_eval, "espeak_audio", lambda *a: (np.zeros(8000, np.float32), 8000))
    monkeypatch.setattr(tts_eval.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_a_batched_eval_gives_every_sample_the_codes_it_has_one_at_a_time(texts, monkeypatch):
    """--batch 4 over 3 texts x 3 seeds: batches of 4, 4 and 1 requests at once, and every sample's codes
    and finish reasons exactly those of --batch 1, in the same order (audio within the codec's batched
    decode rounding)."""
    batches: list[int] = []
    synthesize_many = TTS.synthesize_many

    def counted(self, jobs):
        batches.append(len(jobs))
        return synthesize_many(self, jobs)

    monkeypatch.setattr(TTS, "synthesize_many", counted)
    runs = {}
    for batch in (1, 4):
        args = eval_args(
            ["--model", "tiny", "--sentences", str(texts), "--seeds", "0-2", "--batch", str(batch)]
        )
        args.max_new_frames = 12
        sentences, seeds = tts_eval.eval_texts(args), tts_eval.parse_seeds(args.seeds)
        tts, run = tts_eval.load_for_eval(args, len(sentences), seeds, lambda *a: None)
        assert tts.engine.config.max_batch == batch and run["batch"] == batch
        batches.clear()
        runs[batch] = list(tts_eval.synthesize_samples(tts, sentences, seeds, args))
        assert batches == ([1] * 9 if batch == 1 else [4, 4, 1])
        tts.close()
    assert len(runs[1]) == len(runs[4]) == 9
    for (s1, r1), (s4, r4) in zip(runs[1], runs[4], strict=True):
        assert (s4.seed, s4.request_seed, s4.text) == (s1.seed, s1.request_seed, s1.text)
        assert torch.equal(r4.codes, r1.codes)
        assert (s4.finish, s4.frames, s4.audio_seconds) == (s1.finish, s1.frames, s1.audio_seconds)
        np.testing.assert_allclose(r4.audio, r1.audio, atol=1e-5)
    assert [s.request_seed for s, _ in runs[4]] == [seed * 1000 + i for seed in range(3) for i in range(3)]


def test_synthesize_only_writes_each_samples_audio_and_a_manifest_without_the_asr(
    tmp_path, texts, monkeypatch, capsys
):
    monkeypatch.setattr(tts_eval, "ASR", NoASR)
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # (importing it would raise)
    monkeypatch.setitem(sys.modules, "jiwer", None)
    audio_dir = tmp_path / "audio"
    argv = ["eval", "--model", "tiny", "--sentences", str(texts), "--seeds", "5,7", "--max-new-frames", "12"]
    assert main([*argv, "--batch", "2", "--synthesize-only", "--audio-dir", str(audio_dir), "-q"]) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = json.loads((audio_dir / "manifest.json").read_text())
    assert summary == {k: v for k, v in manifest.items() if k not in ("texts", "samples")}
    assert manifest["format"] == "tts-eval-audio/1" and manifest["texts"] == TEXTS.splitlines()
    assert (manifest["seeds"], manifest["batch"], manifest["sentences"]) == ([5, 7], 2, 3)
    assert manifest["sampling"]["max_new_frames"] == 12 and manifest["model"] == "tiny"
    assert manifest["describe"].startswith("tiny") and manifest["sample_rate"] == 16000
    samples = manifest["samples"]
    assert [(s["seed"], s["request_seed"], s["text"]) for s in samples] == [
        (seed, seed * 1000 + i, text) for seed in (5, 7) for i, text in enumerate(TEXTS.splitlines())
    ]
    assert manifest["audio_seconds"] == pytest.approx(sum(s["audio_seconds"] for s in samples))
    # Each file is the audio `tts synthesize --seed REQUEST_SEED` gives (24-bit FLAC: within 1e-5).
    solo = TTS.load("tiny", max_batch=1)
    for s in samples:
        alone = solo.synthesize(s["text"], seed=s["request_seed"], max_new_frames=12)
        assert (s["frames"], s["finish"]) == (alone.frames, ",".join(f.value for f in alone.finish_reasons))
        assert s["wall_seconds"] > 0 and set(s) >= {"expected_seconds", "clipped_samples"}
        audio, rate = sf.read(audio_dir / s["file"], dtype="float32")
        assert rate == 16000 and len(audio) == round(s["audio_seconds"] * rate) == len(alone.audio)
        np.testing.assert_allclose(audio, alone.audio, atol=1e-5)
    solo.close()


@pytest.mark.parametrize("batch", ["1", "2"])
def test_from_audio_reports_what_a_one_phase_run_reports(tmp_path, texts, monkeypatch, capsys, batch):
    """The same model, texts, seeds and stand-in ASR: scoring the written audio gives the one-phase
    report (gates and exit code included), but for the timings, which are the synthesis run's."""
    set_scoring_stand_ins(monkeypatch)
    argv = ["eval", "--model", "tiny", "--sentences", str(texts), "--everyday", "--seeds", "0-2"]
    argv += ["--max-new-frames", "12", "--batch", batch, "-q"]
    one_phase, audio_dir, scored = tmp_path / "one.json", tmp_path / "audio", tmp_path / "two.json"
    ScriptedASR.calls = []
    code = main([*argv, "--out", str(one_phase)])
    assert code in (0, 3)
    heard = ScriptedASR.calls
    assert main([*argv, "--synthesize-only", "--audio-dir", str(audio_dir)]) == 0
    ScriptedASR.calls = []
    assert main(["eval", "--from-audio", str(audio_dir), "--out", str(scored), "-q"]) == code
    # The ASR heard the same audio: sample for sample one at a time; with a batch, whose streams the codec
    # decodes together as they come, within the float rounding of that decode (docs/usage.md).
    assert [(rate, len(data)) for rate, data in ScriptedASR.calls] == [
        (rate, len(data)) for rate, data in heard
    ]
    if batch == "1":
        assert ScriptedASR.calls == heard
    for (_, data), (_, before) in zip(ScriptedASR.calls, heard, strict=True):
        np.testing.assert_allclose(
            np.frombuffer(data, np.float32), np.frombuffer(before, np.float32), atol=1e-5
        )
    capsys.readouterr()
    a, b = json.loads(one_phase.read_text()), json.loads(scored.read_text())
    manifest = json.loads((audio_dir / "manifest.json").read_text())
    assert b.pop("audio_dir") == str(audio_dir)
    assert (b["rtf"], b["load_seconds"]) == (manifest["rtf"], manifest["load_seconds"])
    for report in (a, b):
        del report["rtf"], report["load_seconds"]
        for sample in report["samples"]:
            del sample["wall_seconds"]
    assert b == a
    # (the stand-ins made every part of the report run)
    assert a["loops"] > 0 and a["incomplete_samples"] and a["espeak"] and "complete" in a["gates"]
    assert 0 <= a["complete"] <= a["complete_beyond_asr"] <= 1
    assert all("espeak_missing" in entry for entry in a["incomplete_samples"])
    assert ("rtf_batched" in b) == (batch != "1")


def test_the_batched_rtf_is_each_batchs_wall_time_over_the_audio():
    def sample(wall, audio):
        return tts_eval.Sample("x", 0, audio, wall, 1, "stop")

    samples = [sample(1.0, 2.0), sample(3.0, 2.0), sample(2.0, 2.0), sample(1.0, 2.0), sample(0.5, 2.0)]
    assert tts_eval.batched_rtf(samples, 1) == pytest.approx(7.5 / 10)
    assert tts_eval.batched_rtf(samples, 2) == pytest.approx((3.0 + 2.0 + 0.5) / 10)
    assert tts_eval.batched_rtf(samples, 8) == pytest.approx(3.0 / 10)
    assert tts_eval.batched_rtf([sample(1.0, 0.0)], 1) is None


@pytest.mark.parametrize(
    "text, seeds",
    [("0-3", [0, 1, 2, 3]), ("0,1,2", [0, 1, 2]), (" 7 ", [7]), ("0-1, 5 - 6,9", [0, 1, 5, 6, 9]),
     ("-2-1", [-2, -1, 0, 1]), ("4-4", [4]), ("0-199", list(range(200)))],
)  # fmt: skip
def test_seeds_take_ranges(text, seeds):
    assert tts_eval.parse_seeds(text) == seeds


@pytest.mark.parametrize(
    "seeds, message",
    [
        ("3-1", "--seeds range 3-1 is empty: A-B needs A <= B"),
        ("0-", "--seeds must be comma-separated integers or ranges A-B, got '0-'"),
        ("0-3-5", "--seeds must be comma-separated integers or ranges A-B, got '0-3-5'"),
        ("1,,2", "--seeds must be comma-separated integers or ranges A-B, got '1,,2'"),
        ("0-3,2", "--seeds lists seed 2 more than once"),
        ("0-100000", "--seeds gives more than 100000 seeds"),
    ],
)
def test_bad_seeds_exit_2_with_one_line(capsys, monkeypatch, seeds, message):
    monkeypatch.setattr(tts_eval, "evaluate", NoASR)
    assert main(["eval", "--seeds", seeds]) == 2
    assert capsys.readouterr().err.strip() == f"tts: error: {message}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--synthesize-only"], "--synthesize-only needs --audio-dir DIR"),
        (["--audio-dir", "{tmp}/a"], "--audio-dir goes with --synthesize-only (to score audio written there: "
         "--from-audio DIR)"),
        (["--synthesize-only", "--audio-dir", "{tmp}/a", "--from-audio", "{tmp}/a"],
         "--synthesize-only and --from-audio are the two phases of one evaluation: give one"),
        (["--from-audio", "{tmp}/a", "--seeds", "0-3"],
         "--seeds is a synthesis option: --from-audio takes the synthesis settings from {m}"),
        (["--from-audio", "{tmp}/a", "--batch", "4"],
         "--batch is a synthesis option: --from-audio takes the synthesis settings from {m}"),
        (["--synthesize-only", "--audio-dir", "{tmp}/a", "--out", "{tmp}/r.json"],
         "--out is a scoring option: --synthesize-only does not score (score its audio with --from-audio "
         "{tmp}/a)"),
        (["--from-audio", "{tmp}/a", "--voices", "ava,ben"],
         "--voices needs the model and the ASR in one run: not with --synthesize-only or --from-audio"),
        (["--synthesize-only", "--audio-dir", "{tmp}/missing/a"],
         "cannot make --audio-dir {tmp}/missing/a: no such file or directory"),
        (["--synthesize-only", "--audio-dir", "{tmp}/done"],
         "--audio-dir {tmp}/done already holds an evaluation's audio (manifest.json): give a new or empty "
         "directory"),
        (["--batch", "0"], "--batch must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_the_phase_options_are_checked_before_any_work(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(tts_eval, "evaluate", NoASR)
    monkeypatch.setattr(tts_eval, "synthesize_audio", NoASR)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "manifest.json").write_text("{}")
    assert main(["eval", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    expected = message.format(tmp=tmp_path, m=tmp_path / "a" / "manifest.json")
    assert capsys.readouterr().err.strip() == f"tts: error: {expected}"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """An audio directory that --synthesize-only wrote (2 texts x 2 seeds of the tiny model)."""
    from service_helpers import EndTokenNever

    from tts.engine import model_runner

    root = tmp_path_factory.mktemp("written")
    (root / "texts.txt").write_text("Hello there.\nThird one.\n")
    argv = ["eval", "--model", "tiny", "--sentences", str(root / "texts.txt"), "--seeds", "0-1"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(model_runner, "F", EndTokenNever())  # every sample has audio (8 frames)
        argv += ["--max-new-frames", "8", "--synthesize-only", "--audio-dir", str(root / "a"), "-q"]
        assert main(argv) == 0
    return root / "a"


@pytest.mark.parametrize(
    "breaks, message",
    [
        (None, "no {m} (give a directory that tts eval --synthesize-only --audio-dir wrote)"),
        ("not json", "{m} is not a tts eval manifest: the file: Invalid JSON: ..."),
        (lambda m: m.pop("texts"), "{m} is not a tts eval manifest: texts: Field required"),
        (lambda m: m.update(format="other/1"), "{m} is not a tts eval manifest: format: Input "
         "should be 'tts-eval-audio/1'"),
        (lambda m: m["samples"][1].update(frames="many"), "{m} is not a tts eval manifest: "
         "samples.1.frames: Input should be a valid integer, unable to parse string as an integer"),
        (lambda m: m["samples"].pop(), "{m} holds 3 samples, not one per text (2) and seed (2)"),
        (lambda m: m["samples"].reverse(), "{m}: sample 0 is seed 1 of 'Third one.', not seed "
         "0 of 'Hello there.' (samples go seed by seed, texts in order)"),
        (lambda m: m["samples"][2].update(file="../x.flac"), "{m}: sample 2's file '../x.flac' "
         "is not a name in {dir}"),
        (lambda m: m["samples"][2].update(file="gone.flac"), "cannot read {dir}/gone.flac: ..."),
        ("not flac", "cannot read {dir}/seed0_text0001.flac: ..."),
        (lambda m: m.update(sample_rate=8000), "{dir}/seed0_text0000.flac holds {n} samples at 16000 Hz in 1 "
         "channel(s); {m} says {half} at 8000 Hz, mono"),
    ],
)  # fmt: skip
def test_from_audio_refuses_a_missing_or_broken_manifest_with_one_line(
    tmp_path, written, capsys, monkeypatch, breaks, message
):
    monkeypatch.setattr(tts_eval, "ASR", NoASR)
    audio_dir = tmp_path / "copy"
    audio_dir.mkdir()
    for f in written.iterdir():
        (audio_dir / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((written / "manifest.json").read_text())
    if breaks is None:
        (audio_dir / "manifest.json").unlink()
    elif breaks == "not json":
        (audio_dir / "manifest.json").write_text("{not json")
    elif breaks == "not flac":
        (audio_dir / "seed0_text0001.flac").write_bytes(b"fLaC" + bytes(100))
    else:
        breaks(manifest)
        (audio_dir / "manifest.json").write_text(json.dumps(manifest))
    seconds = json.loads((written / "manifest.json").read_text())["samples"][0]["audio_seconds"]
    assert main(["eval", "--from-audio", str(audio_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    expected = "tts: error: --from-audio: " + message.format(
        dir=audio_dir, m=audio_dir / "manifest.json", n=round(seconds * 16000), half=round(seconds * 8000)
    )
    if expected.endswith("..."):  # (the JSON parser's or libsndfile's own words follow)
        assert err.startswith(expected[:-3])
    else:
        assert err.strip() == expected


def test_eval_loads_the_model_in_the_dtype_asked_for(monkeypatch, capsys, tmp_path):
    """`tts eval --dtype bfloat16` loads the weights in bfloat16 (the option was parsed and then not
    passed on): the load is stopped there, the dtype it was asked for recorded."""
    import torch

    import tts.checkpoints.load
    from tts.cli.main import main

    asked = {}

    def load(spec, device="cpu", dtype=None, **kwargs):
        asked["dtype"] = dtype
        raise RuntimeError("stopped at the load")

    monkeypatch.setattr(tts.checkpoints.load, "load_bundle", load)
    out = tmp_path / "audio"  # (the synthesis phase: no ASR needed)
    argv = ["eval", "--dtype", "bfloat16", "--limit", "1", "--seeds", "0", "--synthesize-only"]
    assert main([*argv, "--audio-dir", str(out)]) == 1
    assert asked["dtype"] == torch.bfloat16
    assert "stopped at the load" in capsys.readouterr().err
