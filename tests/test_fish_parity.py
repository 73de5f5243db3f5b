"""Parity with fish-speech on tiny random checkpoints in the real on-disk formats.

The goldens in tests/golden were produced by running fish-speech itself (main for S2, d3df505 for S1,
v1.5.1 for 1.5) on checkpoints written by `tts.checkpoints.fish.write_checkpoint` from the same seeds;
README.md there says exactly how. Here the same checkpoints are regenerated (bit-identical: the weights are a
pure function of the seed) and loaded through our loaders.
"""

import pytest
import torch
from fish_golden import CASES, golden, prompt_inputs

from tts.checkpoints.fish.loader import FAMILIES, load_fish_model
from tts.engine import Engine, EngineConfig, SamplingParams
from tts.model.transformer import DualARTransformer

FAMILY_KEYS = {"s2": "s2-pro", "s1": "s1", "fish-1.5": "fish-1.5"}
GOLDEN_FILES = {"s2": "fish_s2", "s1": "fish_s1", "fish-1.5": "fish_15"}


@pytest.fixture(scope="module")
def loaded(fish_checkpoints):
    """family -> (model fp32, tokenizer, prompt format, golden tensors)."""
    out = {}
    for fam, key in FAMILY_KEYS.items():
        model, tokenizer, family = load_fish_model(fish_checkpoints[fam], "cpu", torch.float32)
        assert family == key
        fmt = FAMILIES[key].prompt_format(tokenizer, model.config.num_codebooks)
        out[fam] = (model, tokenizer, fmt, golden(GOLDEN_FILES[fam]))
    return out


def _prompt(fam, name, loaded):
    model, _, fmt, _ = loaded[fam]
    spec = CASES["families"][fam]
    case = next(c for c in spec["prompts"] if c["name"] == name)
    c = model.config
    text, refs, hist = prompt_inputs(case, c.num_codebooks, c.codebook_size, spec["residual_high"])
    return fmt.build(text, refs, hist)


PROMPT_CASES = [(fam, c["name"]) for fam, spec in CASES["families"].items() for c in spec["prompts"]]
GEN_CASES = [(fam, name) for fam, spec in CASES["families"].items() for name in spec["generate"]]


@pytest.mark.parametrize("fam,name", PROMPT_CASES)
def test_prompt_token_ids_identical_to_reference(fam, name, loaded):
    ours = _prompt(fam, name, loaded)
    ref = loaded[fam][3][f"prompt_{name}"].long()
    assert ours.shape == ref.shape, f"{fam}/{name}: {tuple(ours.shape)} vs reference {tuple(ref.shape)}"
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("fam,name", GEN_CASES)
def test_prefill_logits_match_reference_fp32(fam, name, loaded):
    model: DualARTransformer = loaded[fam][0]
    ref = loaded[fam][3][f"logits_{name}"]
    logits, _ = model(_prompt(fam, name, loaded).unsqueeze(0))
    ours = logits[0, -1]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    c = model.config
    allowed = list(range(c.semantic_begin_id, c.semantic_end_id + 1)) + [c.eos_token_id]
    assert int(ours[allowed].argmax()) == int(ref[allowed].argmax())


def greedy_frames(
    model: DualARTransformer,
    prompt: torch.Tensor,
    n: int,
    repetition: str | None = None,
    penalty: float = 1.0,
) -> torch.Tensor:
    """Generate with our engine (eager, greedy, no RAS); returns `[n, N]` codes."""
    cfg = EngineConfig(
        max_batch=1, graphs="off", num_blocks=1 + (prompt.shape[0] + n) // 16 + 4, repetition=repetition
    )
    engine = Engine(model, cfg)
    request = engine.submit(
        prompt,
        SamplingParams(
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            max_new_frames=n,
            ras_window=0,
            seed=0,
            repetition_penalty=penalty,
        ),
    )
    codes, finished = [], False
    while not finished:
        for out in engine.step():
            assert out.request_id == request.request_id
            if out.codes.numel():
                codes.append(out.codes)
            finished = out.finished
    return torch.cat(codes)


@pytest.mark.parametrize("fam,name", GEN_CASES)
def test_greedy_frames_identical_to_reference_fp32(fam, name, loaded):
    model = loaded[fam][0]
    ref = loaded[fam][3][f"frames_{name}"].long()  # [frames, 1 + N]: token, c_0 .. c_{N-1}
    n = CASES["families"][fam]["frames"]
    codes = greedy_frames(model, _prompt(fam, name, loaded), n)
    assert codes.shape == (n, model.config.num_codebooks)
    assert torch.equal(codes, ref[:, 1:]), (
        f"first differing frame: {int((codes != ref[:, 1:]).any(1).nonzero()[0])}"
    )
    assert torch.equal(ref[:, 0], codes[:, 0] + model.config.semantic_begin_id)


REP_CASES = [(fam, name) for fam, spec in CASES["repetition"].items() for name in spec["cases"]]


@pytest.mark.parametrize("fam,name", REP_CASES)
def test_greedy_frames_with_repetition_penalty_identical_to_reference(fam, name, loaded):
    # fish-speech's own generate() with its 16-frame penalty (1.2 for 1.5, 1.1 for S1; README in golden/).
    spec = CASES["repetition"][fam]
    model = loaded[fam][0]
    ref = golden(spec["golden"])[f"frames_rp_{name}"].long()
    n = spec["frames"]
    codes = greedy_frames(
        model, _prompt(fam, name, loaded), n, FAMILIES[FAMILY_KEYS[fam]].repetition, spec["penalty"]
    )
    assert codes.shape == (n, model.config.num_codebooks)
    assert torch.equal(codes, ref[:, 1:]), (
        f"first differing frame: {int((codes != ref[:, 1:]).any(1).nonzero()[0])}"
    )
    # The penalty changes the frames: without it they differ from the reference's penalized ones.
    plain = greedy_frames(model, _prompt(fam, name, loaded), n, None)
    assert not torch.equal(plain, ref[:, 1:])
