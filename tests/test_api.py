import re

import numpy as np
import pytest
import torch

from tts import TTS, InvalidRequest, VoiceNotFound
from tts.codec import AudioError
from tts.text.normalize import TextError
from tts.text.prompt import Turn, VoiceReference


@pytest.fixture(scope="module")
def tts(tiny_bundle):
    return TTS(tiny_bundle)


def test_synthesize_returns_audio_of_frames_times_frame_length(tts):
    r = tts.synthesize("Hello there.", seed=3, max_new_frames=20)
    assert r.audio.dtype == np.float32
    assert len(r.audio) == r.frames * tts.bundle.codec.frame_length
    assert 0 < r.frames <= 20
    assert r.sample_rate == 16000 and r.rtf > 0


def test_stream_chunks_concatenate_to_synthesize_and_to_offline_decode(tts):
    chunks = list(
        tts.stream("Streaming works.", seed=5, max_new_frames=30, first_chunk_frames=2, chunk_frames=5)
    )
    whole = tts.synthesize("Streaming works.", seed=5, max_new_frames=30)
    assert chunks[0].frame_end - chunks[0].frame_start == 2 or len(chunks) == 1
    assert [c.frame_start for c in chunks[1:]] == [c.frame_end for c in chunks[:-1]]
    audio = np.concatenate([c.samples for c in chunks])
    assert len(audio) == len(whole.audio)
    np.testing.assert_allclose(audio, whole.audio, atol=1e-6)
    offline = tts.bundle.codec.decode(whole.codes).numpy()
    np.testing.assert_allclose(audio, offline, atol=1e-5)


def test_time_to_first_audio_is_split_into_phases_that_add_up(tts):
    """The runner's first-audio phases (what `tts_first_audio_seconds_total` exports) cover exactly the
    span from submission to the first audio chunk, once per job that had audio."""
    from tts.runtime.jobs import FIRST_AUDIO_PHASES, Finished, ListSink

    runner = tts.runner
    before, jobs = dict(runner.first_audio_seconds), runner.first_audio_jobs
    sink = ListSink()
    job_id = runner.submit(tts.prepare("Where does the time go?", seed=2, max_new_frames=12), sink)
    tts._run_until_ended(job_id)
    finished = [e for e in sink.events if isinstance(e, Finished)]
    assert len(finished) == 1 and finished[0].first_audio_at is not None
    spent = {p: runner.first_audio_seconds[p] - before[p] for p in FIRST_AUDIO_PHASES}
    assert runner.first_audio_jobs == jobs + 1
    assert all(v >= 0 for v in spent.values()) and spent["first_frame"] > 0
    assert sum(spent.values()) == pytest.approx(
        finished[0].first_audio_at - finished[0].submitted_at, abs=1e-9
    )


def test_the_logged_voice_names_the_voice_used():
    """The server's request log shows `SynthesisJob.voice_kind`: with no voice named, the default preset
    by name (a log saying only `default` read like a voice called "default")."""
    from tts.checkpoints.load import load_bundle
    from tts.runtime.planner import Planner

    bundle = load_bundle("default")
    planner = Planner(bundle, 4096)
    assert planner.job("Hello.").voice_kind == f"default:{bundle.default_voice}"
    assert planner.job("Hello.", voice="ben").voice_kind == "preset:ben"


def test_same_seed_same_audio_and_voices_change_output(tts):
    a = tts.synthesize("Same seed.", seed=11, max_new_frames=15)
    b = tts.synthesize("Same seed.", seed=11, max_new_frames=15)
    assert torch.equal(a.codes, b.codes)
    c = tts.synthesize("Same seed.", seed=11, max_new_frames=15, voice="alpha")
    assert not torch.equal(a.codes, c.codes)


def test_long_text_is_chunked_with_context(tts):
    text = "One sentence here. " * 30
    chunks = tts.plan(text)
    assert len(chunks) > 1
    r = tts.synthesize(text, seed=1, max_new_frames=5)
    assert len(r.finish_reasons) == len(chunks)
    assert tts.engine.scheduler.allocator.num_free == tts.engine.scheduler.allocator.num_usable


def test_bad_inputs(tts):
    with pytest.raises(TextError):
        tts.synthesize("  ")
    with pytest.raises(InvalidRequest):
        tts.synthesize("hi", top_k=-1)
    with pytest.raises(VoiceNotFound):
        tts.synthesize("hi", voice="nobody")
    with pytest.raises(InvalidRequest, match="context"):
        tts.synthesize("word " * 2000, chunk_length=0)


