"""Sessions (tts/runtime/sessions.py, the Python API's `TTS.session`): text streamed in, cut into chunks
(first clause early, then sentences, flush, length bound), spoken in order over one kept KV sequence
(prefix reuse counted exactly), barge-in cancel that keeps the session open, word timings, bounds and
timeouts. Deterministic: fixed frame counts (min_new_frames = max_new_frames, the end token never drawn),
a test clock for the timeouts."""

import dataclasses
from concurrent.futures import Future

import pytest
import torch
from helpers import tone_wav

from tts import TTS, EngineConfig, InvalidRequest
from tts.engine.sequences import common_prefix
from tts.model.config import AlignerSpec
from tts.model.kv_cache import blocks_needed
from tts.runtime.request import ReferenceClip, RequestLimits, prepare_reference
from tts.runtime.request_errors import InvalidField
from tts.runtime.sessions import (
    ChunkEnded,
    ChunkStarted,
    SessionAudio,
    SessionClosed,
    SessionEnded,
    SessionLimit,
    SessionManager,
    SessionOptions,
    SessionWarning,
    WordTimings,
)
from tts.text.prompt import Turn, VoiceReference
from tts.text.stream_cut import TextBuffer

FRAMES = dict(max_new_frames=6, min_new_frames=6, seed=3)


@pytest.fixture(scope="module")
def tts(tiny_bundle):
    t = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8))
    yield t
    t.close()


@pytest.fixture(scope="module")
def aligned_tts(tiny_bundle):
    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    t = TTS(bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8))
    assert t.engine.loop_guard
    yield t
    t.close()


def of(events, kind):
    return [e for e in events if isinstance(e, kind)]


def all_freed(tts):
    e = tts.engine
    return e.kv_usage()[0] == 0 and e.num_running == 0 and not e.sequences and not tts.runner.jobs


# ---- the chunk-cutting rule ----------------------------------------------------------------------------


def test_the_first_chunk_ends_at_a_clause_later_ones_at_sentences_and_flush_takes_the_rest():
    b = TextBuffer(max_bytes=60, first_words=3)
    assert b.push("Well, I") == []  # a clause of one word is too short to go early
    assert b.push(" think, so") == ["Well, I think,"]
    assert b.push(" it goes, on and") == []  # later chunks wait for a sentence end
    assert b.push(" on. Then 3.") == ["so it goes, on and on."]
    assert b.push("5 more") == []  # "3." followed by a digit is no sentence end
    assert b.flush() == ["Then 3.5 more"]
    b.new_turn()
    assert b.push("Yes. And") == ["Yes."]  # a sentence end before any clause end
    assert b.push(" " + "word " * 20) == ["And " + " ".join(["word"] * 11)]  # the length bound, at a space
    assert all(len(c.encode()) <= 60 for c in b.flush())


# ---- sessions ------------------------------------------------------------------------------------------


def test_text_waits_for_a_boundary_or_a_flush_and_chunks_are_spoken_in_order(tts):
    s = tts.session(**FRAMES)
    s.send("Hello there my")
    assert list(s) == [] and s.core.pending_text == "Hello there my"
    s.send(" friend")
    s.flush()
    events = list(s)
    assert [e.text for e in of(events, ChunkStarted)] == ["Hello there my friend"]
    (end,) = of(events, ChunkEnded)
    assert (end.reason, end.frames, end.cached_tokens) == ("length", 6, 0)
    audio = of(events, SessionAudio)
    assert [a.sample_offset for a in audio] == [0] + [a.sample_offset + len(a.samples) for a in audio[:-1]]
    assert end.audio_end == sum(len(a.samples) for a in audio) == 6 * tts.bundle.codec.frame_length
    s.send("One. Two.")
    s.close()
    events = list(s)
    assert [e.text for e in of(events, ChunkEnded)] == ["One.", "Two."]
    assert [e.chunk for e in of(events, ChunkEnded)] == [1, 2]
    assert isinstance(events[-1], SessionEnded) and events[-1].reason == "closed"
    assert all_freed(tts)


