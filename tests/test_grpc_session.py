"""gRPC `SynthesizeSession` (bidi) against a real server on the tiny model, through a real grpc.aio client:
flush and close, barge-in (nothing of the cut chunk after its end, its row and new KV blocks freed, exact
block counts, the next chunk reusing the history), word timings inside the audio, bad messages as
INVALID_ARGUMENT naming the field with everything freed, a paused session that cannot starve a unary job,
the session limit, and drain. Deterministic: exact frame counts (min_new_frames = max_new_frames), waits
on events and server state, no timings."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import grpc
import numpy as np
import pytest
from helpers import tone_wav
from service_helpers import NO_BDP, ServerThread, wait_idle

from service.client import channel_options
from service.common import ServiceLimits
from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.checkpoints.load import load_bundle
from tts.codec.base import AudioError
from tts.engine import EngineConfig
from tts.model.kv_cache import blocks_needed
from tts.runtime.request import ReferenceClip, prepare_reference
from tts.text.prompt import VoiceReference

BLOCK = 8


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


@pytest.fixture(scope="module")
def server(bundle):
    # One row: a unary job must wait for a session's row (the starvation test); a short pause timeout
    # only acts while another request waits for it.
    limits = ServiceLimits(max_waiting=4, max_queued_chunks=4, pause_timeout=0.3, max_sessions=2)
    srv = ServerThread(bundle, EngineConfig(max_batch=1, block_size=BLOCK), limits)
    yield srv
    srv.stop()


def start(
    frames: int,
    seed: int = 3,
    encoding=pb.AUDIO_ENCODING_FLOAT32,
    chunk_frames: int = 0,
    voice: pb.Voice | None = None,
    **sampling,
):
    return pb.SessionRequest(
        start=pb.SessionStart(
            voice=voice,
            sampling=pb.SamplingOptions(seed=seed, max_new_frames=frames, min_new_frames=frames, **sampling),
            output=pb.OutputOptions(
                encoding=encoding, first_chunk_frames=chunk_frames, chunk_frames=chunk_frames
            ),
        )
    )


def text(t: str) -> pb.SessionRequest:
    return pb.SessionRequest(text=t)


FLUSH = pb.SessionRequest(flush=pb.SessionFlush())
CANCEL = pb.SessionRequest(cancel=pb.SessionCancel())
CLOSE = pb.SessionRequest(close=pb.SessionClose())


def run(server, body, **channel):
    """Run `body(stub)` in a fresh asyncio loop with a grpc.aio channel to `server`."""

    async def main():
        options = channel_options() + list(channel.items())
        async with grpc.aio.insecure_channel(server.address, options=options) as ch:
            return await body(pb_grpc.TextToSpeechStub(ch))

    return asyncio.run(main())


async def read_until(call, until):
    """Messages up to and including the first for which `until(message)` holds."""
    out = []
    while True:
        m = await call.read()
        assert m is not grpc.aio.EOF, f"stream ended early after {[x.WhichOneof('message') for x in out]}"
        out.append(m)
        if until(m):
            return out


def kind(m) -> str:
    return m.WhichOneof("message")


async def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def freed(server) -> None:
    wait_idle(server.loop)
    assert server.loop.sessions_open == 0 and server.server.load()["sessions"] == 0
    assert not server.loop.engine.sequences


def test_flush_and_close_stream_chunks_audio_and_timings_on_one_clock(server, bundle):
    frame_length = bundle.codec.frame_length

    async def body(stub):
        call = stub.SynthesizeSession()
        await call.write(start(6))
        header = (await call.read()).header
        assert header.session_id and header.sample_rate == bundle.codec.sample_rate
        assert header.encoding == pb.AUDIO_ENCODING_FLOAT32
        assert server.server.load()["sessions"] == 1
        assert server.server.metrics.registry.get_sample_value("tts_sessions_open") == 1
        for piece in ("Hello there my", " friend. And", " then more"):
            await call.write(text(piece))
        await call.write(FLUSH)
        await call.write(CLOSE)
        await call.done_writing()
        messages = await read_until(call, lambda m: kind(m) == "end")
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        return messages

    messages = run(server, body)
    starts = [m.chunk_start for m in messages if kind(m) == "chunk_start"]
    ends = [m.chunk_end for m in messages if kind(m) == "chunk_end"]
    assert [s.chunk for s in starts] == [0, 1]
    assert [(e.chunk, e.finish_reason, e.frames) for e in ends] == [
        (0, pb.FINISH_REASON_LENGTH, 6),
        (1, pb.FINISH_REASON_LENGTH, 6),
    ]
    assert ends[0].cached_tokens == 0 and ends[1].cached_tokens > 0  # the second chunk reuses the KV
    audio = [m.audio for m in messages if kind(m) == "audio"]
    offsets = [a.sample_offset for a in audio]
    sizes = [len(a.audio) // 4 for a in audio]
    assert offsets == [0] + list(np.cumsum(sizes)[:-1])  # contiguous on the session clock
    end = messages[-1].end
    assert end.reason == "closed" and end.audio_samples == sum(sizes) == 12 * frame_length
    # word timings: in text order, never going back, each inside audio already received
    received, last_end, words = 0, 0.0, []
    rate = bundle.codec.sample_rate
    for m in messages:
        if kind(m) == "audio":
            received += len(m.audio.audio) // 4
        elif kind(m) == "timings":
            for w in m.timings.words:
                assert last_end - 1e-9 <= w.start <= w.end <= received / rate + 1e-9
                last_end = w.end
                words.append(w.text)
    assert words == "Hello there my friend. And then more".split()
    freed(server)


def test_barge_in_drops_the_rest_frees_the_row_and_blocks_and_the_session_goes_on(server):
    engine = server.loop.engine

    async def body(stub):
        call = stub.SynthesizeSession()
        await call.write(start(300, chunk_frames=1))
        sid = (await call.read()).header.session_id
        # (texts long enough that the runaway guard allows 300 frames)
        await call.write(
            text(
                "The first sentence here is long enough for three hundred frames of audio at the very least."
            )
        )
        await call.write(FLUSH)
        first = [m for m in await read_until(call, lambda m: kind(m) == "chunk_end")][-1].chunk_end
        assert first.frames == 300
        history = first.cached_tokens + first.prefill_tokens + 1 + 300 - 1
        await wait_for(lambda: engine.num_running == 0, "the first chunk's row freed")
        held = blocks_needed(history, BLOCK)
        assert engine.kv_usage()[0] == engine.sequence_blocks(sid) == held
        await call.write(
            text("A long second sentence that is interrupted by the listener before it is over.")
        )
        await call.write(FLUSH)
        await read_until(call, lambda m: kind(m) == "audio")
        # the client stops reading: HTTP/2's windows fill, the server's queue fills, the chunk pauses
        await wait_for(lambda: server.loop.stats.paused == 1, "the chunk paused")
        assert engine.num_running == 1 and engine.kv_usage()[0] > held
        generated = engine.frames_generated
        await call.write(CANCEL)
        after = await read_until(call, lambda m: kind(m) == "chunk_end")
        cut = after[-1].chunk_end
        assert (cut.chunk, cut.finish_reason) == (1, pb.FINISH_REASON_CANCELLED)
        assert all(m.chunk_start.chunk == 1 for m in after if kind(m) == "chunk_start")
        await wait_for(lambda: engine.num_running == 0, "the row freed")
        assert engine.kv_usage()[0] == engine.sequence_blocks(sid) == held  # its new blocks freed
        assert engine.frames_generated == generated  # no frame after the cancel
        # the session stays open: the next chunk continues the history before the cancelled one
        await call.write(text("After the barge-in another long sentence that is spoken to its very end."))
        await call.write(FLUSH)
        again = await read_until(call, lambda m: kind(m) == "chunk_end")
        assert not [m for m in again if kind(m) == "audio" and m.audio.chunk == 1]  # nothing of the cut chunk
        end = again[-1].chunk_end
        assert (end.chunk, end.finish_reason, end.frames, end.cached_tokens) == (
            2,
            pb.FINISH_REASON_LENGTH,
            300,
            history,
        )
        assert sum(m.audio.frame_end - m.audio.frame_start for m in again if kind(m) == "audio") == 300
        await call.write(CLOSE)
        rest = await read_until(call, lambda m: kind(m) == "end")
        assert rest[-1].end.reason == "closed"
        assert await call.code() == grpc.StatusCode.OK

    run(server, body, **NO_BDP)
    assert server.loop.stats.barge_ins >= 1
    freed(server)


async def status_of(call) -> tuple[grpc.StatusCode, str, str | None]:
    """Read `call` to its end; its status code, details and the `tts-field` trailer."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        while True:
            m = await call.read()
            if m is grpc.aio.EOF:
                break
    err = info.value
    fields = dict(err.trailing_metadata() or ())
    return err.code(), err.details(), fields.get("tts-field")