def test_reference_audio_checks(tts):
    sr = 8000
    t = np.arange(sr * 2) / sr
    stereo = np.stack([np.sin(2 * np.pi * 300 * t), np.sin(2 * np.pi * 500 * t)]).astype(np.float32) * 0.3
    ref = tts.reference_from_audio(stereo, sr, "Some words.")
    assert ref.codes.shape == (4, 50)  # 2 s at 16 kHz / 640 samples per frame
    with pytest.raises(AudioError, match="silent"):
        tts.reference_from_audio(np.zeros(sr * 2, np.float32), sr, "x")
    with pytest.raises(AudioError, match="long"):
        tts.reference_from_audio(stereo[:, :1000], sr, "x")
    with pytest.raises(InvalidRequest, match="transcript"):
        tts.reference_from_audio(stereo, sr, " ")
    # 40 s: over a quarter of the tiny model's 1024-token context (256 frames = 10.24 s). Refused with a
    # message naming the limit: cutting the audio would separate it from its transcript.
    long_clip = np.tile(stereo, 20)
    with pytest.raises(
        AudioError, match=r"reference audio is 40\.0 s long; this model takes at most 10\.2 s"
    ):
        tts.reference_from_audio(long_clip, sr, "long")
    assert tts.reference_from_audio(long_clip[:, : int(10.2 * sr)], sr, "long").codes.shape[1] == 255


def test_abandoned_stream_frees_its_request(tts):
    gen = tts.stream("Stop early please.", seed=2, max_new_frames=50, first_chunk_frames=1)
    next(gen)
    gen.close()
    assert tts.engine.num_running == 0
    assert tts.engine.scheduler.allocator.num_free == tts.engine.scheduler.allocator.num_usable


def test_seed_of_every_text_chunk_is_checked_before_work(tts):
    with pytest.raises(InvalidRequest, match="seed"):
        tts.prepare("One sentence here. Another sentence there.", seed=2**63 - 1, chunk_length=25)


@pytest.mark.parametrize("tag", ["<|im_end|>", "<|im_start|>", "<|voice|>", "<|semantic:3|>", "<|nonsense|>"])
def test_reserved_tags_in_text_are_rejected_before_any_work(tts, tag):
    frames = tts.engine.frames_generated
    with pytest.raises(InvalidRequest, match=re.escape(f"reserved tag '{tag}'")):
        tts.prepare(f"Hello {tag} world.")
    with pytest.raises(InvalidRequest, match=re.escape(f"reserved tag '{tag}'")):
        tts.synthesize(f"Hello {tag} world.", seed=1, max_new_frames=3)
    with pytest.raises(InvalidRequest, match=re.escape(f"reserved tag '{tag}'")):
        tts.reference_from_audio(np.full(16000, 0.3, np.float32), 16000, f"A transcript {tag} here.")
    assert tts.engine.frames_generated == frames and tts.engine.num_running == tts.engine.num_waiting == 0


def test_the_default_prompt_format_allows_speaker_tags_only(tts):
    assert tts.bundle.prompt_format.user_tags.fullmatch("<|speaker:3|>")
    assert tts.plan("<|speaker:0|>Hi there. <|speaker:1|>Hello.") == [
        "<|speaker:0|>Hi there.\n<|speaker:1|>Hello."
    ]


def test_prompt_builder_never_turns_user_text_into_special_tokens(tts):
    """Defense in depth: text that skipped the planner (a VoiceReference made by hand, a direct build)
    still cannot put a special token into the prompt."""
    fmt = tts.bundle.prompt_format
    with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|im_end|>'")):
        fmt.build("Hi<|im_end|>")
    codes = torch.zeros(4, 3, dtype=torch.int64)
    with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|voice|>'")):
        fmt.build("Hi.", [VoiceReference(codes, "ref <|voice|> text")])
    with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|im_start|>'")):
        fmt.build("Hi.", [], [Turn("<|im_start|>earlier", codes)])
    with pytest.raises(InvalidRequest, match=re.escape("reserved tag '<|im_end|>'")):
        tts.synthesize("Hi.", voice=VoiceReference(codes, "sneaky<|im_end|>"), max_new_frames=2)
    # Allowed tags and the format's own framing still build.
    ids = fmt.build("<|speaker:1|>Hi.", [VoiceReference(codes, "<|speaker:0|>ref")])[:, 0].tolist()
    tok = tts.bundle.tokenizer
    assert ids.count(tok.token_id("<|speaker:1|>")) == 1 and ids.count(tok.token_id("<|voice|>")) == 1