def test_each_chunk_prefills_only_its_new_tokens_so_later_sentences_cost_the_same(tts):
    s = tts.session(**FRAMES)
    for _ in range(5):
        s.send("The same sentence again. ")
    s.close()
    events = list(s)
    ends = of(events, ChunkEnded)
    assert [e.reason for e in ends] == ["length"] * 5
    fmt, refs = tts.bundle.prompt_format, tts.voice(None)
    codes = {}
    for a in of(events, SessionAudio):
        codes.setdefault(a.chunk, []).append(a.codes)
    turns = []
    held = 0
    for k, end in enumerate(ends):
        prompt = fmt.build(end.text, refs, turns)
        assert end.cached_tokens == held  # the whole history held so far, reused
        assert end.prefill_tokens == prompt.shape[0] - 1 - held  # only the new tokens
        held = prompt.shape[0] + end.frames - 1  # the prompt and every frame but the last
        turns = turns + [Turn(end.text, torch.cat(codes[k], dim=1))]
    # the new tokens of chunks 2..5 are the same: one frame, the turn's markup, the sentence
    assert len({e.prefill_tokens for e in ends[1:]}) == 1 < ends[0].prefill_tokens
    assert tts.engine.reprefill_tokens == 0
    assert all_freed(tts)


def test_cancel_frees_the_chunks_row_and_blocks_within_one_step_and_the_session_goes_on(tts):
    engine = tts.engine
    s = tts.session(max_new_frames=60, min_new_frames=60, seed=4)
    s.send("First sentence here.")
    s.flush()
    first = of(list(s), ChunkEnded)[0]
    held = engine.sequence_blocks(s.id)
    assert (
        engine.kv_usage()[0]
        == held
        == blocks_needed(first.cached_tokens + first.prefill_tokens + 1 + 60 - 1, 8)
    )
    s.send("A long second sentence that is interrupted.")
    s.flush()
    while not any(isinstance(e, SessionAudio) for e in s.poll()):
        pass
    assert engine.num_running == 1 and engine.kv_usage()[0] > held
    frames, steps = engine.frames_generated, engine.frame_steps
    s.cancel()
    events = s.poll()  # one pass: one engine step
    assert engine.num_running == 0 and engine.kv_usage()[0] == held
    assert (engine.frames_generated, engine.frame_steps) == (frames, steps)  # no frame after the cancel
    events += list(s)
    (end,) = of(events, ChunkEnded)
    assert end.reason == "cancelled" and 0 < end.frames < 60
    # the session stays open; the next chunk continues the history before the cancelled one
    s.send("After the barge-in.")
    s.flush()
    (again,) = of(list(s), ChunkEnded)
    assert (
        again.reason == "length"
        and again.cached_tokens == first.cached_tokens + first.prefill_tokens + 1 + 60 - 1
    )
    s.close()
    assert isinstance(list(s)[-1], SessionEnded) and all_freed(tts)


def _check_timings(events, sample_rate):
    sent, words, last_start, last_end = 0, {}, 0, 0
    chunk_text = {e.chunk: e.text for e in of(events, ChunkStarted)}
    for e in events:
        if isinstance(e, SessionAudio):
            sent = e.sample_offset + len(e.samples)
        elif isinstance(e, WordTimings):
            for w in e.words:
                assert w.start_sample <= w.end_sample <= sent  # inside the audio sent
                assert w.start_sample >= last_start and w.start_sample >= last_end  # monotonic
                assert w.start == w.start_sample / sample_rate and w.end == w.end_sample / sample_rate
                last_start, last_end = w.start_sample, w.end_sample
                words.setdefault(w.chunk, []).append(w)
    for chunk, text in chunk_text.items():
        assert [w.text for w in words[chunk]] == text.split()  # every word, in text order
    return [w for ws in words.values() for w in ws]


def test_word_timings_without_aligner_heads_are_estimated_chunk_exact_and_inside_the_audio(tts):
    s = tts.session(**FRAMES)
    s.send("Hello there, my good friend. How are you?")
    s.close()
    events = list(s)
    words = _check_timings(events, tts.sample_rate)
    assert all(w.estimated for w in words)
    for end in of(events, ChunkEnded):  # chunk-exact: the chunk's words cover exactly its audio
        chunk_words = [w for w in words if w.chunk == end.chunk]
        assert chunk_words[0].start_sample == end.audio_start and chunk_words[-1].end_sample == end.audio_end


def test_word_timings_from_the_aligner_are_measured_monotonic_and_inside_the_audio(aligned_tts):
    s = aligned_tts.session(max_new_frames=12, min_new_frames=12, seed=5)
    s.send("Hello there, my good friend. How are you today? Fine.")
    s.close()
    events = list(s)
    words = _check_timings(events, aligned_tts.sample_rate)
    assert any(not w.estimated for w in words)
    assert all_freed(aligned_tts)


