import pytest
import torch
from helpers import params, random_prompt, run_to_completion
from service_helpers import EndTokenFavoured

from tts.engine import Engine, EngineConfig, FinishReason, InvalidRequest, QueueFull


def make_engine(model, **kw):
    cfg = dict(max_batch=4, graphs="off", block_size=8)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def test_batched_request_gives_same_codes_as_alone(tiny_model):
    """fp32 CPU: a request batched with two others of different lengths (one joining late) gives the
    same codes as when it runs alone."""
    prompts = {
        "a": random_prompt(tiny_model, 11, 1),
        "b": random_prompt(tiny_model, 40, 2),
        "c": random_prompt(tiny_model, 3, 3),
    }
    budgets = {"a": 20, "b": 9, "c": 15}
    solo = {}
    for rid, p in prompts.items():
        engine = make_engine(tiny_model)
        engine.submit(p, params(max_new_frames=budgets[rid], seed=len(rid) + ord(rid)), rid)
        solo[rid] = run_to_completion(engine)[0][rid]
    engine = make_engine(tiny_model)
    for rid in ("a", "b"):
        engine.submit(prompts[rid], params(max_new_frames=budgets[rid], seed=len(rid) + ord(rid)), rid)
    collected = {"a": [], "b": [], "c": []}
    for i in range(100):
        if i == 4:
            engine.submit(prompts["c"], params(max_new_frames=budgets["c"], seed=1 + ord("c")), "c")
        for out in engine.step():
            collected[out.request_id].append(out.codes)
        if not engine.has_work():
            break
    for rid in prompts:
        batched = torch.cat(collected[rid])
        assert batched.shape[0] > 0
        assert torch.equal(batched, solo[rid]), rid


def test_finish_reasons_and_every_block_returns(tiny_model):
    engine = make_engine(tiny_model, max_batch=2)
    usable = engine.scheduler.allocator.num_usable
    for i in range(5):
        engine.submit(random_prompt(tiny_model, 5 + 7 * i, i), params(max_new_frames=3 + i, seed=i), f"r{i}")
    codes, reasons = run_to_completion(engine)
    assert set(reasons) == {f"r{i}" for i in range(5)}
    for i in range(5):
        r = reasons[f"r{i}"]
        assert r in (FinishReason.LENGTH, FinishReason.STOP)
        if r == FinishReason.LENGTH:
            assert codes[f"r{i}"].shape[0] == 3 + i  # never past the budget
        else:
            assert codes[f"r{i}"].shape[0] < 3 + i
    assert engine.scheduler.allocator.num_free == usable
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not engine.runner.buffers.active.any()


def test_stop_on_end_token_drops_that_frame(tiny_model):
    """Force the end token by pointing its head row at the row's hidden state: finish STOP, no frame."""
    engine = make_engine(tiny_model, max_batch=1)
    engine.submit(random_prompt(tiny_model, 6, 0), params(temperature=0.0, max_new_frames=10), "s")
    engine.step()  # admit + one frame
    _, h = engine.runner.slow_step(1)
    engine.runner.semantic_head[-1] = 1e3 * h[0] / h[0].pow(2).sum()
    outs = engine.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == FinishReason.STOP
    assert outs[0].codes.shape == (0, tiny_model.config.num_codebooks)
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable


def test_admission_waits_for_blocks(tiny_model):
    # 8-token blocks, 4 in the pool. The first takes ceil(10 / 8) = 2 at admission; the second would need
    # its 2 plus one of reserve for the first, but only 2 are free: it waits.
    engine = make_engine(tiny_model, num_blocks=5)
    engine.submit(random_prompt(tiny_model, 10, 0), params(max_new_frames=10), "first")
    engine.submit(random_prompt(tiny_model, 10, 1), params(max_new_frames=10), "second")
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    codes, reasons = run_to_completion(engine)
    assert set(reasons) == {"first", "second"}
    assert engine.scheduler.allocator.num_free == 4