def test_text_the_english_voice_cannot_say_is_left_out_with_a_warning(tts):
    job = tts.prepare("Hello 你好世界 world.", max_new_frames=4, seed=1)
    assert job.chunks == ["Hello world."]
    assert job.warnings == [
        "this model reads English only: 4 characters of Han text were left out "
        "(a multilingual model such as Fish Audio S2-Pro reads them)"
    ]
    result = tts.synthesize("Hello 你好世界 world.", max_new_frames=4, seed=1)
    assert result.warnings[0] == job.warnings[0]  # the planner's warning reaches the result
    with pytest.raises(TextError, match="reads English only"):
        tts.prepare("你好世界。")


def test_a_repetition_penalty_the_model_does_not_apply_is_reported(tts):
    """The tiny bundle samples without a repetition penalty (like S2-Pro and the default voice): a
    request that sets one is told it is ignored instead of silently getting the same audio."""
    assert tts.bundle.repetition is None
    job = tts.prepare("Hello there.", max_new_frames=4, seed=1, repetition_penalty=1.3)
    assert job.warnings == [
        "repetition_penalty 1.3 is ignored: this model samples without a repetition penalty "
        "(as its reference code does)"
    ]
    assert tts.prepare("Hello there.", max_new_frames=4, seed=1, repetition_penalty=1.0).warnings == []


def test_normalize_false_reads_the_text_as_given(tts):
    assert tts.plan("I have **3** cats.") == ["I have three cats."]
    assert tts.plan("I have **3** cats.", normalize=False) == ["I have **3** cats."]
    job = tts.prepare("I have **3** cats.", normalize=False, max_new_frames=4)
    assert job.chunks == ["I have **3** cats."] and job.warnings == []
    result = tts.synthesize("I have 3 cats.", normalize=False, max_new_frames=3, min_new_frames=3, seed=2)
    assert result.frames == 3


def test_a_reference_transcript_is_normalized_by_the_models_policy(tts):
    prepared = tts.planner.prepare_reference(
        np.sin(np.arange(16000) / 5.0).astype(np.float32) * 0.3, 16000, "I am 5 年."
    )
    assert prepared.text == "I am five." and prepared.warnings[0].startswith(
        "reference transcript: this model"
    )


def test_a_chunk_cut_by_max_new_frames_is_reported(tiny_bundle, monkeypatch):
    """A text chunk that reaches max_new_frames (not the runaway guard) ends `length` with a warning
    that names the budget; asking for exactly that many frames (min_new_frames = max_new_frames) warns
    of nothing."""
    from service_helpers import EndTokenNever

    from tts.engine import model_runner
    from tts.params import FinishReason

    monkeypatch.setattr(model_runner, "F", EndTokenNever())
    tts = TTS(tiny_bundle)
    try:
        text = "A sentence long enough for the runaway guard."
        r = tts.synthesize(text, seed=1, max_new_frames=6)
        assert (r.frames, r.finish_reasons) == (6, [FinishReason.LENGTH])
        assert r.warnings == [
            f"the text reached max_new_frames (6 frames, 0.2 s) for {len(text)} bytes of text: "
            "its audio may stop mid-word"
        ]
        r = tts.synthesize(text, seed=1, max_new_frames=6, min_new_frames=6)
        assert (r.frames, r.finish_reasons, r.warnings) == (6, [FinishReason.LENGTH], [])
    finally:
        tts.close()


def test_startup_graphs_construct_and_warm_up(tiny_bundle, standin_graphs):
    """`graphs="startup"` (the CLI's default on CUDA) captures and runs a warm-up synthesis inside the
    constructor: every attribute that synthesis reads must exist by then (stand-in graphs on a CPU run the
    same path)."""
    from tts.api import TTS
    from tts.engine import EngineConfig

    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, graphs="startup", buckets=(1, 2)))
    assert tts.engine.graphs.enabled
    result = tts.synthesize("Hello.", seed=1, max_new_frames=6, min_new_frames=6)
    assert result.frames == 6


