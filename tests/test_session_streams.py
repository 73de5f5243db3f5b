"""Sessions on the service's engine thread (`EngineThread.open_session` -> `SessionStream`): commands posted
to the engine thread, events in order to thread and asyncio consumers, one codec stream per session,
barge-in counted in frame steps, the session limit, hold and idle timeouts on a test clock,
back-pressure and preemption of a session nobody reads, shutdown. Deterministic: exact frame counts
(min_new_frames = max_new_frames, the end token never drawn), waits on events, counts not timings."""

from __future__ import annotations

import asyncio
import queue
import time

import numpy as np
import pytest
import torch
from helpers import run_iterations

from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig
from tts.model.kv_cache import blocks_needed
from tts.params import InvalidRequest
from tts.runtime.engine_thread import (
    ChunkEnded,
    ChunkStarted,
    EngineThread,
    Finished,
    LoopClosed,
    SessionAudio,
    SessionClosed,
    SessionEnded,
    SessionLimit,
    SessionOptions,
    WordTimings,
)

BLOCK = 8


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


@pytest.fixture
def make_loop(bundle):
    loops = []

    def make(**options):
        engine_config = EngineConfig(max_batch=options.pop("max_batch", 2), ignore_eos=True, block_size=BLOCK)
        loop = EngineThread(bundle, engine_config, **options).start()
        loop.wait_ready(60)
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()


def frames(n, seed=3):
    return dict(max_new_frames=n, min_new_frames=n, seed=seed)


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def take(stream, until, timeout=60.0):
    """Events up to and including the first for which `until(event)` holds."""
    events = []
    while not events or not until(events[-1]):
        events.append(stream.get(timeout=timeout))
    return events


def drain(stream, timeout=60.0):
    return take(stream, lambda e: isinstance(e, SessionEnded), timeout)


