"""Real-time admission (tts.engine.realtime): a request waits while a playing stream lacks slack, and is
admitted once the streams built it, after its wait budget, or when nothing runs.

The engine's clock is a test clock that only the frame step and the prefill move (by fixed amounts:
a device of known speed), so every admission happens at an iteration these tests count exactly.
"""

import dataclasses
import math
import time

import pytest
import torch
from helpers import params, random_prompt, run_to_completion

from tts.engine import Engine, EngineConfig, realtime
from tts.engine.realtime import STEP_STALE, Playback, RealtimeAdmission, StepTimes
from tts.params import FrameConvention, chunk_size
from tts.runtime.jobs import Finished, JobPipeline, ListSink, _Job
from tts.runtime.planner import Planner

STEP = 0.04  # seconds per frame step, whatever the batch
PREFILL = 0.05  # seconds per iteration that prefills
RATE = 10.0  # frames of audio per second: a frame plays for 0.1 s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedEngine(Engine):
    """An engine whose clock moves only by the device's time: STEP per frame step, PREFILL per
    prefill."""

    def _start(self, admitted, outputs):
        if admitted:
            self.clock.now += PREFILL
        super()._start(admitted, outputs)

    def _frame_step(self, n, while_stepping=None):
        self.clock.now += STEP
        return super()._frame_step(n, while_stepping)


def timed_engine(model, **kw) -> TimedEngine:
    cfg = dict(max_batch=4, graphs="off", block_size=8, realtime_admission=True, realtime_margin=0.02)
    cfg.update(kw)
    return TimedEngine(model, EngineConfig(**cfg), clock=Clock())


def stream(engine, model, rid, seed, frames=40):
    """Submit a stream of `frames` frames (no end token before): chunks of 2, 2, then 4 frames."""
    return engine.submit(
        random_prompt(model, 9, seed),
        params(max_new_frames=frames, min_new_frames=frames, seed=seed),
        rid,
        playback=Playback(RATE, first=2, later=4),
    )


def steps_until_running(engine, request, limit=50) -> int:
    for i in range(1, limit + 1):
        engine.step()
        if engine.is_running(request.request_id):
            return i
    raise AssertionError(f"{request.request_id} was not admitted in {limit} iterations")


def test_playback_releases_chunks_as_the_job_runner_does():
    p = Playback(RATE, first=4, later=16)
    p.advance(3, now=1.0)
    assert (p.released, p.chunks, p.started) == (0, 0, None)
    p.advance(4, now=1.5)  # chunk 0: 4 frames; the player starts
    assert (p.released, p.chunks, p.started) == (4, 1, 1.5)
    p.advance(7, now=2.0)
    assert p.released == 4 and p.due() == 4  # chunk 1 is the first size again
    p.advance(8, now=2.1)  # chunk 1: 4 frames
    assert (p.released, p.chunks) == (8, 2) and p.due() == 8
    p.end_request(12)  # a text chunk ends: its frames stay pending (8 of them released)
    p.advance(3, now=2.9)  # the next text chunk's request: 15 frames, 7 pending: chunk 2 (8) not due
    assert (p.frames, p.released) == (15, 8)
    p.advance(4, now=3.1)
    assert (p.released, p.chunks) == (16, 3) and p.due() == 16
    # the player ran dry at 1.9 s (chunk 1 came at 2.1 s) and at 2.5 s (chunk 2 came at 3.1 s): it plays
    # chunk 2 from 3.1 s to 3.9 s; the next chunk (16 frames) needs 16 steps
    assert p.slack(now=3.1, step=0.02) == pytest.approx(3.9 - 3.1 - 16 * 0.02)
    assert [chunk_size(4, 16, k) for k in range(5)] == [4, 4, 8, 16, 16]


def test_a_held_back_chunk_goes_out_whole():
    """Frames the loop guard held go out with the chunk that comes due, as one release."""
    p = Playback(RATE, first=4, later=16)
    p.advance(4, now=0.0)
    p.advance(30, now=1.0)  # 26 pending at once (a hold let go): one release of all of them
    assert (p.released, p.chunks) == (30, 2)


