"""The Wyoming front (service/wyoming.py) end to end: a real server on 127.0.0.1 (ephemeral ports, tiny
model), the `wyoming` package's client and event functions against it. The model's sampling is greedy with
min = max frames, so every job is exactly FRAMES frames whatever the random weights say; jobs that must
stay open are HOLD_FRAMES long and their client does not read (they pause, and cannot finish). No test
depends on timing: waits are on the engine loop's state or on events."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
import torch
from service_helpers import ServerThread, wait_idle

from service import wyoming as front
from service.server import ServiceLimits
from tts.api import TTS
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig
from tts.runtime.sessions import ChunkEnded, SessionAudio

pytest.importorskip("wyoming")
from wyoming.audio import AudioChunk, AudioStart, AudioStop  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.error import Error  # noqa: E402
from wyoming.event import Event, async_read_event, async_write_event, write_event  # noqa: E402
from wyoming.info import Describe, Info  # noqa: E402
from wyoming.ping import Ping, Pong  # noqa: E402
from wyoming.tts import (  # noqa: E402
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

FRAMES = 10
HOLD_FRAMES = 600  # per text chunk (the tiny model's context is 1024 tokens)
MAX_TEXT_BYTES = 2000
# One sentence of 4 text chunks (the planner splits it at 200 bytes), each HOLD_FRAMES frames (the runaway
# guard allows 1325): 3 MB of PCM16, far more than the socket buffers of a client that does not read.
LONG = " ".join(["This sentence keeps the stream open for as long as the test needs it"] * 9) + "."
HOLD_TOTAL = 4 * HOLD_FRAMES
TIMEOUT = 120.0


def fixed_frames(bundle, frames: int):
    """`bundle` whose default sampling is greedy and exactly `frames` frames per text chunk."""
    sampling = dataclasses.replace(
        bundle.sampling, temperature=0.0, max_new_frames=frames, min_new_frames=frames
    )
    return dataclasses.replace(bundle, sampling=sampling)


@pytest.fixture(scope="module")
def bundle():
    return fixed_frames(load_bundle("tiny"), FRAMES)


@pytest.fixture(scope="module")
def server(bundle):
    limits = ServiceLimits(max_waiting=2, max_queued_chunks=2, max_text_bytes=MAX_TEXT_BYTES)
    srv = ServerThread(bundle, EngineConfig(max_batch=2), limits, wyoming_port=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hold():
    """One row and no queue (one job in flight at most), one session; every job HOLD_FRAMES frames."""
    limits = ServiceLimits(max_waiting=0, max_queued_chunks=2, max_text_bytes=MAX_TEXT_BYTES, max_sessions=1)
    srv = ServerThread(
        fixed_frames(load_bundle("tiny"), HOLD_FRAMES), EngineConfig(max_batch=1), limits, wyoming_port=0
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(bundle):
    return TTS(bundle)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def count(srv, outcome: str) -> float:
    return srv.server.metrics.registry.get_sample_value("tts_requests_total", {"outcome": outcome}) or 0.0


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


async def read_until(client: AsyncTcpClient, *types: str) -> list[Event]:
    """Events up to and including the first of `types` (or the end of the connection)."""
    events = []
    while (event := await client.read_event()) is not None:
        events.append(event)
        if event.type in types:
            break
    return events


def pcm(events: list[Event]) -> np.ndarray:
    raw = b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32767


def assert_one_stream(events: list[Event], samples: int) -> None:
    """One audio-start (16 kHz, 16-bit mono) ... one audio-stop, chunks of the same format in between,
    timestamps contiguous (ms), `samples` samples in all."""
    types = [e.type for e in events]
    assert types.count("audio-start") == 1 and types.count("audio-stop") == 1
    start, stop = types.index("audio-start"), types.index("audio-stop")
    assert set(types[start + 1 : stop]) == {"audio-chunk"} and start == 0
    fmt = AudioStart.from_event(events[0])
    assert (fmt.rate, fmt.width, fmt.channels) == (16000, 2, 1)
    offset = 0
    for e in events[start + 1 : stop]:
        chunk = AudioChunk.from_event(e)
        assert (chunk.rate, chunk.width, chunk.channels) == (16000, 2, 1)
        assert chunk.timestamp == offset * 1000 // 16000
        offset += len(chunk.audio) // 2
    assert offset == samples and AudioStop.from_event(events[stop]).timestamp == samples * 1000 // 16000


async def raw_connection(port: int, receive_buffer: int | None = None):
    """A connection through the wyoming package's event functions on a plain socket (a small receive
    buffer for a client that will not read)."""
    sock = socket.socket()
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


def frame_bytes(*events: Event) -> bytes:
    buf = io.BytesIO()
    for e in events:
        write_event(e, buf)
    return buf.getvalue()


# ---- describe, one-shot, streaming --------------------------------------------------------------------


def test_describe_lists_presets_and_registered_voices(server):
    planner = server.loop.planner
    tone = 0.3 * torch.sin(2 * torch.pi * 220 * torch.arange(16000) / 16000)
    ref = planner.prepare_reference(tone, 16000, "This is voice gamma.")
    server.loop.add_voice("gamma", ref).result(60)
    try:

        async def describe():
            async with AsyncTcpClient("127.0.0.1", server.server.wyoming_port) as client:
                await client.write_event(Describe().event())
                info = Info.from_event(await client.read_event())
                await client.write_event(Ping(text="hi").event())
                return info, Pong.from_event(await client.read_event())

        info, pong = run(describe())
    finally:
        server.loop.delete_voice("gamma")
    assert pong.text == "hi"
    assert not info.asr and len(info.tts) == 1
    program = info.tts[0]
    assert program.name == "dualar-tts" and program.installed and program.supports_synthesize_streaming
    assert [(v.name, v.languages, v.installed) for v in program.voices] == [
        ("alpha", ["en"], True),
        ("beta", ["en"], True),
        ("gamma", ["en"], True),
    ]
    assert [v.description for v in program.voices] == [
        "alpha (preset)",
        "beta (preset)",
        "gamma (registered)",
    ]


def test_one_shot_synthesize_is_the_whole_text_as_one_job(server, offline):
    ok = count(server, "ok")

    async def synthesize():
        async with AsyncTcpClient("127.0.0.1", server.server.wyoming_port) as client:
            await client.write_event(
                Synthesize(text="Hello there.", voice=SynthesizeVoice(name="alpha")).event()
            )
            first = await read_until(client, "audio-stop")
            # The connection serves the next request: no voice this time.
            await client.write_event(Synthesize(text="Good morning.").event())
            return first, await read_until(client, "audio-stop")

    first, second = run(synthesize())
    assert_one_stream(first, FRAMES * 640)
    assert_one_stream(second, FRAMES * 640)
    # The audio is what the Python API makes of the same text and voice (greedy), to 16-bit precision.
    ref = offline.synthesize("Hello there.", voice="alpha")
    assert np.abs(pcm(first) - ref.audio).max() <= 1.5 / 32767
    assert count(server, "ok") == ok + 2
    wait_idle(server.loop)


def test_streaming_synthesize_speaks_each_sentence_in_one_audio_stream(server, offline):
    ok = count(server, "ok")
    pieces = ["Hello there. How", " are you to", "day? Fine"]

    async def stream():
        async with AsyncTcpClient("127.0.0.1", server.server.wyoming_port) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="beta")).event())
            await client.write_event(SynthesizeChunk(text=pieces[0]).event())
            # The first sentence is spoken before the text is complete: audio comes before synthesize-stop.
            early = await read_until(client, "audio-chunk")
            for piece in pieces[1:]:
                await client.write_event(SynthesizeChunk(text=piece).event())
            # What Home Assistant sends for servers without streaming: the whole text again (ignored here).
            await client.write_event(
                Synthesize(text="".join(pieces), voice=SynthesizeVoice(name="beta")).event()
            )
            await client.write_event(SynthesizeStop().event())
            return early + await read_until(client, "synthesize-stopped")

    events = run(stream())
    assert [e.type for e in events[:2]] == ["audio-start", "audio-chunk"]
    assert SynthesizeStopped.is_type(events[-1].type)
    sentences = ["Hello there.", "How are you today?", "Fine"]
    assert_one_stream(events[:-1], len(sentences) * FRAMES * 640)
    # One session: each sentence with the earlier ones as context, on one codec stream. The audio is what
    # a session of the Python API makes of the same pieces (greedy), to 16-bit precision.
    session = offline.session(voice="beta")
    for piece in pieces:
        session.send(piece)
    session.close()
    session_events = list(session)
    ended = [e.chunk for e in session_events if isinstance(e, ChunkEnded)]
    assert ended == [0, 1, 2]  # one chunk per sentence
    ref = np.concatenate([e.samples for e in session_events if isinstance(e, SessionAudio)])
    assert np.abs(pcm(events) - ref).max() <= 1.5 / 32767
    assert count(server, "ok") == ok + 1  # one stream, one request
    wait_idle(server.loop)


def test_a_streamed_piece_with_nothing_to_speak_is_skipped(server):
    async def stream(pieces):
        async with AsyncTcpClient("127.0.0.1", server.server.wyoming_port) as client:
            await client.write_event(SynthesizeStart().event())
            for piece in pieces:
                await client.write_event(SynthesizeChunk(text=piece).event())
            await client.write_event(SynthesizeStop().event())
            return await read_until(client, "synthesize-stopped", "error")

    events = run(stream(["Hello there. ", "... ", "Bye."]))
    assert SynthesizeStopped.is_type(events[-1].type)
    assert_one_stream(events[:-1], 2 * FRAMES * 640)
    before = count(server, "no_audio")
    events = run(stream(["... ", "?!"]))
    assert [e.type for e in events] == ["error"]
    error = Error.from_event(events[0])
    assert error.code == "no_audio" and "nothing to speak" in error.text
    assert count(server, "no_audio") == before + 1
    wait_idle(server.loop)


@pytest.mark.parametrize(
    "text, cut",
    [
        ("Hello there. How", len("Hello there. ")),
        ("Hello there.", 0),  # nothing after the period yet: "3." may become "3.14"
        ("It costs 3.", 0),
        ("Ask Dr. Smith. He", len("Ask Dr. Smith. ")),
        ("One! Two? Three", len("One! Two? ")),
        ("Line one\nLine", len("Line one\n")),
        ("No sentence end", 0),
    ],
)
def test_sentence_cut(text, cut):
    assert front.sentence_cut(text) == cut


# ---- bad input: an error event, the connection closed, the server serving ------------------------------

OVERSIZE = "a" * (MAX_TEXT_BYTES + 1)
BAD = [
    ("unknown event", [Event("frobnicate")], "invalid_argument", "unknown event type 'frobnicate'"),
    ("malformed JSON", [b"{not json\n"], "invalid_argument", "malformed event header: not JSON"),
    ("no type", [b'{"data": {"text": "hi"}}\n'], "invalid_argument", "`type` (a string) is missing"),
    ("bad data_length", [b'{"type": "describe", "data_length": -1}\n'], "invalid_argument",
     "data_length must be"),
    ("header over the limit", [b'{"type": "synthesize", "data": {"text": "' + b"a" * 100_000 + b'"}}\n'],
     "invalid_argument", "header line is over"),
    ("chunk without start", [SynthesizeChunk(text="Hi.").event()], "invalid_argument",
     "synthesize-chunk without synthesize-start"),
    ("stop without start", [SynthesizeStop().event()], "invalid_argument",
     "synthesize-stop without synthesize-start"),
    ("start twice", [SynthesizeStart().event(), SynthesizeStart().event()], "invalid_argument",
     "synthesize-start inside a stream"),
    ("no text", [Event("synthesize", {"voice": {"name": "alpha"}})], "invalid_argument",
     "synthesize needs `text`"),
    ("text over the limit", [Synthesize(text=OVERSIZE).event()], "invalid_argument",
     f"synthesize text is {MAX_TEXT_BYTES + 1} bytes; the limit is {MAX_TEXT_BYTES}"),
    ("streamed text over the limit",
     [SynthesizeStart().event(), SynthesizeChunk(text="a" * 1500).event(),
      SynthesizeChunk(text="a" * 501).event()],
     "invalid_argument", f"the streamed text is {MAX_TEXT_BYTES + 1} bytes; the limit is {MAX_TEXT_BYTES}"),
    ("unknown voice", [Synthesize(text="Hi.", voice=SynthesizeVoice(name="nobody")).event()], "not_found",
     "nobody"),
    ("unknown voice in a stream", [SynthesizeStart(voice=SynthesizeVoice(name="nobody")).event()],
     "not_found", "nobody"),
    ("unknown language", [Synthesize(text="Hi.", voice=SynthesizeVoice(language="xx")).event()],
     "invalid_argument", "voice.language 'xx' is not spoken by this model (it speaks en)"),
    ("nothing to speak", [Synthesize(text=" ... ").event()], "invalid_argument", "nothing to speak"),
    ("empty text", [Synthesize(text="").event()], "invalid_argument", "nothing to speak"),
    ("another program", [Event("select-program", {"name": "piper"})], "invalid_argument",
     "unknown program 'piper'"),
]  # fmt: skip


@pytest.mark.parametrize("sent, code, message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_an_error_event_and_the_server_keeps_serving(server, sent, code, message):
    before = count(server, code)

    async def exchange():
        reader, writer = await raw_connection(server.server.wyoming_port)
        writer.write(b"".join(e if isinstance(e, bytes) else frame_bytes(e) for e in sent))
        await writer.drain()
        events = []
        while (event := await async_read_event(reader)) is not None:
            events.append(event)
        writer.close()
        return events

    events = run(exchange())
    assert [e.type for e in events] == ["error"], events  # then the server closed the connection
    error = Error.from_event(events[0])
    assert error.code == code and message in error.text, error.text
    assert count(server, code) == before + 1
    wait_idle(server.loop)

    async def still_serving():
        async with AsyncTcpClient("127.0.0.1", server.server.wyoming_port) as client:
            await client.write_event(Synthesize(text="Still here.").event())
            return await read_until(client, "audio-stop", "error")

    assert_one_stream(run(still_serving()), FRAMES * 640)


# ---- held jobs: text after stop, disconnect, admission, shutdown --------------------------------------


def test_the_held_sentence_is_as_long_as_said(hold):
    assert len(hold.loop.planner.plan(LONG)) * HOLD_FRAMES == HOLD_TOTAL


def held_stream(srv):
    """Start a stream whose first sentence (HOLD_FRAMES frames) runs and pauses: its client does not read.
    Returns (reader, writer) once the job is paused."""

    async def start():
        reader, writer = await raw_connection(srv.server.wyoming_port, receive_buffer=16 * 1024)
        await async_write_event(SynthesizeStart().event(), writer)
        await async_write_event(SynthesizeChunk(text=LONG + " ").event(), writer)
        return reader, writer

    return start


def test_text_after_stop_cancels_the_stream(hold, monkeypatch):
    monkeypatch.setattr(front, "ERROR_SEND_SECONDS", TIMEOUT)  # (the error waits behind unread audio)
    before = count(hold, "invalid_argument")

    async def scenario():
        reader, writer = await held_stream(hold)()
        await asyncio.to_thread(wait_for, lambda: hold.loop.stats.paused == 1, "the held job to pause")
        await async_write_event(SynthesizeStop().event(), writer)
        await async_write_event(SynthesizeChunk(text="More text.").event(), writer)
        # The job is cancelled (it could not have finished: nothing was read).
        await asyncio.to_thread(wait_idle, hold.loop)
        events = []
        while (event := await async_read_event(reader)) is not None:
            events.append(event)
        writer.close()
        return events

    events = run(scenario())
    assert events[-1].type == "error" and {e.type for e in events[:-1]} <= {"audio-start", "audio-chunk"}
    error = Error.from_event(events[-1])
    assert error.code == "invalid_argument" and "synthesize-chunk after synthesize-stop" in error.text
    assert len(pcm(events)) < HOLD_TOTAL * 640
    assert count(hold, "invalid_argument") == before + 1


def test_a_client_that_disconnects_frees_its_job(hold):
    before = count(hold, "cancelled")
    frames_before = hold.loop.stats.frames_total

    async def scenario():
        reader, writer = await held_stream(hold)()
        await asyncio.to_thread(wait_for, lambda: hold.loop.stats.paused == 1, "the held job to pause")
        assert hold.loop.sessions_open == 1 and hold.loop.engine.kv_usage()[0] > 0
        writer.transport.abort()  # gone, with unread audio

    run(scenario())
    wait_idle(hold.loop)  # no job, engine request, KV block or row left
    wait_for(lambda: count(hold, "cancelled") == before + 1, "the cancel to be counted")
    assert hold.loop.stats.frames_total - frames_before < HOLD_TOTAL


def test_admission_is_shared_with_the_other_fronts(hold):
    """A stream is a session of the engine loop: the server's session limit (one here) counts it as it
    counts gRPC's SynthesizeSession calls."""
    before = count(hold, "resource_exhausted")

    async def scenario():
        reader, writer = await held_stream(hold)()  # the one session the server opens
        await asyncio.to_thread(wait_for, lambda: hold.loop.stats.paused == 1, "the held job to pause")
        async with AsyncTcpClient("127.0.0.1", hold.server.wyoming_port) as client:
            # (refused at synthesize-start: the server then closes, so nothing more is written, which
            # could meet the closed socket)
            await client.write_event(SynthesizeStart().event())
            refused = await read_until(client, "synthesize-stopped", "error")
        writer.transport.abort()
        return refused

    refused = run(scenario())
    assert [e.type for e in refused] == ["error"]
    error = Error.from_event(refused[0])
    assert error.code == "resource_exhausted" and "at capacity" in error.text
    assert count(hold, "resource_exhausted") == before + 1
    wait_idle(hold.loop)


