"""Kept sequences (tts/engine/sequences.py): a session's next request prefills only its new positions,
cancel frees exactly the new chunk's blocks, dropped history is prefilled again and counted, idle
sequences give way to waiting requests."""

import pytest
import torch
from helpers import params, random_prompt, run_to_completion

from tts.engine import Engine, EngineConfig
from tts.engine.sequences import common_prefix
from tts.model.kv_cache import blocks_needed

BS = 8


def make_engine(model, **kw):
    cfg = dict(max_batch=2, graphs="off", block_size=BS, ignore_eos=True)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def frame_columns(model, codes: torch.Tensor) -> torch.Tensor:
    """The prompt columns of generated codes `[T, N]`, as the prompt format lays out a history turn."""
    c = model.config
    cols = torch.empty(codes.shape[0], 1 + c.num_codebooks, dtype=torch.int64)
    cols[:, 0] = codes[:, 0] + c.semantic_begin_id
    cols[:, 1:] = codes
    return cols


def fixed(n: int, seed: int = 7):
    return params(max_new_frames=n, min_new_frames=n, seed=seed)


def first_chunk(engine, model, frames=5):
    p1 = random_prompt(model, 20, seed=1)
    engine.submit(p1, fixed(frames), "a", sequence="s")
    codes, reasons = run_to_completion(engine)
    return p1, codes["a"]


def test_common_prefix_ignores_the_prompts_last_column():
    a = torch.arange(12).view(6, 2)
    assert common_prefix(a, a) == 5
    b = a.clone()
    b[3, 1] = -1
    assert common_prefix(a, b) == 3
    assert common_prefix(None, a) == 0
    assert common_prefix(a[:2], a) == 2


def test_a_sessions_next_request_prefills_only_its_new_positions_and_its_kv_equals_a_full_prefill(tiny_model):
    engine = make_engine(tiny_model)
    p1, codes = first_chunk(engine, tiny_model, frames=5)
    assert codes.shape[0] == 5
    held = 20 + 5 - 1  # the prompt and every frame but the last (never fed back)
    assert engine.sequence_blocks("s") == blocks_needed(held, BS)
    assert engine.kv_usage()[0] == blocks_needed(held, BS)
    new_text = random_prompt(tiny_model, 9, seed=2, semantic_every=None)
    p2 = torch.cat([p1, frame_columns(tiny_model, codes), new_text])
    before = engine.prefill_tokens
    request = engine.submit(p2, fixed(3), "b", sequence="s")
    assert request.cached == held
    engine.step()  # admitted, prefilled, one frame
    assert request.prefill_tokens == p2.shape[0] - 1 - held == 1 + 9 - 1
    assert engine.prefill_tokens - before == request.prefill_tokens
    assert engine.reprefill_tokens == 0
    # The K/V of every prompt position equal those of a prefill of the whole prompt from scratch.
    kv, T = engine.kv, p2.shape[0] - 1
    fresh = engine.scheduler.allocator.allocate(blocks_needed(T, BS))
    try:
        engine.runner.prefill(p2, fresh)
        pos = torch.arange(T)
        a = kv.slots_for_positions(torch.tensor(request.blocks), pos)
        b = kv.slots_for_positions(torch.tensor(fresh), pos)
        for cache in (kv.k, kv.v):
            flat = cache.view(cache.shape[0], -1, *cache.shape[-2:])
            torch.testing.assert_close(flat[:, a], flat[:, b], atol=2e-5, rtol=1e-4)
    finally:
        engine.scheduler.allocator.free(fresh)
    run_to_completion(engine)
    assert engine.sequence_blocks("s") == blocks_needed(p2.shape[0] + 3 - 1, BS)


def test_cancel_frees_the_new_chunks_row_and_blocks_and_keeps_the_history(tiny_model):
    engine = make_engine(tiny_model)
    p1, codes = first_chunk(engine, tiny_model)
    held_blocks = engine.sequence_blocks("s")
    p2 = torch.cat([p1, frame_columns(tiny_model, codes), random_prompt(tiny_model, 30, seed=3)])
    request = engine.submit(p2, fixed(40), "b", sequence="s")
    engine.step()
    used = engine.kv_usage()[0]
    # blocks are taken as the request grows: after its first frame, those of its prompt
    assert used == blocks_needed(p2.shape[0], BS) and engine.num_running == 1
    engine.cancel("b")
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason.value) for o in outputs] == [("b", "cancelled")]
    assert engine.num_running == 0
    assert engine.kv_usage()[0] == held_blocks == engine.sequence_blocks("s")
    assert request.cached == 20 + 5 - 1  # the new chunk held its prefix's blocks and freed the rest
    # the next chunk continues from the same history: the cancelled chunk's positions are not reused
    again = engine.submit(p2, fixed(2), "c", sequence="s")
    assert again.cached == 20 + 5 - 1
    run_to_completion(engine)