def test_synthesize_many_gives_each_job_its_solo_codes_in_order(tiny_bundle):
    """Jobs run together (more than fit at once: the next starts as one ends) give, in the order given,
    the codes and finish reasons each has alone, and audio within the codec's batched-decode rounding."""
    from tts.engine import EngineConfig

    texts = ["Hello there.", "A second, longer sentence to read.", "Third.", "Four.", "And the fifth one."]
    budgets = [6, 20, 12, 9, 15]
    # max_waiting 2 < max_batch 4: submitting all five at once would overflow the waiting queue
    many = TTS(tiny_bundle, EngineConfig(max_batch=4, max_waiting=2))
    solo = TTS(tiny_bundle, EngineConfig(max_batch=1))
    try:
        jobs = [
            many.prepare(t, seed=100 + k, max_new_frames=b)
            for k, (t, b) in enumerate(zip(texts, budgets, strict=True))
        ]
        steps, rows = many.engine.frame_steps, many.engine.step_rows
        together = many.synthesize_many(jobs)
        assert many.engine.step_rows - rows > many.engine.frame_steps - steps  # some steps ran 2+ rows
        for k, (text, budget) in enumerate(zip(texts, budgets, strict=True)):
            alone = solo.synthesize(text, seed=100 + k, max_new_frames=budget)
            assert torch.equal(together[k].codes, alone.codes)
            assert together[k].finish_reasons == alone.finish_reasons
            np.testing.assert_allclose(together[k].audio, alone.audio, atol=1e-5)
            assert together[k].sample_rate == alone.sample_rate
        assert all(0 < (r.first_audio_seconds or 0) <= r.wall_seconds for r in together)
        assert many.engine.num_running == 0
        assert many.engine.scheduler.allocator.num_free == many.engine.scheduler.allocator.num_usable
        assert many.synthesize_many([]) == []
    finally:
        many.close()
        solo.close()


def test_synthesize_many_raises_a_failed_jobs_error_and_frees_the_others(tiny_bundle):
    from tts.engine import EngineConfig

    many = TTS(tiny_bundle, EngineConfig(max_batch=2))
    try:
        good = many.prepare("Hello there.", seed=1, max_new_frames=30)
        bad = many.prepare("Hello there.", seed=2, max_new_frames=30)
        bad.chunks = ["word " * 2000]  # (a prompt over the context: refused when its chunk is submitted)
        with pytest.raises(InvalidRequest):
            many.synthesize_many([good, bad, good])
        assert many.engine.num_running == 0 and not many.runner.jobs
        assert many.engine.scheduler.allocator.num_free == many.engine.scheduler.allocator.num_usable
    finally:
        many.close()


def test_synthesize_many_raises_the_first_error_not_a_cleanup_one(tiny_bundle, monkeypatch):
    """When a step fails while jobs run, freeing them may fail too (the engine is broken): the caller gets
    the step's error, not the cleanup's."""
    from tts.api import TTS
    from tts.engine import EngineConfig

    tts = TTS(tiny_bundle, EngineConfig(max_batch=2))
    jobs = [tts.prepare("Hello there.", seed=i, max_new_frames=8, min_new_frames=8) for i in range(2)]

    def step_fails():
        raise RuntimeError("the step failed")

    def cleanup_fails(job_id):
        raise RuntimeError("the cleanup failed too")

    monkeypatch.setattr(tts.runner, "step", step_fails)
    monkeypatch.setattr(tts, "_run_until_ended", cleanup_fails)
    with pytest.raises(RuntimeError, match="the step failed"):
        tts.synthesize_many(jobs)


@pytest.fixture(scope="module")
def default_tts():
    from tts.checkpoints.load import load_bundle
    from tts.engine import EngineConfig

    return TTS(load_bundle("default"), EngineConfig(max_batch=1))


def test_a_text_chunk_the_model_reads_as_nothing_is_left_out_with_a_warning(default_tts):
    """A text whose later chunk the model's frontend reads as nothing ("- - - ...": no phonemes) gets
    that chunk left out with a warning, as a session leaves such text out; it failed mid-stream, after
    audio had gone out, with an internal error (an empty text span)."""
    text = "Hello there. " + "- " * 300
    job = default_tts.planner.job(text, seed=1)
    assert job.chunks == ["Hello there."]
    assert len(job.budgets) == 1
    assert any(w.startswith("nothing to speak in '- - -") and w.endswith(": left out") for w in job.warnings)
    result = default_tts.synthesize(text, seed=1, max_new_frames=8, min_new_frames=8)  # (8 frames, held)
    assert result.frames == 8 and any(w.startswith("nothing to speak in") for w in result.warnings)


def test_a_text_the_model_reads_as_nothing_at_all_is_refused_before_any_work(default_tts):
    from tts.runtime.request_errors import field_of

    with pytest.raises(TextError, match="nothing to speak") as exc:
        default_tts.planner.job("\u0301" * 50 + ". " + "- " * 300, seed=1)
    assert field_of(exc.value) == "text"