def test_measured_words_start_mid_frame_on_the_codecs_audio_clock(aligned_tts, monkeypatch):
    codec = aligned_tts.bundle.codec
    monkeypatch.setattr(codec, "delay", 7, raising=False)  # (the tiny codec's own is 0)
    s = aligned_tts.session(max_new_frames=12, min_new_frames=12, seed=5)
    s.send("Hello there, my good friend. How are you today? Fine.")
    s.close()
    events = list(s)
    words = _check_timings(events, aligned_tts.sample_rate)
    starts = {e.chunk: e.sample_offset for e in of(events, ChunkStarted)}
    # a measured word starts in the middle of the frame the aligner found it in, `delay` samples on
    # (unless held inside the audio at the chunk's end); a chunk's first word starts with its audio
    ends = {e.chunk: e.audio_end for e in of(events, ChunkEnded)}
    inner = [w for w in words if not w.estimated and w.start_sample not in (starts[w.chunk], ends[w.chunk])]
    assert inner and all(
        (w.start_sample - starts[w.chunk]) % codec.frame_length == codec.frame_length // 2 + 7 for w in inner
    )
    assert all(ws[0].start_sample == starts[c] for c, ws in _by_chunk(words).items())
    assert all_freed(aligned_tts)


def _by_chunk(words):
    out = {}
    for w in words:
        out.setdefault(w.chunk, []).append(w)
    return out


def test_bad_use_gets_a_clear_error_and_frees_everything(tts):
    s = tts.session(options=SessionOptions(max_pending_bytes=40), **FRAMES)
    with pytest.raises(InvalidRequest, match="text: 41 bytes"):
        s.send("x" * 41)
    assert s.core.pending_text == ""  # nothing of it was taken
    with pytest.raises(InvalidRequest, match="text must be a string"):
        s.send(b"bytes")  # type: ignore[arg-type]
    s.send("Fine.")
    s.close()
    with pytest.raises(SessionClosed, match="was closed"):
        s.send("More.")
    list(s)
    with pytest.raises(SessionClosed, match="has ended"):
        s.flush()
    assert all_freed(tts)
    with pytest.raises(InvalidRequest, match="max_new_frames"):
        tts.session(max_new_frames=10**6)


def test_sessions_count_against_admission_and_an_idle_session_cannot_starve_others(tiny_bundle):
    # a pool of 24 usable blocks of 8: an idle session's history (about 12 blocks) and a request that
    # needs 20 blocks do not fit together
    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8, num_blocks=25))
    try:
        tts._sessions = SessionManager(tts.runner, max_sessions=1)
        s = tts.session(max_new_frames=8, min_new_frames=8, seed=1)
        with pytest.raises(SessionLimit):
            tts.session()
        s.send("The session speaks first.")
        s.flush()
        assert of(list(s), ChunkEnded)[0].reason == "length"
        assert tts.engine.sequence_blocks(s.id) > 4
        other = tts.synthesize("Another client.", seed=2, max_new_frames=70, min_new_frames=70)
        assert other.frames == 70 and tts.engine.sequence_evictions == 1
        s.send("And again.")
        s.flush()
        (end,) = of(list(s), ChunkEnded)
        assert end.reason == "length" and end.cached_tokens == 0  # its history prefilled again ...
        assert tts.engine.reprefill_tokens > 0  # ... and counted
        s.abort()
        assert all_freed(tts)
    finally:
        tts.close()


def test_text_without_a_boundary_is_cut_after_hold_seconds_and_an_idle_session_times_out(tts):
    now = [0.0]
    tts._sessions = SessionManager(tts.runner, clock=lambda: now[0])
    try:
        s = tts.session(options=SessionOptions(hold_seconds=2.0, idle_seconds=10.0), **FRAMES)
        s.send("no boundary here")
        assert tts.sessions.tick() == 2.0 and list(s) == []
        now[0] = 2.0
        tts.sessions.tick()
        events = list(s)
        assert [e.text for e in of(events, ChunkEnded)] == ["no boundary here"]
        now[0] = 5.0
        assert tts.sessions.tick() is not None and not s.core.ended
        now[0] = 50.0
        tts.sessions.tick()
        (ended,) = of(list(s), SessionEnded)
        assert ended.reason == "idle_timeout" and all_freed(tts)
    finally:
        tts._sessions = None