def wait_until(predicate, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def idle(loop) -> bool:
    e, stage = loop.engine, loop.runner.stage
    return (
        loop.in_flight == 0
        and loop.sessions_open == 0
        and e.kv_usage()[0] == 0
        and e.num_running == 0
        and not e.sequences
        and stage.free_slots == stage.max_streams
    )


def test_a_session_streams_text_in_and_ordered_events_out_on_one_codec_stream(make_loop, bundle):
    loop = make_loop()
    s = loop.open_session(**frames(6))
    assert loop.sessions_open == 1
    s.send("Hello there my")
    s.send(" friend. And")
    s.send(" then more")
    s.flush()
    s.close()
    with pytest.raises(SessionClosed, match="was closed"):
        s.send("Too late.")
    events = drain(s)
    assert [e.chunk for e in of(events, ChunkStarted)] == [0, 1]
    assert [(e.chunk, e.reason, e.frames) for e in of(events, ChunkEnded)] == [
        (0, "length", 6),
        (1, "length", 6),
    ]
    # in order: each chunk's start, its audio and timings, its end; SessionEnded last
    for k in (0, 1):
        at = [i for i, e in enumerate(events) if getattr(e, "chunk", None) == k]
        assert isinstance(events[at[0]], ChunkStarted) and isinstance(events[at[-1]], ChunkEnded)
        assert all(isinstance(events[i], SessionAudio | WordTimings) for i in at[1:-1])
    assert isinstance(events[-1], SessionEnded) and events[-1].reason == "closed"
    audio = of(events, SessionAudio)
    assert [a.sample_offset for a in audio] == [0] + [a.sample_offset + len(a.samples) for a in audio[:-1]]
    assert events[-1].audio_samples == 12 * bundle.codec.frame_length
    # one codec stream for the whole session: its audio is the offline decode of all its codes
    codes = torch.cat([a.codes for a in audio], dim=1)
    pcm = np.concatenate([a.samples for a in audio])
    np.testing.assert_allclose(pcm, bundle.codec.decode(codes).numpy(), atol=1e-6, rtol=0)
    assert s.done and loop.sessions_open == 0
    wait_until(lambda: idle(loop), what="everything freed")


def test_barge_in_drops_queued_audio_frees_the_row_before_another_frame_and_the_session_goes_on(make_loop):
    loop = make_loop(max_queued_chunks=2)
    engine = loop.engine
    options = SessionOptions(first_chunk_frames=1, chunk_frames=1)
    s = loop.open_session(options=options, **frames(60, seed=4))
    s.send("First sentence here.")
    s.flush()
    first = of(take(s, lambda e: isinstance(e, ChunkEnded)), ChunkEnded)[0]
    history = first.cached_tokens + first.prefill_tokens + 1 + 60 - 1
    wait_until(lambda: engine.num_running == 0, what="the first chunk's row freed")
    held = blocks_needed(history, BLOCK)
    assert engine.kv_usage()[0] == engine.sequence_blocks(s.session_id) == held
    s.send("A long second sentence that is interrupted.")
    s.flush()
    take(s, lambda e: isinstance(e, SessionAudio))  # audio is playing; then the reader stops reading
    # paused at the cap of unread audio (2), the codec stage idle: nothing more happens until it is read
    wait_until(lambda: s.paused and s.queued_audio == 2 and loop.runner.stage.idle, what="paused")
    assert engine.num_running == 1 and engine.kv_usage()[0] > held
    generated = engine.frames_generated  # (stable: the paused row emits nothing)
    s.cancel()
    events = take(s, lambda e: isinstance(e, ChunkEnded))
    assert of(events, SessionAudio) == [] and s.discarded == 2  # nothing after the cancel is heard
    (end,) = of(events, ChunkEnded)
    assert end.reason == "cancelled" and end.chunk == 1
    wait_until(lambda: engine.num_running == 0, what="the row freed")
    assert engine.kv_usage()[0] == engine.sequence_blocks(s.session_id) == held  # the new blocks freed
    assert engine.frames_generated == generated  # no frame after the cancel
    # counted on the engine thread: freed before any further frame step, no frame and no audio after it
    assert s.barge_in is not None
    assert (s.barge_in.chunk, s.barge_in.frames_after, s.barge_in.steps, s.barge_in.audio_after) == (
        1,
        0,
        0,
        0,
    )
    # the session stays open: the next chunk continues the history before the cancelled one
    s.send("After the barge-in.")
    s.flush()
    events = take(s, lambda e: isinstance(e, ChunkEnded))
    (again,) = of(events, ChunkEnded)
    assert (again.chunk, again.reason, again.cached_tokens) == (2, "length", history)
    assert len(of(events, SessionAudio)) == 60
    s.close()
    assert drain(s)[-1].reason == "closed"
    wait_until(lambda: idle(loop), what="everything freed")


def test_hold_and_idle_timeouts_run_on_the_session_clock_without_any_job(make_loop):
    now = [0.0]
    loop = make_loop(session_clock=lambda: now[0])
    s = loop.open_session(options=SessionOptions(hold_seconds=2.0, idle_seconds=10.0), **frames(4))
    s.send("no boundary here")
    with pytest.raises(queue.Empty):
        s.get(timeout=0.2)  # waits for a boundary
    now[0] = 2.0
    loop.wake()
    events = take(s, lambda e: isinstance(e, ChunkEnded))
    assert [e.reason for e in of(events, ChunkEnded)] == ["length"]
    now[0] = 11.0  # the chunk ended at 2.0: idle until 12.0
    loop.wake()
    with pytest.raises(queue.Empty):
        s.get(timeout=0.2)
    now[0] = 12.0
    loop.wake()
    (ended,) = of(drain(s), SessionEnded)
    assert ended.reason == "idle_timeout"
    with pytest.raises(SessionClosed, match="has ended"):
        s.send("More.")
    wait_until(lambda: idle(loop), what="everything freed")


def test_the_session_limit_refuses_clearly_and_bad_use_gets_a_clear_error(make_loop):
    loop = make_loop(max_sessions=1)
    s = loop.open_session(options=SessionOptions(max_pending_bytes=40), **frames(4))
    with pytest.raises(SessionLimit, match="1 sessions are open"):
        loop.open_session()
    loop._refresh_stats()
    assert loop.stats.sessions == 1 == loop.sessions_open
    with pytest.raises(InvalidRequest, match="text: 41 bytes"):
        s.send("x" * 41)  # nothing of it taken
    with pytest.raises(InvalidRequest, match="must be a string"):
        s.send(b"bytes")  # type: ignore[arg-type]
    s.send("x" * 30)
    with pytest.raises(InvalidRequest, match="would make 41 bytes"):
        s.send("y" * 11)
    with pytest.raises(InvalidRequest, match="max_new_frames"):
        loop.open_session(max_new_frames=10**6)
    s.abort()
    assert drain(s)[-1].reason == "aborted"
    assert loop.sessions_open == 0  # freed before the consumer saw the end
    s2 = loop.open_session(**frames(4))
    s2.abort()
    drain(s2)
    wait_until(lambda: idle(loop), what="everything freed")


def test_a_session_nobody_reads_is_paused_and_ended_without_starving_a_job(make_loop):
    loop = make_loop(max_batch=1, max_waiting=2, max_queued_chunks=1, pause_timeout=0.2)
    options = SessionOptions(first_chunk_frames=1, chunk_frames=1)
    s = loop.open_session(options=options, **frames(200))
    s.send("A long sentence that nobody listens to, for a while.")
    s.flush()
    wait_until(lambda: s.paused and loop.engine.num_running == 1, what="the unread session paused")
    spec = loop.planner.job("Meanwhile.", seed=1, max_new_frames=5, min_new_frames=5)
    stream = loop.submit(spec)
    job_events = []
    while not job_events or not isinstance(job_events[-1], Finished):
        job_events.append(stream.get(timeout=60))
    assert job_events[-1].frames == 5  # it ran: the paused session was ended for it
    events = drain(s)
    (end,) = of(events, ChunkEnded)
    assert end.reason == "error" and "Preempted" in end.error
    assert events[-1].reason == "preempted"
    wait_until(lambda: idle(loop), what="everything freed")


def test_shutdown_ends_every_session(make_loop):
    loop = make_loop(max_queued_chunks=1)
    speaking = loop.open_session(options=SessionOptions(first_chunk_frames=1, chunk_frames=1), **frames(200))
    speaking.send("Still speaking when the server stops.")
    speaking.flush()
    quiet = loop.open_session()
    wait_until(lambda: speaking.paused, what="the speaking session paused")
    loop.stop()
    for s in (speaking, quiet):
        assert drain(s)[-1].reason == "shutdown"
    assert loop.engine.kv_usage()[0] == 0 and not loop.engine.sequences and loop.sessions_open == 0
    with pytest.raises(LoopClosed):
        loop.open_session()


def test_an_asyncio_consumer_reads_pauses_resumes_and_barges_in(make_loop):
    loop = make_loop(max_queued_chunks=2)
    options = SessionOptions(first_chunk_frames=1, chunk_frames=1)

    async def run():
        s = loop.open_session(aio_loop=asyncio.get_running_loop(), options=options, **frames(12))
        s.send("One. Two.")
        s.flush()
        events = []
        while len(of(events, SessionAudio)) < 3:  # (its back-pressure pauses and resumes it meanwhile)
            events.append(await s.next())
        s.cancel()
        while not isinstance(events[-1], ChunkEnded):
            events.append(await s.next())
        s.send("Three.")
        s.close()
        return events + [event async for event in s]

    events = asyncio.run(run())
    ends = of(events, ChunkEnded)
    assert [(e.chunk, e.reason) for e in ends] == [(0, "cancelled"), (1, "length")]
    # nothing of chunk 0 after its third audio event; chunk 1 in full; SessionEnded last
    assert [a.chunk for a in of(events, SessionAudio)] == [0, 0, 0] + [1] * 12
    assert isinstance(events[-1], SessionEnded) and events[-1].reason == "closed"
    wait_until(lambda: idle(loop), what="everything freed")


def test_a_session_nobody_reads_stays_paused_across_its_chunks(make_loop):
    """Back-pressure holds across chunk boundaries: a chunk that ends while its audio waits unread does
    not let the next chunks run ahead; the session generates nothing more until it is read."""
    loop = make_loop(max_queued_chunks=2)
    options = SessionOptions(first_chunk_frames=1, chunk_frames=1)
    s = loop.open_session(options=options, **frames(2))
    s.send("One is here. Two is here. Three is here. Four is here. Five is here.")
    s.flush()
    # chunk 0's two frames wait unread (the cap): chunk 1 waits for the reader, holding no row
    wait_until(lambda: s.paused and s.queued_audio == 2 and loop.runner.stage.idle, what="paused")
    generated = loop.engine.frames_generated
    run_iterations(loop)  # (nothing may happen meanwhile)
    assert s.queued_audio == 2 and loop.engine.num_running == 0 and loop.engine.frames_generated == generated
    s.close()
    events = drain(s)
    assert [e.reason for e in of(events, ChunkEnded)] == ["length"] * 5
    assert len(of(events, SessionAudio)) == 10
    wait_until(lambda: idle(loop), what="everything freed")