def test_a_player_that_ran_dry_starts_again_on_the_next_chunk():
    """A chunk that comes after the player ran dry is played from its release on: the stream owes
    nothing for the gap (its slack is not negative for the rest of its life)."""
    p = Playback(RATE, first=4, later=16)
    p.advance(4, now=0.0)  # chunk 0: played until 0.4 s
    p.advance(8, now=1.0)  # chunk 1 (4 frames), 0.6 s late: played from 1.0 s to 1.4 s
    assert p.slack(now=1.0, step=0.01) == pytest.approx(1.4 - 1.0 - 8 * 0.01)  # chunk 2: 8 frames
    p.advance(16, now=1.2)  # in time: played after chunk 1, until 2.2 s
    assert p.slack(now=1.2, step=0.01) == pytest.approx(2.2 - 1.2 - 16 * 0.01)


def test_ramp_slack_is_the_tightest_chunk_of_the_ramp():
    p = Playback(RATE, first=4, later=16)
    # Chunks 4, 4, 8, 16, 16: chunk k + 1 comes after the steps of chunks 1..k+1 and must come before
    # the audio of chunks 0..k has played: chunk 1 (4 steps) within 0.4 s, chunk 2 (12) within 0.8 s,
    # chunk 3 (28) within 1.6 s, chunk 4 (44) within 3.2 s. At 0.02 s a step chunk 1 is the tightest.
    slacks = [0.4 - 4 * 0.02, 0.8 - 12 * 0.02, 1.6 - 28 * 0.02, 3.2 - 44 * 0.02]
    assert p.ramp_slack(0.02) == pytest.approx(min(slacks)) == pytest.approx(0.32)
    # At 0.055 s chunk 3 is: 0.18, 0.14, 0.06, 0.78 (the ramp's chunks of equal size 4, 4 do not end
    # the search: the chunks after them are bigger).
    assert p.ramp_slack(0.055) == pytest.approx(1.6 - 28 * 0.055)
    # 1.75x real time (28 frames in 1.6 s of audio): exactly in time
    assert p.ramp_slack(0.1 / 1.75) == pytest.approx(0.0, abs=1e-12)
    assert p.ramp_slack(0.058) < 0  # (chunks 1 and 2 alone would still be in time)
    assert p.ramp_slack(0.1) == -math.inf  # not faster than real time


def test_ramp_slack_of_ramps_that_do_not_grow():
    # Equal sizes from the first chunk on: every chunk gains, chunk 1 is the tightest.
    assert Playback(RATE, first=8, later=8).ramp_slack(0.05) == pytest.approx(0.8 - 8 * 0.05)
    # A large first chunk, then small ones (16, 4, 4, ...): chunk 1 is the tightest.
    assert Playback(RATE, first=16, later=4).ramp_slack(0.05) == pytest.approx(1.6 - 4 * 0.05)
    # 1, 1, 2, 4, ..., 128, 256, 256: below twice real time the tightest is the last chunk of the ramp,
    # chunk 9 (chunks 1..9: 511 steps) before the 256 frames of chunks 0..8 have played.
    assert Playback(RATE, first=1, later=256).ramp_slack(0.06) == pytest.approx(25.6 - 511 * 0.06)


def test_step_times_fall_back_to_the_nearest_measured_rows():
    t = StepTimes()
    assert t.step_seconds(8) is None and t.prefill(100) == 0.0
    t.observe_step(4, 0.02)
    t.observe_step(16, 0.03)
    assert t.step_seconds(8) == 0.02 and t.step_seconds(64) == 0.03 and t.step_seconds(2) == 0.02
    t.observe_prefill(100, 0.05)
    assert t.prefill(50) == 0.05 and t.prefill(200) == pytest.approx(0.1)


def test_a_step_time_not_measured_for_a_while_gives_way_to_a_fresh_one():
    # One slow step at 16 rows must not keep the batch below 16 for good: once that estimate is
    # STEP_STALE seconds old and the batch runs smaller, the nearest fresh one stands in (and the
    # next step at 16 rows measures it again).
    t = StepTimes()
    t.observe_step(8, 0.02, now=0.0)
    t.observe_step(16, 0.5, now=0.0)  # (a step slowed by something else on the GPU)
    assert t.step_seconds(16, now=1.0) == 0.5
    t.observe_step(8, 0.02, now=STEP_STALE + 1.0)
    assert t.step_seconds(16, now=STEP_STALE + 1.0) == 0.02
    t.observe_step(16, 0.03, now=STEP_STALE + 2.0)  # measured again: a fresh estimate
    assert t.step_seconds(16, now=STEP_STALE + 2.0) == 0.03