def test_history_beyond_the_context_drops_the_oldest_turns_and_the_reprefill_is_counted(tiny_bundle):
    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8, max_context=220))
    try:
        s = tts.session(**FRAMES)
        for _ in range(6):
            s.send("The same sentence again. ")
        s.close()
        ends = of(list(s), ChunkEnded)
        assert [e.reason for e in ends] == ["length"] * 6
        expected, held = 0, 0
        for end in ends:
            prompt_len = end.cached_tokens + end.prefill_tokens + 1
            assert prompt_len + 6 <= 220  # every prompt fits the context with its budget
            expected += min(held, prompt_len - 1) - end.cached_tokens
            held = prompt_len + end.frames - 1
        # some chunk found its oldest turns dropped: the history after them was prefilled again, counted
        assert expected > 0 and tts.engine.reprefill_tokens == expected
        assert all_freed(tts)
    finally:
        tts.close()


def test_a_session_whose_audio_is_not_read_is_paused_and_goes_on_when_read(tts):
    cap = tts.runner.max_queued_chunks
    options = SessionOptions(first_chunk_frames=1, chunk_frames=1)
    s = tts.session(options=options, max_new_frames=40, min_new_frames=40, seed=2)
    s.send("Nobody reads this for a while.")
    s.flush()
    engine = tts.engine
    for _ in range(400):  # drive the pipeline without reading, until the chunk is paused
        tts.runner.step()
        tts.sessions.tick()
        request = next(iter(engine._requests.values()), None)
        if request is not None and request.paused:
            break
    else:
        raise AssertionError("the unread session was never paused")
    assert s.core.unread_audio() <= cap and s.core.current is not None
    events = list(s)  # reading resumes it: the chunk ends with all its frames
    (end,) = of(events, ChunkEnded)
    assert end.reason == "length" and end.frames == 40
    s.close()
    list(s)
    assert all_freed(tts)


def test_a_sessions_audio_over_several_chunks_continues_one_codec_stream(tts):
    """Every chunk of a session decodes on one codec stream: chunk N+1's audio continues chunk N's
    decoder state, so the session's audio equals the offline decode of all its codes (as a multi-chunk
    job's does), not a decode restarted at every chunk boundary."""
    codec = tts.bundle.codec
    s = tts.session(**FRAMES)
    s.send("First sentence here. Second one follows. And a third.")
    s.close()
    events = list(s)
    assert [e.reason for e in of(events, ChunkEnded)] == ["length"] * 3
    audio = of(events, SessionAudio)
    codes = torch.cat([a.codes for a in audio], dim=1)
    pcm = torch.cat([torch.from_numpy(a.samples) for a in audio])
    restarted = torch.cat(
        [codec.decode(torch.cat([a.codes for a in audio if a.chunk == k], dim=1)) for k in range(3)]
    )
    assert not torch.allclose(pcm, restarted, atol=1e-4)  # (this codec has left context: a reset shows)
    torch.testing.assert_close(pcm, codec.decode(codes), atol=1e-6, rtol=0)
    assert all_freed(tts) and tts.runner.stage.free_slots == tts.runner.stage.max_streams


def test_the_next_chunk_waits_while_the_audio_before_it_is_unread(tts):
    """Back-pressure between chunks: a chunk that ended with `max_queued_chunks` audio events unread
    does not let the next chunk start (no row, no frame) until they are read."""
    cap = tts.runner.max_queued_chunks
    options = SessionOptions(first_chunk_frames=1, chunk_frames=1)
    s = tts.session(options=options, max_new_frames=cap, min_new_frames=cap, seed=2)
    s.send("One is here. Two is here. Three is here.")
    s.flush()
    stage, engine = tts.runner.stage, tts.engine
    for _ in range(2000):  # drive the pipeline without reading until chunk 0 has ended
        tts._wake.clear()
        if not tts.runner.step():
            tts._wake.wait(0.1)
        tts.sessions.tick()
        if s.core.current is None and stage.idle:
            break
    else:
        raise AssertionError("chunk 0 never ended")
    frames = engine.frames_generated
    for _ in range(5):
        tts.runner.step()
        tts.sessions.tick()
    assert s.core.unread_audio() == cap and engine.num_running == 0 and engine.frames_generated == frames
    assert [e.chunk for e in of(s.core.events, ChunkStarted)] == [0] and len(s.core.queue) == 2
    events = list(s)  # reading lets the next chunks go
    assert [e.reason for e in of(events, ChunkEnded)] == ["length"] * 3
    s.close()
    list(s)
    assert all_freed(tts)


