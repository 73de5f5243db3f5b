import math

import torch
import torch.nn.functional as F
from helpers import random_prompt

from tts.checkpoints.bundle import build_tiny_bundle
from tts.engine import Engine, EngineConfig
from tts.engine.model_runner import RowInit


def _load(engine, row, prompt):
    blocks = engine.scheduler.allocator.allocate(8)
    engine.runner.prefill(prompt, blocks)
    engine.runner.load_row(
        row,
        RowInit(
            prompt[-1],
            prompt.shape[0] - 1,
            blocks,
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            seed=0,
            budget=100,
            ras_len=0,
        ),
    )


@torch.inference_mode()
def test_decode_step_logits_match_full_sequence_forward(tiny_model):
    """Paged prefill + one paged decode step == the dense full-sequence forward at the last position."""
    engine = Engine(tiny_model, EngineConfig(max_batch=4, graphs="off", block_size=4))
    prompts = [random_prompt(tiny_model, n, seed=n) for n in (5, 17, 33)]
    for row, p in enumerate(prompts):
        _load(engine, row, p)
    _, h_post = engine.runner.slow_step(3)
    logits = F.linear(h_post, tiny_model.lm_head_weight())
    for row, p in enumerate(prompts):
        ref_logits, _ = tiny_model(p.unsqueeze(0))
        torch.testing.assert_close(logits[row], ref_logits[0, -1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_greedy_frame_codes_are_the_argmax_of_the_teacher_forced_fast_ar(tiny_model):
    """The fast AR loop in the frame step predicts codebook k from codes 0..k-1 exactly as the teacher-forced
    training forward does (the layout of docs/fish_dual_ar.md §1.3), and c_0 = token - semantic_begin."""
    c = tiny_model.config
    engine = Engine(tiny_model, EngineConfig(max_batch=2, graphs="off"))
    for seed in range(20):  # find a prompt whose greedy frame is audio, not the end token
        prompt = random_prompt(tiny_model, 9, seed=seed)
        _load(engine, 0, prompt)
        engine.runner.decode_step(1)
        frame = engine.runner.buffers.out[0, engine.runner.out_layout.frame].clone()
        if frame[0] != c.eos_token_id:
            break
    assert frame[0] != c.eos_token_id
    assert frame[1] == frame[0] - c.semantic_begin_id
    slow_logits, fast_logits = tiny_model(torch.cat([prompt, frame.unsqueeze(0)]).unsqueeze(0))
    allowed = list(range(c.semantic_begin_id, c.semantic_end_id + 1)) + [c.eos_token_id]
    assert int(frame[0]) == allowed[int(slow_logits[0, -2, allowed].argmax())]
    for k in range(1, c.num_codebooks):
        assert int(frame[1 + k]) == int(fast_logits[0, -2, k].argmax())


def test_embedding_scales_only_semantic_positions(tiny_model):
    c = tiny_model.config
    frames = torch.zeros(1, 2, 1 + c.num_codebooks, dtype=torch.int64)
    frames[0, 0, 0] = 65  # a text token: codes ignored even if non-zero
    frames[0, 0, 1:] = 3
    frames[0, 1, 0] = c.semantic_begin_id + 5
    frames[0, 1, 1:] = torch.tensor([5, 1, 2, 3])
    x = tiny_model.embed(frames)
    torch.testing.assert_close(x[0, 0], tiny_model.embeddings.weight[65])
    cb = sum(
        tiny_model.codebook_embeddings.weight[int(frames[0, 1, 1 + i]) + i * c.codebook_size]
        for i in range(4)
    )
    expected = (tiny_model.embeddings.weight[c.semantic_begin_id + 5] + cb) / math.sqrt(c.num_codebooks + 1)
    torch.testing.assert_close(x[0, 1], expected)


def test_head_dims_the_triton_kernels_cannot_tile_use_the_torch_path():
    from tts.model.config import ModelArgs
    from tts.model.kernels import kernel_head_dim_ok
    from tts.model.transformer import DualARTransformer

    assert kernel_head_dim_ok(128) and kernel_head_dim_ok(16)
    assert not kernel_head_dim_ok(80) and not kernel_head_dim_ok(8)
    args = ModelArgs(
        vocab_size=64, n_layer=1, n_head=2, dim=160, head_dim=80, semantic_begin_id=40, semantic_end_id=47
    )
    m = DualARTransformer(args)
    assert not m.layers[0].attention.fusable


def test_joint_qk_norm_and_rope_is_bit_exact_to_separate_heads():
    """The CPU frame step norms and rotates q and k heads as one tensor, with the RoPE pair swap as
    one gather (`cpu_decode._qkv`); the module norms and rotates them separately (`nn.RMSNorm`, a
    flip). Same per-head math, so the same bits (fp32, CPU)."""
    from tts.engine.cpu_decode import BlockWeights, _qkv
    from tts.model.layers import Rope, precompute_freqs_cis
    from tts.model.transformer import Attention

    torch.manual_seed(3)
    attn = Attention(96, 6, 2, 16, qkv_bias=False, o_bias=False, qk_norm=True, eps=1e-6).eval()
    with torch.no_grad():
        attn.q_norm.weight.normal_(1, 0.2)
        attn.k_norm.weight.normal_(1, 0.2)
    table = precompute_freqs_cis(40, 16)[torch.tensor([3, 17, 39])].unsqueeze(1)  # [B, 1, D/2, 2]
    x = torch.randn(3, 96)
    w = BlockWeights(
        attention_norm=torch.ones(96),
        wqkv=attn.wqkv.weight,
        wqkv_bias=None,
        qk_norm=attn.qk_norm_weight,
        wo=attn.wo.weight,
        wo_bias=None,
        ffn_norm=torch.ones(96),
        w13=torch.zeros(2, 96),  # (unused by _qkv)
        w2=torch.zeros(96, 1),
        n_head=6,
        n_kv=2,
        head_dim=16,
        eps=1e-6,
    )
    with torch.inference_mode():
        q, k, v = attn._split_norm_rotate(attn.wqkv(x.unsqueeze(1)), table)
        cos, sin = Rope(table).factors()
        q1, k1, v1 = _qkv(w, x, cos[:, 0], sin[:, 0])
    assert torch.equal(q[:, 0], q1) and torch.equal(k[:, 0], k1) and torch.equal(v[:, 0], v1)


def test_cpu_decode_layout_keeps_every_value_and_the_logits():
    """The CPU decode layout (fused w1/w3, column-major wide projections) changes strides only: the
    state dict keeps its keys and values, and the teacher-forced logits stay within fp32 rounding."""
    model = build_tiny_bundle().model  # not the shared fixture: earlier engines already laid it out
    prompt = random_prompt(model, 12, seed=3).unsqueeze(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        ref_slow, ref_fast = model(prompt)
    model.use_cpu_decode_layout()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    wqkv = model.layers[0].attention.wqkv.weight
    assert wqkv.stride() == (1, wqkv.shape[0])  # [out, in] stored as a contiguous [in, out]
    ff = model.layers[0].feed_forward
    assert ff.w1.weight.data_ptr() == ff.w13.data_ptr()  # w1 and w3 are views of the fused matrix
    with torch.inference_mode():
        slow, fast = model(prompt)
    torch.testing.assert_close(slow, ref_slow, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, ref_fast, rtol=1e-5, atol=1e-5)


def test_a_cpu_engine_made_under_inference_mode_leaves_the_model_trainable():
    """The layout is built outside inference mode (weights made inside it could not be trained), and
    with autograd on, the feed-forward uses w1 and w3 themselves, so their gradients arrive."""
    model = build_tiny_bundle().model
    with torch.inference_mode():
        Engine(model, EngineConfig(max_batch=1, graphs="off"))
    slow, _ = model(random_prompt(model, 6, seed=1).unsqueeze(0))
    slow.sum().backward()
    assert model.layers[0].feed_forward.w1.weight.grad is not None


def test_cpu_layout_of_a_model_fused_row_major_refuses_column_major():
    """`fuse_weights()` (CUDA's row-major w13) first, then the CPU layout: w1 and w3 stay views of one
    column-major w13 (not re-laid separately, which would leave a stale w13 behind)."""
    model = build_tiny_bundle().model
    model.fuse_weights()
    model.use_cpu_decode_layout()
    ff = model.layers[0].feed_forward
    assert not ff.w13.is_contiguous() and ff.fused_w13() is ff.w13
    assert ff.w1.weight.data_ptr() == ff.w13.data_ptr()


def test_a_laid_out_model_converted_or_reloaded_uses_its_new_weights():
    """`.to()` and `load_state_dict(assign=True)` give w1/w3 new storage: the stale fused copy must not
    be used any more (it raised a dtype error, or silently kept the old weights)."""
    model = build_tiny_bundle().model
    prompt = random_prompt(model, 8, seed=2).unsqueeze(0)
    model.use_cpu_decode_layout()
    other = build_tiny_bundle(seed=1).model
    model.load_state_dict(other.state_dict(), assign=True)
    with torch.no_grad():
        torch.testing.assert_close(model(prompt)[0], other(prompt)[0], rtol=1e-5, atol=1e-5)
        half = model.to(torch.bfloat16)
        assert half(prompt)[0].dtype == torch.bfloat16
