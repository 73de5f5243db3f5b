import threading

import pytest
import torch
from helpers import EagerBucketsEngine, params, random_prompt, run_to_completion

import graphs.runner
from graphs import GraphRunner
from graphs.runner import StandInGraph
from tts.engine import Engine, EngineConfig


def test_bucket_choice():
    r = GraphRunner(lambda b, v: None, max_batch=40, buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64))
    assert r.buckets == [1, 2, 4, 8, 16, 24, 32, 40]  # 48 and 64 become max_batch
    assert [r.bucket_for(n) for n in (1, 2, 3, 5, 17, 32, 33, 40, 41)] == [1, 2, 4, 8, 24, 32, 40, 40, None]


def test_lazy_capture_after_warmup_and_counts():
    calls = []
    r = GraphRunner(lambda b, v: calls.append(b), max_batch=8, buckets=(1, 2, 4))
    assert [r.run(n) for n in (3, 3, 3, 1, 5)] == [4, 4, 4, 1, 5]
    # bucket 4: warm-up eager, capture + replay, replay; bucket 1: warm-up; 5 > largest: eager
    assert calls == [4, 4, 4, 1, 5]  # the stand-in capture records without running
    s = r.stats
    assert (s.replays, s.eager_steps, s.eager_warmup, s.eager_over_max) == (2, 3, 2, 1)
    assert set(s.capture_seconds) == {(4, None)}
    assert s.replay_share == pytest.approx(2 / 5)


def test_startup_capture_largest_first():
    order = []
    r = GraphRunner(lambda b, v: order.append((b, v)), max_batch=4, buckets=(1, 2, 4))
    r.capture_all(variants=("x", "y"))
    assert [b for b, _ in order] == [4, 4, 2, 2, 1, 1]  # warm-up runs only; stand-in captures record
    assert list(r.stats.capture_seconds)[:2] == [(4, "x"), (4, "y")]
    r.run(2, "y")
    assert order[-1] == (2, "y")  # the stand-in replays the captured variant
    assert r.stats.replays == 1 and r.stats.eager_steps == 0


def test_failed_capture_leaves_bucket_eager_and_keeps_serving():
    r = GraphRunner(lambda b, v: None, max_batch=4, buckets=(4,))

    def failing_capture(key):
        raise RuntimeError("injected capture failure")

    r._capture_standin = failing_capture  # the CUDA variant of this test lives in test_cuda_graphs.py
    assert [r.run(3) for _ in range(4)] == [4, 4, 3, 3]
    assert r.stats.failed_buckets() == {4} and "injected" in r.stats.failed_captures[(4, None)]
    assert r.stats.replays == 0 and r.stats.eager_steps == 4


def test_captures_from_two_threads_never_overlap(monkeypatch):
    # Runner B (another thread, as the codec stage's worker beside the engine thread) asks for a capture
    # while runner A's is open: B's starts only after A's has ended (graphs.runner.CAPTURE_LOCK).
    a_inside, b_waits = threading.Event(), threading.Event()
    lock = threading.Lock()

    class SignallingLock:  # CAPTURE_LOCK that says when thread "b" starts waiting for it
        def __enter__(self):
            if threading.current_thread().name == "b":
                b_waits.set()
            lock.acquire()

        def __exit__(self, *exc):
            lock.release()

    monkeypatch.setattr(graphs.runner, "CAPTURE_LOCK", SignallingLock())
    order = []
    a = GraphRunner(lambda b, v: None, max_batch=1, buckets=(1,))
    b = GraphRunner(lambda b, v: None, max_batch=1, buckets=(1,))

    def capture(name, other, wait=None):
        def standin(key):
            order.append(f"{name} begins, other capturing: {other.capturing}")
            if wait is not None:
                a_inside.set()
                assert wait.wait(timeout=30), "thread b never asked for the capture lock"
            order.append(f"{name} ends")
            graph = StandInGraph()
            graph.capture(lambda: None)
            return graph

        return standin

    a._capture_standin = capture("a", b, wait=b_waits)
    b._capture_standin = capture("b", a)
    a.run(1)  # the warm-up
    b.run(1)
    errors = []

    def run(runner):
        try:
            runner.run(1)  # the capture, then its replay
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread_a = threading.Thread(target=run, args=(a,), name="a")
    thread_a.start()
    assert a_inside.wait(timeout=30)
    thread_b = threading.Thread(target=run, args=(b,), name="b")
    thread_b.start()
    thread_a.join(timeout=60)
    thread_b.join(timeout=60)
    assert errors == [] and not thread_a.is_alive() and not thread_b.is_alive()
    assert order == [
        "a begins, other capturing: False",
        "a ends",
        "b begins, other capturing: False",
        "b ends",
    ]
    assert set(a.graphs) == set(b.graphs) == {(1, None)}
    assert a.stats.replays == b.stats.replays == 1 and not a.stats.failed_captures


