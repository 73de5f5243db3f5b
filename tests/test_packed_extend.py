"""The packed extension prefill (tts/engine/sequences.py `prefill_extend_packed`): sessions whose later
chunks are admitted in the same iteration prefill their new positions together, each attending to its
own cached prefix; the K/V and codes equal those of prefilling them one by one, passes are counted
exactly, and a failed packed pass falls back to one by one (a bad prompt failing alone)."""

import pytest
import torch
from helpers import random_prompt, run_to_completion
from test_sequences import BS, fixed, frame_columns, make_engine

import tts.engine.model_runner as mr
import tts.engine.sequences as sequences
from tts.engine.request import FinishReason
from tts.model.kv_cache import blocks_needed

# New text columns of each session's second chunk: positions prefilled by the extension (the 1-column one
# exercises a single-query sequence in the packed pass).
NEW = (9, 1, 12, 6)
FIRST = 20  # first chunk's prompt columns
FRAMES = 5  # first chunk's frames: it holds FIRST + FRAMES - 1 positions
HELD = FIRST + FRAMES - 1


def second_chunks(engine, model, new=NEW, fresh: int = 0):
    """Each session's first chunk alone (run to completion, one after the other: prefilled alone, as
    with packing off), then every session's second chunk (and `fresh` requests without a sequence)
    submitted together and admitted by one `step()`. Returns (the second chunks' and fresh requests,
    prefill passes of that step, that step's outputs)."""
    prompts = []
    for i in range(len(new)):
        p1 = random_prompt(model, FIRST, seed=i)
        engine.submit(p1, fixed(FRAMES, seed=i), f"a{i}", sequence=f"s{i}")
        codes, _ = run_to_completion(engine)
        tail = random_prompt(model, new[i], seed=10 + i, semantic_every=None)
        prompts.append(torch.cat([p1, frame_columns(model, codes[f"a{i}"]), tail]))
    requests = [
        engine.submit(p, fixed(4, seed=20 + i), f"b{i}", sequence=f"s{i}") for i, p in enumerate(prompts)
    ]
    requests += [
        engine.submit(random_prompt(model, 7 + 5 * j, seed=30 + j), fixed(4), f"f{j}") for j in range(fresh)
    ]
    assert [r.cached for r in requests] == [HELD] * len(new) + [0] * fresh
    passes = engine.runner.prefill_passes
    outputs = engine.step()  # all admitted (max_batch rows), prefilled, one frame
    return requests, engine.runner.prefill_passes - passes, outputs


