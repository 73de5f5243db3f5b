"""The one definition of a replica's state (service.common.ReplicaState): what gRPC health, HTTP /health and
/load report, and why a call is refused, in every state."""

from __future__ import annotations

from types import SimpleNamespace

from service.common import ReplicaState, ServiceLimits


def fake_loop(**flags):
    loop = SimpleNamespace(ready=False, alive=True, accepting=True, failure=None)
    loop.__dict__.update(flags)
    return loop


def test_each_state_says_readiness_liveness_and_admission_once():
    loop = fake_loop()
    state = ReplicaState(loop, ServiceLimits(), "r0")
    rows = []

    def row():
        refusal = state.refusal()
        rows.append((state.state, state.serving, state.live, state.health()[0], str(refusal or "")))

    row()  # start-up
    loop.ready, state.warm = True, True
    row()
    state.stopping = True  # stop() called: admitted until admission closes
    row()
    loop.accepting = False
    row()
    loop.alive = False
    row()
    assert rows == [
        ("warming_up", False, True, False, "the server is warming up; not accepting requests"),
        ("serving", True, True, True, ""),
        ("draining", False, True, False, ""),
        ("draining", False, True, False, "the server is shutting down; not accepting requests"),
        ("stopped", False, False, False, "the engine has stopped; not accepting requests"),
    ]
    failed = ReplicaState(fake_loop(ready=True, failure="the codec stage died"), ServiceLimits())
    failed.warm = True
    assert (failed.state, failed.serving, failed.live) == ("failed", False, False)
    assert failed.health() == (False, {"status": "failed", "reason": "the codec stage died"})
    # GetInfo only needs the engine built: refused while warming up, answered while draining.
    assert state.refusal(new_work=False) is None
    assert str(ReplicaState(fake_loop(), ServiceLimits()).refusal(new_work=False)).endswith(
        "warming up; not accepting requests"
    )
