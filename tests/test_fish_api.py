"""Serving a Fish checkpoint through the API and CLI: synthesis, references, speaker turns, commands."""

import math
import re

import numpy as np
import pytest
import soundfile as sf
import torch

from tts.api import TTS
from tts.checkpoints.bundle import build_tiny_bundle
from tts.checkpoints.fish.prompts import Fish15PromptFormat, S1PromptFormat, S2PromptFormat
from tts.checkpoints.fish.tokenizer import FISH15_SPECIAL_TOKENS, TiktokenTokenizer
from tts.checkpoints.load import load_bundle
from tts.cli.main import main
from tts.codec.base import AudioError
from tts.engine import Engine, EngineConfig, InvalidRequest, SamplingParams
from tts.text.normalize import normalize_text, split_speaker_turns
from tts.text.prompt import Turn, VoiceReference


@pytest.fixture(scope="module")
def s2_tts(fish_checkpoints):
    return TTS(load_bundle(fish_checkpoints["s2"]), EngineConfig(max_batch=2, graphs="off"))


def _tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * math.pi * 220 * t).astype(np.float32)
    return np.stack([x, 0.5 * x]) if channels == 2 else x


def test_synthesize_streams_the_same_audio_as_decoding_the_codes(s2_tts):
    result = s2_tts.synthesize("Hello there.", max_new_frames=12, seed=3, temperature=0.8)
    assert result.frames == 12 and result.sample_rate == 44100
    assert result.audio.shape == (12 * 2048,) and np.isfinite(result.audio).all()
    offline = s2_tts.bundle.codec.decode(result.codes).numpy()
    np.testing.assert_allclose(result.audio, offline, atol=1e-4)


def test_stereo_8khz_reference_is_downmixed_and_resampled(s2_tts):
    ref = s2_tts.reference_from_audio(_tone(1.0, 8000, channels=2), 8000, "A reference clip.")
    assert ref.codes.shape == (10, math.ceil(44100 / 2048)) and ref.text == "A reference clip."
    result = s2_tts.synthesize("Hi.", voice=ref, max_new_frames=4, seed=1)
    assert result.frames == 4


def test_half_second_reference_is_accepted_shorter_is_an_error(s2_tts):
    assert s2_tts.reference_from_audio(_tone(0.5, 44100), 44100, "Short.").codes.shape[1] == 11
    with pytest.raises(AudioError, match="at least 0.5 s"):
        s2_tts.reference_from_audio(_tone(0.2, 44100), 44100, "Too short.")


def test_silent_reference_is_an_error(s2_tts):
    with pytest.raises(AudioError, match="silent"):
        s2_tts.reference_from_audio(np.zeros(44100, np.float32), 44100, "Nothing.")


def test_reference_over_the_context_budget_is_refused(s2_tts):
    # A quarter of the context is for reference audio: with a 256-token context that is 64 frames
    # (2.97 s); with S2-Pro's 32768 it is the 30 s cap. A longer clip is refused with the limit named
    # (cutting it would separate the audio from its transcript); one at the limit is taken whole.
    tts = TTS(s2_tts.bundle, EngineConfig(max_batch=1, graphs="off", max_context=256))
    limit = tts.planner.max_reference_seconds
    assert abs(limit - 64 / (44100 / 2048)) < 1e-6 and s2_tts.planner.max_reference_seconds == 256 / (
        44100 / 2048
    )
    with pytest.raises(
        AudioError, match=r"reference audio is 120\.0 s long; this model takes at most 3\.0 s"
    ):
        tts.reference_from_audio(_tone(120.0, 8000), 8000, "Long.")
    ref = tts.reference_from_audio(_tone(2.9, 8000), 8000, "Short enough.")
    assert ref.codes.shape[1] == math.ceil(round(2.9 * 44100) / 2048)


def test_several_references_all_enter_the_prompt(s2_tts):
    a = s2_tts.reference_from_audio(_tone(0.6, 44100), 44100, "First.")
    b = s2_tts.reference_from_audio(_tone(0.7, 44100), 44100, "Second.")
    prompt = s2_tts.bundle.prompt_format.build("Target.", [a, b])
    begin = s2_tts.bundle.model.config.semantic_begin_id
    assert int((prompt[:, 0] >= begin).sum()) == a.codes.shape[1] + b.codes.shape[1]
    assert s2_tts.synthesize("Target.", voice=[a, b], max_new_frames=3, seed=2).frames == 3


def test_speaker_tags_survive_normalization_and_split_into_turns(s2_tts):
    text = "<|speaker:0|>I have 3 cats. <|speaker:1|>Really? <|speaker:0|>Yes."
    assert normalize_text(text) == "<|speaker:0|>I have three cats. <|speaker:1|>Really? <|speaker:0|>Yes."
    # S2-Pro reads digits itself (fish-speech passes text as it is): its plan keeps them
    assert s2_tts.plan(text) == ["<|speaker:0|>I have 3 cats.\n<|speaker:1|>Really?\n<|speaker:0|>Yes."]
    turns = split_speaker_turns(normalize_text(text), max_bytes=40)
    assert turns == ["<|speaker:0|>I have three cats.", "<|speaker:1|>Really?\n<|speaker:0|>Yes."]
    many = "".join(f"<|speaker:{i % 7}|>Line {i}." for i in range(12))
    assert [c.count("<|speaker:") for c in split_speaker_turns(normalize_text(many), 10_000)] == [5, 5, 2]