def test_a_request_waits_until_the_playing_stream_built_slack(tiny_model):
    """A's first chunk (2 frames, 0.2 s of audio) is out after its second step, at 0.13 s; its next
    (2 frames) needs 0.08 s: 0.12 s of slack, less B's prefill (0.05 s a prompt like A's, 9/8 of
    that for one token more: 0.056 s) is below the margin (0.08 s). B waits two iterations, until
    A's second chunk is out (0.21 s; the player has 0.32 s, the next chunk of 4 frames needs 0.16 s:
    0.16 s of slack, 0.104 s after the prefill), then joins."""
    engine = timed_engine(tiny_model, realtime_max_wait=10.0, realtime_margin=0.08)
    a = stream(engine, tiny_model, "a", 1)
    assert steps_until_running(engine, a) == 1
    engine.step()
    assert a.playback.started == pytest.approx(PREFILL + 2 * STEP)
    b = stream(engine, tiny_model, "b", 2)
    assert steps_until_running(engine, b) == 3  # two deferred, admitted on the third
    assert a.num_generated == 5  # frames 3-4 ran while B waited; the fifth with B
    assert engine.realtime.deferred == {"slack": 1, "speed": 0, "gather": 0} and engine.realtime.forced == 0
    assert b.deferred


def test_without_the_policy_the_request_joins_at_once(tiny_model):
    engine = timed_engine(tiny_model, realtime_admission=False)
    a = stream(engine, tiny_model, "a", 1)
    engine.step()
    engine.step()
    b = stream(engine, tiny_model, "b", 2)
    assert steps_until_running(engine, b) == 1
    assert a.playback is not None and a.playback.started is None  # (no policy: nothing kept up to date)


def test_a_request_that_waited_its_budget_is_admitted(tiny_model):
    """B arrives at 0.13 s with a 0.1 s budget: deferred at 0.13, 0.17, 0.21; at 0.25 s it has
    waited 0.12 s and joins although A still lacks slack (0.16 s from its second chunk on, less B's
    prefill, 0.056 s, is below the margin of 0.15 s until its third chunk, at 0.37 s)."""
    engine = timed_engine(tiny_model, realtime_max_wait=0.1, realtime_margin=0.15)
    a = stream(engine, tiny_model, "a", 1)
    engine.step()
    engine.step()
    b = stream(engine, tiny_model, "b", 2)
    assert steps_until_running(engine, b) == 4
    assert engine.realtime.forced == 1 and engine.realtime.deferred["slack"] == 1
    assert a.num_generated == 6  # B joined before the step of A's sixth frame (in its third chunk)


@pytest.mark.parametrize("ride_tokens, rides", [(256, True), (17, False)])
def test_a_waiting_request_rides_along_with_a_forced_prefill(tiny_model, monkeypatch, ride_tokens, rides):
    """As above, B is forced at 0.25 s. C came at 0.17 s and has waited only 0.08 s, and A still
    lacks slack; but B's prefill runs anyway and the pass holds 9 + 9 prompt tokens: C joins it (one
    packed pass), unless the pass may hold fewer tokens than that."""
    monkeypatch.setattr(realtime, "RIDE_ALONG_TOKENS", ride_tokens)
    engine = timed_engine(tiny_model, realtime_max_wait=0.1, realtime_margin=0.15, packed_prefill=True)
    a = stream(engine, tiny_model, "a", 1)
    engine.step()
    engine.step()
    b = stream(engine, tiny_model, "b", 2)
    engine.step()  # B deferred
    c = stream(engine, tiny_model, "c", 3)
    passes = engine.runner.prefill_passes
    assert steps_until_running(engine, b) == 3  # (0.17, 0.21 deferred; forced at 0.25)
    assert engine.is_running("c") == rides
    assert engine.runner.prefill_passes == passes + 1
    assert engine.realtime.forced == 1 and engine.realtime.rode_along == (1 if rides else 0)
    # (C behind the deferred B was not asked until B was forced; without riding it is deferred then)
    assert engine.realtime.deferred["slack"] == (1 if rides else 2)
    assert a.num_generated == 6
    if not rides:
        steps_until_running(engine, c)  # (in a pass of its own)
        assert engine.runner.prefill_passes == passes + 2