# ---- a reference clip sent with the session ------------------------------------------------------------


def prepared_clip(tts, seconds: float = 2.0):
    """A clip checked as a one-shot request's is, and the voice it encodes to (the codec, called here)."""
    clip = ReferenceClip(tone_wav(tts.sample_rate, seconds), "A tone to clone.")
    ref = prepare_reference(tts.planner, clip, RequestLimits())
    return ref, VoiceReference(tts.bundle.codec.encode_audio(ref.samples), ref.text)


def reference_prefix(tts, voice) -> int:
    """Prompt positions up to the end of the voice reference (where two texts' prompts first differ)."""
    fmt = tts.bundle.prompt_format
    return common_prefix(fmt.build("One.", [voice], []), fmt.build("Two.", [voice], []))


def test_a_reference_clip_is_encoded_once_and_is_the_prefix_every_chunk_reuses(tts):
    ref, voice = prepared_clip(tts)
    encodes = tts.runner.stage.stats.encode_calls
    s = tts.session(reference=ref, **FRAMES)
    for _ in range(3):
        s.send("The same sentence again. ")
    s.flush()
    events = list(s)
    ends = of(events, ChunkEnded)
    assert [e.reason for e in ends] == ["length"] * 3
    assert tts.runner.stage.stats.encode_calls == encodes + 1  # once for the session, not per chunk
    (got,) = s.core.references
    assert torch.equal(got.codes, voice.codes) and got.text == voice.text
    fmt = tts.bundle.prompt_format
    codes = {}
    for a in of(events, SessionAudio):
        codes.setdefault(a.chunk, []).append(a.codes)
    turns: list[Turn] = []
    held = 0
    for k, end in enumerate(ends):
        prompt = fmt.build(end.text, [voice], turns)
        assert end.cached_tokens == held  # the reference and the history, reused
        assert end.prefill_tokens == prompt.shape[0] - 1 - held  # only the new tokens
        held = prompt.shape[0] + end.frames - 1
        turns = turns + [Turn(end.text, torch.cat(codes[k], dim=1))]
    # the first chunk prefilled the reference (its transcript and every frame of its codes) ...
    plain = fmt.build(ends[0].text, [], [])
    assert ends[0].prefill_tokens > plain.shape[0] - 1 + voice.codes.shape[1]
    # ... and later chunks only their own turn: the same count as a session without a reference
    assert len({e.prefill_tokens for e in ends[1:]}) == 1 < ends[0].prefill_tokens
    # the session's kept KV starts with the reference's prompt
    P = reference_prefix(tts, voice)
    columns = tts.engine.sequences[s.id].columns
    assert torch.equal(columns[:P], fmt.build(ends[0].text, [voice], [])[:P])
    s.close()
    assert isinstance(list(s)[-1], SessionEnded) and all_freed(tts)


def test_the_reference_stays_in_the_kept_prefix_when_the_oldest_turns_are_dropped(tiny_bundle):
    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8, max_context=300))
    try:
        ref, voice = prepared_clip(tts, seconds=1.0)
        s = tts.session(reference=ref, **FRAMES)
        for _ in range(8):
            s.send("The same sentence again. ")
        s.close()
        ends = of(list(s), ChunkEnded)
        assert [e.reason for e in ends] == ["length"] * 8
        P = reference_prefix(tts, voice)
        expected, held = 0, 0
        for end in ends:
            prompt_len = end.cached_tokens + end.prefill_tokens + 1
            assert prompt_len + 6 <= 300
            expected += min(held, prompt_len - 1) - end.cached_tokens
            held = prompt_len + end.frames - 1
        assert expected > 0 and tts.engine.reprefill_tokens == expected  # turns were dropped ...
        assert all(e.cached_tokens >= P for e in ends[1:])  # ... never the reference
        assert all_freed(tts)
    finally:
        tts.close()


