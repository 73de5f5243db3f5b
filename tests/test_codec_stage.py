"""The codec stage (tts/runtime/codec_stage.py): batching of queued pieces, order per stream, start-up
capture (stand-in graphs on the CPU), the per-stream frame limit, gathering (a later piece waits for
more work to share its call, no longer than its stream's player can spare)."""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tts.checkpoints.load import load_bundle
from tts.runtime.codec_stage import (
    CALL_EMA,
    GATHER_MARGIN_CALLS,
    GATHER_MARGIN_SECONDS,
    CodecStage,
    _Piece,
    gather_bounds,
    gather_wait,
)


@pytest.fixture(scope="module")
def codec():
    return load_bundle("default").codec  # the default voice's codec: a batched, graph-safe decoder


def codes_for(seed: int, frames: int, codec) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.codebook_size, (codec.num_codebooks, frames), generator=g)


def collect(stage: CodecStage, done: threading.Event, want: int) -> list:
    results = []
    while len(results) < want:
        assert done.wait(30), "no codec results"
        done.clear()
        results += stage.results()
    return results


def test_queued_pieces_of_several_streams_decode_in_one_call_in_order(codec):
    """Pieces queued while the worker is busy go out together: three streams' pieces in one call, each
    stream's audio equal to its offline decode, results in queue order per stream."""
    done = threading.Event()
    stage = CodecStage(codec, max_streams=4, notify=done.set)
    try:
        slots = [stage.open() for _ in range(3)]
        streams = {s: codes_for(s, 20, codec) for s in slots}
        gate = threading.Event()
        stage._tasks.append((gate.wait, Future()))  # hold the worker until every piece is queued
        with stage._cv:
            stage._cv.notify()
        for s in slots:  # two pieces per stream: 4 then 16 frames
            stage.decode(s, (s, 0), streams[s][:, :4])
            stage.decode(s, (s, 1), streams[s][:, 4:])
        calls = stage.stats.decode_calls
        gate.set()
        results = collect(stage, done, 6)
        assert stage.stats.decode_calls == calls + 1 and stage.stats.decode_rows == 3
        for s in slots:
            mine = [r for r in results if r.tag[0] == s]
            assert [r.tag[1] for r in mine] == [0, 1]
            audio = np.concatenate([r.samples for r in mine])
            # (to float rounding: the learned vocoder's convolutions over three rows at once round
            # differently from one row's; a wrong or reordered piece is off by far more)
            np.testing.assert_allclose(audio, codec.decode(streams[s]).numpy(), rtol=0, atol=1e-5)
    finally:
        stage.stop()


def test_padded_frames_count_what_a_call_computed(codec):
    """An eager call pads every row to the longest: rows of 4 and 12 frames compute 2 x 12 frames, which
    `decode_padded_frames` counts beside the 16 real ones (the fill the load benchmark reports)."""
    done = threading.Event()
    stage = CodecStage(codec, max_streams=2, notify=done.set, graphs=False)
    try:
        a, b = stage.open(), stage.open()
        gate = threading.Event()
        stage._tasks.append((gate.wait, Future()))  # hold the worker until both pieces are queued
        with stage._cv:
            stage._cv.notify()
        stage.decode(a, (a, 0), codes_for(1, 4, codec))
        stage.decode(b, (b, 0), codes_for(2, 12, codec))
        gate.set()
        collect(stage, done, 2)
        s = stage.stats
        assert (s.decode_calls, s.decode_rows, s.decode_frames, s.decode_padded_frames) == (1, 2, 16, 24)
    finally:
        stage.stop()


def test_start_up_capture_leaves_streams_untouched(codec):
    """capture() warms and captures every (rows, frames) bucket on pad rows only: a stream decoded
    after it (through the replays) equals its offline decode. Stand-in graphs on the CPU."""
    done = threading.Event()
    stage = CodecStage(codec, max_streams=4, notify=done.set, max_rows=4, max_call_frames=64)
    stage.graphs.enabled = True  # CPU stand-in graphs: the bucket logic and the replays run
    try:
        slot = stage.open()
        assert stage.capture((4, 16)).result(60) == len(stage.graphs.graphs) > 0
        assert {T for _, T in stage.graphs.graphs} == {4, 16}
        codes = codes_for(7, 20, codec)
        stage.decode(slot, 0, codes[:, :4])
        stage.decode(slot, 1, codes[:, 4:])
        results = collect(stage, done, 2)
        audio = np.concatenate([r.samples for r in sorted(results, key=lambda r: r.tag)])
        np.testing.assert_array_equal(audio, codec.decode(codes).numpy())
        assert stage.graphs.stats.replays >= 2
    finally:
        stage.stop()


