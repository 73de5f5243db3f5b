import pytest
import torch
import torch.nn.functional as F

from tts.model.kv_cache import (
    SCRATCH_BLOCK,
    BlockAllocator,
    OutOfBlocks,
    PagedKVCache,
    paged_decode_attention,
)


def dense_reference(q, k_seq, v_seq, scale):
    """q [H, D]; k_seq, v_seq [L, Hkv, D] -> [H, D], plain softmax attention with repeat_interleave GQA."""
    H, Hkv = q.shape[0], k_seq.shape[1]
    k = k_seq.repeat_interleave(H // Hkv, dim=1).double()
    v = v_seq.repeat_interleave(H // Hkv, dim=1).double()
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_matches_dense_across_block_boundaries(block_size):
    torch.manual_seed(0)
    H, Hkv, D, n_blocks = 8, 2, 16, 40
    cache = PagedKVCache(1, n_blocks, block_size, Hkv, D, torch.float32, "cpu")
    alloc = BlockAllocator(n_blocks)
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 5]
    max_blocks = 4
    tables = torch.full((len(lengths), max_blocks), SCRATCH_BLOCK, dtype=torch.int32)
    seqs = []
    for r, L in enumerate(lengths):
        blocks = alloc.allocate((L + block_size - 1) // block_size)
        tables[r, : len(blocks)] = torch.tensor(blocks)
        k, v = torch.randn(L, Hkv, D), torch.randn(L, Hkv, D)
        slots = cache.slots_for_positions(tables[r], torch.arange(L))
        cache.write(0, slots, k, v)
        seqs.append((k, v))
    q = torch.randn(len(lengths), H, D)
    out = paged_decode_attention(q, cache.k[0], cache.v[0], tables, torch.tensor(lengths), D**-0.5)
    for r, (k, v) in enumerate(seqs):
        torch.testing.assert_close(
            out[r].double(), dense_reference(q[r], k, v, D**-0.5), rtol=1e-5, atol=1e-5
        )


def test_paged_matches_sdpa_causal_last_row():
    torch.manual_seed(1)
    H, Hkv, D, L, bs = 4, 4, 8, 37, 16
    cache = PagedKVCache(1, 8, bs, Hkv, D, torch.float32, "cpu")
    table = torch.tensor([3, 1, 6], dtype=torch.int32)  # non-contiguous blocks
    q, k, v = torch.randn(L, H, D), torch.randn(L, Hkv, D), torch.randn(L, Hkv, D)
    cache.write(0, cache.slots_for_positions(table, torch.arange(L)), k, v)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
    )[0, :, -1]
    out = paged_decode_attention(q[-1:], cache.k[0], cache.v[0], table[None], torch.tensor([L]), D**-0.5)
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


def test_allocator_never_hands_out_scratch_and_rejects_double_free():
    alloc = BlockAllocator(5)
    blocks = alloc.allocate(4)
    assert SCRATCH_BLOCK not in blocks and sorted(blocks) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)
    alloc.free(blocks[:2])
    with pytest.raises(ValueError):
        alloc.free(blocks[:1])
    with pytest.raises(ValueError):
        alloc.free([SCRATCH_BLOCK])
    assert alloc.num_free == 2
    with pytest.raises(ValueError):  # a block twice in one call: refused, and nothing is freed
        alloc.free([blocks[2], blocks[2]])
    assert alloc.num_free == 2
    assert alloc.allocate(2) == blocks[:2]  # freed blocks come back in the order they went out
    alloc.free(blocks)
    assert alloc.num_free == 4 and sorted(alloc.allocate(4)) == [1, 2, 3, 4]


def test_step_attention_paths_are_bit_exact_to_the_reference_math():
    """PagedDecodeAttention (index_select and bmm) and the CPU frame step's SlicedDecodeAttention (a
    slice of consecutive blocks) give the same bits as the plain gather + einsum formulation."""
    from tts.engine.cpu_step import SlicedDecodeAttention
    from tts.model.kv_cache import PagedDecodeAttention

    torch.manual_seed(2)
    H, Hkv, D, bs = 6, 2, 64, 16
    cache = PagedKVCache(1, 12, bs, Hkv, D, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()

    def reference(q, tables, lens):
        B = q.shape[0]
        k = cache.k[0][tables.long()].reshape(B, -1, Hkv, D)
        v = cache.v[0][tables.long()].reshape(B, -1, Hkv, D)
        scores = torch.einsum("bkgd,blkd->bkgl", q.view(B, Hkv, H // Hkv, D), k) * D**-0.5
        visible = torch.arange(k.shape[1]).view(1, 1, 1, -1) < lens.view(B, 1, 1, 1)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(B, H, D)

    cases = [
        (torch.tensor([[3, 4, 5, 6]]), torch.tensor([50])),  # one row, consecutive blocks: a slice
        (torch.tensor([[3, 7, 5, 0]]), torch.tensor([40])),  # one row, scattered: index_select
        (torch.tensor([[1, 2, 0, 0], [8, 9, 10, 11]]), torch.tensor([20, 64])),
    ]
    for tables, lens in cases:
        q = torch.randn(tables.shape[0], H, D)
        sliced = SlicedDecodeAttention(tables.to(torch.int32), lens, bs)
        assert (sliced.first_block is not None) == (tables.shape[0] == 1 and tables[0, 1] == 4)
        for attention in (sliced, PagedDecodeAttention(tables.to(torch.int32), lens, bs)):
            out = attention(q, cache.k[0], cache.v[0], D**-0.5)
            assert torch.equal(out, reference(q, tables, lens))
