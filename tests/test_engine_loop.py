"""EngineThread: the engine thread driving the job pipeline: streamed audio, back-pressure, preemption of
paused streams, cancel, failures."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import run_iterations

from tts.api import TTS
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig, FinishReason
from tts.runtime.engine_thread import (
    Audio,
    Cancelled,
    EngineFailed,
    EngineThread,
    Failed,
    Finished,
    LoopClosed,
    Overloaded,
    Preempted,
    RequestStream,
    Started,
)


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


@pytest.fixture(scope="module")
def offline(bundle):
    return TTS(bundle)


@pytest.fixture
def make_loop(bundle):
    loops = []

    def make(**options):
        engine_config = EngineConfig(max_batch=options.pop("max_batch", 4))
        loop = EngineThread(bundle, engine_config, **options).start()
        loop.wait_ready(60)
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.stop()


def job(loop, text, max_new_frames=20, seed=1, temperature=None, hold=False, **kw):
    """A planned job; `hold`: exactly max_new_frames frames per text chunk (the end token held off), so
    a test does not depend on when the random model would stop."""
    sampling = dict(seed=seed, max_new_frames=max_new_frames, temperature=temperature)
    if hold:
        sampling["min_new_frames"] = max_new_frames
    return loop.planner.job(text, **sampling, **kw)


LONG_TEXT = "A text long enough for the runaway guard to allow every frame these tests ask for."


def drain(stream, timeout=60.0):
    events = []
    while True:
        event = stream.get(timeout=timeout)
        events.append(event)
        if isinstance(event, Finished | Failed):
            return events


def wait_until(predicate, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def idle(loop) -> bool:
    e = loop.engine
    return loop.in_flight == 0 and e.kv_usage()[0] == 0 and e.num_running == 0 and e.num_waiting == 0


def test_events_and_streamed_audio_equal_offline(make_loop, bundle, offline):
    loop = make_loop()
    events = drain(loop.submit(job(loop, "Hello there.", 30, seed=7, first_chunk_frames=3, chunk_frames=8)))
    assert isinstance(events[0], Started) and events[0].seed == 7 and events[0].text_chunks == 1
    audio = [e for e in events if isinstance(e, Audio)]
    assert [a.sequence for a in audio] == list(range(len(audio)))
    # the first size twice, then doubling up to chunk_frames
    assert [a.frame_end - a.frame_start for a in audio[:4]] == [3, 3, 6, 8]
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.frames == audio[-1].frame_end
    pcm = np.concatenate([a.samples for a in audio])
    codes = torch.cat([a.codes for a in audio], dim=1)
    ref = offline.synthesize("Hello there.", seed=7, max_new_frames=30)
    assert torch.equal(codes, ref.codes)
    np.testing.assert_allclose(pcm, bundle.codec.decode(codes).numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(pcm, ref.audio, atol=1e-6, rtol=0)
    wait_until(lambda: idle(loop), what="idle")


def test_a_job_frees_its_admission_before_its_client_sees_the_end(make_loop, monkeypatch):
    """When the final event reaches the consumer, the job no longer counts as in flight: a client that
    resubmits at once is not refused for a slot its own ended request still held, and /load is exact."""
    from tts.runtime.engine_thread import RequestStream

    loop = make_loop()
    seen = []
    deliver = RequestStream.deliver

    def recording(self, event):
        if isinstance(event, Finished | Failed):
            seen.append(loop.in_flight)
        return deliver(self, event)

    monkeypatch.setattr(RequestStream, "deliver", recording)
    drain(loop.submit(job(loop, "Hello.", 4, seed=1, hold=True)))
    assert seen == [0]


def test_asyncio_consumer(make_loop):
    loop = make_loop()

    async def consume():
        stream = loop.submit(job(loop, "Hello.", 8, seed=2), asyncio.get_running_loop())
        events = []
        while not stream.done:
            events.append(await stream.next())
        return events

    events = asyncio.run(consume())
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)


def test_events_for_an_event_loop_go_over_in_one_handover_per_flush(bundle):
    # Not started: this thread plays the engine thread, which delivers and flushes.
    loop = EngineThread(bundle, EngineConfig(max_batch=1), warmup=False)
    aio = asyncio.new_event_loop()
    try:
        a, b = RequestStream(loop, "a", aio), RequestStream(loop, "b", aio)
        audio = Audio(0, np.zeros(4, np.float32), 0, 1, torch.zeros(2, 1, dtype=torch.int64))
        end = Finished(1, [], 0.0, None)
        sent = [
            (a, Started("a", 1, 1)),
            (b, Started("b", 2, 1)),
            (a, audio),
            (b, Failed(Cancelled("x"))),
            (a, end),
        ]
        for stream, event in sent:
            assert stream.deliver(event)
        assert loop.handovers == 0 and a._aq is not None and a._aq.empty()  # nothing before the flush
        loop._flush()
        loop._flush()  # nothing new: no second handover
        assert loop.handovers == 1
        aio.run_until_complete(asyncio.sleep(0))  # the event loop runs the handover

        async def take(stream, n):
            return [await stream.next() for _ in range(n)]

        assert aio.run_until_complete(take(a, 3)) == [e for s, e in sent if s is a]
        assert aio.run_until_complete(take(b, 2)) == [e for s, e in sent if s is b]
        assert a.done and b.done and a.queued_chunks == 0
        aio.close()
        assert not RequestStream(loop, "c", aio).deliver(end)  # a closed event loop: refused at once
        assert loop._outbox == {}
    finally:
        aio.close()


def test_an_event_loop_closed_before_the_hand_over_cancels_its_jobs(make_loop):
    loop = make_loop()
    aio = asyncio.new_event_loop()  # never run: its stream's events wait in the outbox for the flush
    frames = loop.engine.frames_generated

    def close_then_flush():  # (on the engine thread, before the job's first engine step)
        loop.runner.before_engine_step = loop._flush
        aio.close()
        loop._flush()  # the hand-over of `Started` fails: the job is cancelled

    loop.runner.before_engine_step = close_then_flush
    try:
        loop.submit(job(loop, LONG_TEXT, 40, hold=True), aio)
        wait_until(lambda: idle(loop), what="the job cancelled and everything freed")
        assert loop.engine.frames_generated == frames and loop.handovers == 0
    finally:
        aio.close()


def slow_job(loop):
    """A greedy 40-frame job in 2-frame chunks, held open to its budget: a reader that stops reading it
    makes it hit the back-pressure cap."""
    return job(
        loop,
        "Back pressure test.",
        40,
        seed=4,
        temperature=0.0,
        chunk_frames=2,
        first_chunk_frames=2,
        hold=True,
    )


def test_back_pressure_pauses_only_the_slow_request(make_loop, bundle, offline):
    loop = make_loop(max_queued_chunks=2)
    slow = loop.submit(slow_job(loop))
    assert isinstance(slow.get(timeout=60), Started)
    wait_until(lambda: slow.paused and loop.stats.paused == 1, what="pause")
    frames = loop.engine.frames_generated
    other = drain(loop.submit(job(loop, "Meanwhile.", 10, seed=1)))  # the batch keeps running
    assert isinstance(other[-1], Finished) and other[-1].frames > 0
    assert slow.queued_chunks == 2  # the cap: memory stays bounded
    assert loop.engine.frames_generated - frames == other[-1].frames  # nothing more for the slow one
    wait_until(lambda: loop.stats.running == 1 and loop.stats.jobs == 1, what="other request gone")
    assert loop.engine.num_running == 1  # the slow one keeps its row while paused
    events = drain(slow)  # reading resumes it
    audio = [e for e in events if isinstance(e, Audio)]
    assert [a.sequence for a in audio] == list(range(len(audio)))
    ref = offline.synthesize(
        "Back pressure test.", seed=4, max_new_frames=40, min_new_frames=40, temperature=0.0
    )
    np.testing.assert_allclose(np.concatenate([a.samples for a in audio]), ref.audio, atol=1e-6, rtol=0)
    assert events[-1].frames == ref.frames == 40
    wait_until(lambda: idle(loop), what="idle")


def test_back_pressure_counts_chunks_still_being_decoded(make_loop):
    """A codec stage that lags (held here) must not let a job that nobody reads run ahead: chunks in
    flight on the codec stage count toward the cap, so the job pauses after `cap` chunks however slow
    the decode, and its unread queue never exceeds the cap."""
    import threading

    loop = make_loop(max_queued_chunks=2)
    stage = loop.runner.stage
    gate = threading.Event()
    decode = stage.decoder.decode

    def held(*args, **kwargs):
        gate.wait(60)
        return decode(*args, **kwargs)

    stage.decoder.decode = held
    try:
        base = loop.engine.frames_generated  # (the loop's warm-up synthesis counts too)
        slow = loop.submit(slow_job(loop))
        assert isinstance(slow.get(timeout=60), Started)
        wait_until(lambda: slow.paused, what="pause while the codec stage is held")
        frames = loop.engine.frames_generated
        assert frames - base == 4  # two chunks of two frames, then nothing
        gate.set()
        wait_until(lambda: slow.queued_chunks == 2 and stage.idle, what="decoded")
        assert loop.engine.frames_generated == frames and slow.queued_chunks == 2
        events = drain(slow)
        assert events[-1].frames == 40
    finally:
        gate.set()
        stage.decoder.decode = decode


def test_pause_across_text_chunks_stops_generation_until_read(make_loop, offline):
    """A two-chunk text whose reader does not read: the job pauses (its next text chunk deferred, or its
    engine request paused, depending on when the audio came back) and generates nothing more until the
    consumer reads; then the whole audio equals the offline synthesis."""
    loop = make_loop(max_queued_chunks=1)
    text = " ".join(f"This is sentence number {i} of a text long enough to be split." for i in range(4))
    assert len(loop.planner.plan(text)) == 2
    stream = loop.submit(
        job(loop, text, 2, seed=9, temperature=0.0, first_chunk_frames=2, chunk_frames=2, hold=True)
    )
    assert isinstance(stream.get(timeout=60), Started)

    def stopped() -> bool:
        state = next(iter(loop.runner.jobs.values()), None)
        return (
            stream.paused
            and state is not None
            and not state.inflight
            and (state.deferred or not loop.engine.runner.buffers.active.any())
        )

    wait_until(stopped, what="paused generation")
    frames = loop.engine.frames_generated
    run_iterations(loop)
    assert loop.engine.frames_generated == frames
    events = drain(stream)
    audio = np.concatenate([e.samples for e in events if isinstance(e, Audio)])
    ref = offline.synthesize(text, seed=9, max_new_frames=2, min_new_frames=2, temperature=0.0)
    assert events[-1].frames == ref.frames == 4 and len(events[-1].finish_reasons) == 2
    np.testing.assert_allclose(audio, ref.audio, atol=1e-6, rtol=0)
    wait_until(lambda: idle(loop), what="idle")


def test_cancel_running_paused_and_queued_jobs_frees_everything(make_loop):
    loop = make_loop(max_batch=1, max_waiting=2, max_queued_chunks=1)
    running = loop.submit(job(loop, LONG_TEXT, 200, hold=True, chunk_frames=1, first_chunk_frames=1))
    queued = loop.submit(job(loop, LONG_TEXT, 200, hold=True))
    assert isinstance(running.get(timeout=60), Started)
    wait_until(lambda: running.paused, what="pause")  # one unread chunk: paused
    wait_until(lambda: loop.stats.waiting == 1, what="second job queued")  # no free row for it
    running.cancel()
    queued.cancel()
    for stream in (running, queued):
        events = []
        while not events or not isinstance(events[-1], Failed):
            events.append(stream.get(timeout=60))
        assert isinstance(events[-1].error, Cancelled)
    wait_until(lambda: idle(loop), what="idle")


def test_admission_is_bounded(make_loop):
    loop = make_loop(max_batch=1, max_waiting=1)
    streams = [loop.submit(job(loop, LONG_TEXT, 200, hold=True)) for _ in range(2)]
    with pytest.raises(Overloaded, match="2 requests in flight"):
        loop.submit(job(loop, "Too many."))
    for s in streams:
        s.cancel()
    wait_until(lambda: idle(loop), what="idle")
    drain(loop.submit(job(loop, "Room again.", 4)))


def test_step_failure_fails_every_job_and_the_loop_keeps_serving(make_loop, monkeypatch):
    loop = make_loop()
    streams = [loop.submit(job(loop, LONG_TEXT, 200, seed=i, hold=True)) for i in range(3)]
    for s in streams:
        assert isinstance(s.get(timeout=60), Started)
    real_step = loop.engine.step

    def broken_step(*args):
        monkeypatch.setattr(loop.engine, "step", real_step)
        raise RuntimeError("device lost")

    monkeypatch.setattr(loop.engine, "step", broken_step)
    for s in streams:
        events = drain(s)
        assert isinstance(events[-1], Failed) and isinstance(events[-1].error, EngineFailed)
        assert "device lost" in str(events[-1].error)
    wait_until(lambda: idle(loop), what="idle")
    # (the stats are a snapshot the engine thread takes after it has delivered an iteration's events)
    wait_until(lambda: loop.stats.step_failures == 1, what="the failed step counted")
    assert isinstance(drain(loop.submit(job(loop, "Still here.", 4)))[-1], Finished)


def test_a_request_sent_while_a_frame_step_computes_is_taken_in_during_that_step(make_loop, monkeypatch):
    """The commands that reach the engine thread while a frame step computes are applied before the
    step's frame is read back (on CUDA the GPU computes meanwhile), so the new request joins at the
    next iteration, as it would have had it waited for the loop. Held on events, no timing."""
    loop = make_loop()
    engine = loop.engine
    launched, sent = threading.Event(), threading.Event()
    seen: list[bool] = []
    run, to_host = engine.graphs.run, engine._frame_to_host

    def run_and_wait(*args):
        result = run(*args)
        if not launched.is_set():  # the first step's launch: held until the test's submit is queued
            launched.set()
            assert sent.wait(60)
        return result

    def read_back(n):
        if not seen:
            seen.append(any(j.spec.params.seed == 2 for j in loop.runner.jobs.values()))
        return to_host(n)

    monkeypatch.setattr(engine.graphs, "run", run_and_wait)
    monkeypatch.setattr(engine, "_frame_to_host", read_back)
    first = loop.submit(job(loop, LONG_TEXT, 200, seed=1, hold=True))
    assert launched.wait(60)
    second = loop.submit(job(loop, "Sent mid-step.", 4, seed=2))
    sent.set()
    assert isinstance(drain(second)[-1], Finished)
    assert seen == [True]
    first.cancel()


def test_a_codec_failure_fails_only_the_jobs_of_that_call(make_loop, monkeypatch):
    """A decode call that raises fails the jobs whose audio it held, with INTERNAL's EngineFailed; the
    stage and the loop keep serving."""
    from tts.codec.base import StreamingDecoder

    real_push = StreamingDecoder.push

    def push(self, codes):
        if codes.shape[1] == 3:  # only the job whose chunks are 3 frames long
            raise RuntimeError("decoder exploded")
        return real_push(self, codes)

    monkeypatch.setattr(StreamingDecoder, "push", push)
    loop = make_loop()
    bad = loop.submit(job(loop, "Bad.", 30, temperature=0.0, first_chunk_frames=3, chunk_frames=3, hold=True))
    events = drain(bad)
    assert isinstance(events[-1], Failed) and "decoder exploded" in str(events[-1].error)
    assert isinstance(events[-1].error, EngineFailed)
    assert isinstance(drain(loop.submit(job(loop, "Good.", 30, seed=3, hold=True)))[-1], Finished)
    wait_until(lambda: idle(loop), what="idle")
    assert loop.alive and loop.runner.stage.stats.failures >= 1


def test_bad_reference_found_on_the_engine_thread_fails_the_job(make_loop):
    loop = make_loop()
    prepared = loop.planner.prepare_reference(np.ones(16000, np.float32) * 0.1, 16000, "x")
    bad = replace(prepared, samples=torch.zeros(2, 3, 5))  # not [samples]: the codec raises
    events = drain(loop.submit(job(loop, "Hi.", 4, reference=bad)))
    assert len(events) == 1 and isinstance(events[0], Failed)
    wait_until(lambda: idle(loop), what="idle")


def test_stop_ends_open_jobs_and_refuses_new_ones(make_loop):
    loop = make_loop()
    stream = loop.submit(job(loop, LONG_TEXT, 300, hold=True))
    assert isinstance(stream.get(timeout=60), Started)
    loop.stop()
    assert not loop.alive
    events = drain(stream)
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, LoopClosed)
    assert loop.engine.kv_usage()[0] == 0
    with pytest.raises(LoopClosed):
        loop.submit(job(loop, "After."))
    with pytest.raises(queue.Empty):
        stream.get(timeout=0.01)


def test_a_paused_stream_is_preempted_only_while_others_wait(make_loop):
    """Back-pressure pauses a job that nobody reads; it keeps its row while nobody else needs one, and is
    ended with Preempted (RESOURCE_EXHAUSTED) once another job waits for a row longer than the pause
    timeout; the waiting job then runs."""
    loop = make_loop(max_batch=1, max_waiting=2, max_queued_chunks=1, pause_timeout=0.2)
    hog = loop.submit(job(loop, LONG_TEXT, 200, hold=True, chunk_frames=1, first_chunk_frames=1))
    assert isinstance(hog.get(timeout=60), Started)
    wait_until(lambda: hog.paused and loop.stats.paused == 1, what="pause")
    time.sleep(0.5)  # past the (wall-clock) timeout, but nobody waits: it keeps its row
    run_iterations(loop)  # (iterations that saw the timeout passed)
    assert loop.engine.num_running == 1 and loop.in_flight == 1
    other = loop.submit(job(loop, "Hello.", 5, seed=2, hold=True))
    events = drain(other)  # runs once the hog is preempted
    assert isinstance(events[-1], Finished) and events[-1].frames == 5
    hog_events = drain(hog)
    assert isinstance(hog_events[-1], Failed) and isinstance(hog_events[-1].error, Preempted)
    assert "not read for 0.2 s" in str(hog_events[-1].error)
    wait_until(lambda: idle(loop), what="idle")


def test_a_job_whose_request_was_preempted_for_kv_blocks_fails_with_preempted(make_loop):
    """The engine ends a request with PREEMPTED when the KV pool runs out mid-stream and no request can
    decode (tts.engine.scheduler; the policy itself: tests/test_kv_pool.py). Its job then fails with
    Preempted (RESOURCE_EXHAUSTED), never a stream cut without its status. (The job is held paused by
    back-pressure, so the engine request is surely still running when it is ended.)"""
    loop = make_loop(max_batch=2, max_queued_chunks=1)
    stream = loop.submit(job(loop, LONG_TEXT, 200, hold=True, chunk_frames=1, first_chunk_frames=1))
    assert isinstance(stream.get(timeout=60), Started)
    wait_until(lambda: stream.paused and loop.stats.paused == 1, what="pause")
    (request,) = list(loop.engine.scheduler.running)
    loop.engine.cancel(request.request_id, FinishReason.PREEMPTED)
    events = drain(stream)
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, Preempted)
    assert "KV cache is full" in str(events[-1].error)
    wait_until(lambda: idle(loop), what="idle")


def test_a_codec_stage_that_fails_once_recovers_and_serves_the_next_job(make_loop, bundle, monkeypatch):
    """A decode call that raises (injected, once) fails the job whose audio it held with EngineFailed
    naming the error, is counted, and the stage probes itself, passes and serves on: the next job's
    audio equals its offline decode, and the replica stays in service."""
    loop = make_loop()
    stage = loop.runner.stage
    real_decode = stage.decoder.decode
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected decode failure")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(stage.decoder, "decode", fails_once)
    events = drain(loop.submit(job(loop, "Hello.", 8, hold=True)))
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, EngineFailed)
    assert "injected decode failure" in str(events[-1].error)
    wait_until(lambda: idle(loop), what="the failed job freed")
    events = drain(loop.submit(job(loop, LONG_TEXT, 12, seed=5, hold=True)))
    assert isinstance(events[-1], Finished) and events[-1].frames == 12
    audio = [e for e in events if isinstance(e, Audio)]
    codes = torch.cat([a.codes for a in audio], dim=1)
    pcm = np.concatenate([a.samples for a in audio])
    np.testing.assert_allclose(pcm, bundle.codec.decode(codes).numpy(), atol=1e-6, rtol=0)
    assert stage.stats.failures == 1 and stage.dead is None and loop.failure is None
    loop._refresh_stats()  # (the engine thread refreshes it every iteration; be exact here)
    assert loop.stats.codec_failures == 1 and not loop.stats.failed


def test_a_failed_stream_reset_fails_that_job_only_and_the_stage_recovers(make_loop, monkeypatch):
    """A reset that raises (injected, once) leaves that stream's state undefined: its job fails, the
    stage serves on and the next job (its slot reset anew) finishes."""
    loop = make_loop()
    stage = loop.runner.stage
    real_reset = stage.decoder.reset
    calls = []

    def fails_once(slots):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected reset failure")
        return real_reset(slots)

    monkeypatch.setattr(stage.decoder, "reset", fails_once)
    events = drain(loop.submit(job(loop, "Hello.", 8, hold=True)))
    assert isinstance(events[-1], Failed) and "injected reset failure" in str(events[-1].error)
    events = drain(loop.submit(job(loop, "Again.", 8, hold=True)))
    assert isinstance(events[-1], Finished) and events[-1].frames == 8
    assert stage.stats.failures == 1 and loop.failure is None
    wait_until(lambda: idle(loop), what="idle")


def test_a_codec_stage_that_cannot_recover_takes_the_replica_out(make_loop, monkeypatch):
    """A decoder that always raises (a broken device): the job it held fails with EngineFailed, the
    probe fails too, the stage is dead and the loop out of service: `failure` names the cause,
    `on_failed` is called once, new submissions are refused with LoopClosed (UNAVAILABLE) at once, and
    everything the failed job held is freed."""
    loop = make_loop()
    reasons = []
    loop.on_failed = reasons.append
    stage = loop.runner.stage

    def broken(*args, **kwargs):
        raise RuntimeError("device gone")

    monkeypatch.setattr(stage.decoder, "decode", broken)
    events = drain(loop.submit(job(loop, "Hello.", 8, hold=True)))
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, EngineFailed)
    assert "device gone" in str(events[-1].error)
    wait_until(lambda: loop.failure is not None, what="out of service")
    assert "codec stage is out of service" in loop.failure and "device gone" in loop.failure
    assert reasons == [loop.failure]
    with pytest.raises(LoopClosed, match="out of service"):
        loop.submit(job(loop, "Again.", 8, hold=True))
    wait_until(lambda: loop.in_flight == 0 and loop.engine.kv_usage()[0] == 0, what="freed")
    assert stage.stats.failures == 1 and loop.alive


def test_jobs_in_flight_fail_when_the_codec_stage_dies(make_loop, monkeypatch):
    """A job still generating when the stage dies (another job's call broke the device) fails with
    EngineFailed naming the cause, rather than waiting for audio that will never come."""
    import threading
    from concurrent.futures import Future

    loop = make_loop(max_queued_chunks=64)
    stage = loop.runner.stage
    gate = threading.Event()
    stage._tasks.append((gate.wait, Future()))  # hold the worker until the job has queued audio
    with stage._cv:
        stage._cv.notify()
    long = loop.submit(job(loop, LONG_TEXT, 200, hold=True, first_chunk_frames=1, chunk_frames=1))
    assert isinstance(long.get(timeout=60), Started)

    def broken(*args, **kwargs):
        raise RuntimeError("device gone")

    monkeypatch.setattr(stage.decoder, "decode", broken)
    gate.set()
    events = drain(long)
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, EngineFailed)
    assert "device gone" in str(events[-1].error)
    wait_until(lambda: loop.in_flight == 0 and loop.engine.kv_usage()[0] == 0, what="freed")
    assert loop.failure is not None


def test_engine_steps_failing_in_a_row_take_the_replica_out(make_loop, monkeypatch):
    """One failed engine step fails the jobs in flight and the loop serves on (see above); steps failing
    MAX_CONSECUTIVE_STEP_FAILURES times in a row (a broken device) take the replica out of service."""
    from tts.runtime.jobs import MAX_CONSECUTIVE_STEP_FAILURES

    loop = make_loop()

    def broken_step(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(loop.engine, "step", broken_step)
    for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
        assert loop.failure is None
        events = drain(loop.submit(job(loop, "Hello.", 4, seed=i)))
        assert isinstance(events[-1], Failed) and "device lost" in str(events[-1].error)
    wait_until(lambda: loop.failure is not None, what="out of service")
    assert "engine steps in a row failed" in loop.failure and "device lost" in loop.failure
    with pytest.raises(LoopClosed, match="out of service"):
        loop.submit(job(loop, "Again."))


def test_a_crash_of_the_engine_thread_fails_its_jobs_and_says_why(make_loop, monkeypatch):
    """An exception outside the engine step (a bug in the pipeline, injected) ends the engine thread:
    it is logged once, jobs in flight fail with EngineFailed naming it, `failure` says why and
    `on_failed` is called once (the server's health turns NOT_SERVING)."""
    loop = make_loop()
    reasons = []
    loop.on_failed = reasons.append
    stream = loop.submit(job(loop, LONG_TEXT, 200, hold=True))
    assert isinstance(stream.get(timeout=60), Started)

    def broken():
        raise RuntimeError("pipeline bug")

    monkeypatch.setattr(loop.runner, "_preempt_paused", broken)
    events = drain(stream)
    assert isinstance(events[-1], Failed) and isinstance(events[-1].error, EngineFailed)
    assert "pipeline bug" in str(events[-1].error)
    wait_until(lambda: not loop.alive, what="the engine thread ended")
    assert loop.failure is not None and "the engine thread failed" in loop.failure
    assert reasons == [loop.failure]
    with pytest.raises(LoopClosed):
        loop.submit(job(loop, "After."))


def test_chunk_sizes_repeat_the_first_then_double_up_to_chunk_frames():
    from tts.runtime.jobs import chunk_size, ramp_sizes

    assert [chunk_size(4, 16, k) for k in range(6)] == [4, 4, 8, 16, 16, 16]
    assert ramp_sizes(4, 16) == (4, 8, 16) and ramp_sizes(16, 4) == (4, 16)
    assert ramp_sizes(1, 256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert [chunk_size(3, 8, k) for k in range(5)] == [3, 3, 6, 8, 8]
    assert [chunk_size(16, 4, k) for k in range(3)] == [16, 4, 4]  # a large first chunk, small later ones
    assert chunk_size(1, 256, 100) == 256 and chunk_size(256, 256, 0) == 256


SPLIT_TEXT = " ".join(
    f"Sentence number {i} is here to make a text long enough for two chunks of audio." for i in range(4)
)


@pytest.fixture(scope="module")
def boundary_loops():
    """One loop per model (built on first use), kept for every chunk size."""
    loops: dict[str, EngineThread] = {}

    def get(model: str) -> EngineThread:
        if model not in loops:
            engine_config = EngineConfig(max_batch=2)
            loops[model] = EngineThread(load_bundle(model), engine_config, max_queued_chunks=16).start()
            loops[model].wait_ready(120)
        return loops[model]

    yield get
    for loop in loops.values():
        loop.stop()


@pytest.mark.parametrize("model", ["tiny", "default"])
@pytest.mark.parametrize("chunk_frames", [1, 16, 255, 256])
def test_every_allowed_chunk_size_streams_a_text_chunks_tail_after_a_full_piece(
    boundary_loops, model, chunk_frames
):
    """Audio chunks of `chunk_frames` (1, 16, the largest allowed and one less) over two text chunks:
    text chunk 1 has chunk_frames + 2 frames (a full piece, then a short tail that goes out with text
    chunk 2's one frame, the request's audio limit; on a model with a loop guard the held frames move
    the split).
    The codec stage is held until every piece is queued for the stream, so one call could take a full
    piece and the tail together (more than the largest piece for 255 and 256): every size decodes, in
    order, and the audio equals the offline decode of the streamed codes."""
    import threading
    from concurrent.futures import Future

    from tts.runtime.codec_stage import MAX_PIECE_FRAMES

    loop = boundary_loops(model)
    stage = loop.runner.stage
    c = chunk_frames
    gate = threading.Event()
    stage._tasks.append((gate.wait, Future()))  # hold the worker until every piece is queued
    with stage._cv:
        stage._cv.notify()
    spec = job(
        loop,
        SPLIT_TEXT,
        c + 2,
        seed=3,
        hold=True,
        first_chunk_frames=c,
        chunk_frames=c,
        max_audio_seconds=(c + 3.5) / loop.planner.frame_rate,
    )
    assert len(spec.chunks) >= 2

    def queued() -> list[int]:
        with stage._cv:
            return [item.codes.shape[1] for kind, item in stage._queue if kind == "decode"]

    try:
        stream = loop.submit(spec)
        wait_until(lambda: sum(queued()) == c + 3, timeout=120, what="every piece queued")
        pieces = queued()
    finally:
        gate.set()
    if model == "tiny":  # (no loop guard: a full piece, then the tail with text chunk 2's frame)
        assert pieces == ([c, 3] if c > 1 else [1] * 4)
    if c >= MAX_PIECE_FRAMES - 1:
        assert len(pieces) >= 2 and pieces[0] + pieces[1] > MAX_PIECE_FRAMES  # the case exercised
    events = drain(stream, timeout=120)
    fin = events[-1]
    assert isinstance(fin, Finished), fin
    audio = [e for e in events if isinstance(e, Audio)]
    assert [a.frame_end - a.frame_start for a in audio] == pieces
    assert fin.frames == c + 3 and len(fin.finish_reasons) == len(spec.chunks)
    codes = torch.cat([a.codes for a in audio], dim=1)
    pcm = np.concatenate([a.samples for a in audio])
    # (within float rounding: the learned vocoder's convolutions block differently by call shape)
    np.testing.assert_allclose(pcm, loop.bundle.codec.decode(codes).numpy(), atol=1e-5, rtol=0)
    assert stage.stats.failures == 0 and loop.failure is None
    wait_until(lambda: idle(loop), what="idle")


def test_a_decode_call_holds_at_most_two_rows_per_engine_row_and_at_least_16(make_loop):
    """The frames a decode call takes come from the engine's rows (its max batch) and the last pieces of
    streams that just ended: a server with many stream slots sizes its codec calls, and the graphs and
    buffers captured for them, to twice its max batch, not to every slot; at least 16 rows, so that a
    small batch's codec that fell behind drains the pieces of streams that ended meanwhile in few calls."""
    small = make_loop(max_batch=2, max_waiting=40, max_sessions=8).runner.stage
    assert small.max_streams == 2 + 40 + 8 + 1
    assert small.max_rows == 16 and max(small.graphs.buckets) == 16
    large = make_loop(max_batch=12, max_waiting=40, max_sessions=8).runner.stage
    assert large.max_rows == 24 and max(large.graphs.buckets) == 24