def test_cancel_running_and_waiting_requests_frees_blocks(tiny_model):
    engine = make_engine(tiny_model, max_batch=1)
    engine.submit(random_prompt(tiny_model, 8, 0), params(max_new_frames=50), "run")
    engine.submit(random_prompt(tiny_model, 8, 1), params(max_new_frames=50), "wait")
    engine.step()
    engine.step()
    engine.cancel("run")
    engine.cancel("wait")
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {
        "run": FinishReason.CANCELLED,
        "wait": FinishReason.CANCELLED,
    }
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable
    assert not engine.has_work()


def test_paused_request_resumes_with_the_same_codes(tiny_model):
    ref_engine = make_engine(tiny_model)
    ref_engine.submit(random_prompt(tiny_model, 8, 0), params(max_new_frames=10), "p")
    ref = run_to_completion(ref_engine)[0]["p"]
    engine = make_engine(tiny_model)
    engine.submit(random_prompt(tiny_model, 8, 0), params(max_new_frames=10), "p")
    engine.submit(random_prompt(tiny_model, 12, 5), params(max_new_frames=20, seed=3), "other")
    got = []
    for i in range(60):
        if i == 3:
            engine.set_paused("p", True)
        if i == 8:
            engine.set_paused("p", False)
        for out in engine.step():
            if out.request_id == "p":
                got.append(out.codes)
                if 3 < i < 8:
                    assert out.codes.numel() == 0 and not out.finished
        if not engine.has_work():
            break
    assert torch.equal(torch.cat(got), ref)


