"""An end token sampled before the text is said is refused in the stream (`Engine._refuse_end`), and a
chunk that still ends early says `short`, never `stop`. What the model samples is scripted: the end
token's logit is forced up at chosen step counters and down everywhere else (never left to random
weights), and the loop guard says when the text is said."""

import dataclasses
import time

import pytest
import torch
from helpers import ScriptedGuard, params, random_prompt

from tts.api import TTS
from tts.engine import Engine, EngineConfig, FinishReason
from tts.engine.aligner import MAX_END_REFUSALS, MAX_STALLED_REFUSALS, LoopGuard
from tts.engine.model_runner import ModelRunner
from tts.model.config import AlignerSpec


class SaidAfter(ScriptedGuard):
    """A stand-in guard with no repeats whose text counts as said once `said_at` frames are kept."""

    said_at = 0

    def said_all(self) -> bool:
        return self.kept >= self.said_at


@pytest.fixture
def script(monkeypatch):
    """script(ends, said_at): the end token is sampled at the step counters in `ends` (unless masked:
    min_new_frames or a refusal) and never elsewhere; guards say the text is said after `said_at` kept
    frames. Returns the step counters at which the end token was masked."""
    import tts.engine.engine as engine_module

    masked: list[int] = []
    original = ModelRunner.main_logits

    def apply(ends, said_at: int):
        monkeypatch.setattr(SaidAfter, "script", {})
        monkeypatch.setattr(SaidAfter, "said_at", said_at)
        monkeypatch.setattr(engine_module, "LoopGuard", SaidAfter)

        def main_logits(self, b, h_post, penalty):
            logits = original(self, b, h_post, penalty)
            steps = self.buffers.steps[:b]
            wanted = torch.tensor([int(s) in ends for s in steps])
            blocked = torch.isinf(logits[:, -1])
            masked.extend(int(s) for s, w, m in zip(steps, wanted, blocked, strict=True) if w and m)
            logits[:, -1] = torch.where(wanted & ~blocked, 1e4, float("-inf"))
            return logits

        monkeypatch.setattr(ModelRunner, "main_logits", main_logits)
        return masked

    return apply


def engine(model) -> Engine:
    cfg = EngineConfig(max_batch=2, graphs="off", block_size=8, aligner=AlignerSpec(1, (0, 3)))
    return Engine(model, cfg)


def drive(e: Engine):
    """Step until idle: (codes kept `[T, N]`, the finish output)."""
    kept, end = [], None
    while e.has_work():
        for out in e.step():
            if out.retract:
                del kept[-out.retract :]
            kept += list(out.codes)
            end = out if out.finished else end
    return torch.stack(kept), end


def test_an_end_token_before_the_text_is_said_is_refused_and_the_text_goes_on(tiny_model, script):
    """The end token at step 5 comes with the text unsaid: it is refused (its frame is no audio, so
    the 5 frames before it stay as they were), step 6 samples without it, and the end token at step 20,
    after the text is said (12 frames), ends the request `stop` with 19 frames."""
    prompt = random_prompt(tiny_model, 20, 0)
    p = params(max_new_frames=40, temperature=0.1, top_p=0.5)
    masked = script({30}, said_at=0)
    reference, _ = drive_one(tiny_model, prompt, p)  # no end token before step 30
    masked.clear()
    script({5, 6, 20}, said_at=12)
    e = engine(tiny_model)
    e.submit(prompt, p, "r", text_span=(2, 12))
    codes, end = drive(e)
    assert end.finish_reason == FinishReason.STOP and codes.shape[0] == 19
    assert e.end_refusals == 1 and masked == [6]  # the step after the refusal had no end token
    assert torch.equal(codes[:5], reference[:5])  # what was handed out before the refusal is unchanged
    assert e.scheduler.allocator.num_free == e.scheduler.allocator.num_usable
    again, _ = drive_one(tiny_model, prompt, p, {5, 6, 20}, 12, script)
    assert torch.equal(codes, again)  # the same seed gives the same codes, refusal and all


def drive_one(model, prompt, p, ends=None, said_at=None, script=None):
    if script is not None:
        script(ends, said_at)
    e = engine(model)
    e.submit(prompt, p, "r", text_span=(2, 12))
    return drive(e)