def test_riding_along_needs_a_pass_of_the_riders_kind_that_the_engine_packs():
    """A stream plays with 0.08 s of slack, below the margin: a new request rides along with a fresh
    prompt admitted before it (one packed pass), but not with a session's continuation (an extension
    pass apart from fresh prompts), and not where the engine prefills each prompt alone."""
    from types import SimpleNamespace

    def admission(packs=True):
        a = RealtimeAdmission(margin=0.15, max_wait=10.0, packs=packs)
        a.times.observe_step(2, STEP)
        a.times.observe_prefill(9, PREFILL)
        return a

    playing = Playback(RATE, first=2, later=4)
    playing.advance(2, 0.0)  # its first chunk out at 0 s: 0.2 s of audio, the next 2 frames due
    running = [SimpleNamespace(playback=playing, paused=False, stalled=False)]

    def request(cached=0):
        return SimpleNamespace(
            playback=Playback(RATE, first=2, later=4), prompt_len=9 + cached, cached=cached,
            arrival_time=0.0, deferred=False,
        )  # fmt: skip

    fresh, continuation = request(), request(cached=40)
    assert admission().admits(fresh, [request()], running, 2, now=0.04)
    assert not admission().admits(fresh, [continuation], running, 2, now=0.04)
    assert not admission(packs=False).admits(fresh, [request()], running, 2, now=0.04)
    assert admission().admits(request(cached=30), [continuation], running, 2, now=0.04)  # (its kind)
    a = admission()
    assert not a.admits(request(), [], running, 2, now=0.04)  # (nothing to ride with: deferred)
    assert a.deferred["slack"] == 1 and a.rode_along == 0


def test_nothing_running_admits_at_once(tiny_model):
    """A request finds nothing running: it is admitted in the first iteration, however slow the step."""
    engine = timed_engine(tiny_model)
    engine.realtime.times.observe_step(1, 10.0)  # (a step slower than real time)
    a = stream(engine, tiny_model, "a", 1)
    assert steps_until_running(engine, a) == 1
    assert engine.realtime.deferred == {"slack": 0, "speed": 0, "gather": 0}


def test_a_batch_too_slow_for_a_new_stream_takes_none_until_one_ends(tiny_model):
    """At 0.07 s a step, a new stream of chunks 2, 2, 4 cannot be in time (chunks 1 and 2, 6 frames,
    within the 0.4 s of audio of chunks 0 and 1: 1.5x real time): B waits, whatever its budget, until
    A ends, then is admitted in the next iteration."""
    global STEP
    engine = timed_engine(tiny_model, realtime_max_wait=0.0)
    old, STEP = STEP, 0.07
    try:
        a = stream(engine, tiny_model, "a", 1, frames=6)
        engine.step()
        engine.step()  # (a step measured)
        b = stream(engine, tiny_model, "b", 2)
        iterations = steps_until_running(engine, b)
    finally:
        STEP = old
    assert a.num_generated == 6 and iterations == 5  # A's 4 more frames, then B with nothing running
    assert engine.realtime.deferred == {"slack": 0, "speed": 1, "gather": 0} and engine.realtime.forced == 0


def test_the_policy_changes_no_codes(tiny_model):
    """CPU, same seeds, requests one after another: the same codes with the policy on and off."""
    outputs = []
    for on in (False, True):
        engine = Engine(
            tiny_model, EngineConfig(max_batch=4, graphs="off", block_size=8, realtime_admission=on)
        )
        codes = {}
        for i in range(3):
            engine.submit(
                random_prompt(tiny_model, 7 + 5 * i, i),
                params(max_new_frames=12, seed=10 + i),
                f"r{i}",
                playback=Playback(RATE),
            )
            codes.update(run_to_completion(engine)[0])
        outputs.append(codes)
    off, on = outputs
    assert off.keys() == on.keys() and all(off[k].shape[0] > 0 for k in off)
    assert all(torch.equal(off[k], on[k]) for k in off)


@pytest.mark.parametrize("gather, b_iterations, passes", [(0.0, 1, 2), (0.1, 4, 1)])
def test_a_new_pass_waits_the_gathering_time_for_others_to_share_it(tiny_model, gather, b_iterations, passes):
    """A plays with slack to spare (margin 0). B arrives at 0.13 s, C at 0.17 s. Without gathering B
    joins at once and C later, in a pass of its own: two passes. With 0.1 s of gathering B would open
    a pass while A plays: it waits (deferred at 0.13, 0.17, 0.21 s) until it has waited 0.1 s (0.25 s),
    and C, which came meanwhile, shares its pass."""
    engine = timed_engine(
        tiny_model, realtime_max_wait=10.0, realtime_margin=0.0, packed_prefill=True, prefill_gather=gather
    )
    a = stream(engine, tiny_model, "a", 1)
    engine.step()
    engine.step()
    assert a.playback.started is not None
    b = stream(engine, tiny_model, "b", 2)
    passes0 = engine.runner.prefill_passes
    engine.step()
    c = stream(engine, tiny_model, "c", 3)
    if gather:
        assert steps_until_running(engine, b) == b_iterations - 1
    else:
        assert engine.is_running("b")
        steps_until_running(engine, c)
    assert engine.is_running("c") and not c.deferred
    assert engine.runner.prefill_passes == passes0 + passes
    assert engine.realtime.deferred == {"slack": 0, "speed": 0, "gather": 1 if gather else 0}
    assert engine.realtime.forced == 0