def test_shutdown_ends_an_open_stream_with_an_error_and_closes(bundle):
    srv = ServerThread(
        fixed_frames(bundle, HOLD_FRAMES),
        EngineConfig(max_batch=1),
        ServiceLimits(max_queued_chunks=2),
        wyoming_port=0,
    )
    try:

        async def scenario():
            reader, writer = await held_stream(srv)()
            await asyncio.to_thread(wait_for, lambda: srv.loop.stats.paused == 1, "the held job to pause")
            stopping = asyncio.ensure_future(asyncio.to_thread(srv.stop, 0.0))
            events = []
            while (event := await async_read_event(reader)) is not None:
                events.append(event)
            await stopping
            return events

        events = run(scenario())
    finally:
        srv.stop()
    error = Error.from_event(events[-1])
    assert error.code == "unavailable" and "shut down" in error.text, error.text


# ---- connections: the cap and the idle timeout -------------------------------------------------------


def test_the_connection_past_the_cap_gets_an_error_and_the_next_one_is_served(bundle):
    """Two connections at most: the third is answered `resource_exhausted` and closed, while the two
    open ones keep working; once one closes, a new one is served."""
    limits = ServiceLimits(max_wyoming_connections=2, wyoming_idle_timeout=None)
    srv = ServerThread(bundle, EngineConfig(max_batch=1), limits, wyoming_port=0)
    port = srv.server.wyoming_port

    async def describe(client: AsyncTcpClient) -> str:
        await client.write_event(Describe().event())
        return (await read_until(client, "info", "error"))[-1].type

    async def scenario():
        async with AsyncTcpClient("127.0.0.1", port) as a, AsyncTcpClient("127.0.0.1", port) as b:
            assert [await describe(a), await describe(b)] == ["info", "info"]  # (both accepted)
            async with AsyncTcpClient("127.0.0.1", port) as c:
                refused = await read_until(c, "error")
                assert await c.read_event() is None  # (closed)
            assert await describe(a) == "info"
        # (once the server has seen both leave)
        await asyncio.to_thread(wait_for, lambda: not srv.server._wyoming._connections, "a and b to close")
        async with AsyncTcpClient("127.0.0.1", port) as d:
            assert await describe(d) == "info"
        return refused

    try:
        before = count(srv, "resource_exhausted")
        refused = run(scenario())
        assert [e.type for e in refused] == ["error"]
        error = Error.from_event(refused[0])
        assert error.code == "resource_exhausted" and "2 Wyoming connections are open" in error.text
        assert count(srv, "resource_exhausted") == before + 1
    finally:
        srv.stop()