def test_bad_messages_are_invalid_argument_naming_the_field_and_free_everything(server):
    async def no_start(stub):
        call = stub.SynthesizeSession()
        await call.write(text("Hello."))
        return await status_of(call)

    code, details, field = run(server, no_start)
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "start")
    assert "start must be the first message" in details
    freed(server)

    async def bad_sampling(stub):
        call = stub.SynthesizeSession()
        await call.write(start(6, top_p=2.0))
        return await status_of(call)

    code, details, field = run(server, bad_sampling)
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "start.sampling.top_p")
    freed(server)

    async def oversize(stub):
        call = stub.SynthesizeSession()
        await call.write(start(6))
        header = (await call.read()).header
        await call.write(text("x" * (header.max_pending_bytes + 1)))
        return await status_of(call)

    code, details, field = run(server, oversize)
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "text")
    assert "waiting to be spoken" in details
    freed(server)

    async def after_close(stub):
        call = stub.SynthesizeSession()
        await call.write(start(600, chunk_frames=1))
        await call.read()
        await call.write(text("Hold this session open while the client does not read."))
        await call.write(FLUSH)
        await wait_for(lambda: server.loop.stats.paused == 1, "the chunk paused")  # so it cannot end first
        await call.write(CLOSE)
        await call.write(text("More after close."))
        return await status_of(call)

    code, details, field = run(server, after_close, **NO_BDP)
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "text")
    assert "after close" in details
    freed(server)

    def raw_call(stub_channel):
        return stub_channel.stream_stream(
            "/tts.v1.TextToSpeech/SynthesizeSession",
            request_serializer=lambda data: data,
            response_deserializer=pb.SessionResponse.FromString,
        )()

    async def malformed(_stub):
        options = channel_options()
        async with grpc.aio.insecure_channel(server.address, options=options) as ch:
            call = raw_call(ch)
            await call.write(start(6).SerializeToString())
            await call.read()
            await call.write(b"\x12\x02\xff\xfe")  # field 2 (text): bytes that are not UTF-8
            return await status_of(call)

    code, details, _ = run(server, malformed)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "text must be UTF-8" in details
    freed(server)

    async def second_start(stub):
        call = stub.SynthesizeSession()
        await call.write(start(6))
        await call.read()
        await call.write(start(6))
        return await status_of(call)

    code, _, field = run(server, second_start)
    assert (code, field) == (grpc.StatusCode.INVALID_ARGUMENT, "start")
    freed(server)