def test_a_gathering_head_does_not_hold_up_a_stream_whose_player_runs(tiny_model):
    """B (fresh) would gather for 0.1 s, but D, queued behind it, is A's next text chunk (A's player
    runs): waiting would only make D later, so B does not gather and both join at once."""
    engine = timed_engine(
        tiny_model, realtime_max_wait=10.0, realtime_margin=0.0, packed_prefill=True, prefill_gather=0.1
    )
    a = stream(engine, tiny_model, "a", 1)
    engine.step()
    engine.step()
    assert a.playback.started is not None
    stream(engine, tiny_model, "b", 2)
    d = engine.submit(
        random_prompt(tiny_model, 9, 4), params(max_new_frames=8, seed=4), "d", playback=a.playback
    )
    assert RealtimeAdmission.must_not_wait(d)
    engine.step()
    assert engine.is_running("b") and engine.is_running("d")
    assert engine.realtime.deferred["gather"] == 0


def test_gathering_waits_only_to_open_a_fresh_pass_while_streams_play():
    """The gathering wait applies to a fresh prompt that would open a pass while a stream plays; not
    with a pass of its kind admitted already, not to a session's continuation, not where the engine
    prefills each prompt alone, not with no stream playing, and not once it has waited the time."""
    from types import SimpleNamespace

    def admission(packs=True):
        a = RealtimeAdmission(margin=0.0, max_wait=10.0, packs=packs, gather=0.1)
        a.times.observe_step(2, STEP)
        a.times.observe_prefill(9, PREFILL)
        return a

    playing = Playback(RATE, first=2, later=4)
    playing.advance(2, 0.0)  # its first chunk out at 0 s: slack enough for any one newcomer
    running = [SimpleNamespace(playback=playing, paused=False, stalled=False)]
    silent = [SimpleNamespace(playback=Playback(RATE, first=2, later=4), paused=False, stalled=False)]

    def request(cached=0, arrival=0.0):
        return SimpleNamespace(
            playback=Playback(RATE, first=2, later=4), prompt_len=9 + cached, cached=cached,
            arrival_time=arrival, deferred=False,
        )  # fmt: skip

    a = admission()
    assert not a.admits(request(), [], running, 2, now=0.04)
    assert a.deferred["gather"] == 1
    assert admission().admits(request(arrival=-0.07), [], running, 2, now=0.04)  # (waited the time)
    assert admission().admits(request(), [], running, 2, now=0.04, gather=False)  # (one behind must not wait)
    assert admission().admits(request(), [request()], running, 2, now=0.04)  # (a pass opened already)
    assert admission().admits(request(cached=30), [], running, 2, now=0.04)
    assert admission(packs=False).admits(request(), [], running, 2, now=0.04)
    assert admission().admits(request(), [], silent, 2, now=0.04)  # (no player runs yet)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="realtime_margin"):
        EngineConfig(realtime_margin=-0.1).validate()
    with pytest.raises(ValueError, match="realtime_max_wait"):
        EngineConfig(realtime_max_wait=float("nan")).validate()
    with pytest.raises(ValueError, match="prefill_gather must be"):
        EngineConfig(realtime_admission=True, prefill_gather=-0.1).validate()
    with pytest.raises(ValueError, match="prefill_gather needs realtime_admission"):
        EngineConfig(prefill_gather=0.05).validate()
    with pytest.raises(ValueError, match="prefill_gather must be below realtime_max_wait"):
        EngineConfig(realtime_admission=True, prefill_gather=0.15, realtime_max_wait=0.15).validate()


