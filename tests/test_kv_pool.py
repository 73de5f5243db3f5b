"""The KV pool on demand: blocks taken as a request grows, admission by free blocks, and the policy when
the pool runs out mid-stream (stall, then PREEMPTED for the most recently admitted). Exact counts, CPU,
the end token never sampled (ignore_eos), so every count follows from the prompt lengths and budgets."""

import pytest
import torch
from helpers import params, random_prompt, run_to_completion

from tts.engine import Engine, EngineConfig, FinishReason, InvalidRequest
from tts.engine import engine as engine_module
from tts.engine.engine import kv_bytes_per_token, max_batch_for_memory
from tts.model.kv_cache import SCRATCH_BLOCK, blocks_needed

BS = 8  # tokens per block in these tests


def make_engine(model, **kw):
    cfg = dict(max_batch=2, graphs="off", block_size=BS, ignore_eos=True)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def solo_codes(model, prompt, budget, seed):
    engine = make_engine(model, max_batch=1)
    engine.submit(prompt, params(max_new_frames=budget, seed=seed), "solo")
    codes, reasons = run_to_completion(engine)
    assert reasons["solo"] == FinishReason.LENGTH
    return codes["solo"]


def test_blocks_grow_with_frames_and_return_at_the_end(tiny_model):
    engine = make_engine(tiny_model, max_batch=1)
    prompt_len, budget = 10, 30
    request = engine.submit(random_prompt(tiny_model, prompt_len, 0), params(max_new_frames=budget), "r")
    used = []
    for _ in range(budget - 1):
        engine.step()
        used.append(engine.kv_usage()[0])
        g = request.num_generated
        # the blocks cover every position written so far (0 .. prompt_len - 2 + g), no more
        assert len(request.blocks) == blocks_needed(prompt_len - 1 + g, BS)
        table = engine.runner.buffers.block_tables[0].tolist()
        assert table[: len(request.blocks)] == request.blocks
        assert set(table[len(request.blocks) :]) == {SCRATCH_BLOCK}
    assert used == [blocks_needed(prompt_len - 1 + g, BS) for g in range(1, budget)]
    assert used[0] == 2 and used[-1] == 5  # not the 5 of the whole budget from the start
    outs = engine.step()
    assert [o.finish_reason for o in outs] == [FinishReason.LENGTH]
    assert engine.kv_usage()[0] == 0


@pytest.mark.parametrize("how", ["cancel", "fail"])
def test_blocks_return_on_cancel_and_failure(tiny_model, how):
    engine = make_engine(tiny_model)
    engine.submit(random_prompt(tiny_model, 10, 0), params(max_new_frames=40), "a")
    engine.submit(random_prompt(tiny_model, 20, 1), params(max_new_frames=40), "b")
    for _ in range(12):
        engine.step()
    assert engine.kv_usage()[0] == blocks_needed(9 + 12, BS) + blocks_needed(19 + 12, BS)
    if how == "cancel":
        engine.cancel("a")
        engine.cancel("b")
        outs = engine.step()
        assert {o.finish_reason for o in outs} == {FinishReason.CANCELLED}
    else:
        outs = engine.fail_all("boom")
        assert {o.finish_reason for o in outs} == {FinishReason.ERROR}
    assert engine.kv_usage() == (0, engine.scheduler.allocator.num_usable)


def test_admission_by_free_blocks_and_a_reserve_per_running_request(tiny_model):
    # 5 usable blocks. "a" (10 tokens) needs 2 now: 2 + 0 running <= 5. "b" (20 tokens) needs 3 now,
    # plus a block of reserve for "a": 3 + 1 > 3 free, so it waits until "a" is done.
    engine = make_engine(tiny_model, num_blocks=6)
    engine.submit(random_prompt(tiny_model, 10, 0), params(max_new_frames=4), "a")
    engine.submit(random_prompt(tiny_model, 20, 1), params(max_new_frames=4), "b")
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    assert engine.scheduler.running[0].request_id == "a"
    assert engine.kv_usage()[0] == 2
    for _ in range(3):  # "a" ends in the third of these; "b" is admitted in the next iteration
        engine.step()
    assert engine.num_running == 0 and engine.num_waiting == 1
    engine.step()
    assert engine.num_running == 1 and engine.kv_usage()[0] == 3
    _, reasons = run_to_completion(engine)
    assert reasons == {"b": FinishReason.LENGTH}
    assert engine.kv_usage()[0] == 0


def test_a_request_larger_than_the_pool_is_refused_at_submission(tiny_model):
    engine = make_engine(tiny_model, num_blocks=6)
    with pytest.raises(InvalidRequest, match="KV blocks"):
        engine.submit(random_prompt(tiny_model, 10, 0), params(max_new_frames=40), "big")  # needs 7 > 5
    assert engine.num_waiting == 0 and engine.kv_usage()[0] == 0