def test_row_buckets_stop_at_the_number_of_streams(codec):
    """A call holds one row per stream: a stage of 5 streams captures no graph of 8 rows or more."""
    stage = CodecStage(codec, max_streams=5, max_call_frames=1024)
    stage.graphs.enabled = True  # CPU stand-in graphs
    try:
        assert stage.max_rows == 5 and stage.graphs.buckets == [1, 2, 4, 5]
        stage.capture((4, 16)).result(60)
        assert sorted(stage.graphs.graphs) == [(b, T) for b in (1, 2, 4, 5) for T in (4, 16)]
    finally:
        stage.stop()


def test_a_stream_may_not_pass_the_decoders_position_limit(codec):
    stage = CodecStage(codec, max_streams=2)
    stage.max_stream_frames = 10
    try:
        slot = stage.open()
        stage.decode(slot, 0, codes_for(1, 8, codec))
        with pytest.raises(ValueError, match="limit of 10 frames per stream"):
            stage.decode(slot, 1, codes_for(2, 4, codec))
    finally:
        stage.stop()


@pytest.mark.parametrize("graphs", [False, True])
def test_a_full_piece_and_a_tail_queued_together_both_decode(codec, graphs):
    """A full-size piece (MAX_PIECE_FRAMES frames) and its stream's short tail, queued while the worker
    is busy, may not share one row (wider than the staging buffers): both decode, in order, and the
    stream equals its offline decode; the stage keeps serving."""
    from tts.runtime.codec_stage import MAX_PIECE_FRAMES

    done = threading.Event()
    stage = CodecStage(codec, max_streams=2, notify=done.set)
    stage.graphs.enabled = graphs  # CPU stand-in graphs: the padded (bucketed) path
    try:
        a, b = stage.open(), stage.open()
        full = codes_for(3, MAX_PIECE_FRAMES + 2, codec)
        other = codes_for(4, 5, codec)
        gate = threading.Event()
        stage._tasks.append((gate.wait, Future()))  # hold the worker until every piece is queued
        with stage._cv:
            stage._cv.notify()
        stage.decode(a, (a, 0), full[:, :MAX_PIECE_FRAMES])
        stage.decode(a, (a, 1), full[:, MAX_PIECE_FRAMES:])
        stage.decode(b, (b, 0), other)
        gate.set()
        results = collect(stage, done, 3)
        assert not [r.error for r in results if r.error is not None]
        mine = [r for r in results if r.tag[0] == a]
        assert [r.tag[1] for r in mine] == [0, 1]
        audio = np.concatenate([r.samples for r in mine])
        np.testing.assert_allclose(audio, codec.decode(full).numpy(), rtol=0, atol=1e-5)
        assert stage.dead is None and stage.stats.failures == 0
    finally:
        stage.stop()


# ---- gathering (`gather`: a later piece may wait for more work to share its call) -----------------------


def piece(
    slot: int, frames: int, queued_at: float, first: bool = False, deadline: float | None = None
) -> _Piece:
    return _Piece(slot, None, torch.zeros(1, frames, dtype=torch.int64), first, queued_at, deadline)


def test_gather_wait_decides_when_the_next_call_starts():
    """The decision alone: the seconds still to wait before a call of the queued pieces (0: now)."""
    wait = functools.partial(gather_wait, gather=0.5, target_frames=32, max_rows=4)
    later = [piece(0, 8, 1.0), piece(1, 8, 1.125)]
    assert wait(later, 1.25) == 0.25  # the oldest's bound: queued at 1.0, may wait until 1.5
    assert wait(later, 1.5) == 0.0 and wait(later, 9.0) == 0.0  # the bound passed
    assert wait([*later, piece(2, 4, 1.25, first=True)], 1.25) == 0.0  # a stream's first piece: now
    assert wait([*later, piece(0, 15, 1.25)], 1.25) == 0.25  # 31 frames: under the target ...
    assert wait([*later, piece(0, 16, 1.25)], 1.25) == 0.0  # ... 32: the call is worth it
    assert wait([*later, piece(2, 1, 1.25), piece(3, 1, 1.25)], 1.25) == 0.0  # a row for every stream
    assert wait([], 1.25) == 0.0  # nothing to gather (resets only)
    assert gather_wait(later, 1.25, gather=0.0, target_frames=32, max_rows=4) == 0.0  # gathering off


