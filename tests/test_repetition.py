"""The repetition penalty inside the frame step (fish-speech 1.5 and S1; parity goldens are in
tests/test_fish_parity.py, the captured step in tests/test_cuda_graphs.py)."""

import pytest
import torch
from helpers import random_prompt

from tts.checkpoints.fish.loader import load_fish_model
from tts.engine import Engine, EngineConfig, InvalidRequest, SamplingParams
from tts.engine.model_runner import REPETITION_WINDOW, apply_repetition_penalty


def test_penalty_divides_positive_and_multiplies_negative_logits_once_per_token():
    logits = torch.tensor([[2.0, -2.0, 4.0, 1.0], [1.0, 1.0, -1.0, 3.0]])
    ids = torch.tensor([[0, 1, 0, 9], [-1, 3, 3, 4]])  # repeats count once; -1, 4 and 9 are outside V
    out = apply_repetition_penalty(logits, ids, torch.tensor([[2.0], [4.0]]))
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 4.0, 1.0], [1.0, 1.0, -1.0, 0.75]]))
    assert torch.equal(apply_repetition_penalty(logits, ids, torch.ones(2, 1)), logits)


def test_penalty_rounds_to_the_logits_dtype_like_the_reference():
    logits = torch.tensor([[1.3, -0.7]], dtype=torch.bfloat16)
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), torch.tensor([[1.2]]))
    assert out.dtype == torch.bfloat16
    ref_p = torch.tensor(1.2)  # fish-speech: bf16 logits with a 0-dim float32 penalty
    assert torch.equal(out[0], torch.where(logits[0] < 0, logits[0] * ref_p, logits[0] / ref_p))


def test_repetition_penalty_is_validated():
    for bad in (0.0, -1.0, 2.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequest, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad).validate()
    SamplingParams(repetition_penalty=1.99).validate()


@pytest.fixture(scope="module")
def fish15(fish_checkpoints):
    return load_fish_model(fish_checkpoints["fish-1.5"])[0]


def _prompt(model, n, seed):
    """Text tokens only, anywhere below the semantic range."""
    return random_prompt(model, n, seed, text_high=model.config.semantic_begin_id, semantic_every=None)


def _run(model, jobs, repetition, max_batch=4):
    """jobs: {rid: (prompt, SamplingParams)} submitted together; returns {rid: codes [n, N]}."""
    engine = Engine(model, EngineConfig(max_batch=max_batch, graphs="off", repetition=repetition))
    out = {rid: [] for rid in jobs}
    for rid, (p, params) in jobs.items():
        engine.submit(p, params, rid)
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].append(o.codes)
    return {rid: torch.cat(v) for rid, v in out.items()}


def _params(penalty, seed, frames=2 * REPETITION_WINDOW + 5):
    return SamplingParams(
        temperature=0.9,
        top_p=0.95,
        top_k=0,
        max_new_frames=frames,
        ras_window=0,
        seed=seed,
        repetition_penalty=penalty,
    )


@pytest.mark.parametrize("mode", ["fish-1.5", "s1"])
def test_batched_rows_with_different_penalties_equal_solo_runs(fish15, mode):
    jobs = {f"r{i}": (_prompt(fish15, 9 + 5 * i, i), _params(p, i)) for i, p in enumerate((1.0, 1.2, 1.7))}
    batched = _run(fish15, jobs, mode)
    for rid, job in jobs.items():
        solo = _run(fish15, {rid: job}, mode, max_batch=1)[rid]
        assert torch.equal(batched[rid], solo), rid


def test_penalty_one_and_no_penalty_mode_give_identical_codes_and_the_penalty_changes_them(fish15):
    jobs = {"a": (_prompt(fish15, 12, 3), _params(1.0, 3)), "b": (_prompt(fish15, 7, 4), _params(1.0, 4))}
    off = _run(fish15, jobs, None)
    assert all(torch.equal(off[r], v) for r, v in _run(fish15, jobs, "fish-1.5").items())
    penalized = _run(fish15, {"a": (jobs["a"][0], _params(1.8, 3))}, "fish-1.5")["a"]
    assert not torch.equal(penalized, off["a"])
    # Without a mode the runner ignores the request's penalty (S2 and the default model).
    assert torch.equal(_run(fish15, {"a": (jobs["a"][0], _params(1.8, 3))}, None)["a"], off["a"])


def test_history_is_reset_when_a_row_is_reused(fish15):
    job = (_prompt(fish15, 10, 5), _params(1.5, 5, frames=20))
    engine = Engine(fish15, EngineConfig(max_batch=1, graphs="off", repetition="fish-1.5"))
    runs = []
    for rid in ("first", "second"):
        engine.submit(*job, rid)
        codes = []
        while engine.has_work():
            codes += [o.codes for o in engine.step()]
        runs.append(torch.cat(codes))
    assert torch.equal(runs[0], runs[1])


def test_unknown_mode_is_refused(fish15):
    with pytest.raises(ValueError, match="repetition must be one of"):
        Engine(fish15, EngineConfig(max_batch=1, graphs="off", repetition="dac"))