def test_a_paused_session_cannot_starve_a_unary_job(server):
    async def body(stub):
        call = stub.SynthesizeSession()
        await call.write(start(600, chunk_frames=1))
        await call.read()
        await call.write(text("Hold the only row while nobody reads this session."))
        await call.write(FLUSH)
        await wait_for(lambda: server.loop.stats.paused == 1, "the session paused on the only row")
        reply = await stub.SynthesizeUnary(
            pb.SynthesizeRequest(
                text="Meanwhile.", sampling=pb.SamplingOptions(seed=1, max_new_frames=5, min_new_frames=5)
            ),
            timeout=120,
        )
        assert reply.end.frames == 5
        code, details, _ = await status_of(call)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "not read" in details

    run(server, body, **NO_BDP)
    freed(server)


def test_the_session_limit_is_resource_exhausted(server):
    async def body(stub):
        calls = [stub.SynthesizeSession() for _ in range(2)]
        for c in calls:
            await c.write(start(6))
            await c.read()
        extra = stub.SynthesizeSession()
        await extra.write(start(6))
        code, details, _ = await status_of(extra)
        for c in calls:
            await c.write(CLOSE)
            assert (await read_until(c, lambda m: kind(m) == "end"))[-1].end.reason == "closed"
        return code, details

    code, details = run(server, body)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "sessions are open" in details
    freed(server)