def test_clients_that_connect_and_leave_one_after_another_are_never_refused(bundle):
    """One connection at most, and clients that each connect, ask, read the answer and close, one after
    another (as Home Assistant asks a server's info): a client that has left does not hold the slot
    while its end is still unread, so none of them is refused."""
    limits = ServiceLimits(max_wyoming_connections=1, wyoming_idle_timeout=None)
    srv = ServerThread(bundle, EngineConfig(max_batch=1), limits, wyoming_port=0)
    port = srv.server.wyoming_port

    async def scenario() -> list[str]:
        answers = []
        for _ in range(20):
            for _ in range(5):  # connect and leave at once (a port check)
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                await writer.wait_closed()
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Describe().event())
                answers.append((await read_until(client, "info", "error"))[-1].type)
        return answers

    try:
        before = count(srv, "resource_exhausted")
        assert run(scenario()) == ["info"] * 20
        assert count(srv, "resource_exhausted") == before
    finally:
        srv.stop()


def test_a_half_closed_client_that_never_reads_gives_its_slot_up(bundle):
    """A client that sends pings whose pongs overfill the socket, closes its sending side and never reads
    leaves the server's task stuck writing to it. It has ended its stream, so it is gone (as any client
    whose stream ends): the next client at the cap closes that connection and takes the slot, and the
    cap never holds more live connections than it allows."""
    limits = ServiceLimits(max_wyoming_connections=1, wyoming_idle_timeout=None)
    srv = ServerThread(bundle, EngineConfig(max_batch=1), limits, wyoming_port=0)
    port = srv.server.wyoming_port
    connections = srv.server._wyoming._connections
    data = json.dumps({"text": "x" * 180_000}).encode()
    ping = json.dumps({"type": "ping", "data_length": len(data)}).encode() + b"\n" + data
    stuck = socket.socket()
    try:
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(("127.0.0.1", port))
        stuck.sendall(ping * 2)
        stuck.shutdown(socket.SHUT_WR)
        wait_for(lambda: any(c.client_left() for c in list(connections.values())), "the end to be read")

        async def describe() -> str:
            async with AsyncTcpClient("127.0.0.1", port) as client:
                await client.write_event(Describe().event())
                answer = (await read_until(client, "info", "error"))[-1].type
                while len(connections) > 1:  # the stuck one closes (its task ends once its write fails)
                    await asyncio.sleep(0.01)
                return answer

        before = count(srv, "resource_exhausted")
        assert run(describe()) == "info"
        assert count(srv, "resource_exhausted") == before
    finally:
        stuck.close()
        srv.stop()


