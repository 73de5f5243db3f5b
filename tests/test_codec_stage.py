"""The codec stage (tts/engine/codec_stage.py): batching of queued pieces, order per stream, start-up
capture (stand-in graphs on the CPU), the per-stream frame limit."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tts.checkpoints.load import load_bundle
from tts.runtime.codec_stage import CodecStage


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