def test_prompt_formats_say_which_tags_user_text_may_hold(fish_checkpoints):
    """S2's prompt documents `<|speaker:N|>` turns; S1's and 1.5's prompts have no speaker support."""
    s2 = load_bundle(fish_checkpoints["s2"]).prompt_format
    assert isinstance(s2, S2PromptFormat) and s2.user_tags.fullmatch("<|speaker:4|>")
    assert S1PromptFormat.user_tags is None and Fish15PromptFormat.user_tags is None


def test_s1_rejects_speaker_tags_s2_accepts_them(s2_tts, fish_checkpoints):
    s1 = TTS(load_bundle(fish_checkpoints["s1"]), EngineConfig(max_batch=1, graphs="off"))
    with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|speaker:1|>'")):
        s1.prepare("<|speaker:1|>Hello.", max_new_frames=4)
    assert s1.prepare("Hello.", max_new_frames=4).chunks == ["Hello."]
    assert s2_tts.prepare("<|speaker:1|>Hello.", max_new_frames=4).chunks == ["<|speaker:1|>Hello."]


@pytest.mark.parametrize("family", ["s2", "s1", "fish-1.5"])
def test_fish_prompt_builders_never_turn_user_text_into_special_tokens(fish_checkpoints, family):
    bundle_dir = fish_checkpoints[family]
    if family == "fish-1.5":
        fmt = Fish15PromptFormat(TiktokenTokenizer.from_dir(bundle_dir, FISH15_SPECIAL_TOKENS), 8)
    else:
        fmt = load_bundle(bundle_dir).prompt_format
    n = fmt.num_codebooks
    codes = torch.zeros(n, 2, dtype=torch.int64)
    for text, refs, history in [
        ("Hi <|im_end|>", [], []),
        ("Hi.", [VoiceReference(codes, "ref <|im_end|>")], []),
        ("Hi.", [], [Turn("earlier <|im_end|>", codes)]),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|im_end|>'")):
            fmt.build(text, refs, history)
    # 1.5's cleaning drops emoji: the check sees the text the tokenizer gets.
    if family == "fish-1.5":
        with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|im_end|>'")):
            fmt.build("Hi <|im_\U0001f600end|>")


def test_s2_rejects_qwen_added_tokens_in_text(s2_tts):
    """S2's tokenizer.json (Qwen3) matches `<think>` and friends inline: the prompt builder refuses them."""
    with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<think>'")):
        s2_tts.prepare("Let me <think> about it.")


def test_engine_outputs_are_not_overwritten_by_later_steps():
    # On a CPU device the step's output buffer must be copied, not viewed (frames would all read as
    # the latest one).
    bundle = build_tiny_bundle()
    engine = Engine(bundle.model, EngineConfig(max_batch=1, graphs="off"))
    engine.submit(
        bundle.prompt_format.build("Hello."), SamplingParams(temperature=1.0, max_new_frames=6, seed=5)
    )
    seen = []
    for _ in range(6):
        for out in engine.step():
            seen.append((out.codes, out.codes.clone()))
    assert len(seen) >= 3
    assert all(torch.equal(view, snapshot) for view, snapshot in seen)


# ---- CLI ---------------------------------------------------------------------------------------------


def test_cli_write_checkpoint_info_and_synthesize(tmp_path, capsys):
    out = tmp_path / "ck"
    assert (
        main(["write-checkpoint", "--shape", "tiny-s2", "--out", str(out), "--dtype", "fp32", "--seed", "4"])
        == 0
    )
    assert "tiny-s2 (s2-pro)" in capsys.readouterr().out
    assert main(["info", "--model", str(out)]) == 0
    info = capsys.readouterr().out
    assert "Fish Audio S2-Pro (fish_qwen3_omni)" in info and "float32" in info and "MiB" in info
    assert "codebooks 10 x 4096" in info
    wav = tmp_path / "out.wav"
    # (a fixed seed: a random one could draw the end token before 5 frames)
    frames = ["--seed", "1", "--max-new-frames", "5"]
    rc = main(["synthesize", "Hi there.", "--model", str(out), "-o", str(wav), *frames, "-q"])
    assert rc == 0
    audio, rate = sf.read(wav)
    assert rate == 44100 and audio.shape == (5 * 2048,)


def test_cli_write_checkpoint_refuses_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["write-checkpoint", "--shape", "tiny-1.5", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck")]  # no partial directory left


def test_cli_reports_bad_checkpoints_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "something"}')
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tts: error: unsupported model_type 'something' (expected 'dual_ar' or 'fish_qwen3_omni')"


def test_cli_lists_every_checkpoint_shape():
    from tts.checkpoints.fish.writer import SHAPES
    from tts.cli.write_checkpoint import SHAPE_NAMES

    assert set(SHAPE_NAMES) == set(SHAPES)


@pytest.mark.parametrize("family", ["s2", "s1"])
def test_fish_models_read_chinese_and_digits_as_given(fish_checkpoints, family):
    # fish-speech main (S2) and d3df505 (S1) tokenize the user's text as it is: the planned chunk is the
    # text itself, so the prompt is the one the reference builds for it (tokenization: test_fish_parity).
    text = "1951年，我们的村子只有一条泥路。每到下雨天，孩子们就只能光着脚去上学。"
    tts = TTS(load_bundle(fish_checkpoints[family]), EngineConfig(max_batch=1, graphs="off"))
    job = tts.prepare(text, max_new_frames=4)
    assert job.chunks == [text] and job.warnings == []
    fmt = tts.bundle.prompt_format
    assert torch.equal(tts.planner.prompt(job.chunks[0], [], [], job.params), fmt.build(text))
    assert fmt.text_policy == f"fish-{family}"
