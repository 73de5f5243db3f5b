"""A request's preparation (text, planning) runs off the serving threads and within its deadline: health
and other clients are answered while one is prepared, and a preparation past the client's deadline or
the server's `max_prepare_seconds` ends with DEADLINE_EXCEEDED (HTTP 504) and stops its work. Driven by
events: preparation is held on an Event the test controls."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from service_helpers import ServerThread, collect, rpc_error, wait_idle

import service.grpc_front
import service.http
from service.client import build_request
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig
from tts.text.budget import PreparationTimeout

pytest.importorskip("fastapi")
pytest.importorskip("grpc_health")
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

HELD = "Held: "  # requests whose text starts so are held in preparation


class HeldPreparation:
    """`plan_job` that, for texts starting with HELD, says it started (`entered`), waits for `release`,
    then runs the real preparation and records how it ended (`outcome`, `done`)."""

    def __init__(self):
        self.original = service.http.plan_job
        self.entered, self.release, self.done = threading.Event(), threading.Event(), threading.Event()
        self.outcome: BaseException | str | None = None

    def __call__(self, planner, request, *args, **kwargs):
        if not request.text.startswith(HELD):
            return self.original(planner, request, *args, **kwargs)
        self.entered.set()
        try:
            assert self.release.wait(60), "the test never released the preparation"
            result = self.original(planner, request, *args, **kwargs)
            self.outcome = "prepared"
            return result
        except BaseException as exc:
            self.outcome = exc
            raise
        finally:
            self.done.set()


@pytest.fixture(scope="module")
def server():
    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=4), http_port=0)
    yield srv
    srv.stop()


@pytest.fixture
def held(monkeypatch):
    hold = HeldPreparation()
    monkeypatch.setattr(service.grpc_front, "plan_job", hold)
    monkeypatch.setattr(service.http, "plan_job", hold)
    yield hold
    hold.release.set()


def _http(server, path, body=None):
    """(status, JSON or bytes) of one HTTP request."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}", data, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_for(condition, what, timeout=30.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_health_and_other_clients_are_answered_while_a_request_is_prepared(server, held, monkeypatch):
    monkeypatch.setattr(server.server.limits, "max_prepare_seconds", 600.0)  # held as long as the test says
    with server.channel() as channel, ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.TextToSpeechStub(channel)
        first = pool.submit(
            lambda: collect(stub.Synthesize(build_request(HELD + "Hello.", seed=1, max_new_frames=4)))
        )
        assert held.entered.wait(30)
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert _http(server, "/health")[0] == 200
        other = collect(stub.Synthesize(build_request("Another client.", seed=2, max_new_frames=4)))
        assert other["end"].frames > 0
        assert not held.done.is_set()  # all of that while the first was still being prepared
        held.release.set()
        assert first.result(60)["end"].frames > 0
    assert held.outcome == "prepared"
    wait_idle(server.loop)


def test_a_client_deadline_ends_preparation_with_deadline_exceeded(server, held):
    registry = server.server.metrics.registry

    def count():
        return registry.get_sample_value("tts_requests_total", {"outcome": "deadline_exceeded"}) or 0.0

    before = count()
    with server.channel() as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        request = build_request(HELD + "Hello.", seed=1, max_new_frames=4)
        err = rpc_error(lambda: stub.SynthesizeUnary(request, timeout=0.5))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for(lambda: count() > before, "the server to end the call")  # its deadline cancelled the handler
    held.release.set()
    assert held.done.wait(30)
    assert isinstance(held.outcome, PreparationTimeout)  # the preparation stopped at its first step
    wait_idle(server.loop)


def test_a_preparation_past_the_server_limit_is_deadline_exceeded_and_504(server, held, monkeypatch):
    monkeypatch.setattr(server.server.limits, "max_prepare_seconds", 0.2)
    with server.channel() as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        err = rpc_error(lambda: collect(stub.Synthesize(build_request(HELD + "Hello.", seed=1))))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took longer than its deadline (0.2 s)" in err.details()
    held.release.set()
    assert held.done.wait(30) and isinstance(held.outcome, PreparationTimeout)

    held.entered.clear(), held.release.clear(), held.done.clear()
    status, body = _http(server, "/v1/audio/speech", {"input": HELD + "Hello.", "response_format": "wav"})
    assert status == 504
    assert body["error"]["code"] == "deadline_exceeded" and "0.2 s" in body["error"]["message"]
    held.release.set()
    assert held.done.wait(30) and isinstance(held.outcome, PreparationTimeout)
    wait_idle(server.loop)


@pytest.mark.parametrize("text", ["1" * 400, "$" + "9" * 400])
def test_a_long_digit_run_is_read_not_a_server_error(server, text):
    """num2words overflows at 307 digits (and int() refuses 4301): such text was INTERNAL / 500."""
    with server.channel() as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        out = collect(stub.Synthesize(build_request(text, seed=1, max_new_frames=2)))
    assert out["end"].frames > 0
    status, _ = _http(
        server, "/v1/audio/speech", {"input": text, "response_format": "pcm", "max_new_frames": 2, "seed": 1}
    )  # (a fixed seed: a random one could end every text chunk at once, no audio: 422)
    assert status == 200
    wait_idle(server.loop)
