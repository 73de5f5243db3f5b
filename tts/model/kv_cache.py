"""Paged KV cache for the slow AR (the PagedAttention idea, docs/DESIGN.md invariant 8).

K and V of every slow layer live in one pool of fixed-size blocks, `[n_layer, num_blocks, block_size,
n_kv_heads, head_dim]`. A request owns a list of blocks, its *block table*; token position p of that
request lives in block `table[p // block_size]` at offset `p % block_size`. Block 0 is the reserved
*scratch block*: pad rows and inactive rows point their tables at it and write their K/V there, so they
never touch a real request's blocks (docs/DESIGN.md invariant 4).

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
        self._free_set = set(self._free)  # (the checks in `free`, without a set built per call)

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
        blocks = [self._free.pop() for _ in range(n)]
        self._free_set.difference_update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool. Freeing the scratch block or a free block is a bug and raises
        (freeing none of `blocks`)."""
        returned: set[int] = set()
        for b in blocks:
            if b == SCRATCH_BLOCK or b in self._free_set or b in returned or not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} is not an allocated block")
            returned.add(b)
        self._free_set |= returned
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class PagedKVCache:
    """The block pool of the slow AR's K and V, one tensor each: `[n_layer, num_blocks, block_size,
    n_kv_heads, head_dim]` in the model dtype."""

    def __init__(
        self,
        n_layer: int,
        num_blocks: int,
        block_size: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
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
        kf.index_copy_(0, slots, k if k.dtype == kf.dtype else k.to(kf.dtype))
        vf.index_copy_(0, slots, v if v.dtype == vf.dtype else v.to(vf.dtype))

    def slots_for_positions(self, block_table: Tensor, positions: Tensor) -> Tensor:
        """Flat slot of each position (`paged_slots` with this cache's block size)."""
        return paged_slots(block_table, positions, self.block_size)


def paged_slots(block_tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat pool slot of each position, `table[pos // block_size] * block_size + pos % block_size`:
    int64, the shape of `positions`. block_tables `[W]` with positions `[P]`, or one table per row
    `[b, W]` with positions `[b, P]` (int64). No host sync: safe inside a captured graph."""
    blocks = block_tables.gather(-1, positions // block_size).long()
    return blocks * block_size + positions % block_size


def paged_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float
) -> Tensor:
    """One query token per row attending to its paged context (torch reference implementation).

    q: `[B, H, D]`; k_cache, v_cache: one layer's pool `[num_blocks, block_size, Hkv, D]`;
    block_tables: `[B, max_blocks]` int32/int64; context_lens: `[B]` (>= 1), the number of cached
    tokens each row attends to (its own token included). GQA: KV head j serves query heads
    `j*g .. j*g+g-1` (repeat_interleave order, docs/fish_dual_ar.md §1.2). Softmax in fp32; returns
    `[B, H, D]` in q's dtype.
    Reads the whole block-table width with a mask, so the shapes do not depend on the lengths.
    """
    return PagedDecodeAttention(block_tables, context_lens, k_cache.shape[1])(q, k_cache, v_cache, scale)


class PagedDecodeAttention:
    """`paged_decode_attention` for one decode step of every layer: the block-table and mask work that
    does not depend on the layer is done once here, and each call attends one layer's pool. Reads no
    device data on the host: safe inside a captured CUDA graph. (The CPU frame step reads a single
    row's consecutive blocks as a slice instead: `tts.engine.cpu_step`.)

    Scores and outputs are two batched matrix products (`bmm`, what `einsum` would call, without its
    per-call planning); the casts are skipped where they are no-ops (fp32), since the CPU path is bound
    by op dispatch.
    """

    def __init__(self, block_tables: Tensor, context_lens: Tensor, block_size: int):
        B, W = block_tables.shape
        L = W * block_size
        self.rows = B
        self.index = block_tables.long().view(-1)
        positions = torch.arange(L, device=context_lens.device).view(1, 1, 1, L)
        self.hidden = positions >= context_lens.view(B, 1, 1, 1)  # masked: not in the row's context

    def _gather(self, cache: Tensor) -> Tensor:
        """The rows' blocks, `[B, L, Hkv, D]` contiguous."""
        return cache.index_select(0, self.index).view(self.rows, -1, *cache.shape[2:])

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> Tensor:
        B, H, D = q.shape
        n_kv = k_cache.shape[2]
        k, v = self._gather(k_cache), self._gather(v_cache)
        if q.dtype != torch.float32 or k.dtype != torch.float32:
            q32, k, v = q.float(), k.float(), v.float()
        else:
            q32 = q
        g, L = H // n_kv, k.shape[1]
        qg = q32.view(B, n_kv, g, D)
        scores = torch.bmm(qg.reshape(B * n_kv, g, D), k.permute(0, 2, 3, 1).reshape(B * n_kv, D, L))
        scores = scores.view(B, n_kv, g, L) * scale
        probs = torch.softmax(scores.masked_fill(self.hidden, float("-inf")), dim=-1)
        out = torch.bmm(probs.view(B * n_kv, g, L), v.permute(0, 2, 1, 3).reshape(B * n_kv, L, D))
        out = out.reshape(B, H, D)
        return out if out.dtype == q.dtype else out.to(q.dtype)
