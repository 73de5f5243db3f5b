"""One replica's manners behind a balancer (in-process server, tiny model): its name in every answer, the
drain delay, the liveness health service, the load signal, and connection age."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import pytest
from service_helpers import HOLD, HOLD_TEXT, NO_BDP, ServerThread, collect

from service.client import build_request
from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from service.server import LIVENESS_SERVICE, SERVICE_NAME, ServiceLimits
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig

pytest.importorskip("grpc_health")
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


def short(seed: int = 1):
    return build_request("Hello.", seed=seed, max_new_frames=4, min_new_frames=4)


def health(channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def test_the_replica_is_named_in_headers_info_http_and_load(bundle):
    srv = ServerThread(bundle, EngineConfig(max_batch=2), http_port=0, replica="gpu-7")
    try:
        with srv.channel() as channel:
            stub = pb_grpc.TextToSpeechStub(channel)
            assert collect(stub.Synthesize(short()))["header"].replica == "gpu-7"
            assert stub.SynthesizeUnary(short()).header.replica == "gpu-7"
            assert stub.GetInfo(pb.GetInfoRequest()).replica == "gpu-7"
        base = f"http://127.0.0.1:{srv.server.http_port}"
        body = {"input": "Hi.", "response_format": "pcm", "max_new_frames": 3, "min_new_frames": 3}
        body = json.dumps(body).encode()  # (3 frames whatever the random weights sample)
        request = urllib.request.Request(
            base + "/v1/audio/speech", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.headers["X-Replica"] == "gpu-7"
            response.read()
        load = json.loads(urllib.request.urlopen(base + "/load", timeout=10).read())
        assert load["replica"] == "gpu-7" and load["status"] == "serving"
        assert (load["max_batch"], load["max_in_flight"], load["in_flight"]) == (2, 2 + 16, 0)
        assert load["kv_blocks_total"] > 0 and load["load"] == 0.0
    finally:
        srv.stop()


def test_default_name_is_host_and_port(bundle):
    import socket

    srv = ServerThread(bundle, EngineConfig(max_batch=2))
    try:
        assert srv.server.replica == f"{socket.gethostname()}:{srv.server.port}"
    finally:
        srv.stop()


def test_drain_delay_keeps_admitting_while_not_serving(bundle):
    """stop(grace, drain_delay): health turns NOT_SERVING at once (liveness stays SERVING) while new calls
    are still admitted and served; once the delay is over new calls get UNAVAILABLE and an open stream has
    `grace` to finish. Only lower bounds of time are asserted, apart from the 3 s delay being long enough
    for one short call to be admitted."""
    srv = ServerThread(
        bundle, EngineConfig(max_batch=2), ServiceLimits(pause_timeout=None, max_queued_chunks=2)
    )
    channel = srv.channel(**NO_BDP)
    stub = pb_grpc.TextToSpeechStub(channel)
    assert health(channel, LIVENESS_SERVICE) == SERVING and health(channel, SERVICE_NAME) == SERVING
    held = stub.Synthesize(build_request(HOLD_TEXT, **HOLD))  # cannot end while it is not read
    assert next(held).WhichOneof("message") == "header"
    delay, grace = 3.0, 1.0
    elapsed: list[float] = []

    def stop():
        t0 = time.monotonic()
        srv.call(srv.server.stop(grace, drain_delay=delay), timeout=60)
        elapsed.append(time.monotonic() - t0)

    stopper = threading.Thread(target=stop)
    stopper.start()
    deadline = time.monotonic() + 30
    while health(channel, SERVICE_NAME) != NOT_SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert health(channel, "") == NOT_SERVING and health(channel, LIVENESS_SERVICE) == SERVING
    assert srv.server.state == "draining"
    r = collect(stub.Synthesize(short(2)))  # sent during the delay: admitted and served
    assert r["end"].frames == 4
    while srv.loop.accepting:  # the delay ends: admission closes
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(grpc.RpcError) as info:
        collect(stub.Synthesize(short(3)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
    stopper.join(60)
    with pytest.raises(grpc.RpcError) as info:
        list(held)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    assert elapsed and elapsed[0] >= delay + grace - 0.05, elapsed
    srv._thread.join(30)


def test_max_connection_age_sends_clients_away_without_cutting_streams(bundle):
    """With max_connection_age 0.5 s the server sends GOAWAY: the client channel leaves READY by itself
    (and reconnects for its next call); a stream open on the old connection still ends with all frames."""
    srv = ServerThread(bundle, EngineConfig(max_batch=2), ServiceLimits(max_connection_age=0.5))
    channel = srv.channel()
    states: list[grpc.ChannelConnectivity] = []
    changed = threading.Condition()

    def on_state(state):
        with changed:
            states.append(state)
            changed.notify_all()

    channel.subscribe(on_state, try_to_connect=False)
    try:
        stub = pb_grpc.TextToSpeechStub(channel)
        call = stub.Synthesize(build_request("Hello there.", seed=1, max_new_frames=60, min_new_frames=60))
        assert next(call).WhichOneof("message") == "header"
        with changed:
            assert changed.wait_for(lambda: grpc.ChannelConnectivity.READY in states, 30)
            ready_at = states.index(grpc.ChannelConnectivity.READY)
            # GOAWAY after about 0.5 s (+ jitter): the channel goes IDLE on its own, nobody closed it.
            assert changed.wait_for(lambda: grpc.ChannelConnectivity.IDLE in states[ready_at:], 60), states
        frames = sum(1 for r in call if r.WhichOneof("message") == "chunk")
        assert frames > 0
        assert collect(stub.Synthesize(short()))["end"].frames == 4  # a new connection for the next call
    finally:
        channel.unsubscribe(on_state)
        channel.close()
        srv.stop()


def test_grpc_options_carry_the_connection_age():
    from service.grpc_front import grpc_options

    options = dict(grpc_options(ServiceLimits(max_connection_age=300, max_connection_age_grace=30)))
    assert (
        options["grpc.max_connection_age_ms"] == 300_000
        and options["grpc.max_connection_age_grace_ms"] == 30_000
    )
    options = dict(grpc_options(ServiceLimits()))
    assert "grpc.max_connection_age_ms" not in options and "grpc.max_connection_age_grace_ms" not in options
    assert options["grpc.max_allowed_incoming_connections"] == 1024
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert "grpc.max_connection_idle_ms" not in dict(grpc_options(ServiceLimits(max_connection_idle=None)))


def test_a_connection_past_the_grpc_cap_is_refused_and_the_next_one_served(bundle):
    """Two gRPC connections at most: a third client's call fails UNAVAILABLE while the two are open, and
    succeeds once one of them has closed (each channel its own connection: no shared subchannel)."""
    srv = ServerThread(bundle, EngineConfig(max_batch=1), ServiceLimits(max_grpc_connections=2))

    def channel():
        return srv.channel(**{"grpc.use_local_subchannel_pool": 1})

    def check(ch) -> int:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30).status

    a, b, c = channel(), channel(), channel()
    try:
        assert [check(a), check(b)] == [SERVING, SERVING]
        with pytest.raises(grpc.RpcError) as refused:
            check(c)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        a.close()
        deadline = time.monotonic() + 60  # (the server frees the slot when it sees the close)
        while True:
            d = channel()
            try:
                assert check(d) == SERVING
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the freed connection was never taken"
                time.sleep(0.05)
            finally:
                d.close()
        assert check(b) == SERVING
    finally:
        for ch in (a, b, c):
            ch.close()
        srv.stop()
