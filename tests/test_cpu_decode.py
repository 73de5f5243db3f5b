"""tts/engine/cpu_decode.py: the CPU frame step's layers without the modules, bit-identical to them."""

import pytest
import torch
from helpers import params, random_prompt, run_to_completion

from tts.checkpoints.bundle import build_tiny_bundle
from tts.engine import Engine, EngineConfig
from tts.engine.cpu_decode import block_weights, decode_layers, decode_layers_kv_only
from tts.model.layers import Rope
from tts.model.transformer import run_layers, run_layers_kv_only


def _model():
    model = build_tiny_bundle().model
    model.use_cpu_decode_layout()  # what the engine does on a CPU (fused w1/w3)
    return model


@pytest.fixture
def model():
    """Built outside inference mode, as a loaded model is (its weights keep version counters)."""
    return _model()


def _core(q, k, v):
    """A stand-in attention over `[B, H, D]` / `[B, Hkv, D]` that uses all three inputs."""
    g = q.shape[1] // k.shape[1]
    return q * 0.5 + (k * v).repeat_interleave(g, dim=1)


@torch.inference_mode()
def test_decode_layers_equal_the_modules_bit_for_bit(model):
    B, D = 3, model.config.head_dim
    x = torch.randn(B, model.config.dim)
    table = model.freqs_cis[torch.tensor([4, 9, 30])].unsqueeze(1)  # [B, 1, D/2, 2]
    rope = Rope(table)
    cos, sin = rope.factors()  # [B, 1, 1, D]
    written = {"modules": [], "lean": []}

    def module_attend(i):
        def attend(q, k, v):
            written["modules"].append((k[:, 0].clone(), v[:, 0].clone()))
            return _core(q[:, 0], k[:, 0], v[:, 0]).unsqueeze(1)

        return attend

    def lean_attend(i, q, k, v):
        written["lean"].append((k.clone(), v.clone()))
        return _core(q, k, v)

    ref_pre, ref_post = run_layers(model.layers, model.norm, x.unsqueeze(1), rope, module_attend)
    blocks, final = block_weights(model.layers, model.norm)
    pre, post = decode_layers(blocks, final, x, cos[:, 0], sin[:, 0], lean_attend)
    assert cos.shape[-1] == D
    assert torch.equal(pre, ref_pre[:, 0]) and torch.equal(post, ref_post[:, 0])
    for (k0, v0), (k1, v1) in zip(written["modules"], written["lean"], strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@torch.inference_mode()
def test_kv_only_position_writes_the_same_kv(model):
    x = torch.randn(2, model.config.fast_dim)
    rope = Rope(model.fast_freqs_cis[0:1])
    cos, sin = rope.factors()
    got = {"modules": [], "lean": []}

    def module_attend(i):
        return lambda q, k, v: _core(q[:, 0], k[:, 0], v[:, 0]).unsqueeze(1)

    def lean_attend(i, q, k, v):
        return _core(q, k, v)

    run_layers_kv_only(
        model.fast_layers,
        x.unsqueeze(1),
        rope,
        module_attend,
        lambda i, k, v: got["modules"].append((i, k[:, 0], v[:, 0])),
    )
    blocks, _ = block_weights(model.fast_layers, model.fast_norm)
    decode_layers_kv_only(
        blocks, x, cos[0], sin[0], lean_attend, lambda i, k, v: got["lean"].append((i, k, v))
    )
    assert len(got["lean"]) == 1 and got["lean"][0][0] == len(model.fast_layers) - 1
    (_, k0, v0), (_, k1, v1) = got["modules"][0], got["lean"][0]
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_the_cpu_engine_gives_the_modules_codes():
    """End to end: the CPU frame step through cpu_decode gives the codes of its module path, and both
    give the codes of the captured step (`ModelRunner.decode_step`, no CPU caches) run on the CPU."""
    model = build_tiny_bundle().model
    prompts = [random_prompt(model, n, seed=n) for n in (7, 19)]
    codes = {}
    for mode in ("lean", "modules", "captured step"):
        engine = Engine(model, EngineConfig(max_batch=2, graphs="off", block_size=8))
        assert engine.cpu_step is not None and engine.cpu_step.layers is not None
        if mode == "modules":
            engine.cpu_step.layers = None  # what a model cpu_decode does not support gets
        elif mode == "captured step":
            engine.graphs.step_fn = engine.runner.decode_step
        for i, p in enumerate(prompts):
            engine.submit(p, params(max_new_frames=12, seed=i), f"r{i}")
        codes[mode] = run_to_completion(engine)[0]
    for mode in ("modules", "captured step"):
        assert codes[mode].keys() == codes["lean"].keys()
        for rid, got in codes["lean"].items():
            assert got.shape[0] > 0 and torch.equal(got, codes[mode][rid]), (mode, rid)


def test_models_it_does_not_support_use_the_modules():
    model = build_tiny_bundle(dtype=torch.bfloat16).model
    assert block_weights(model.layers, model.norm) is None  # not fp32
    model = _model()
    model.layers[0].ffn_norm.eps = 1e-3  # norms with different eps
    assert block_weights(model.layers, model.norm) is None


@torch.inference_mode()
def test_a_qk_norm_weight_changed_in_place_is_seen(model):
    """BlockWeights asks the attention for its q/k-norm weight each call (the module path rebuilds it
    when either weight changes), so an in-place change after the engine was built takes effect."""
    blocks, final = block_weights(model.layers, model.norm)
    model.layers[0].attention.q_norm.weight.mul_(3.0)
    x = torch.randn(1, model.config.dim)
    rope = Rope(model.freqs_cis[2:3])
    cos, sin = rope.factors()
    ref_pre, _ = run_layers(
        model.layers,
        model.norm,
        x.unsqueeze(1),
        rope,
        lambda i: lambda q, k, v: _core(q[:, 0], k[:, 0], v[:, 0]).unsqueeze(1),
    )
    pre, _ = decode_layers(blocks, final, x, cos[0], sin[0], lambda i, q, k, v: _core(q, k, v))
    assert torch.equal(pre, ref_pre[:, 0])
