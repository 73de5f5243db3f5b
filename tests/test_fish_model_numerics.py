"""Numerics of tts/model.py that bit-exact parity with fish-speech depends on (docs/fish_dual_ar.md §7)."""

import math

import torch

from tts.model.config import ModelArgs
from tts.model.layers import precompute_freqs_cis
from tts.model.transformer import DualARTransformer


def _polar_table(seq_len: int, n_elem: int, base: float) -> torch.Tensor:
    # fish-speech builds the RoPE table as the bf16 rounding of torch.polar(1, angle) (llama.py).
    inv_freq = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    angles = torch.outer(torch.arange(seq_len), inv_freq)
    c = torch.polar(torch.ones_like(angles), angles)
    return torch.stack([c.real, c.imag], dim=-1).to(torch.bfloat16)


def test_rope_table_matches_polar_construction_bit_for_bit():
    # cos/sin computed separately differ from torch.polar in a handful of entries after bf16
    # rounding (2 of 4.2 M for S2's 32768 x 128 table), enough to break bit-exact parity.
    for seq_len, n_elem, base in [(32768, 128, 1e6), (32768, 64, 1e4)]:
        assert torch.equal(precompute_freqs_cis(seq_len, n_elem, base), _polar_table(seq_len, n_elem, base))


def _tiny(**overrides) -> DualARTransformer:
    args = ModelArgs(
        vocab_size=64,
        n_layer=1,
        n_head=2,
        n_local_heads=1,
        head_dim=8,
        dim=16,
        intermediate_size=32,
        max_seq_len=32,
        codebook_size=8,
        num_codebooks=4,
        semantic_begin_id=40,
        semantic_end_id=47,
        n_fast_layer=1,
        **overrides,
    )
    torch.manual_seed(0)
    m = DualARTransformer(args)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=1.0)
    m.init_buffers()
    return m


def test_scaled_codebook_embedding_divides_by_sqrt_n_plus_1_exactly():
    # fish-speech divides the semantic positions' sum by sqrt(N + 1); multiplying by the reciprocal
    # rounds differently in the last bit.
    m = _tiny(scale_codebook_embeddings=True)
    frames = torch.tensor([[[3, 0, 0, 0, 0], [41, 1, 5, 7, 2], [47, 7, 2, 0, 1]]])
    x = m.embed(frames)
    E, C = m.embeddings.weight, m.codebook_embeddings.weight
    assert torch.equal(x[0, 0], E[3])
    for t in (1, 2):
        tok, codes = frames[0, t, 0], frames[0, t, 1:]
        cb = torch.stack([C[int(c) + 8 * i] for i, c in enumerate(codes)]).sum(0)
        assert torch.equal(x[0, t], (E[tok] + cb) / math.sqrt(5))


def test_unshared_codebook_embeddings_use_no_offsets():
    # fish-speech 1.5's `share_codebook_embeddings=False` indexes codebook_embeddings without the
    # per-codebook offset i * codebook_size.
    m = _tiny(share_codebook_embeddings=False)
    frames = torch.tensor([[[41, 1, 5, 7, 2]]])
    E, C = m.embeddings.weight, m.codebook_embeddings.weight
    expected = E[41] + torch.stack([C[1], C[5], C[7], C[2]]).sum(0)
    assert torch.equal(m.embed(frames)[0, 0], expected)


def test_model_builds_on_the_meta_device():
    # Loaders build the model under torch.device("meta") and assign weights afterwards.
    args = ModelArgs(vocab_size=64, n_layer=1, n_head=2, dim=16, semantic_begin_id=40, semantic_end_id=47)
    with torch.device("meta"):
        m = DualARTransformer(args)
    assert m.embeddings.weight.is_meta and m.freqs_cis.is_meta  # no table is computed for a meta model
    m.init_buffers("cpu")
    assert torch.equal(m.freqs_cis, precompute_freqs_cis(args.max_seq_len, args.head_dim, args.rope_base))
