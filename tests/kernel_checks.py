"""Checks of the Triton kernels against their torch references, run on CPU through Triton's
interpreter. Executed by tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1 and
TTS_FUSED_KERNELS=interpret (both must be set before Triton is imported). The same kernels are
checked on the GPU by tests/test_cuda_graphs.py."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import tts.model.kernels as K  # noqa: E402
from tts.model.kernels.fused import add_rmsnorm, qk_norm_rope, rmsnorm, silu_mul  # noqa: E402
from tts.model.kernels.paged_attention import triton_paged_decode_attention  # noqa: E402
from tts.model.kernels.sampling import triton_sample, triton_sample_main_token  # noqa: E402
from tts.model.kv_cache import paged_decode_attention  # noqa: E402
from tts.model.layers import RMSNorm, apply_rotary_emb, precompute_freqs_cis  # noqa: E402
from tts.model.sampling import RowParams, sample, sample_main_token  # noqa: E402


def check_paged_attention():
    torch.manual_seed(0)
    H, Hkv, D, bs, NB = 8, 2, 16, 4, 30
    kc, vc = torch.randn(NB, bs, Hkv, D), torch.randn(NB, bs, Hkv, D)
    tables = torch.randint(1, NB, (4, 80), dtype=torch.int32)  # 320 tokens: five 64-token chunks
    lens = torch.tensor([1, 7, 200, 320])  # one token, inside a block, a partial last chunk, the full table
    q = torch.randn(4, H, D)
    ref = paged_decode_attention(q, kc, vc, tables, lens, D**-0.5)
    # one program per row, two and eight sharing a row's chunks round-robin (more programs than chunks:
    # some find none), and the automatic choice
    for splits in (1, 2, 8, None):
        out = triton_paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, splits=splits)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # KV blocks larger than a chunk (128 tokens a block, 64 a chunk)
    kc, vc = torch.randn(6, 128, Hkv, D), torch.randn(6, 128, Hkv, D)
    tables = torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32)
    lens = torch.tensor([65, 300])
    q = torch.randn(2, H, D)
    ref = paged_decode_attention(q, kc, vc, tables, lens, D**-0.5)
    for splits in (1, 4):
        out = triton_paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, splits=splits)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def check_norms_rope_silu():
    torch.manual_seed(1)
    x, r, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    m = RMSNorm(40, 1e-6)
    m.weight.data = w
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), m(x))
    normed, h = add_rmsnorm(x, r, w, 1e-6)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(normed, m(x + r))
    qkv = torch.randn(2, (4 + 2 * 2) * 16)
    freqs = precompute_freqs_cis(32, 16, 1e4)[torch.tensor([3, 17])]
    qw, kw = torch.randn(16), torch.randn(16)
    q, k, v = qk_norm_rope(qkv, 4, 2, 16, freqs, qw, kw, 1e-6)
    qr, kr, vr = qkv.view(2, 1, -1).split([64, 32, 32], -1)
    qn, kn = torch.nn.RMSNorm(16, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    qn.weight.data, kn.weight.data = qw, kw
    f = freqs.unsqueeze(1)
    torch.testing.assert_close(q, apply_rotary_emb(qn(qr.view(2, 1, 4, 16)), f))
    torch.testing.assert_close(k, apply_rotary_emb(kn(kr.view(2, 1, 2, 16)), f))
    torch.testing.assert_close(v, vr.view(2, 1, 2, 16))
    a = torch.randn(3, 100)
    torch.testing.assert_close(silu_mul(a), torch.nn.functional.silu(a[:, :50]) * a[:, 50:])


def check_sampler():
    torch.manual_seed(2)
    B, V = 6, 37
    logits = torch.randn(B, V) * 3
    logits[5] = 0.0
    logits[5, 4] = 1.0  # ties: order by token id
    t = torch.tensor([0.0, 0.5, 1.0, 0.8, 1.2, 1.0])
    p = torch.tensor([1.0, 0.9, 0.5, 0.8, 1.0, 0.5])
    k = torch.tensor([0, 5, 0, 30, 1, 0])
    window = torch.randint(0, V, (B, 10))
    wl = torch.tensor([10, 0, 5, 10, 10, 3])
    for s in range(3):
        seeds, steps = torch.arange(B) * 1000 + s, torch.full((B,), s)
        assert torch.equal(
            sample(logits, RowParams(t, p, k, seeds, steps), 3),
            triton_sample(logits, t, p, k, seeds, steps, 3),
        )
        a = sample_main_token(logits, RowParams(t, p, k, seeds, steps), window, wl, V - 1, 11)
        b = triton_sample_main_token(logits, t, p, k, seeds, steps, window, wl, V - 1, 11)
        assert torch.equal(a, b)
        # the top-k fast path (bf16 logits, every row 0 < top_k <= cap) gives the full sort's draws,
        # ties included (row 5 is all ties but one)
        kk = torch.tensor([3, 5, 8, 30, 1, 16])
        lb = logits.to(torch.bfloat16)
        full = sample(lb, RowParams(t, p, kk, seeds, steps), 4)
        assert torch.equal(full, triton_sample(lb, t, p, kk, seeds, steps, 4, top_k_cap=30))
        a = sample_main_token(lb, RowParams(t, p, kk, seeds, steps), window, wl, V - 1, 11)
        b = triton_sample_main_token(lb, t, p, kk, seeds, steps, window, wl, V - 1, 11, top_k_cap=30)
        assert torch.equal(a, b)


def check_snake():
    """The DAC decoder's fused elementwise passes against the torch formula, and the batched decoder
    with them against the same decoder without (the tiny codec, fp32, two calls of ragged rows)."""
    from test_dac_batched import _codec, _codes

    from tts.codec.dac.net import Snake1d
    from tts.model.kernels.snake import add_snake, snake

    torch.manual_seed(2)
    m = Snake1d(6)
    m.alpha.data = torch.rand(1, 6, 1) * 3 + 0.05
    x = torch.randn(3, 6, 1100) * 4  # two blocks of T, the second partial
    sliced = torch.randn(3, 6, 1200)[..., 50:1150]  # a conv output cut along T: rows not contiguous
    bias, res = torch.randn(6), torch.randn(3, 6, 1100)
    with torch.no_grad():
        K.set_fused_kernels(False)
        ref = m(x)
        K.set_fused_kernels(True)
        torch.testing.assert_close(snake(x, m.alpha), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)  # Snake1d takes the kernel
        K.set_fused_kernels(False)
        ref_sliced = m(sliced + bias[:, None])
        ref_sum = sliced + bias[:, None] + res
        ref_next = m(ref_sum)
    torch.testing.assert_close(snake(sliced, m.alpha, bias), ref_sliced, rtol=1e-5, atol=1e-5)
    total, nxt = add_snake(sliced, bias, res, m.alpha)
    torch.testing.assert_close(total, ref_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(nxt, ref_next, rtol=1e-5, atol=1e-5)
    total, none = add_snake(sliced, bias)
    assert none is None
    torch.testing.assert_close(total, sliced + bias[:, None], rtol=1e-6, atol=1e-6)

    codec = _codec()
    outputs = []
    for fused in (False, True):
        K.set_fused_kernels(fused)
        dec = codec.batched_stream(2)
        dec.reset(torch.tensor([0, 1]))
        calls = [(2, [2, 1]), (2, [1, 2])]  # (T, lengths of slots 0 and 1)
        outputs.append(
            [
                dec.decode(
                    torch.tensor([0, 1]),
                    torch.stack([_codes(T, f"s{i}{T}{n}") for i, n in enumerate(lengths)]),
                    torch.tensor(lengths),
                )
                for T, lengths in calls
            ]
        )
    K.set_fused_kernels(True)
    for (_, lengths), plain, fused in zip(calls, *outputs, strict=True):
        for row, n in enumerate(lengths):
            n *= codec.frame_length
            torch.testing.assert_close(fused[row, :n], plain[row, :n], rtol=0, atol=2e-5)


def check_quant_linear():
    """The weight-only fp8 / int8 kernels (both: small M and tensor-core tiles; K a multiple of the
    block and not; with and without bias) against `reference_linear` (fp32 activations: the two differ
    only in summation order)."""
    from tts.model.kernels.wquant import GEMV_MAX_ROWS, quant_linear
    from tts.model.quant import quantize_weight, reference_linear

    torch.manual_seed(3)
    for fmt in ("fp8", "int8"):
        for M, N, Kd in ((1, 10, 64), (3, 37, 80), (GEMV_MAX_ROWS + 1, 70, 96), (20, 40, 130), (33, 130, 64)):
            q, scale = quantize_weight(torch.randn(N, Kd), fmt)
            x = torch.randn(M, Kd)
            for bias in (None, torch.randn(N)):
                ref = reference_linear(x, q, scale, bias)
                torch.testing.assert_close(quant_linear(x, q, scale, bias), ref, rtol=1e-5, atol=1e-4)
        # a config's num_stages (the interpreter ignores it: this checks that the 5-tuple reaches the
        # kernel; tests/test_quant.py runs the kernel on the GPU)
        q, scale = quantize_weight(torch.randn(12, 96), fmt)
        x = torch.randn(2, 96)
        for bk in (32, 64):  # K a multiple of the block and not
            out = quant_linear(x, q, scale, config=(2, 4, bk, 4, 1))
            torch.testing.assert_close(out, reference_linear(x, q, scale), rtol=1e-5, atol=1e-4)
        # leading dimensions and 16-bit activations: one rounding (the kernel's) against two (the
        # reference's product, then its scaled value): within 2 bf16 ulps. The tensor-core path in
        # fp16 only: this interpreter's tl.dot of bf16 operands returns garbage (a plain bf16 dot
        # kernel too); tests/test_quant.py checks it in bf16 on the GPU.
        q, scale = quantize_weight(torch.randn(24, 48), fmt)
        for rows, dtype in ((2, torch.bfloat16), (GEMV_MAX_ROWS + 3, torch.float16)):
            x = torch.randn(rows, 1, 48).to(dtype)
            out = quant_linear(x, q, scale)
            assert out.shape == (rows, 1, 24) and out.dtype == dtype
            torch.testing.assert_close(out, reference_linear(x, q, scale), rtol=2 * 2**-8, atol=1e-2)


def check_engine_end_to_end():
    """The whole frame step with every kernel on gives the torch path's codes (fp32)."""
    from helpers import params, random_prompt, run_to_completion

    import tts.model.kernels.fused as fused_module
    from tts.checkpoints.bundle import build_tiny_bundle
    from tts.engine import Engine, EngineConfig

    results = []
    destinations = []  # the fused decode writes K/V straight into the caches (slow and fast)
    qk_norm_rope_kernel = fused_module.qk_norm_rope

    def recording(*args, kv_dest=None, **kwargs):
        destinations.append(kv_dest is not None)
        return qk_norm_rope_kernel(*args, kv_dest=kv_dest, **kwargs)

    fused_module.qk_norm_rope = recording
    for fused in (False, True):
        K.set_fused_kernels(fused)
        model = build_tiny_bundle().model
        if fused:
            model.fuse_weights()
        engine = Engine(
            model, EngineConfig(max_batch=2, graphs="off", attention_backend="triton" if fused else "torch")
        )
        for i in range(2):
            engine.submit(random_prompt(model, 6 + 9 * i, i + 1), params(max_new_frames=3, seed=i), f"r{i}")
        results.append(run_to_completion(engine)[0])
    fused_module.qk_norm_rope = qk_norm_rope_kernel
    for rid in results[0]:
        assert torch.equal(results[0][rid], results[1][rid]), rid
    assert destinations and all(destinations), "a fused decode step did not write its K/V directly"