def test_a_connection_waiting_for_a_slot_when_the_server_stops_is_refused_not_served(bundle, monkeypatch):
    """A connection accepted at the cap waits a few loop passes for a slot; if the server stops meanwhile,
    it is answered with an error and closed, never registered after stop() has closed the others."""
    limits = ServiceLimits(max_wyoming_connections=1, wyoming_idle_timeout=None)
    srv = ServerThread(bundle, EngineConfig(max_batch=1), limits, wyoming_port=0)
    wy = srv.server._wyoming
    waiting, served = threading.Event(), []

    async def slot_free_once_the_stop_began() -> bool:
        waiting.set()
        while wy._server is not None and wy._server.is_serving():
            await asyncio.sleep(0)
        return True

    monkeypatch.setattr(wy, "_slot_free", slot_free_once_the_stop_began)
    run_connection = front._Connection.run

    async def recorded_run(connection):
        served.append(connection)
        await run_connection(connection)

    monkeypatch.setattr(front._Connection, "run", recorded_run)
    sock = socket.create_connection(("127.0.0.1", srv.server.wyoming_port))
    try:
        write_event(Describe().event(), sock.makefile("wb"))
        assert waiting.wait(60)
        srv.stop()
        sock.settimeout(60)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        assert served == []
        assert b'"type": "error"' in received or b'"type":"error"' in received
        assert b"info" not in received
    finally:
        sock.close()