def test_the_engine_sees_the_chunks_the_job_runner_releases(tiny_bundle, monkeypatch):
    """A job of several text chunks through the job runner: the engine's playback clock released exactly
    the audio chunks the job runner sent (all but a last one that the job's end flushes)."""
    from tts.api import TTS

    tts = TTS(tiny_bundle, EngineConfig(max_batch=4, realtime_admission=True))
    clocks = []
    submit = tts.engine.submit

    def recording_submit(*args, **kw):
        clocks.append(kw.get("playback"))
        return submit(*args, **kw)

    monkeypatch.setattr(tts.engine, "submit", recording_submit)
    chunks = list(
        tts.stream(
            "First sentence here. Second one there.",
            chunk_length=12,
            first_chunk_frames=2,
            chunk_frames=8,
            max_new_frames=11,
            min_new_frames=11,
            seed=3,
        )
    )
    assert len(clocks) > 1 and all(c is clocks[0] for c in clocks)  # one clock for the job's requests
    clock, total = clocks[0], 11 * len(clocks)
    expected, end = [], 0
    while end + chunk_size(2, 8, len(expected)) <= total:
        end += chunk_size(2, 8, len(expected))
        expected.append(end)
    ends = [c.frame_end for c in chunks]
    assert ends == expected + ([total] if end < total else [])
    assert (clock.frames, clock.released, clock.chunks) == (total, end, len(expected))


class PacedEngine(Engine):
    """An engine whose clock moves only by `prefill` seconds per prefill and `step` per frame step."""

    def __init__(self, *args, step: float, prefill: float, **kw):
        super().__init__(*args, **kw)
        self.step_seconds, self.prefill_seconds = step, prefill

    def _start(self, admitted, outputs):
        if admitted:
            self.clock.now += self.prefill_seconds
        super()._start(admitted, outputs)

    def _frame_step(self, n, while_stepping=None):
        self.clock.now += self.step_seconds
        return super()._frame_step(n, while_stepping)


# One job of 24 frames (chunks of 2, 2, 4, 8, 8 frames) on the tiny model (25 frames/s: a frame plays
# 0.04 s), its frame j out at 0.05 + 0.025 j s (prefill 0.05 s, 0.025 s a frame step). Per audio chunk the
# seconds from its queueing (engine clock) to its deadline: when the audio before it has played.
#
# Every frame audio: the playback clock releases each chunk in the step of its last frame, as the runner
# queues it. Chunk 0 at 0.1 s: the player starts (its deadline is its queueing). Chunk 1 at 0.15 s: the 2
# frames before it play until 0.18 s. Chunk 2 at 0.25 s: 4 frames, until 0.26 s. Chunk 3 at 0.45 s: the 8
# frames before it ran out at 0.42 s, so the player waited 0.03 s and plays on from 0.45 s (the deadline is
# now). Chunk 4 at 0.65 s: 16 frames from a start moved to 0.13 s, until 0.77 s.
EVERY_FRAME = [0.0, 0.03, 0.01, 0.0, 0.12]
# The first frame of the text chunk not audio (fish-speech 1.5): the clock counts it, so it releases its
# chunks (of frames generated) one step before the runner queues the same audio (one frame later), and
# the tail at the end (7 frames) with the 24th frame. The deadline counts the audio the runner sent, 2,
# 4, 8, 16 frames before chunks 1-4, from the clock's start (0.1 s, moved to 0.13 s by its gap at 0.45 s):
# 0.18 s for chunk 1 queued at 0.175 s, and so on; the clock's own dry time would be a frame later.
FIRST_DROPPED = [-0.025, 0.005, -0.015, -0.025, 0.12]