def check_quant_engine():
    """A tiny model with fp8 weights: the frame step with every kernel on (the quantized linears'
    included) gives the torch path's codes, and its quantized layers ran through the kernel."""
    from helpers import params, random_prompt, run_to_completion

    import tts.model.kernels.wquant as wquant
    from tts.checkpoints.bundle import build_tiny_bundle
    from tts.engine import Engine, EngineConfig
    from tts.model.quant import quantize_model

    calls = []
    kernel = wquant.quant_linear

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    wquant.quant_linear = counting
    results = []
    for fused in (False, True):
        K.set_fused_kernels(fused)
        model = build_tiny_bundle().model
        quantize_model(model, "fp8")
        engine = Engine(
            model, EngineConfig(max_batch=2, graphs="off", attention_backend="triton" if fused else "torch")
        )
        for i in range(2):
            engine.submit(random_prompt(model, 6 + 9 * i, i + 1), params(max_new_frames=3, seed=i), f"r{i}")
        results.append(run_to_completion(engine)[0])
        assert bool(calls) == fused
    wquant.quant_linear = kernel
    K.set_fused_kernels(True)
    for rid in results[0]:
        assert torch.equal(results[0][rid], results[1][rid]), rid


if __name__ == "__main__":
    check_paged_attention()
    check_norms_rope_silu()
    check_sampler()
    check_snake()
    check_engine_end_to_end()
    check_quant_linear()
    check_quant_engine()
    print("kernel checks passed")
