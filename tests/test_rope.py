import math

import torch

from tts.model import apply_rotary_emb, precompute_freqs_cis


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