@pytest.mark.parametrize(
    ("realtime", "frames", "slack"),
    [
        (True, FrameConvention(), EVERY_FRAME),
        (True, FrameConvention(drop_first=True), FIRST_DROPPED),
        (False, FrameConvention(), [None] * 5),
    ],
    ids=["every-frame", "first-dropped", "no-realtime"],
)
def test_the_runner_gives_each_audio_chunk_its_players_dry_time(
    tiny_bundle, monkeypatch, realtime, frames, slack
):
    """The deadline the job runner passes with each audio chunk to the codec stage is the time, on the
    stage's clock, when the audio released before the chunk has played (the tables above, by hand);
    None without real-time admission (no playback clock is kept)."""
    bundle = dataclasses.replace(tiny_bundle, frames=frames)
    config = EngineConfig(max_batch=2, graphs="off", realtime_admission=realtime)
    engine = PacedEngine(bundle.model, config, clock=Clock(), step=0.025, prefill=0.05)
    planner = Planner(bundle, engine.max_context, engine.check)
    pipeline = JobPipeline(engine, planner, max_streams=2)
    pipeline.stage.clock = lambda: 1000.0  # the stage's clock: a second clock, far from the engine's
    queued = []
    decode = pipeline.stage.decode

    def recording_decode(slot, tag, codes, *, first=False, deadline=None):
        queued.append((tag[1], codes.shape[1], first, deadline, engine.clock()))
        decode(slot, tag, codes, first=first, deadline=deadline)

    monkeypatch.setattr(pipeline.stage, "decode", recording_decode)
    try:
        spec = planner.job(
            "A few words.",
            seed=1,
            max_new_frames=24,
            min_new_frames=24,
            first_chunk_frames=2,
            chunk_frames=8,
        )
        sink = ListSink()
        pipeline.submit(spec, sink)
        limit = time.monotonic() + 60  # a safety bound: the audio comes from the codec worker
        while not any(isinstance(e, Finished) for e in sink.events):
            assert time.monotonic() < limit, "the job did not finish"
            if not pipeline.step():
                time.sleep(0.001)
    finally:
        pipeline.stage.stop()
    sizes = [2, 2, 4, 8, 8] if not frames.drop_first else [2, 2, 4, 8, 7]
    assert [(seq, n, first) for seq, n, first, _, _ in queued] == [
        (k, n, k == 0) for k, n in enumerate(sizes)
    ]
    if not realtime:
        assert [deadline for _, _, _, deadline, _ in queued] == slack
        return
    assert [at for *_, at in queued] == pytest.approx(
        [0.1, 0.15, 0.25, 0.45, 0.65] if not frames.drop_first else [0.125, 0.175, 0.275, 0.475, 0.65]
    )
    assert [deadline - 1000.0 for _, _, _, deadline, _ in queued] == pytest.approx(slack, abs=1e-9)


def test_a_deadline_counts_the_audio_before_the_chunk_and_never_more_than_the_clock_released(tiny_bundle):
    """`_deadline` alone: the audio before the chunk is what the job sent, on top of where the job began
    on the playback clock (a session's earlier jobs' frames); where the clock released fewer frames (it
    counts only what the engine saw), its own dry time, the earlier one."""
    config = EngineConfig(max_batch=2, graphs="off", realtime_admission=True)
    engine = PacedEngine(tiny_bundle.model, config, clock=Clock(), step=0.025, prefill=0.05)
    pipeline = JobPipeline(engine, Planner(tiny_bundle, engine.max_context, engine.check), max_streams=2)
    try:
        pipeline.stage.clock = lambda: 1000.0
        engine.clock.now = 2.0
        clock = Playback(25.0, first=2, later=8)
        job = _Job("j", None, ListSink(), 0.0, playback=clock)  # (no spec: `_deadline` reads none)
        assert pipeline._deadline(job) is None  # the player has not started
        clock.advance(12, now=1.0)  # started at 1.0 s; 12 frames released (0.48 s of audio)
        job.playback_start, job.frames_queued = 4, 6  # 4 frames of an earlier job, 6 of this one
        assert pipeline._deadline(job) == pytest.approx(1000.0 + (1.0 + 10 / 25 - 2.0))
        job.frames_queued = 10  # more than the clock saw: its dry time
        assert pipeline._deadline(job) == pytest.approx(1000.0 + (1.0 + 12 / 25 - 2.0))
    finally:
        pipeline.stage.stop()


def test_the_server_reports_the_policy(tiny_bundle):
    """/metrics with real-time admission on: the deferrals by reason, the forced admissions and the
    frame step's estimate the policy predicts from (one request: nothing deferred)."""
    import urllib.request

    from service_helpers import ServerThread, collect
    from tts_tools.loadtest import parse_metrics

    from service.client import build_request
    from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc

    srv = ServerThread(tiny_bundle, EngineConfig(max_batch=4, realtime_admission=True), metrics_port=0)
    try:
        stub = pb_grpc.TextToSpeechStub(srv.channel())
        collect(stub.Synthesize(build_request("Metrics.", seed=1, max_new_frames=6, min_new_frames=6)))
        url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
        values = parse_metrics(urllib.request.urlopen(url, timeout=10).read().decode())
    finally:
        srv.stop()
    assert values['tts_realtime_deferred_total{reason="slack"}'] == 0
    assert values['tts_realtime_deferred_total{reason="speed"}'] == 0
    assert values["tts_realtime_forced_total"] == 0 and values["tts_realtime_rode_along_total"] == 0
    assert values["tts_frame_step_estimate_seconds"] > 0
    assert "tts_realtime_min_slack_seconds" not in values  # (no stream plays now)