def test_a_players_deadline_bounds_the_wait_below_the_cap():
    """A piece's deadline (when its player runs dry) less the margin ends the wait when it comes before
    the cap; pieces without one keep the cap; a deadline within the margin or past means now; a first
    piece, the size target and gathering off mean now whatever the deadlines."""
    wait = functools.partial(gather_wait, gather=0.5, target_frames=32, max_rows=4, margin=0.0625)
    # The cap: queued at 1.0, until 1.5 (0.25 s at 1.25). A deadline at 1.375, less the margin: 1.3125.
    assert wait([piece(0, 8, 1.0), piece(1, 8, 1.125, deadline=1.375)], 1.25) == 0.0625
    assert wait([piece(0, 8, 1.0), piece(1, 8, 1.125, deadline=2.0)], 1.25) == 0.25  # the cap first
    assert wait([piece(0, 8, 1.0), piece(1, 8, 1.125)], 1.25) == 0.25  # no deadline: the cap
    # The earliest deadline of the queued pieces counts, whichever stream and place in the queue.
    several = [piece(0, 8, 1.0, deadline=1.5), piece(1, 4, 1.1, deadline=1.4375), piece(0, 4, 1.2)]
    assert wait(several, 1.25) == 0.125
    assert wait([piece(0, 8, 1.0, deadline=1.3125)], 1.25) == 0.0  # within the margin: now
    assert wait([piece(0, 8, 1.0, deadline=1.0)], 1.25) == 0.0  # past (the player ran dry): now
    assert wait([piece(0, 8, 1.0, deadline=9.0), piece(1, 4, 1.25, first=True)], 1.25) == 0.0
    assert wait([piece(0, 16, 1.0, deadline=9.0), piece(1, 16, 1.1, deadline=9.0)], 1.25) == 0.0
    assert gather_wait([piece(0, 8, 1.0, deadline=9.0)], 1.25, gather=0.0, target_frames=32, max_rows=4) == 0
    # The two bounds apart (the worker counts a call that the deadline started: the cap still waited).
    bounds = functools.partial(gather_bounds, gather=0.5, target_frames=32, max_rows=4, margin=0.0625)
    assert bounds([piece(0, 8, 1.0, deadline=1.375)], 1.25) == (0.25, 0.0625)
    assert bounds([piece(0, 8, 1.0, deadline=1.25)], 1.25) == (0.25, 0.0)
    assert bounds([piece(0, 8, 1.0)], 1.25) == (0.25, math.inf)
    assert bounds([piece(0, 8, 1.0, deadline=1.375), piece(1, 4, 1.2, first=True)], 1.25)[0] == 0.0


class Clock:
    """A clock the test moves; `read` is set when the codec worker reads it (it decided, and waits)."""

    def __init__(self):
        self.now = 100.0
        self.read = threading.Event()

    def __call__(self) -> float:
        if threading.current_thread().name == "gather-test":
            self.read.set()
        return self.now


def past_first_pieces(stage: CodecStage, done: threading.Event, codec, n: int) -> list[int]:
    """Open `n` streams and decode each one's first piece (4 frames; first pieces never gather): the
    slots, with their results collected, so that what the test queues next are later pieces."""
    slots = [stage.open() for _ in range(n)]
    for k, slot in enumerate(slots):
        stage.decode(slot, (slot, 0), codes_for(k + 1, 4, codec))
    collect(stage, done, n)
    return slots


def gathering_stage(codec, done: threading.Event, clock: Clock, **options) -> CodecStage:
    # (an hour's bound on a clock that stands still: only the size, a first piece or the test's clock
    # moving starts a call)
    return CodecStage(
        codec, max_streams=4, notify=done.set, gather=3600.0, clock=clock, name="gather-test", **options
    )