IDLE = 0.5  # (the tests that wait for a close take as long)


class FrozenClock:
    """The Wyoming front's clock, stopped at `now` until the test moves it (its watcher sleeps on the
    real one): what happens before the timeout is then not a race with it."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def brief():
    """Idle connections close after IDLE seconds; one row, one session, every job HOLD_FRAMES frames."""
    limits = ServiceLimits(max_waiting=0, max_queued_chunks=2, max_sessions=1, wyoming_idle_timeout=IDLE)
    srv = ServerThread(
        fixed_frames(load_bundle("tiny"), HOLD_FRAMES), EngineConfig(max_batch=1), limits, wyoming_port=0
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize("sent", [b"", b'{"type": "synthesize", "data_length": 40}\n{"text": '])
def test_an_idle_connection_is_closed(brief, sent):
    """A client that sends nothing, or half an event, is disconnected after the idle timeout."""

    async def scenario():
        reader, writer = await raw_connection(brief.server.wyoming_port)
        writer.write(sent)
        await writer.drain()
        rest = await reader.read()  # (the end of the stream: the server closed it)
        writer.close()
        return rest

    assert run(scenario()) == b""


def test_the_idle_timeout_waits_for_the_synthesis_and_counts_from_its_end(brief, monkeypatch):
    """A synthesis in progress keeps its connection however long it takes (here a held stream, paused
    by a client that does not read, for longer than the timeout, its last event sent before); a
    synthesis that has ended does not close it at once (a ping after it is answered while the clock
    stands), and once the clock has passed the timeout the connection closes with nothing more sent."""
    clock = FrozenClock()

    async def scenario():
        reader, writer = await held_stream(brief)()
        await asyncio.to_thread(wait_for, lambda: brief.loop.stats.paused == 1, "the held job to pause")
        await asyncio.sleep(1.5 * IDLE)
        held = brief.loop.sessions_open == 1 and not writer.transport.is_closing()
        writer.transport.abort()
        await asyncio.to_thread(wait_idle, brief.loop)
        monkeypatch.setattr(front, "time", clock)
        async with AsyncTcpClient("127.0.0.1", brief.server.wyoming_port) as client:
            await client.write_event(Synthesize(text="Short.").event())
            spoken = await read_until(client, "audio-stop", "error")
            await client.write_event(Ping(text="still there?").event())
            pong = await client.read_event()
            clock.now += IDLE
            after = await client.read_event()  # (nothing more: the connection closes)
        return held, spoken, pong, after

    held, spoken, pong, after = run(scenario())
    assert held
    assert spoken[-1].type == "audio-stop"
    assert Pong.is_type(pong.type) and Pong.from_event(pong).text == "still there?" and after is None