def test_refusals_are_bounded_and_an_end_that_stays_early_is_short(tiny_model, script):
    """An end token at every step from 3 on with the text never said: every other step is a refusal
    (the step after one is masked), MAX_END_REFUSALS of them, then the request ends `short`."""
    script(set(range(3, 1000)), said_at=10**6)
    e = engine(tiny_model)
    e.submit(random_prompt(tiny_model, 20, 1), params(max_new_frames=200), "r", text_span=(2, 12))
    codes, end = drive(e)
    assert end.finish_reason == FinishReason.SHORT
    assert e.end_refusals == MAX_END_REFUSALS and codes.shape[0] == 3 + MAX_END_REFUSALS


def test_refusals_stop_when_the_speech_does_not_go_on_through_the_text(tiny_model, script, monkeypatch):
    """With the text position stuck, refusing more would only add babble: after MAX_STALLED_REFUSALS
    refusals in a row that found it no further on, the end token ends the request `short`."""
    script(set(range(3, 1000)), said_at=10**6)
    monkeypatch.setattr(SaidAfter, "reached", lambda self: 1)
    e = engine(tiny_model)
    e.submit(random_prompt(tiny_model, 20, 1), params(max_new_frames=200), "r", text_span=(2, 12))
    codes, end = drive(e)
    assert end.finish_reason == FinishReason.SHORT
    assert e.end_refusals == MAX_STALLED_REFUSALS and codes.shape[0] == 3 + MAX_STALLED_REFUSALS


def test_an_end_far_earlier_than_the_end_floor_is_refused(tiny_model, script):
    """The text counts as said, but an end token before the request's end_floor (8 frames) is refused."""
    script({2, 9}, said_at=0)
    e = engine(tiny_model)
    e.submit(random_prompt(tiny_model, 20, 2), params(max_new_frames=40), "r", text_span=(2, 12), end_floor=8)
    codes, end = drive(e)
    assert (end.finish_reason, codes.shape[0], e.end_refusals) == (FinishReason.STOP, 8, 1)


def test_a_refusal_masks_the_end_token_for_one_step_only(tiny_model, script):
    """Refused at step 3, masked at step 4, and at step 5 (4 frames kept, the text said) it ends the
    request: the row's min_frames is the caller's again after the masked step."""
    masked = script({3, 4, 5}, said_at=4)
    e = engine(tiny_model)
    e.submit(random_prompt(tiny_model, 20, 3), params(max_new_frames=40), "r", text_span=(2, 12))
    codes, end = drive(e)
    assert masked == [4] and e.end_refusals == 1
    assert (end.finish_reason, codes.shape[0]) == (FinishReason.STOP, 4)


def test_a_refusal_in_the_step_where_an_earlier_row_finishes_goes_on_in_the_row_it_moved_to(
    tiny_model, script
):
    """Row 0 ends at step 4 while row 1's end token at step 4 is refused: finishing row 0 moves row 1's
    request into row 0, and the refusal rewinds and reactivates that row (not the vacated one), so the
    request goes on and ends at step 20 with the codes it has alone."""
    script({4, 20}, said_at=10)
    prompt, p = random_prompt(tiny_model, 20, 1), params(max_new_frames=40)
    alone, _ = drive_one(tiny_model, prompt, p)
    e = engine(tiny_model)
    e.submit(random_prompt(tiny_model, 20, 0), params(max_new_frames=40), "a")  # unguarded: ends at 4
    e.submit(prompt, p, "r", text_span=(2, 12))
    kept, ends = [], {}
    for _ in range(100):  # (bounded: a request left on an inactive row would never end)
        if not e.has_work():
            break
        for out in e.step():
            if out.request_id == "r":
                if out.retract:
                    del kept[-out.retract :]
                kept += list(out.codes)
            if out.finished:
                ends[out.request_id] = out.finish_reason
    assert ends == {"a": FinishReason.STOP, "r": FinishReason.STOP} and e.end_refusals == 1
    assert torch.equal(torch.stack(kept), alone) and alone.shape[0] == 19
    assert e.scheduler.allocator.num_free == e.scheduler.allocator.num_usable


def test_the_guard_says_whether_the_text_was_said():
    guard = LoopGuard(10)
    for position in [0, 1, 2, 3, 4, 5, 6, 6, 6]:
        guard.push(position)
    assert not guard.said_all()
    for position in [7, 8, 8, 8]:
        guard.push(position)
    assert guard.said_all() and guard.reached() == 8


def guarded_tts(tiny_bundle) -> TTS:
    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    return TTS(bundle, EngineConfig(max_batch=2, graphs="off"))