def test_drain_ends_an_open_session_with_shutdown_then_unavailable(bundle):
    srv = ServerThread(bundle, EngineConfig(max_batch=1, block_size=BLOCK), ServiceLimits())
    try:

        async def body(stub):
            call = stub.SynthesizeSession()
            await call.write(start(6))
            await call.read()
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(srv.server.stop(0.0), srv.aio_loop))
            messages = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while (m := await call.read()) is not grpc.aio.EOF:
                    messages.append(m)
            return messages, info.value.code()

        messages, code = run(srv, body)
        assert [m.end.reason for m in messages if kind(m) == "end"] == ["shutdown"]
        assert code == grpc.StatusCode.UNAVAILABLE
        srv._thread.join(30)
        assert srv.loop.sessions_open == 0 and not srv.loop.alive
    finally:
        if not srv.server.replica_state.stopping:
            srv.stop()


# ---- a reference clip in `start` ----------------------------------------------------------------------


def session_ends(server, voice: pb.Voice | None, pieces: list[str]) -> tuple[list, pb.SessionEnd]:
    """Run a session of 6-frame chunks over `pieces` (then close): its chunk ends and its end."""

    async def body(stub):
        call = stub.SynthesizeSession()
        await call.write(start(6, voice=voice))
        assert kind(await call.read()) == "header"
        for piece in pieces:
            await call.write(text(piece))
        await call.write(CLOSE)
        messages = await read_until(call, lambda m: kind(m) == "end")
        assert await call.code() == grpc.StatusCode.OK
        return messages

    messages = run(server, body)
    return [m.chunk_end for m in messages if kind(m) == "chunk_end"], messages[-1].end


def test_a_reference_clip_in_start_is_the_sessions_voice_prefilled_with_the_first_chunk_only(server, bundle):
    rate, frame_length = bundle.codec.sample_rate, bundle.codec.frame_length
    clip = ReferenceClip(tone_wav(rate), "A tone to clone.")
    voice = pb.Voice(reference=pb.ReferenceAudio(audio=clip.audio, text=clip.text))
    pieces = ["Hello there my friend. ", "And then more words."]
    encodes = server.loop.runner.stage.stats.encode_calls
    ends, end = session_ends(server, voice, pieces)
    freed(server)
    plain, _ = session_ends(server, None, pieces)
    freed(server)
    assert [(e.finish_reason, e.frames) for e in ends] == [(pb.FINISH_REASON_LENGTH, 6)] * 2
    assert end.reason == "closed" and end.audio_samples == 2 * 6 * frame_length
    assert server.loop.runner.stage.stats.encode_calls == encodes + 1
    # the first chunk's prompt holds the reference (its transcript and codes) besides the plain prompt's
    ref = prepare_reference(server.loop.planner, clip, server.server.limits.request_limits)
    codes = bundle.codec.encode_audio(ref.samples)
    fmt = bundle.prompt_format
    extra = (
        fmt.build(ends[0].text, [VoiceReference(codes, ref.text)], []).shape[0]
        - fmt.build(ends[0].text, [], []).shape[0]
    )
    assert extra > codes.shape[1]
    assert ends[0].cached_tokens == plain[0].cached_tokens == 0
    assert ends[0].prefill_tokens == plain[0].prefill_tokens + extra
    # the next chunk reuses all of it: it prefills only its own new tokens, as a session without one
    assert ends[1].cached_tokens == ends[0].prefill_tokens + 1 + 6 - 1
    assert ends[1].prefill_tokens == plain[1].prefill_tokens