def test_first_pieces_go_at_once_later_pieces_gather_until_the_target(codec):
    """Each stream's first piece is decoded without waiting (the time to first audio), as is a piece
    marked first (a session's next job); later pieces wait until they hold `gather_frames` frames, then
    go in ONE call, counted as gathered; the audio equals the offline decode."""
    done, clock = threading.Event(), Clock()
    stage = gathering_stage(codec, done, clock, gather_frames=32)
    try:
        a, b = stage.open(), stage.open()
        streams = {s: codes_for(s + 20, 36, codec) for s in (a, b)}
        stage.decode(a, (a, 0), streams[a][:, :4])
        stage.decode(b, (b, 0), streams[b][:, :4])
        collect(stage, done, 2)
        assert stage.stats.gathered_calls == 0
        calls, rows = stage.stats.decode_calls, stage.stats.decode_rows
        clock.read.clear()
        stage.decode(a, (a, 1), streams[a][:, 4:12])
        stage.decode(b, (b, 1), streams[b][:, 4:12])  # 16 frames queued: under the target
        assert clock.read.wait(30), "the worker did not look at the queue"
        stage.decode(a, (a, 2), streams[a][:, 12:28])  # 32: the call goes
        results = collect(stage, done, 3)
        assert stage.stats.decode_calls == calls + 1 and stage.stats.decode_rows == rows + 2
        assert stage.stats.gathered_calls == 1
        stage.decode(b, (b, 2), streams[b][:, 12:20], first=True)  # a new job's first chunk: at once
        results += collect(stage, done, 1)
        assert stage.stats.decode_calls == calls + 2
        for s, n in ((a, 28), (b, 20)):
            mine = sorted((r for r in results if r.tag[0] == s), key=lambda r: r.tag[1])
            audio = np.concatenate([r.samples for r in mine])
            full = codec.decode(streams[s][:, :n]).numpy()
            np.testing.assert_allclose(audio, full[len(full) - len(audio) :], rtol=0, atol=1e-5)
    finally:
        stage.stop()


def test_later_pieces_go_when_the_oldest_has_waited_the_bound(codec):
    """Pieces under the target wait; once the oldest has waited `gather` seconds (the stage's clock),
    they go together in one call."""
    done, clock = threading.Event(), Clock()
    stage = gathering_stage(codec, done, clock)
    try:
        a, b = past_first_pieces(stage, done, codec, 2)
        calls = stage.stats.decode_calls
        clock.read.clear()
        stage.decode(a, (a, 1), codes_for(3, 8, codec))
        clock.now += 1800.0
        stage.decode(b, (b, 1), codes_for(4, 8, codec))
        assert clock.read.wait(30), "the worker did not look at the queue"
        clock.now += 1800.0  # the oldest has waited the bound: the next look starts the call
        with stage._cv:
            stage._cv.notify()
        results = collect(stage, done, 2)
        assert sorted(r.tag for r in results) == [(a, 1), (b, 1)]
        assert stage.stats.decode_calls == calls + 1 and stage.stats.gathered_calls == 1
    finally:
        stage.stop()