def prompt_kv(engine, request) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[layers, T, kv_heads, head_dim]` of the request's prompt positions 0 .. T - 1 (T: the
    prompt's columns but its last), read through its block table."""
    T = request.prompt.shape[0] - 1
    slots = engine.kv.slots_for_positions(torch.tensor(request.blocks), torch.arange(T))
    k, v = engine.kv.k, engine.kv.v
    return (
        k.view(k.shape[0], -1, *k.shape[-2:])[:, slots].clone(),
        v.view(v.shape[0], -1, *v.shape[-2:])[:, slots].clone(),
    )


def run(model, packed: bool, fresh: int = 0, new=NEW):
    """(K/V of every request after the admitting step, codes of every request, passes of that step,
    the requests)."""
    engine = make_engine(model, max_batch=len(new) + fresh, packed_prefill=packed)
    requests, passes, outputs = second_chunks(engine, model, new, fresh)
    assert engine.num_running == len(requests)
    kv = {r.request_id: prompt_kv(engine, r) for r in requests}
    later, reasons = run_to_completion(engine)
    assert all(reasons[r.request_id] == FinishReason.LENGTH for r in requests)
    first = {o.request_id: o.codes for o in outputs}
    codes = {r.request_id: torch.cat([first[r.request_id], later[r.request_id]]) for r in requests}
    return kv, codes, passes, requests


def assert_same_kv(a: dict, b: dict, exact: bool = False) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid], b[rid], strict=True):
            if exact:
                assert torch.equal(x, y), rid
            else:
                torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def one_by_one(tiny_model):
    """The reference: packing off, every extension prefilled alone."""
    return run(tiny_model, packed=False)


def test_later_chunks_admitted_together_prefill_in_one_packed_pass_with_the_kv_and_codes_of_one_by_one(
    tiny_model, one_by_one
):
    kv, codes, passes, requests = run(tiny_model, packed=True)
    ref_kv, ref_codes, ref_passes, _ = one_by_one
    assert (passes, ref_passes) == (1, len(NEW))
    assert [r.prefill_tokens for r in requests] == list(NEW)
    assert_same_kv(ref_kv, kv)
    for rid in ref_codes:
        assert torch.equal(codes[rid], ref_codes[rid]), rid


@pytest.mark.parametrize(
    ("bound", "value", "passes"),
    [
        # new columns 9 + 1 fit 16, + 12 does not; 12 + 6 does not: [9, 1], [12], [6]
        ("PACKED_PREFILL_TOKENS", 16, 3),
        # new columns x keys: [9, 1] 10 x (33 + 25) = 580; + 12: 22 x 94 = 2068; [12, 6]: 18 x 66 = 1188
        ("PACKED_EXTEND_MASK_ELEMENTS", 1200, 2),
        ("PACKED_EXTEND_MASK_ELEMENTS", 1000, 3),
        # keys: 33 + 25 fit 70, + 36 do not; 36 + 30 do: [9, 1], [12, 6]
        ("PACKED_EXTEND_KEYS", 70, 2),
        ("PACKED_EXTEND_KEYS", 60, 3),
    ],
)
def test_a_pass_holds_at_most_the_bound_and_the_kv_stay_those_of_one_by_one(
    tiny_model, one_by_one, monkeypatch, bound, value, passes
):
    monkeypatch.setattr(mr if bound == "PACKED_PREFILL_TOKENS" else sequences, bound, value)
    kv, _, got, _ = run(tiny_model, packed=True)
    assert got == passes
    assert_same_kv(one_by_one[0], kv)


def test_fresh_and_continuing_requests_admitted_together_are_packed_separately(tiny_model):
    """Two fresh requests and four continuing sessions in one iteration: one packed pass each (2), where
    one by one takes 6; every request's K/V equal."""
    kv, codes, passes, requests = run(tiny_model, packed=True, fresh=2)
    ref_kv, ref_codes, ref_passes, _ = run(tiny_model, packed=False, fresh=2)
    assert (passes, ref_passes) == (2, len(NEW) + 2)
    assert_same_kv(ref_kv, kv)
    assert all(codes[rid].shape[0] == 4 for rid in ref_codes)


def test_a_failed_packed_pass_falls_back_to_one_by_one_and_a_bad_prompt_fails_alone(tiny_model, monkeypatch):
    """The packed pass raises: every session is prefilled alone, and the one whose own prefill then
    raises (a bad prompt) ends with an error and gives its history up; the others go on with exactly
    the K/V and codes of the engine that never packs (where the same prompt fails alike)."""
    calls = []

    def failing_pass(runner, group, varlen):
        calls.append(len(group))
        raise RuntimeError("injected packed extension failure")

    original = sequences.prefill_extend

    def extend(runner, prompt, table, start):
        if prompt.shape[0] - 1 - start == NEW[2]:  # session 2's chunk: its prompt is "bad"
            raise ValueError("injected bad prompt")
        return original(runner, prompt, table, start)

    monkeypatch.setattr(sequences, "_extend_pass", failing_pass)
    monkeypatch.setattr("tts.engine.engine.prefill_extend", extend)
    runs = {}
    for packed in (False, True):
        engine = make_engine(tiny_model, max_batch=len(NEW), packed_prefill=packed)
        requests, passes, outputs = second_chunks(engine, tiny_model)
        assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [
            ("b2", FinishReason.ERROR)
        ]
        assert "injected bad prompt" in next(o.error for o in outputs if o.finished)
        assert engine.num_running == len(NEW) - 1 and passes == len(NEW) - 1
        assert engine.sequence_blocks("s2") == 0  # (a failed request gives its whole sequence up)
        kv = {r.request_id: prompt_kv(engine, r) for r in requests if r.request_id != "b2"}
        later, reasons = run_to_completion(engine)
        assert all(reasons[rid] == FinishReason.LENGTH for rid in kv)
        first = {o.request_id: o.codes for o in outputs}
        codes = {rid: torch.cat([first[rid], later[rid]]) for rid in kv}
        assert all(c.shape[0] == 4 for c in codes.values())
        runs[packed] = kv, codes
    assert calls == [len(NEW)]  # (the engine that packs tried once)
    assert_same_kv(runs[False][0], runs[True][0], exact=True)
    for rid in runs[False][0]:
        assert torch.equal(runs[True][1][rid], runs[False][1][rid]), rid


def test_packed_extension_writes_only_the_new_positions(tiny_model):
    """The packed pass writes the K/V of the new positions only: every other slot of the pool keeps its
    value (the cached prefixes are read, not rewritten)."""
    engine = make_engine(tiny_model, max_batch=len(NEW), packed_prefill=True)
    runner, alloc = engine.runner, engine.scheduler.allocator
    prefixes = [random_prompt(tiny_model, HELD + 1, seed=i) for i in range(2)]
    tables = [alloc.allocate(blocks_needed(HELD + n, BS)) for n in (5, 3)]
    for p, t in zip(prefixes, tables, strict=True):
        runner.prefill(p, t)
    before = engine.kv.k.clone(), engine.kv.v.clone()
    prompts = [
        torch.cat([p[:-1], random_prompt(tiny_model, n + 1, seed=9)])
        for p, n in zip(prefixes, (5, 3), strict=True)
    ]
    assert (
        sequences.prefill_extend_packed(runner, [(p, t, HELD) for p, t in zip(prompts, tables, strict=True)])
        == 0
    )
    written = torch.zeros(engine.kv.k.shape[1] * BS, dtype=torch.bool)
    for p, t in zip(prompts, tables, strict=True):
        written[engine.kv.slots_for_positions(torch.tensor(t), torch.arange(HELD, p.shape[0] - 1))] = True
    for cache, old in zip((engine.kv.k, engine.kv.v), before, strict=True):
        flat, old = (
            cache.view(cache.shape[0], -1, *cache.shape[-2:]),
            old.view(old.shape[0], -1, *old.shape[-2:]),
        )
        assert torch.equal(flat[:, ~written], old[:, ~written])
        assert not torch.equal(flat[:, written], old[:, written])


@pytest.mark.cuda
def test_packed_extension_on_cuda_matches_one_by_one_in_bf16():
    """On the GPU: sessions' extensions prefilled packed (flash varlen with separate key lengths where
    this torch has it, and the masked SDPA pass in any case) write the K/V that `prefill_extend` of each
    alone writes, to bf16 rounding (other matrix shapes and kernels). A causal mask aligned to the top
    left (a new column not seeing the whole cached prefix), a wrong position or slot gives errors of
    the values' own size."""
    from tts.engine import Engine, EngineConfig
    from tts.model.shapes import build_random_model, shape_config
    from tts.model.transformer import varlen_causal_available

    model = build_random_model(shape_config("small-s2-shape"), "cuda", torch.bfloat16, seed=0)
    engine = Engine(
        model, EngineConfig(max_batch=8, block_size=16, ignore_eos=True, graphs="off", prefill_graphs="off")
    )
    runner, alloc = engine.runner, engine.scheduler.allocator
    cached, new = (37, 50, 120, 64, 16), (5, 2, 30, 17, 40)
    prompts = [
        random_prompt(model, c + n + 1, seed=i, text_high=50_000)
        for i, (c, n) in enumerate(zip(cached, new, strict=True))
    ]
    # alone: prefill_extend each; packed: as the engine calls it (varlen where available); then each kind of
    # packed pass forced
    arms: dict[str, bool | None] = {"alone": None, "packed": None, "mask": False}
    varlen = varlen_causal_available(runner.device, torch.bfloat16, model.config.head_dim, cached_prefix=True)
    if varlen:
        arms["varlen"] = True
    print(f"flash varlen with a cached prefix available: {varlen}")
    kv = {}
    for arm, use_varlen in arms.items():
        tables = [alloc.allocate(blocks_needed(p.shape[0], 16)) for p in prompts]
        for p, t, c in zip(prompts, tables, cached, strict=True):
            runner.prefill(p[: c + 1], t)  # the cached prefix: positions 0 .. c - 1
        group = list(zip(prompts, tables, cached, strict=True))
        if arm == "alone":
            for p, t, c in group:
                sequences.prefill_extend(runner, p, t, c)
        elif arm == "packed":
            assert sequences.prefill_extend_packed(runner, group) == 0  # (none alone: one pass)
        else:
            sequences._extend_pass(runner, group, bool(use_varlen))
        torch.cuda.synchronize()
        kv[arm] = {}  # the new positions' K/V only (the prefixes' are the same prefill's in every arm)
        for i, (p, t, c) in enumerate(zip(prompts, tables, cached, strict=True)):
            slots = engine.kv.slots_for_positions(
                torch.tensor(t, device="cuda"), torch.arange(c, p.shape[0] - 1, device="cuda")
            )
            kv[arm][i] = [
                x.view(x.shape[0], -1, *x.shape[-2:])[:, slots].float() for x in (engine.kv.k, engine.kv.v)
            ]
    for arm in arms:
        if arm == "alone":
            continue
        for i in kv["alone"]:
            for a, b in zip(kv["alone"][i], kv[arm][i], strict=True):
                assert a.abs().sum() > 0
                rel_rms = float((b - a).pow(2).mean().sqrt() / a.pow(2).mean().sqrt())
                worst = float((b - a).abs().max())
                print(
                    f"{arm} vs alone, sequence {i}: relative RMS {rel_rms:.3g}, max |difference| {worst:.3g}"
                )
                assert rel_rms < 1e-2 and worst < 0.125, (arm, i)