def test_too_long_and_bad_params_rejected_before_work(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(InvalidRequest, match="exceeds the context size"):
        engine.submit(random_prompt(tiny_model, 1000, 0), params(max_new_frames=100))
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.submit(random_prompt(tiny_model, 10, 0), params(top_p=0.0))
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.submit(random_prompt(tiny_model, 10, 0), params(temperature=-1.0))
    with pytest.raises(InvalidRequest, match="max_new_frames"):
        engine.submit(random_prompt(tiny_model, 10, 0), params(max_new_frames=0))
    assert not engine.has_work()


def test_waiting_queue_is_bounded(tiny_model):
    engine = make_engine(tiny_model, max_waiting=2)
    engine.submit(random_prompt(tiny_model, 5, 0), params())
    engine.submit(random_prompt(tiny_model, 5, 0), params())
    with pytest.raises(QueueFull):
        engine.submit(random_prompt(tiny_model, 5, 0), params())


def test_unseeded_requests_get_distinct_random_seeds(tiny_model):
    engine = make_engine(tiny_model)
    a = engine.submit(random_prompt(tiny_model, 5, 0), params(seed=None))
    b = engine.submit(random_prompt(tiny_model, 5, 0), params(seed=None))
    assert a.seed != b.seed


# ---- regressions found in review ------------------------------------------------------------------------


def test_failed_prefill_does_not_strand_a_request_admitted_with_it(tiny_model):
    engine = make_engine(tiny_model)
    engine.runner.prefill_orig = engine.runner.prefill

    def prefill(prompt, blocks):
        if int(prompt[0, 0]) == 7:  # the "bad" request: prefill raises (e.g. CUDA OOM)
            raise RuntimeError("injected prefill failure")
        return engine.runner.prefill_orig(prompt, blocks)

    engine.runner.prefill = prefill
    bad = random_prompt(tiny_model, 6, 0)
    bad[0, 0] = 7
    good = random_prompt(tiny_model, 6, 1)
    good[0, 0] = 8
    engine.submit(bad, params(max_new_frames=5), "bad")
    engine.submit(good, params(max_new_frames=5, temperature=0.0), "good")
    codes, reasons = run_to_completion(engine, max_iters=50)
    assert reasons["bad"] == FinishReason.ERROR
    assert reasons["good"] in (FinishReason.LENGTH, FinishReason.STOP) and codes["good"].shape[0] >= 1
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable


def test_outputs_produced_before_a_failing_step_are_not_lost(tiny_model):
    engine = make_engine(tiny_model)
    engine.submit(random_prompt(tiny_model, 6, 0), params(max_new_frames=50), "a")
    engine.submit(random_prompt(tiny_model, 6, 1), params(max_new_frames=50), "b")
    engine.step()
    engine.cancel("a")
    real_run = engine.graphs.run
    engine.graphs.run = lambda n, v=None: (_ for _ in ()).throw(RuntimeError("injected step failure"))
    with pytest.raises(RuntimeError):
        engine.step()
    engine.graphs.run = real_run
    ended = {o.request_id: o.finish_reason for o in engine.fail_all("step failed")}
    assert ended == {"a": FinishReason.CANCELLED, "b": FinishReason.ERROR}
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable


def test_buckets_above_max_batch_are_clamped_to_it(tiny_model, standin_graphs):
    engine = make_engine(tiny_model, max_batch=12, graphs="lazy")
    assert engine.graphs.buckets == [1, 2, 4, 8, 12]
    assert engine.graphs.bucket_for(10) == 12


def test_pause_in_the_iteration_of_admission_and_while_waiting_is_kept(tiny_model):
    engine = make_engine(tiny_model, max_batch=1)
    engine.submit(random_prompt(tiny_model, 6, 0), params(max_new_frames=30), "first")
    engine.submit(random_prompt(tiny_model, 6, 1), params(max_new_frames=30), "second")
    engine.set_paused("first", True)  # applied in the same iteration that admits it
    engine.set_paused("second", True)  # still waiting
    for _ in range(5):
        for out in engine.step():
            assert out.codes.numel() == 0 and not out.finished, out
    engine.set_paused("first", False)
    frames = sum(o.codes.shape[0] for _ in range(3) for o in engine.step() if o.request_id == "first")
    assert frames == 3
    engine.cancel("first")
    engine.step()  # "second" is admitted now, still paused
    assert all(o.codes.numel() == 0 for _ in range(3) for o in engine.step())


def test_malformed_prompts_are_rejected_at_submit(tiny_model):
    c = tiny_model.config
    engine = make_engine(tiny_model)
    narrow = torch.zeros(5, c.num_codebooks, dtype=torch.int64)
    with pytest.raises(InvalidRequest, match="columns"):
        engine.submit(narrow, params())
    bad_token = random_prompt(tiny_model, 5, 0)
    bad_token[-1, 0] = c.vocab_size
    with pytest.raises(InvalidRequest, match="token id"):
        engine.submit(bad_token, params())
    bad_code = random_prompt(tiny_model, 5, 0)
    bad_code[0, 0] = c.semantic_begin_id
    bad_code[0, 2] = c.codebook_size
    with pytest.raises(InvalidRequest, match="code"):
        engine.submit(bad_code, params())
    with pytest.raises(InvalidRequest, match="top_k"):
        engine.submit(random_prompt(tiny_model, 5, 0), params(top_k=2**63 - 1))
    assert not engine.has_work()


def test_cpu_noise_made_frames_ahead_equals_each_frames_own(tiny_model):
    """The CPU frame step makes the sampler noise of coming frames in one batch; every frame must get
    exactly `frame_log_noise(seeds, steps)`, also when a row stops advancing or the seeds change."""
    from tts.model.sampling import frame_log_noise

    engine = make_engine(tiny_model)
    bufs = engine.runner.buffers
    bufs.seeds[:2] = torch.tensor([7, -3])
    bufs.steps[:2] = torch.tensor([0, 5])
    bufs.active[:2] = True

    def check():
        got = engine.cpu_step._frame_noise(2, 6, 70)
        assert torch.equal(got, frame_log_noise(bufs.seeds[:2], bufs.steps[:2], 6, 70))

    for _ in range(20):  # past the first batch of frames ahead
        check()
        bufs.steps[:2] += 1
    bufs.steps[1] -= 1  # row 1 did not advance this frame
    check()
    bufs.steps[:2] += 1
    bufs.seeds[0] = 8  # a new request in row 0
    check()
    bufs.active[1] = False
    check()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_min_new_frames_holds_off_the_end_token(tiny_model, monkeypatch, temperature):
    from tts.engine import model_runner

    monkeypatch.setattr(model_runner, "F", EndTokenFavoured())
    engine = make_engine(tiny_model)
    p = random_prompt(tiny_model, 12, 5)
    engine.submit(p, params(temperature=temperature, max_new_frames=20), "free")
    engine.submit(p, params(temperature=temperature, max_new_frames=20, min_new_frames=7), "held")
    engine.submit(p, params(temperature=temperature, max_new_frames=9, min_new_frames=9), "full")
    codes, reasons = run_to_completion(engine)
    # Without it the end token comes first (no frame); with it, exactly min_new_frames frames, then the
    # end token (its frame dropped); min == max runs to the budget.
    assert (codes["free"].shape[0], reasons["free"]) == (0, FinishReason.STOP)
    assert (codes["held"].shape[0], reasons["held"]) == (7, FinishReason.STOP)
    assert (codes["full"].shape[0], reasons["full"]) == (9, FinishReason.LENGTH)


def test_min_new_frames_is_validated(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(InvalidRequest, match="min_new_frames must be in \\[0, max_new_frames = 5\\]"):
        engine.submit(random_prompt(tiny_model, 4, 1), params(max_new_frames=5, min_new_frames=6))


def test_admission_prefills_at_most_max_prefill_tokens_per_iteration(tiny_model):
    """Five waiting requests of 30-token prompts with a budget of 64 tokens: two are admitted (and
    prefilled) per iteration, so the first iteration's frame step is not delayed by all five prefills."""
    engine = make_engine(tiny_model, max_batch=8, max_prefill_tokens=64)
    for i in range(5):
        engine.submit(random_prompt(tiny_model, 30, i), params(max_new_frames=50), f"r{i}")
    running = []
    for _ in range(3):
        engine.step()
        running.append(engine.num_running)
    assert running == [2, 4, 5]
    # A prompt longer than the budget is still admitted (alone).
    engine = make_engine(tiny_model, max_batch=8, max_prefill_tokens=16)
    engine.submit(random_prompt(tiny_model, 30, 9), params(max_new_frames=5), "long")
    engine.step()
    assert engine.num_running == 1


def test_packed_prefill_writes_the_kv_of_one_request_prefills(tiny_model, monkeypatch):
    """Several prompts prefilled in one pass (block-diagonal causal attention, split into passes of at
    most PACKED_PREFILL_TOKENS positions) write the K/V that prefilling each alone writes, into each
    request's own blocks, and nothing else."""
    import tts.engine.model_runner as mr

    lengths = (11, 1, 40, 3, 25)  # the 1-column prompt has no K/V to write
    prompts = [random_prompt(tiny_model, n, i) for i, n in enumerate(lengths)]
    kv = {}
    for packed in (False, True):
        engine = make_engine(tiny_model, max_batch=8)
        engine.kv.k.fill_(0.5)
        engine.kv.v.fill_(0.5)
        alloc = engine.scheduler.allocator
        tables = [alloc.allocate(-(-n // 8)) for n in lengths]
        if packed:
            monkeypatch.setattr(mr, "PACKED_PREFILL_TOKENS", 60)  # passes: (11, 1, 40, 3) packed, (25) alone
            engine.runner.prefill_packed(prompts, tables)
        else:
            for p, t in zip(prompts, tables, strict=True):
                engine.runner.prefill(p, t)
        kv[packed] = (engine.kv.k.clone(), engine.kv.v.clone())
    for a, b in zip(kv[False], kv[True], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert (a != 0.5).any()  # (something was written)


def prefill_engine(model, graphed: bool):
    """An engine of 8 rows with the packed prefill, its prefill captured lazily (graphed; on a CPU the
    test needs the `standin_graphs` fixture) or eager."""
    setting = "lazy" if graphed else "off"
    return make_engine(model, max_batch=8, packed_prefill=True, graphs=setting, prefill_graphs=setting)


def test_graphed_prefill_writes_the_kv_of_the_eager_prefill(tiny_model, standin_graphs):
    """The prefill as replayed graphs (stand-in graphs on the CPU: the same padded buffers, bucket
    choice and masked attention): prompts padded to a token bucket write the K/V of the eager prefill
    into their own blocks; the pad columns write only the scratch block; warm-up, capture and replay
    all write the same values. A pass longer than the largest bucket runs eagerly."""
    from tts.engine.prefill_graphs import PrefillGraphs
    from tts.model.kv_cache import SCRATCH_BLOCK

    lengths = (11, 1, 40, 3, 25)
    prompts = [random_prompt(tiny_model, n, i) for i, n in enumerate(lengths)]
    kv = {}
    for graphed in (False, True):
        engine = prefill_engine(tiny_model, graphed)
        assert (engine.runner.prefill_graphs is not None) == graphed
        engine.kv.k.fill_(0.5)
        engine.kv.v.fill_(0.5)
        tables = [engine.scheduler.allocator.allocate(-(-n // 8)) for n in lengths]
        for _ in range(3 if graphed else 1):  # warm-up, capture, replay
            engine.runner.prefill_packed(prompts, tables)
            engine.runner.prefill(prompts[4], tables[4])  # one prompt alone: a pass of its own
        kv[graphed] = (engine.kv.k.clone(), engine.kv.v.clone())
        if graphed:
            graph = engine.runner.prefill_graphs
            assert isinstance(graph, PrefillGraphs)
            # One packed pass of 11 + 40 + 3 + 25 = 79 columns (the 1-column prompt has none): bucket 96;
            # the prompt of 25 alone: bucket 32. Each bucket: the capture's run, then a replay.
            assert graph.graphs.stats.replays_by_bucket == {96: 2, 32: 2}
            assert not graph.run([(random_prompt(tiny_model, 3000, 9), list(range(1, 400)))])  # too long
            assert graph.graphs.stats.eager_over_max == 1  # (counted, and prefilled eagerly by the caller)
    for a, b in zip(kv[False], kv[True], strict=True):
        scratch = torch.ones(a.shape[1], dtype=torch.bool)
        scratch[SCRATCH_BLOCK] = False
        torch.testing.assert_close(b[:, scratch], a[:, scratch], atol=1e-5, rtol=1e-5)
        assert (a != 0.5).any()  # (something was written)


def test_a_prefill_bucket_whose_capture_fails_runs_eagerly_at_its_padded_size(tiny_model, standin_graphs):
    """A failed capture leaves its token bucket eager, laid out exactly as a replay would be: the K/V
    are still the eager prefill's."""
    from tts.model.kv_cache import SCRATCH_BLOCK

    assert SCRATCH_BLOCK == 0  # (the comparison below skips block 0)
    prompts = [random_prompt(tiny_model, n, i) for i, n in enumerate((11, 40))]
    kv = {}
    for graphed in (False, True):
        engine = prefill_engine(tiny_model, graphed)
        if graphed:
            runner = engine.runner.prefill_graphs.graphs

            def failing_capture(key):
                raise RuntimeError("injected capture failure")

            runner._capture_standin = failing_capture  # (as tests/test_graph_runner.py injects one)
        tables = [engine.scheduler.allocator.allocate(-(-n // 8)) for n in (11, 40)]
        for _ in range(3 if graphed else 1):  # warm-up, the failed capture, eager again
            engine.runner.prefill_packed(prompts, tables)
        if graphed:
            assert list(runner.stats.failed_captures) == [(64, None)] and runner.stats.replays == 0
        kv[graphed] = (
            engine.kv.k[:, SCRATCH_BLOCK + 1 :].clone(),
            engine.kv.v[:, SCRATCH_BLOCK + 1 :].clone(),
        )
    for a, b in zip(kv[False], kv[True], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_start_up_capture_of_the_prefill_leaves_no_autograd_state_and_no_counts(tiny_model, standin_graphs):
    """Capturing every token bucket at start-up (stand-in graphs on the CPU) runs each bucket's warm-up
    on pad columns in inference mode: the KV cache keeps no autograd history (the tiny model's weights
    require grad), nothing real was written, and the replay and eager counters start at zero."""
    engine = make_engine(tiny_model, max_batch=8, graphs="startup", prefill_graphs="startup")
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and len(graphs.graphs.graphs) == len(graphs.buckets)
    assert any(p.requires_grad for p in tiny_model.parameters())
    assert not engine.kv.k.requires_grad and engine.kv.k.grad_fn is None
    stats = graphs.graphs.stats
    assert (stats.replays, stats.eager_steps, stats.eager_over_max) == (0, 0, 0)


def test_prefill_graphs_setting_is_checked():
    with pytest.raises(ValueError, match="prefill_graphs must be one of off, lazy, startup"):
        EngineConfig(prefill_graphs="sometimes").validate()


def test_engine_prefills_admitted_requests_packed_and_falls_back_one_by_one(tiny_model):
    """With packed prefill, the requests admitted together are prefilled in one call; if that call
    raises, each is prefilled alone and the codes are exactly those of the unpacked engine."""
    prompts = {f"r{i}": random_prompt(tiny_model, 9 + 5 * i, i) for i in range(3)}
    runs = {}
    for mode in ("unpacked", "packed", "failing"):
        engine = make_engine(tiny_model, packed_prefill=mode != "unpacked")
        calls = []
        original = engine.runner.prefill_packed

        def packed(prompts, tables, original=original, calls=calls, fail=mode == "failing"):
            calls.append(len(prompts))
            if fail:
                raise RuntimeError("injected packed prefill failure")
            return original(prompts, tables)

        engine.runner.prefill_packed = packed
        for rid, p in prompts.items():
            engine.submit(p, params(max_new_frames=6, min_new_frames=6, temperature=0.0), rid)
        codes, reasons = run_to_completion(engine)
        assert calls == ([] if mode == "unpacked" else [3])
        assert all(r == FinishReason.LENGTH for r in reasons.values())
        assert all(codes[rid].shape[0] == 6 for rid in prompts)
        runs[mode] = codes
    for rid in prompts:
        assert torch.equal(runs["failing"][rid], runs["unpacked"][rid])


def test_the_step_output_layout_is_frame_column_then_emitted_done_and_text_position(tiny_model):
    """`OutLayout` names the columns of `out` that the step writes and `Engine.step` reads."""
    from tts.engine.model_runner import OutLayout

    cols = OutLayout(4)
    assert (cols.token, cols.frame, cols.codes, cols.emitted, cols.done, cols.align, cols.width) == (
        0,
        slice(0, 5),
        slice(1, 5),
        5,
        6,
        7,
        8,
    )
    engine = make_engine(tiny_model)
    N = tiny_model.config.num_codebooks
    assert engine.runner.out_layout == OutLayout(N) and engine.runner.buffers.out.shape[1] == N + 4


def test_frame_steps_and_rows_count_the_batch(tiny_model):
    """frame_steps counts steps with running rows and step_rows sums those rows: two requests of 3 and 5
    frames (end token held off) -> 5 steps, 3 x 2 + 2 x 1 = 8 rows."""
    engine = make_engine(tiny_model)
    engine.submit(random_prompt(tiny_model, 6, 0), params(max_new_frames=3, min_new_frames=3), "a")
    engine.submit(random_prompt(tiny_model, 6, 1), params(max_new_frames=5, min_new_frames=5), "b")
    codes, _ = run_to_completion(engine)
    assert (codes["a"].shape[0], codes["b"].shape[0]) == (3, 5)
    assert (engine.frame_steps, engine.step_rows) == (5, 8)


def test_prefill_counters_count_passes_and_requests(tiny_model):
    """Two requests admitted in one iteration: one packed pass when packing is on, two passes when off;
    two requests prefilled either way."""
    for packed, passes in ((True, 1), (False, 2)):
        engine = make_engine(tiny_model, packed_prefill=packed)
        engine.submit(random_prompt(tiny_model, 6, 0), params(max_new_frames=2), "a")
        engine.submit(random_prompt(tiny_model, 9, 1), params(max_new_frames=2), "b")
        engine.step()
        assert (engine.runner.prefill_passes, engine.prefill_requests) == (passes, 2)


def _counted(fn, calls: list, name: str):
    """`fn`, appending `name` to `calls` on every call."""

    def counted(*args):
        calls.append(name)
        return fn(*args)

    return counted


def test_prefill_warmup_runs_every_kind_and_leaves_no_trace(tiny_model, monkeypatch):
    """`warmup_prefill` runs the prefill alone and packed on throwaway prompts: afterwards the free list
    is what it was (same blocks, same order), the prefill counters are unchanged, and a request gives
    the codes it gives on an engine that never warmed up."""
    codes = []
    for warm in (False, True):
        engine = make_engine(tiny_model, packed_prefill=True)
        engine.submit(random_prompt(tiny_model, 5, 7), params(max_new_frames=2, seed=1), "first")
        run_to_completion(engine)
        if warm:
            calls: list[str] = []
            for name in ("prefill", "prefill_packed"):
                monkeypatch.setattr(engine.runner, name, _counted(getattr(engine.runner, name), calls, name))
            free, passes = list(engine.scheduler.allocator._free), engine.runner.prefill_passes
            engine.warmup_prefill()
            assert calls.count("prefill") >= 2 and calls.count("prefill_packed") >= 2
            assert engine.scheduler.allocator._free == free
            assert (engine.runner.prefill_passes, passes) == (passes, 1)
        engine.submit(random_prompt(tiny_model, 12, 4), params(max_new_frames=6, seed=3), "a")
        codes.append(run_to_completion(engine)[0]["a"])
    assert torch.equal(codes[0], codes[1])


def test_prefill_warmup_of_a_one_row_engine_skips_the_packed_prefill(tiny_model, monkeypatch):
    """With max_batch 1 no iteration admits two requests, so warming the packed prefill is wasted."""
    engine = make_engine(tiny_model, packed_prefill=True, max_batch=1)
    calls: list[str] = []
    for name in ("prefill", "prefill_packed"):
        monkeypatch.setattr(engine.runner, name, _counted(getattr(engine.runner, name), calls, name))
    engine.warmup_prefill()
    assert calls == ["prefill"] * sum(len(lengths) == 1 for lengths in engine.WARMUP_PREFILLS)


def test_prefill_warmup_skips_what_does_not_fit_the_pool(tiny_model):
    """A pool too small for some of the warm-up's prompts: those are skipped, nothing is taken."""
    engine = make_engine(tiny_model, packed_prefill=True, num_blocks=4)  # 3 usable blocks of 8 tokens
    engine.warmup_prefill()
    assert engine.scheduler.allocator.num_free == 3


def test_work_beside_the_step_runs_between_its_launch_and_its_read_back(tiny_model):
    """`step(while_stepping)` runs the caller's work once per iteration that steps, after the frame step
    is launched and before its frame is read back; a request it submits joins at the next iteration; an
    iteration with nothing running does not call it; its seconds are not the step's."""
    engine = make_engine(tiny_model)
    order: list[str] = []
    run, to_host = engine.graphs.run, engine._frame_to_host
    engine.graphs.run = lambda *a: (order.append("launch"), run(*a))[1]
    engine._frame_to_host = lambda n: (order.append("read back"), to_host(n))[1]
    calls = []

    def beside():
        order.append("beside")
        calls.append(engine.num_running)
        if len(calls) == 1:
            engine.submit(random_prompt(tiny_model, 5, 2), params(max_new_frames=3, seed=2), "b")

    assert engine.step(beside) == [] and calls == []  # nothing running, nothing submitted
    engine.submit(random_prompt(tiny_model, 5, 1), params(max_new_frames=3, seed=1), "a")
    engine.step(beside)
    assert order == ["launch", "beside", "read back"] and calls == [1]
    assert engine.num_waiting == 1 and engine.num_running == 1  # "b" waits for the next iteration
    engine.step(beside)
    assert calls == [1, 2]  # "b" joined
    replay = engine.phase_seconds["replay"]
    clock = engine.clock
    engine.clock = lambda: clock() + 1000.0 * len(calls)  # the work beside "takes" 1,000 s a call
    engine.step(beside)
    assert engine.phase_seconds["replay"] - replay < 100.0


def test_a_step_sample_leaves_out_the_work_beside_it_only_where_it_held_the_frame_back():
    """Real-time admission's sample of a step's seconds: on a CPU the work beside the step ran after its
    compute (all of it comes off); on CUDA it ran while the device computed, so only what it outlasted
    the device by comes off (a burst of commands is not a slow step)."""
    from tts.engine.engine import step_sample

    assert step_sample(0.015, 0.005, None) == pytest.approx(0.010)  # CPU
    # CUDA, a graph replay (launched in 0.1 ms): work hidden by the step, then a 50 ms burst
    assert step_sample(0.0131, 0.0005, 0.0130, 0.0001) == pytest.approx(0.0131)
    assert step_sample(0.0512, 0.0500, 0.0130, 0.0001) == pytest.approx(0.0141)
    # CUDA, an eager step (20 ms launching, the device done 0.5 ms later): the work ran after it
    assert step_sample(0.0355, 0.0150, 0.0205, 0.0200) == pytest.approx(0.0210)