def test_a_synthesis_that_ends_before_its_text_is_said_is_short_with_a_warning(tiny_bundle, script):
    script(set(range(3, 1000)), said_at=10**6)
    result = guarded_tts(tiny_bundle).synthesize("A few words of text to read.", seed=3)
    assert result.finish_reasons == [FinishReason.SHORT]
    assert any("before its text was said" in w for w in result.warnings)


@pytest.fixture
def guarded_tiny(monkeypatch, tiny_bundle):
    """`--model tiny` loads the tiny bundle with aligner heads (so that its requests are guarded)."""
    import tts.checkpoints.load as load

    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    monkeypatch.setattr(load, "load_bundle", lambda *a, **kw: bundle)


@pytest.mark.parametrize("keep", [False, True])
def test_the_cli_writes_no_short_file_and_exits_3_unless_keep_partial(
    tmp_path, capsys, script, guarded_tiny, keep
):
    from tts.cli.main import EXIT_INCOMPLETE, main

    script(set(range(3, 1000)), said_at=10**6)  # every end token early: the text ends `short`
    out = tmp_path / "out.wav"
    argv = ["synthesize", "A few words of text to read.", "-o", str(out), "--model", "tiny", "--seed", "1"]
    code = main([*argv, "--keep-partial"] if keep else argv)
    err = capsys.readouterr().err
    assert "before its text was said" in err
    if keep:
        assert code == 0 and out.is_file()
    else:
        assert code == EXIT_INCOMPLETE and not out.exists()
        assert "tts: error: the speech ended before the text was said" in err


def test_the_cli_exits_0_when_the_text_is_said(tmp_path, script, guarded_tiny):
    from tts.cli.main import main

    script({3, 30}, said_at=5)  # refused at 3, said by 30
    out = tmp_path / "out.wav"
    assert main(["synthesize", "A few words.", "-o", str(out), "--model", "tiny", "--seed", "1", "-q"]) == 0
    assert out.is_file()


def test_a_pass_whose_step_refused_an_end_token_made_progress(tiny_bundle, script):
    """The service's job pipeline: a pass whose only event is a frame step that refused an end token
    (its frame taken back, so no output) must report progress, or the engine loop sleeps on a request
    that still has work and its stream hangs. No audio chunk is due before the refusal at step 5 (the
    first chunk has 16 frames), so no codec result can stand in for the progress."""
    from tts.engine import for_bundle
    from tts.runtime.jobs import Finished, JobPipeline, ListSink
    from tts.runtime.planner import Planner

    script({5, 20}, said_at=12)
    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    engine = Engine(bundle.model, for_bundle(EngineConfig(max_batch=2, graphs="off"), bundle))
    pipeline = JobPipeline(engine, Planner(bundle, engine.max_context, engine.check), max_streams=2)
    try:
        spec = Planner(bundle, engine.max_context, engine.check).job(
            "A few words of text to read.", seed=1, max_new_frames=40, first_chunk_frames=16
        )
        sink = ListSink()
        pipeline.submit(spec, sink)
        passes = 0
        while engine.end_refusals == 0:
            assert engine.has_work() and passes < 50
            frames = engine.frames_generated
            progressed = pipeline.step()
            passes += 1
            if engine.end_refusals:  # this pass refused the end token
                assert engine.frames_generated == frames + 1 and progressed
        deadline = time.monotonic() + 60  # a safety bound: the rest waits on the codec worker
        while not any(isinstance(e, Finished) for e in sink.events):
            assert time.monotonic() < deadline, "the job did not finish"
            if not pipeline.step():
                time.sleep(0.001)
        [finished] = [e for e in sink.events if isinstance(e, Finished)]
        assert finished.finish_reasons == [FinishReason.STOP] and engine.end_refusals == 1
    finally:
        pipeline.stage.stop()


def test_a_reading_whose_heads_hold_on_the_last_phoneme_has_said_its_text():
    """The default voice's text tokens are the bytes of its IPA: "things." ends in ŋ (two bytes), z, ".".
    Its aligner heads hold on ŋ and pass "z." within a frame or two before the end token, so the
    furthest trusted position is the text's third token from the end, and that reading is complete
    (refused there, it ended `short` or babbled on). Four tokens short is still short."""
    guard = LoopGuard(20)
    for position in [0, 2, 4, 6, 8, 10, 12, 14, 16, 17, 17, 17, 18, 19, 15]:
        guard.push(position)
    assert guard.reached() == 17 and guard.said_all()
    early = LoopGuard(20)
    for position in [0, 2, 4, 6, 8, 10, 12, 14, 16, 16, 16, 18, 19, 15]:
        early.push(position)
    assert early.reached() == 16 and not early.said_all()
