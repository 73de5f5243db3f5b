"""Paged KV cache for the slow AR (the PagedAttention idea, DESIGN.md invariant 8).

K and V of every slow layer live in one pool of fixed-size blocks, `[n_layer, num_blocks, block_size,
n_kv_heads, head_dim]`. A request owns a list of blocks, its *block table*; token position p of that
request lives in block `table[p // block_size]` at offset `p % block_size`. Block 0 is the reserved
*scratch block*: pad rows and inactive rows point their tables at it and write their K/V there, so they
never touch a real request's blocks (invariant 4).

`paged_decode_attention` is the plain torch implementation: the CPU path, and the reference that the
GPU kernel (`tts/kernels/`) is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCRATCH_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """Raised when the pool cannot hold a request's blocks."""


class BlockAllocator:
    """Free list over blocks `1 .. num_blocks - 1` (block 0 is the scratch block, never handed out)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (one is the scratch block)")
        self.num_blocks = num_blocks
        # Hand out low ids first: pop() from the end of a descending list.
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks; raises OutOfBlocks (taking none) if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool. Freeing the scratch block or a free block is a bug and raises."""
        free_set = set(self._free)
        for b in blocks:
            if b == SCRATCH_BLOCK or b in free_set or not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} is not an allocated block")
            free_set.add(b)
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class PagedKVCache:
    """The block pool of the slow AR's K and V, one tensor each: `[n_layer, num_blocks, block_size,
    n_kv_heads, head_dim]` in the model dtype."""

    def __init__(
        self, n_layer: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ):  # fmt: skip
        shape = (n_layer, num_blocks, block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @staticmethod
    def bytes_per_block(n_layer: int, block_size: int, n_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * n_layer * block_size * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write K/V of `n` tokens into flat slots (`block * block_size + offset`).

        slots: `[n]` int64; k, v: `[n, n_kv_heads, head_dim]`. No allocation beyond the index op, no
        host sync: safe inside a captured graph.
        """
        kf = self.k[layer].view(-1, *self.k.shape[-2:])
        vf = self.v[layer].view(-1, *self.v.shape[-2:])
        kf.index_copy_(0, slots, k.to(kf.dtype))
        vf.index_copy_(0, slots, v.to(vf.dtype))

    def slots_for_positions(self, block_table: Tensor, positions: Tensor) -> Tensor:
        """Flat slot of each position: `block_table[pos // bs] * bs + pos % bs` (int64, same shape)."""
        bs = self.block_size
        return block_table[positions // bs].long() * bs + positions % bs


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """One query token per row attending to its paged context (torch reference implementation).

    q: `[B, H, D]`; k_cache, v_cache: one layer's pool `[num_blocks, block_size, Hkv, D]`;
    block_tables: `[B, max_blocks]` int32/int64; context_lens: `[B]` (>= 1), the number of cached
    tokens each row attends to (its own token included). GQA: KV head j serves query heads
    `j*g .. j*g+g-1` (repeat_interleave order, spec 1.2). Softmax in fp32; returns `[B, H, D]` in q's dtype.
    Reads the whole block-table width with a mask, so the shapes do not depend on the lengths.
    """
    B, H, D = q.shape
    _, block_size, n_kv, _ = k_cache.shape
    g = H // n_kv
    k = k_cache[block_tables.long()].reshape(B, -1, n_kv, D)  # [B, L, Hkv, D]
    v = v_cache[block_tables.long()].reshape(B, -1, n_kv, D)
    L = k.shape[1]
    qf = q.float().view(B, n_kv, g, D)
    scores = torch.einsum("bkgd,blkd->bkgl", qf, k.float()) * scale
    visible = torch.arange(L, device=q.device).view(1, 1, 1, L) < context_lens.view(B, 1, 1, 1)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v.float())
    return out.reshape(B, H, D).to(q.dtype)