def test_dropped_history_is_prefilled_again_and_counted(tiny_model):
    engine = make_engine(tiny_model)
    p1, codes = first_chunk(engine, tiny_model)
    p2 = p1.clone()
    p2[10:, 0] = (p2[10:, 0] + 1) % 200  # the history differs from position 10 on (turns dropped)
    request = engine.submit(p2, fixed(2), "b", sequence="s")
    assert request.cached == 10
    assert engine.reprefill_tokens == 19 - 10  # the held positions the new prompt needs, prefilled again
    run_to_completion(engine)
    assert request.prefill_tokens == 19 - 10


def test_an_idle_sequence_is_evicted_for_a_waiting_request_and_released_sequences_free_their_blocks(
    tiny_model,
):
    # 2 requests of 20 + 12 positions need 4 blocks each: a pool of 6 usable blocks fits one sequence (3)
    # and one request, not both
    engine = make_engine(tiny_model, num_blocks=7)
    p1, codes = first_chunk(engine, tiny_model)
    assert engine.sequence_blocks("s") == 3 and engine.kv_usage() == (3, 6)
    engine.submit(random_prompt(tiny_model, 20, seed=4), fixed(12), "other")
    got, reasons = run_to_completion(engine)
    assert got["other"].shape[0] == 12 and engine.sequence_evictions == 1
    assert engine.sequence_blocks("s") == 0 and engine.kv_usage()[0] == 0
    # the session's next request prefills its whole history again: counted
    p2 = torch.cat([p1, frame_columns(tiny_model, codes), random_prompt(tiny_model, 3, seed=5)])
    request = engine.submit(p2, fixed(2), "b", sequence="s")
    assert request.cached == 0 and engine.reprefill_tokens == 20 + 5 - 1
    run_to_completion(engine)
    assert engine.release_sequence("s") == blocks_needed(p2.shape[0] + 1, BS)
    assert engine.kv_usage()[0] == 0 and "s" not in engine.sequences


def test_a_request_cancelled_while_waiting_gives_its_prefix_back_and_a_busy_sequence_is_refused(tiny_model):
    engine = make_engine(tiny_model)
    p1, codes = first_chunk(engine, tiny_model)
    held = engine.sequence_blocks("s")
    p2 = torch.cat([p1, frame_columns(tiny_model, codes), random_prompt(tiny_model, 4, seed=6)])
    engine.submit(p2, fixed(2), "b", sequence="s")
    with pytest.raises(ValueError, match="in use"):
        engine.submit(p2, fixed(2), "c", sequence="s")
    engine.cancel("b")
    engine.step()
    assert engine.sequence_blocks("s") == held and engine.kv_usage()[0] == held
    assert engine.submit(p2, fixed(2), "d", sequence="s").cached == 20 + 5 - 1
    run_to_completion(engine)


def test_with_graphs_the_frame_step_replays_and_the_extension_prefill_runs_eagerly_with_the_same_kv(
    tiny_model, standin_graphs
):
    """Stand-in graphs on a CPU: the frame step and a fresh prompt's prefill go through the graph runners
    as on CUDA; a session's extension prefill does not (it reads the cached prefix), and its K/V and codes
    equal the eager engine's."""
    results = []
    for graphs in ("off", "lazy"):
        engine = make_engine(tiny_model, graphs=graphs, prefill_graphs=graphs)
        p1, codes = first_chunk(engine, tiny_model)
        p2 = torch.cat([p1, frame_columns(tiny_model, codes), random_prompt(tiny_model, 9, seed=2)])
        pg = engine.runner.prefill_graphs
        steps = (pg.graphs.stats.replays + pg.graphs.stats.eager_steps) if pg is not None else 0
        engine.submit(p2, fixed(4), "b", sequence="s")
        got, _ = run_to_completion(engine)
        if pg is not None:  # the extension prefill did not go through the prefill graphs
            assert pg.graphs.stats.replays + pg.graphs.stats.eager_steps == steps
            assert engine.graphs.stats.replays > 0
        results.append((codes, got["b"]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