def test_a_later_piece_goes_when_its_player_needs_it_not_at_the_cap(codec):
    """With an hour's cap, a later piece whose player runs dry 0.5 s after it was queued waits until
    its deadline less the margin (the calls' moving average on the stage's clock, 0 on a clock that
    stands still during the calls, so GATHER_MARGIN_SECONDS), then goes: a gathered call that the
    deadline started. A piece queued with its deadline within the margin goes at once (no wait)."""
    done, clock = threading.Event(), Clock()
    stage = gathering_stage(codec, done, clock)
    try:
        a, b = past_first_pieces(stage, done, codec, 2)
        assert stage.call_seconds == 0.0 and stage.gather_margin() == GATHER_MARGIN_SECONDS
        calls = stage.stats.decode_calls
        clock.read.clear()
        stage.decode(a, (a, 1), codes_for(3, 8, codec), deadline=clock.now + 0.5)
        assert clock.read.wait(30), "the worker did not look at the queue"
        clock.read.clear()
        clock.now += 0.5 - 2 * GATHER_MARGIN_SECONDS  # the deadline less the margin is still ahead
        with stage._cv:
            stage._cv.notify()
        assert clock.read.wait(30), "the worker did not look at the queue again"
        assert stage.stats.decode_calls == calls and stage.stats.slack_calls == 0
        clock.now += 2 * GATHER_MARGIN_SECONDS  # the deadline: within the margin
        with stage._cv:
            stage._cv.notify()
        assert [r.tag for r in collect(stage, done, 1)] == [(a, 1)]
        assert stage.stats.decode_calls == calls + 1
        assert stage.stats.gathered_calls == 1 and stage.stats.slack_calls == 1
        stage.decode(b, (b, 1), codes_for(4, 8, codec), deadline=clock.now + GATHER_MARGIN_SECONDS / 2)
        assert [r.tag for r in collect(stage, done, 1)] == [(b, 1)]
        assert stage.stats.decode_calls == calls + 2
        assert stage.stats.gathered_calls == 1 and stage.stats.slack_calls == 2
    finally:
        stage.stop()


def test_the_margin_follows_the_measured_call_seconds(codec, monkeypatch):
    """`call_seconds` is a moving average of the decode calls' seconds on the stage's clock (a decoder
    that takes 0.25 s, then 0.5 s, of a test clock), and the margin is GATHER_MARGIN_CALLS of it plus
    GATHER_MARGIN_SECONDS."""
    done, clock = threading.Event(), Clock()
    stage = gathering_stage(codec, done, clock)
    took = [0.25, 0.5]
    decode = stage.decoder.decode

    def slow_decode(*args):
        clock.now += took.pop(0)
        return decode(*args)

    monkeypatch.setattr(stage.decoder, "decode", slow_decode)
    try:
        assert stage.call_seconds is None and stage.gather_margin() == GATHER_MARGIN_SECONDS
        a = stage.open()
        stage.decode(a, (a, 0), codes_for(1, 4, codec))
        collect(stage, done, 1)
        assert stage.call_seconds == 0.25
        stage.decode(a, (a, 1), codes_for(2, 4, codec), first=True)
        collect(stage, done, 1)
        average = 0.25 + CALL_EMA * (0.5 - 0.25)
        assert stage.call_seconds == average
        assert stage.gather_margin() == GATHER_MARGIN_CALLS * average + GATHER_MARGIN_SECONDS
    finally:
        stage.stop()