def test_out_of_blocks_mid_stream_stalls_then_resumes_with_the_same_codes(tiny_model):
    """5 usable blocks; "a" (8 + 12 frames: 3 blocks at most) and "b" (8 + 25: 4). Both take their third
    block after 9 frames: "a" (row 0) gets the last free one, "b" waits, its row inactive, until "a"
    ends; then it goes on. Neither loses a frame or changes a code."""
    pa, pb = random_prompt(tiny_model, 8, 0), random_prompt(tiny_model, 8, 1)
    engine = make_engine(tiny_model, num_blocks=6)
    engine.submit(pa, params(max_new_frames=12, seed=1), "a")
    engine.submit(pb, params(max_new_frames=25, seed=2), "b")
    collected = {"a": [], "b": []}
    frames_b_while_a_ran = None
    for _ in range(100):
        for out in engine.step():
            collected[out.request_id].append(out.codes)
            if out.request_id == "a" and out.finished:
                frames_b_while_a_ran = sum(c.shape[0] for c in collected["b"])
        if not engine.has_work():
            break
    assert frames_b_while_a_ran == 9  # stalled at its 10th frame's position (16 = 7 + 9)
    assert engine.kv_stalls == 1 and engine.kv_preemptions == 0
    assert torch.equal(torch.cat(collected["a"]), solo_codes(tiny_model, pa, 12, 1))
    assert torch.equal(torch.cat(collected["b"]), solo_codes(tiny_model, pb, 25, 2))
    assert engine.kv_usage()[0] == 0


def test_when_no_request_can_decode_the_newest_is_preempted(tiny_model):
    """5 usable blocks; "a" and "b" (8 + 25 frames each, 4 blocks at most). After 9 frames "b" waits for
    its third block; after 17, "a" waits for its fourth: no row can decode, so "b" (admitted last) ends
    with PREEMPTED and its blocks go to "a", which finishes with the codes of a solo run."""
    pa, pb = random_prompt(tiny_model, 8, 0), random_prompt(tiny_model, 8, 1)
    engine = make_engine(tiny_model, num_blocks=6)
    engine.submit(pa, params(max_new_frames=25, seed=1), "a")
    engine.submit(pb, params(max_new_frames=25, seed=2), "b")
    codes, reasons = run_to_completion(engine)
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.PREEMPTED}
    assert codes["b"].shape[0] == 9
    assert torch.equal(codes["b"], solo_codes(tiny_model, pb, 25, 2)[:9])
    assert torch.equal(codes["a"], solo_codes(tiny_model, pa, 25, 1))
    assert engine.kv_preemptions == 1
    assert engine.kv_usage()[0] == 0


def test_a_preempted_output_says_why(tiny_model):
    engine = make_engine(tiny_model, num_blocks=6)
    engine.submit(random_prompt(tiny_model, 8, 0), params(max_new_frames=25), "a")
    engine.submit(random_prompt(tiny_model, 8, 1), params(max_new_frames=25), "b")
    ended = []
    while engine.has_work():
        ended += [o for o in engine.step() if o.finished]
    preempted = [o for o in ended if o.finish_reason == FinishReason.PREEMPTED]
    assert len(preempted) == 1 and "KV cache is full" in (preempted[0].error or "")


def test_a_paused_request_is_not_stalled_and_resumes(tiny_model):
    """A paused row takes no block while paused (it writes nothing) and gets it when it resumes."""
    engine = make_engine(tiny_model, max_batch=1)
    request = engine.submit(random_prompt(tiny_model, 8, 0), params(max_new_frames=20), "p")
    for _ in range(9):  # positions 7 .. 15 written: 2 blocks; the next position, 16, needs a third
        engine.step()
    assert len(request.blocks) == 2
    engine.set_paused("p", True)
    for _ in range(3):
        engine.step()
    assert request.num_generated == 9 and len(request.blocks) == 2 and not request.stalled
    engine.set_paused("p", False)
    _, reasons = run_to_completion(engine)
    assert reasons == {"p": FinishReason.LENGTH} and engine.kv_usage()[0] == 0


def test_cpu_pool_is_bounded_by_a_fixed_budget_yet_holds_one_full_context(tiny_model, monkeypatch):
    c = tiny_model.config
    per_block = kv_bytes_per_token(tiny_model) * BS
    full = blocks_needed(c.max_seq_len, BS)
    engine = make_engine(tiny_model, max_batch=4)
    assert engine.kv.num_blocks == min(4 * full + 1, max(full + 1, engine_module.CPU_KV_BYTES // per_block))
    monkeypatch.setattr(engine_module, "CPU_KV_BYTES", 3 * per_block)
    assert make_engine(tiny_model, max_batch=4).kv.num_blocks == full + 1
    info = make_engine(tiny_model, max_batch=4).kv_info()
    assert info["blocks"] == full and info["used_blocks"] == 0 and info["memory_fraction"] is None


def test_max_batch_for_memory(tiny_model):
    per_token = kv_bytes_per_token(tiny_model)
    buckets = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    # half of the free memory holds 100 streams of 2048 tokens: the largest bucket under it is 96
    assert max_batch_for_memory(tiny_model, 0.5, free_bytes=2 * 100 * 2048 * per_token, buckets=buckets) == 96
    assert (
        max_batch_for_memory(tiny_model, 0.5, free_bytes=2 * 10**6 * 2048 * per_token, buckets=buckets) == 256
    )
    assert max_batch_for_memory(tiny_model, 0.5, free_bytes=per_token, buckets=buckets) == 1


def test_kv_memory_fraction_is_checked(tiny_model):
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        make_engine(tiny_model, kv_memory_fraction=0.0)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        make_engine(tiny_model, kv_memory_fraction=1.5)