def _engine(model, cls=Engine, **kw):
    return cls(model, EngineConfig(max_batch=4, block_size=8, **kw))


def _run_batch(engine, n=3):
    for i in range(n):
        engine.submit(
            random_prompt(engine.model, 6 + 5 * i, i), params(max_new_frames=8 + 3 * i, seed=i), f"r{i}"
        )
    return run_to_completion(engine)


def test_standin_graph_replay_equals_eager_with_pad_rows(tiny_model, standin_graphs):
    eager_codes, eager_reasons = _run_batch(_engine(tiny_model, graphs="off"))
    engine = _engine(tiny_model, graphs="lazy", buckets=(1, 2, 4))
    ptrs = engine.runner.buffers.data_ptrs()
    codes, reasons = _run_batch(engine)
    assert reasons == eager_reasons
    for k in eager_codes:
        assert torch.equal(codes[k], eager_codes[k])
    assert engine.graphs.stats.replays > 0
    assert engine.runner.buffers.data_ptrs() == ptrs
    # every row went back to the pad state
    assert not engine.runner.buffers.active.any()
    assert (engine.runner.buffers.block_tables == 0).all()


def test_pad_rows_never_touch_real_kv_blocks(tiny_model, standin_graphs):
    """A batch of 3 on the bucket-4 step: the pad row writes only the scratch block."""
    engine = _engine(tiny_model, graphs="lazy", buckets=(4,))
    for i in range(3):
        engine.submit(random_prompt(tiny_model, 7, i), params(max_new_frames=30, seed=i), f"r{i}")
    engine.step()  # admit + warm-up step at bucket 4
    kv_before = engine.kv.k[:, 1:].clone()
    owned = {b for r in engine.scheduler.running for b in r.blocks}
    engine.runner.buffers.active[:3] = False  # freeze the real rows: only pads could write now
    engine.graphs.run(3)
    assert torch.equal(engine.kv.k[:, 1:], kv_before)
    assert owned and 0 not in owned


@pytest.mark.parametrize(
    "setting, standin, enabled, captured",
    [("off", True, False, 0), ("lazy", True, True, 0), ("startup", True, True, 3), ("lazy", False, False, 0)],
)
def test_the_graph_setting(tiny_model, request, setting, standin, enabled, captured):
    """graphs: "off" never captures, "lazy" captures later, "startup" every bucket at construction; a
    CPU has none (the testing stand-ins excepted)."""
    if standin:
        request.getfixturevalue("standin_graphs")
    engine = _engine(tiny_model, graphs=setting, buckets=(1, 2, 4))
    assert engine.graphs.enabled is enabled and len(engine.graphs.graphs) == captured


@pytest.mark.parametrize("value", ["on", "eager", "Lazy"])
def test_unknown_graph_settings_are_refused(value):
    with pytest.raises(ValueError, match="graphs must be one of off, lazy, startup"):
        EngineConfig(graphs=value).validate()


def test_eager_buckets_pad_like_replay_but_never_capture(tiny_model, standin_graphs):
    eager_codes, eager_reasons = _run_batch(_engine(tiny_model, graphs="off"))
    engine = _engine(tiny_model, graphs="startup", buckets=(4,), cls=EagerBucketsEngine)
    assert not engine.graphs.graphs  # no start-up capture either
    codes, reasons = _run_batch(engine)
    assert reasons == eager_reasons
    for k in eager_codes:
        assert torch.equal(codes[k], eager_codes[k])
    s = engine.graphs.stats
    assert s.replays == 0 and not s.capture_seconds and s.eager_steps > 0
    assert engine.graphs.run(3) == 4  # (every row is an inert pad row by now) padded to the bucket
