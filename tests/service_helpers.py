"""The service tests' harness: a real TTSServer on 127.0.0.1 in a thread, reading a stream with every
check a client would make, waiting until a server is back to idle, and streams held open."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from service.client import channel_options, decode_audio, decode_codes
from service.server import TTSServer
from tts.engine import EngineConfig
from tts.runtime.engine_thread import EngineThread

# A stream of exactly HOLD_FRAMES frames whatever the random weights do (the end token is held off),
# for a text long enough that the runaway guard allows it. Sent as float32 one frame per chunk, its
# 1.5 MB of audio cannot finish through HTTP/2's windows (BDP probing off: about 160 KB) unless the
# client reads: a client that stops reading holds the stream open for as long as it likes.
HOLD_FRAMES = 600
HOLD_TEXT = "Hold this stream open for as long as the test needs it, whatever the random weights say."
HOLD = dict(temperature=0.0, seed=4, max_new_frames=HOLD_FRAMES, min_new_frames=HOLD_FRAMES)
NO_BDP = {"grpc.http2.bdp_probe": 0}


class ServerThread:
    """A TTSServer on its own asyncio loop in a background thread (ephemeral ports; `server` options
    go to TTSServer, e.g. `http_port=0` for the HTTP front)."""

    def __init__(self, bundle, engine_config=None, limits=None, metrics_port=None, wait_ready=True, **server):
        self.server = TTSServer(
            bundle, engine_config or EngineConfig(max_batch=8), limits, metrics_port=metrics_port, **server
        )
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._started.wait(60), "server did not start"
        if self._error:
            raise self._error
        self.address = f"127.0.0.1:{self.server.port}"
        self.port = self.server.http_port
        if wait_ready:
            self.call(self.server.wait_ready(120))

    async def _main(self):
        self.aio_loop = asyncio.get_running_loop()
        try:
            await self.server.start("127.0.0.1", 0)
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._started.set()
            return
        self._started.set()
        await self.server.wait_for_termination()

    def call(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.aio_loop).result(timeout)

    def stop(self, grace=0.0):
        if self._thread.is_alive():
            self.call(self.server.stop(grace))
            self._thread.join(30)

    @property
    def loop(self) -> EngineThread:
        return self.server.loop

    def channel(self, **options):
        extra = [(k, v) for k, v in options.items()]
        return grpc.insecure_channel(self.address, options=channel_options() + extra)


def collect(call) -> dict:
    """Read a Synthesize stream into header, chunks and end, checking sequence numbers and frame ranges."""
    header, end, chunks = None, None, []
    for response in call:
        kind = response.WhichOneof("message")
        if kind == "header":
            assert header is None and not chunks
            header = response.header
        elif kind == "chunk":
            assert header is not None and end is None
            assert response.chunk.sequence == len(chunks), "sequence gap"
            if chunks:
                assert response.chunk.frame_start == chunks[-1].frame_end, "frame gap"
            chunks.append(response.chunk)
        else:
            end = response.end
    assert header is not None and end is not None
    raw = b"".join(c.audio for c in chunks)
    codes = [decode_codes(c.codes) for c in chunks if c.HasField("codes")]
    return {
        "header": header,
        "end": end,
        "chunks": chunks,
        "raw": raw,
        "audio": decode_audio(raw, header.encoding),
        "codes": np.concatenate(codes, axis=1) if codes else None,
    }


def engine_work(loop: EngineThread) -> tuple[int, int]:
    """The engine's work so far: requests admitted and prefilled, and frame steps run. (The loop's own
    iteration count is no measure: an idle loop wakes once a second.)"""
    return loop.engine.prefill_requests, loop.engine.frame_steps


def wait_idle(loop: EngineThread, timeout: float = 60.0) -> None:
    """Wait until no job, engine request, KV block or active row is left (the baseline)."""
    deadline = time.monotonic() + timeout
    engine = loop.engine
    while time.monotonic() < deadline:
        if (
            loop.in_flight == 0
            and engine.kv_usage()[0] == 0
            and engine.num_running == 0
            and engine.num_waiting == 0
            and not bool(engine.runner.buffers.active.any())
            and loop.runner.idle()
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"resources not freed: {loop.stats}, kv {engine.kv_usage()}")


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


class EndTokenFavoured:
    """model_runner's `F` with +1e4 on the main-token logits' last column (the end token): a model that
    stops at once, whatever its weights (`monkeypatch.setattr(model_runner, "F", EndTokenFavoured())`)."""

    END_BIAS = 1e4

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def linear(self, x, weight, bias=None):
        out = torch.nn.functional.linear(x, weight, bias)
        out[:, -1] += self.END_BIAS
        return out


class EndTokenNever(EndTokenFavoured):
    """As `EndTokenFavoured` with -1e4: a model that never samples the end token, whatever its weights."""

    END_BIAS = -1e4
