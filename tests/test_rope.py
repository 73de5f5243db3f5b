import math

import torch

from tts.model.layers import apply_rotary_emb, precompute_freqs_cis


def test_rope_matches_explicit_pair_formula():
    """Adjacent pairs (x[2i], x[2i+1]) rotate by angle pos * base^(-2i/D), with the bf16-rounded table."""
    T, H, D, base = 7, 3, 8, 1e6
    x = torch.randn(2, T, H, D, dtype=torch.float64)
    table = precompute_freqs_cis(T, D, base)
    assert table.dtype == torch.bfloat16 and table.shape == (T, D // 2, 2)
    out = apply_rotary_emb(x, table)
    expected = torch.empty_like(x)
    for t in range(T):
        for i in range(D // 2):
            angle = t * base ** (-2 * i / D)
            # the table is stored in bf16: round cos/sin exactly as the runtime does
            c = torch.tensor(math.cos(angle)).to(torch.bfloat16).double()
            s = torch.tensor(math.sin(angle)).to(torch.bfloat16).double()
            a, b = x[..., t, :, 2 * i], x[..., t, :, 2 * i + 1]
            expected[..., t, :, 2 * i] = a * c - b * s
            expected[..., t, :, 2 * i + 1] = b * c + a * s
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_rope_table_is_bf16_rounded_not_fp32():
    table = precompute_freqs_cis(64, 16, 1e4)
    exact = torch.cos(torch.tensor(63.0) * 1e4 ** (-2 * 3 / 16))
    assert table[63, 3, 0].float() != exact  # rounded
    assert abs(table[63, 3, 0].float() - exact) < 4e-3


def test_rope_per_row_positions_equal_table_rows():
    D = 8
    table = precompute_freqs_cis(32, D, 1e4)
    x = torch.randn(3, 1, 2, D)
    pos = torch.tensor([0, 7, 31])
    per_row = apply_rotary_emb(x, table[pos].unsqueeze(1))
    for r in range(3):
        torch.testing.assert_close(per_row[r], apply_rotary_emb(x[r : r + 1], table[pos[r] : pos[r] + 1])[0])


def _pairwise_rope(x, freqs_cis):
    """The pairwise form `(x0 c - x1 s, x1 c + x0 s)` evaluated op by op in fp32 (the former code)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = (freqs_cis if freqs_cis.dim() == 4 else freqs_cis.unsqueeze(0)).float().unsqueeze(2)
    out = torch.stack(
        [xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1], xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]],
        dim=-1,
    )
    return out.flatten(3).type_as(x)


def test_rope_is_bit_exact_to_the_pairwise_form():
    """`x * cos + swap(x) * sin` with the sign folded into sin rounds exactly like the pairwise form,
    signed zeros included, for fp32 and bf16 inputs, shared and per-row tables."""
    torch.manual_seed(0)
    table = precompute_freqs_cis(512, 64)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 512, 5, 64) * torch.logspace(-4, 4, 64)).to(dtype)
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, -0.0, 0.0])
        assert torch.equal(
            apply_rotary_emb(x, table).view(torch.uint8), _pairwise_rope(x, table).view(torch.uint8)
        )
        pos = torch.tensor([3, 511])
        per_row = table[pos].unsqueeze(1)
        assert torch.equal(
            apply_rotary_emb(x[:, :1], per_row).view(torch.uint8),
            _pairwise_rope(x[:, :1], per_row).view(torch.uint8),
        )