def test_a_sessions_chunks_of_one_turn_are_one_stream(tiny_bundle, monkeypatch):
    """A session's later chunks continue the audio its player plays: the engine gets them with the
    turn's playback clock, already started (admitted at once, as a job's next text chunk is); the next
    turn, after the session went quiet, is a new stream."""
    from tts.api import TTS

    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8, realtime_admission=True))
    try:
        seen = []
        submit = tts.engine.submit

        def recording_submit(*args, **kw):
            clock = kw.get("playback")
            seen.append((clock, clock is not None and clock.started is not None))
            return submit(*args, **kw)

        monkeypatch.setattr(tts.engine, "submit", recording_submit)
        s = tts.session(max_new_frames=6, min_new_frames=6, seed=3)
        s.send("First sentence here. Second one follows. And a third.")
        s.flush()
        list(s)
        s.send("Another turn.")
        s.close()
        list(s)
        assert len(seen) == 4 and all(clock is not None for clock, _ in seen)
        assert seen[1][0] is seen[0][0] and seen[2][0] is seen[0][0] and seen[3][0] is not seen[0][0]
        assert [started for _, started in seen] == [False, True, True, False]
        turn = seen[0][0]
        # every frame of the three chunks; released: all but the last chunk's tail (its job's end flushes it)
        assert (turn.frames, turn.released) == (18, 16)
    finally:
        tts.close()


def test_a_sessions_next_job_gets_no_deadline_after_its_players_dry_time(tiny_bundle, monkeypatch):
    """A session's chunks are jobs on ONE playback clock (`submit(playback=...)`, `next_job`). The clock
    counts frames that are no audio (here each text chunk's dropped first frame; with S2 the end-token
    frame), so where the next job begins on it is past the audio its player got: the deadlines of that
    job's chunks must still be no later than when a player fed each chunk at its queueing runs dry."""
    bundle = dataclasses.replace(tiny_bundle, frames=FrameConvention(drop_first=True))
    config = EngineConfig(max_batch=2, graphs="off", realtime_admission=True)
    engine = PacedEngine(bundle.model, config, clock=Clock(), step=0.025, prefill=0.05)
    planner = Planner(bundle, engine.max_context, engine.check)
    pipeline = JobPipeline(engine, planner, max_streams=2)
    pipeline.stage.clock = lambda: 1000.0
    queued = []  # (job, frames, first, deadline on the engine's clock, queued at on the engine's clock)
    decode = pipeline.stage.decode

    def recording_decode(slot, tag, codes, *, first=False, deadline=None):
        at = engine.clock()
        queued.append(
            (tag[0], codes.shape[1], first, None if deadline is None else deadline - 1000.0 + at, at)
        )
        decode(slot, tag, codes, first=first, deadline=deadline)

    monkeypatch.setattr(pipeline.stage, "decode", recording_decode)

    def run(seed: int, playback: Playback | None) -> Playback:
        spec = planner.job(
            "A few words.",
            seed=seed,
            max_new_frames=24,
            min_new_frames=24,
            first_chunk_frames=2,
            chunk_frames=8,
        )
        sink = ListSink()
        job_id = pipeline.submit(spec, sink, playback=playback)
        clock = pipeline.jobs[job_id].playback
        limit = time.monotonic() + 60  # a safety bound: the audio comes from the codec worker
        while not any(isinstance(e, Finished) for e in sink.events):
            assert time.monotonic() < limit, "the job did not finish"
            if not pipeline.step():
                time.sleep(0.001)
        assert clock is not None
        return clock

    try:
        clock = run(1, None)
        for seed in (2, 3):  # the session's next chunks, on the same clock, each right after the one before
            run(seed, clock)
    finally:
        pipeline.stage.stop()
    # A player fed each chunk when it was queued (no decode, no delivery: the latest it can run dry; one
    # that ran dry plays a late chunk from its queueing on).
    dry = None
    late = []
    for job, frames, first, deadline, at in queued:
        # (a deadline already past when the chunk is queued starts its call at once, whatever it says)
        if deadline is not None and not first and deadline > max(dry, at) + 1e-9:
            late.append((job, round(deadline - dry, 6)))
        dry = (
            at + frames / planner.frame_rate if dry is None or dry < at else dry + frames / planner.frame_rate
        )
    assert late == [], "\n".join(map(str, [late, *queued]))