def test_a_bad_reference_clip_in_start_gets_the_one_shot_error_and_frees_everything(server, bundle):
    def one_shot(ref: pb.ReferenceAudio) -> tuple[grpc.StatusCode, str, str | None]:
        request = pb.SynthesizeRequest(text="Hi.", voice=pb.Voice(reference=ref))
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.TextToSpeechStub(channel).SynthesizeUnary(request, timeout=60)
        err = info.value
        return err.code(), err.details(), dict(err.trailing_metadata() or ()).get("tts-field")

    def in_session(ref: pb.ReferenceAudio) -> tuple[grpc.StatusCode, str, str | None]:
        async def body(stub):
            call = stub.SynthesizeSession()
            await call.write(start(6, voice=pb.Voice(reference=ref)))
            return await status_of(call)

        return run(server, body)

    rate = bundle.codec.sample_rate
    bad = [
        pb.ReferenceAudio(audio=b"not audio at all" * 10, text="x"),  # not a clip
        pb.ReferenceAudio(audio=tone_wav(rate), text=" "),  # no transcript
        pb.ReferenceAudio(audio=tone_wav(rate, 0.2), text="Too short."),
        pb.ReferenceAudio(audio=tone_wav(rate, 1.0)[:44] + bytes(2 * rate), text="Silent."),
    ]
    for ref in bad:
        code, details, field = one_shot(ref)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field is not None
        assert field.startswith("voice.reference.")
        rename = lambda t: t.replace("voice.reference.", "start.voice.reference.")  # noqa: E731
        assert in_session(ref) == (code, rename(details), rename(field))
        freed(server)


@pytest.mark.parametrize(
    "error, duration, code, why",
    [
        # a failure of the codec: the server's (INTERNAL)
        (
            RuntimeError("codec exploded"),
            1.5,
            grpc.StatusCode.INTERNAL,
            "could not be encoded: codec exploded",
        ),
        # bad audio (an AudioError): the client's, as for a one-shot request (INVALID_ARGUMENT)
        (
            AudioError("the clip is silent once decoded"),
            1.6,
            grpc.StatusCode.INVALID_ARGUMENT,
            "silent once decoded",
        ),
    ],
)
def test_a_clip_the_codec_cannot_encode_ends_the_session_with_why_and_frees_everything(
    server, bundle, monkeypatch, error, duration, code, why
):
    def broken(samples):
        future: Future = Future()
        future.set_exception(error)
        return future

    monkeypatch.setattr(server.loop.runner.stage, "encode", broken)
    # (a clip no other test sends: the reference cache cannot answer it)
    clip = tone_wav(bundle.codec.sample_rate, duration)
    voice = pb.Voice(reference=pb.ReferenceAudio(audio=clip, text="Once."))

    async def body(stub):
        call = stub.SynthesizeSession()
        await call.write(start(6, voice=voice))
        messages = await read_until(call, lambda m: kind(m) == "end")
        return messages, await status_of(call)

    messages, (got, details, _) = run(server, body)
    assert [kind(m) for m in messages] == ["header", "warning", "end"] and messages[-1].end.reason == "error"
    assert got == code
    assert details.endswith(why)
    freed(server)