def test_an_encode_runs_while_pieces_gather_and_stop_ends_the_wait(codec):
    """A reference encode queued while pieces gather runs at once (the pieces keep waiting: no decode
    call); `stop` ends the wait without waiting out the bound."""
    done, clock = threading.Event(), Clock()
    stage = gathering_stage(codec, done, clock)
    try:
        (a,) = past_first_pieces(stage, done, codec, 1)
        calls = stage.stats.decode_calls
        clock.read.clear()
        stage.decode(a, (a, 1), codes_for(2, 8, codec))
        assert clock.read.wait(30), "the worker did not look at the queue"
        samples = torch.sin(torch.arange(codec.sample_rate // 2) * 0.05).float()
        codes = stage.encode(samples).result(60)
        assert codes.shape[0] == codec.num_codebooks and stage.stats.encode_calls == 1
        assert stage.stats.decode_calls == calls  # the later piece still gathers
    finally:
        stage.stop(timeout=60)
    assert not stage._thread.is_alive()


def test_an_encode_does_not_make_a_gathering_piece_miss_its_deadline(codec, monkeypatch):
    """While a later piece gathers toward its player's deadline, a reference encode queued then must not
    run first when it outlasts the piece's slack: here the encode takes 0.5 s of the stage's clock and
    the piece has 0.2 s left; its decode call must start before the deadline less the margin."""
    done, clock = threading.Event(), Clock()
    stage = gathering_stage(codec, done, clock)
    encode_audio = codec.encode_audio

    def slow_encode(samples):
        clock.now += 0.5
        return encode_audio(samples)

    monkeypatch.setattr(stage.codec, "encode_audio", slow_encode)
    starts = []
    decode = stage.decoder.decode

    def timed_decode(*args):
        starts.append(clock.now)
        return decode(*args)

    monkeypatch.setattr(stage.decoder, "decode", timed_decode)
    try:
        (a,) = past_first_pieces(stage, done, codec, 1)
        clock.read.clear()
        deadline = clock.now + 0.2 + GATHER_MARGIN_SECONDS
        stage.decode(a, (a, 1), codes_for(2, 8, codec), deadline=deadline)
        assert clock.read.wait(30), "the worker did not look at the queue"
        samples = torch.sin(torch.arange(codec.sample_rate // 2) * 0.05).float()
        stage.encode(samples).result(60)
        collect(stage, done, 1)
        assert starts[-1] <= deadline - GATHER_MARGIN_SECONDS
    finally:
        stage.stop(timeout=60)


def test_gathering_changes_no_sample(codec):
    """The same pieces in the same calls give identical PCM with gathering on and off: three streams'
    first pieces in one call, then their later pieces in one call (held back by a busy worker without
    gathering; by the size target with it)."""
    first = {s: codes_for(s + 40, 4, codec) for s in range(3)}
    later = {s: [codes_for(s + 50, 16, codec), codes_for(s + 60, 8, codec)] for s in range(3)}

    def run(stage: CodecStage, done: threading.Event, hold_later: bool) -> dict:
        slots = [stage.open() for _ in range(3)]
        gate = threading.Event()
        stage._tasks.append((gate.wait, Future()))  # hold the worker until every first piece is queued
        with stage._cv:
            stage._cv.notify()
        for i, s in enumerate(slots):
            stage.decode(s, (i, 0), first[i])
        gate.set()
        results = collect(stage, done, 3)
        if hold_later:
            gate = threading.Event()
            stage._tasks.append((gate.wait, Future()))
            with stage._cv:
                stage._cv.notify()
        for k in range(2):
            for i, s in enumerate(slots):
                stage.decode(s, (i, k + 1), later[i][k])
        gate.set()
        results += collect(stage, done, 6)
        assert stage.stats.decode_calls == 2 and stage.stats.decode_rows == 6
        return {r.tag: r.samples for r in results}

    done = threading.Event()
    off = CodecStage(codec, max_streams=4, notify=done.set)
    try:
        without = run(off, done, hold_later=True)
    finally:
        off.stop()
    done, clock = threading.Event(), Clock()
    on = gathering_stage(codec, done, clock, gather_frames=3 * 24)
    try:
        gathered = run(on, done, hold_later=False)
        assert on.stats.gathered_calls <= 1
    finally:
        on.stop()
    assert sorted(without) == sorted(gathered)
    for tag, samples in without.items():
        np.testing.assert_array_equal(gathered[tag], samples)


def test_gather_must_be_seconds_at_least_zero(codec):
    with pytest.raises(ValueError, match="gather must be a number of seconds >= 0, got -1"):
        CodecStage(codec, max_streams=2, gather=-1)


def test_sms_must_be_at_least_zero_on_any_device(codec):
    with pytest.raises(ValueError, match=r"sms must be >= 0 \(0: all\), got -1"):
        CodecStage(codec, max_streams=2, sms=-1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_codec_stage_on_part_of_the_sms_decodes_the_same_audio():
    """`--codec-sms`: the stage's decodes (launched kernel by kernel on a green context's stream of a
    third of the SMs) give the audio of a stage on all SMs (graphs)."""
    from tts.runtime.codec_stage import codec_stream

    codec = load_bundle("default", device="cuda").codec
    sms = torch.cuda.get_device_properties(0).multi_processor_count // 3
    with pytest.raises(ValueError, match="codec SMs must be in"):
        codec_stream(torch.device("cuda", 0), 100_000)
    audio = []
    for n in (0, sms):
        done = threading.Event()
        stage = CodecStage(codec, max_streams=2, notify=done.set, sms=n)
        assert stage.graphs.enabled == (n == 0)
        try:
            slot = stage.open()
            stage.decode(slot, "a", codes_for(3, 16, codec))
            audio.append(collect(stage, done, 1)[0].samples)
        finally:
            stage.stop()
    np.testing.assert_allclose(audio[1], audio[0], rtol=0, atol=1e-5)