def test_a_voice_and_a_reference_or_a_clip_that_does_not_encode_frees_everything(tts, monkeypatch):
    ref, _ = prepared_clip(tts)
    with pytest.raises(InvalidField, match="not both") as info:
        tts.session("default", reference=ref, **FRAMES)
    assert info.value.field == "voice" and not tts.sessions.sessions

    encode: Future = Future()  # the codec stage's encode of the clip, failing after the text came
    monkeypatch.setattr(tts.runner.stage, "encode", lambda samples: encode)
    s = tts.session(reference=ref, **FRAMES)
    s.send("Never spoken at all. ")
    s.flush()
    assert s.core.busy and not s.core.current  # the chunk waits for the voice
    encode.set_exception(RuntimeError("codec exploded"))
    events = list(s)
    assert not of(events, ChunkStarted)
    (warning,) = of(events, SessionWarning)
    assert "the reference clip could not be encoded: codec exploded" in warning.message
    assert events[-1] == SessionEnded(s.id, "error", 0, warning.message)
    assert all_freed(tts) and not tts.sessions.sessions


def test_a_session_chunk_gets_the_budget_a_one_shot_request_of_its_text_gets(aligned_tts, monkeypatch):
    # A paced model (aligner heads) budgets a chunk from its text's tokens, in a session as in a request:
    # "Hi." must not get the whole runaway guard's seconds to babble in.
    runner = aligned_tts.runner
    specs = []
    real = runner.submit
    monkeypatch.setattr(runner, "submit", lambda spec, *a, **k: specs.append(spec) or real(spec, *a, **k))
    s = aligned_tts.session(max_new_frames=400, seed=5)
    s.send("Hi.")
    s.close()
    list(s)
    one_shot = runner.planner.job("Hi.", max_new_frames=400, seed=5)
    assert runner.planner.paced()
    assert one_shot.budgets[0] < runner.planner.guard_frames("Hi.")  # (the paced budget is the smaller)
    assert [spec.budgets for spec in specs] == [one_shot.budgets]
    assert all_freed(aligned_tts)


def test_a_decode_that_fails_while_text_is_queued_does_not_fail_the_next_chunk(tiny_bundle):
    """A failed decode ends its chunk, whose engine request is cancelled at the next engine step; the
    session's next chunk must not start before that cancel has given the kept sequence back (it would
    be refused: the sequence in use). The failure is injected into the codec stage's results."""
    from tts.runtime.codec_stage import DecodeResult

    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8))
    try:
        s = tts.session(max_new_frames=60, min_new_frames=60, seed=4)
        s.send("A long first sentence here. Then a second one.")
        s.flush()
        runner, core = tts.runner, s.core
        while tts.engine.num_running == 0:
            runner.step()
            tts.sessions.tick()
        job = runner.jobs[core.current.job_id]
        real_results, calls = runner.stage.results, []

        def results():
            calls.append(1)
            failed = DecodeResult(tag=(job.job_id, 0), slot=job.slot, frames=1, error=RuntimeError("died"))
            return real_results() + [failed]

        runner.stage.results = results
        runner.step()
        runner.stage.results = real_results
        assert len(calls) == 1
        s.close()
        ended = of(list(s), ChunkEnded)
        assert [(e.chunk, e.reason) for e in ended] == [(0, "error"), (1, "length")], [e.error for e in ended]
        assert "died" in ended[0].error
    finally:
        tts.close()


def test_an_error_in_the_work_beside_a_frame_step_is_raised_after_the_step_not_swallowed(tiny_bundle):
    """A bug in the caller's work beside a frame step (the engine thread's commands) surfaces as it
    would have before the step (the engine thread's failure path), once the step's outputs are handled:
    never logged and dropped."""
    tts = TTS(tiny_bundle, EngineConfig(max_batch=2, ignore_eos=True, block_size=8))
    try:
        s = tts.session(max_new_frames=60, min_new_frames=60, seed=4)
        s.send("A sentence.")
        s.flush()
        runner = tts.runner
        while tts.engine.num_running == 0:
            runner.step()
            tts.sessions.tick()
        calls = []

        def commands():
            calls.append(1)
            raise RuntimeError("a bug in delivery")

        frames = tts.engine.frames_generated
        with pytest.raises(RuntimeError, match="a bug in delivery"):
            runner.step(beside_step=commands)
        assert len(calls) == 1 and tts.engine.frames_generated == frames + 1  # the step itself ran
    finally:
        tts.close()
