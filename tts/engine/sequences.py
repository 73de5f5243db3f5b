"""Kept sequences: a session's KV blocks held between its engine requests (prefix reuse).

A streaming session (`tts.runtime.sessions`) speaks its text chunk by chunk, each chunk one engine request
whose prompt is the session's whole conversation so far (voice references, every earlier turn's text and
codes) plus the new text. Prefilling that history again for every chunk would make a session's fifth
sentence slower to start than its first. Instead the engine keeps the session's *sequence*: the blocks
holding the K/V of every position the last request of the session wrote (its prompt and its fed-back
frames), and the frame columns `[L, 1 + N]` those positions hold. A request submitted with
`Engine.submit(..., sequence=ID)` takes them over: the longest common prefix of the held columns and the
new prompt (all but its last column, which the first frame step reads) is not prefilled again, only the
rest is (`prefill_extend`: the new columns attend to the cached prefix through the block table). When the
request ends, its blocks go back to the sequence:

* ended normally (STOP, LENGTH, LOOP): every position it wrote, i.e. its prompt and all its frames but the
  last (the last frame is never fed back), the blocks beyond freed;
* cancelled: only the prefix it had taken over (the new chunk's blocks are freed: barge-in keeps the
  history, not the half-spoken chunk);
* failed (ERROR): nothing (the whole sequence is freed; the next request prefills from scratch).

When the context forces the session to drop its oldest turns, the new prompt differs from the held columns
right after the system part, so the common prefix is short and the rest is prefilled again: counted as a
re-prefill (`Engine.reprefill_tokens`). Idle sequences (no request holds them) are evicted, least
recently used first, when a waiting request cannot get its blocks, so a session that went quiet never
starves the others (its next chunk is then prefilled in full, counted the same way).

When several requests that continue kept sequences are admitted together and `Engine.packed_prefill` is
on (the default on CUDA), their new positions are prefilled together, in packed passes
(`prefill_extend_packed`): one pass over all their new columns, each attending to its own sequence's
cached prefix and its own earlier new columns (on CUDA flash varlen attention with separate query and
key lengths where the torch build has it, else SDPA with an explicit mask). On a GPU a pass over a few
dozen positions costs about its kernel launches, so packing many sessions' chunks costs about one. If a
packed pass fails, every request is prefilled alone (a bad prompt fails only its own request).

Extension prefills never go through the prefill graphs (those pad prompts to token buckets starting at
position 0 and attend only within the pass, not to a cached prefix): they run eagerly. The ones run one
sequence per pass on CUDA are counted in `Engine.prefix_prefills_eager`. The frame step needs nothing
new: positions and block tables are per row.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tts.engine import model_runner
from tts.model.kv_cache import paged_slots
from tts.model.transformer import (
    packed_causal_attend,
    run_layers_kv_only,
    varlen_causal_attend,
    varlen_causal_available,
)

# A packed extension pass's SDPA mask (new columns x the keys of their sequences) holds at most this many
# elements (flash varlen attention needs no mask).
PACKED_EXTEND_MASK_ELEMENTS = model_runner.PACKED_PREFILL_TOKENS**2
# Keys (cached and new positions of its sequences) one packed extension pass reads at most: each layer
# gathers them from the pool into one K and one V tensor (S2-Pro in bf16: 2 KiB a position each, 128 MiB
# each at the bound).
PACKED_EXTEND_KEYS = 16 * model_runner.PACKED_PREFILL_TOKENS


@dataclass(eq=False)
class KeptSequence:
    """A session's KV held between its requests.

    seq_id: the caller's name for it. blocks: the KV blocks holding positions `0 .. len(columns) - 1`
    (`blocks[p // block_size]`), exactly `blocks_needed(len(columns))` of them. columns: `[L, 1 + N]`
    int64 on the CPU, the frame columns whose K/V those positions hold. busy: a request holds the blocks
    now (then `blocks` is empty: the request owns them). last_used: `time.monotonic()` of the last
    release, for least-recently-used eviction. evicted: times its blocks were taken for other requests.
    """

    seq_id: str
    blocks: list[int] = field(default_factory=list)
    columns: Tensor | None = None
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    evicted: int = 0
    dropped: int = 0  # positions lost to the last eviction (prefilled again by the next request: counted)

    @property
    def length(self) -> int:
        """Positions whose K/V the sequence holds."""
        return 0 if self.columns is None else int(self.columns.shape[0])


def common_prefix(held: Tensor | None, prompt: Tensor) -> int:
    """The number of leading positions at which `held [L, W]` and `prompt [T, W]` (int64) have equal
    columns: how much of a prompt a kept sequence already holds. Only `prompt[:-1]` counts: the prompt's
    last column is the first frame step's input and is never prefilled."""
    if held is None or held.shape[0] == 0 or prompt.shape[0] <= 1:
        return 0
    n = min(held.shape[0], prompt.shape[0] - 1)
    differs = (held[:n] != prompt[:n]).any(dim=1)
    first = torch.nonzero(differs)
    return int(first[0, 0]) if first.numel() else n


@torch.inference_mode()
def prefill_extend(runner, prompt: Tensor, block_table: list[int], start: int) -> None:
    """Prefill positions `start .. T - 2` of `prompt [T, 1 + N]` int64 into `block_table`, whose blocks
    already hold the K/V of positions `0 .. start - 1` (a kept sequence's prefix). Each new column
    attends causally to the cached prefix and to the new columns before it: the K/V of this layer's new
    columns are written into the pool first, then the keys and values of positions `0 .. T - 2` are read
    back through the block table. The result equals `ModelRunner.prefill` of the whole prompt up to float
    rounding (other matrix shapes). Eager on every device, one pass (see the module docstring). `runner`: the
    engine's `ModelRunner`."""
    T = prompt.shape[0] - 1
    n = T - start
    if n <= 0:
        return
    runner.prefill_passes += 1
    m, kv, dev = runner.model, runner.kv, runner.device
    frames = prompt[start:T].to(dev).unsqueeze(0)
    table = torch.tensor(block_table, dtype=torch.int64, device=dev)
    new_positions = torch.arange(start, T, device=dev)
    slots = paged_slots(table, new_positions, kv.block_size)
    all_slots = paged_slots(table, torch.arange(T, device=dev), kv.block_size)
    # query i (position start + i) sees keys at positions <= start + i
    mask = torch.arange(T, device=dev).view(1, T) <= new_positions.view(n, 1)

    def write_kv(i, k, v):
        kv.write(i, slots, k[0], v[0])

    def attend_layer(i):
        def attend(q, k, v):
            write_kv(i, k, v)
            keys = kv.k[i].view(-1, *kv.k.shape[-2:]).index_select(0, all_slots).unsqueeze(0)
            values = kv.v[i].view(-1, *kv.v.shape[-2:]).index_select(0, all_slots).unsqueeze(0)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask,
                enable_gqa=True,
            )
            return o.transpose(1, 2)

        return attend

    run_layers_kv_only(m.layers, m.embed(frames), m.freqs_cis[new_positions], attend_layer, write_kv)


# (prompt [T, 1 + N] int64, block table, cached positions): one kept sequence's extension
Extension = tuple[Tensor, list[int], int]


def prefill_extend_packed(runner, extensions: list[Extension]) -> int:
    """`prefill_extend` of several kept sequences, packed: their new columns (positions `start_i ..
    T_i - 2`) run through the layers together, at most `PACKED_PREFILL_TOKENS` of them per pass, reading
    at most `PACKED_EXTEND_KEYS` keys (positions `0 .. T_i - 2` of each sequence) and, for the SDPA mask,
    at most `PACKED_EXTEND_MASK_ELEMENTS` new columns x keys; a sequence that alone exceeds a bound runs
    alone. Each new column attends causally to its own sequence only: the cached prefix (positions
    `0 .. start_i - 1`, read from the paged pool through its block table) and its own new columns before
    it. The K/V equal `prefill_extend`'s up to float rounding (other matrix
    shapes). Counts every pass in `runner.prefill_passes`; returns how many sequences ran alone (one
    sequence per pass). Raises whatever a pass raises; passes already run have written their K/V, so a
    caller that retries one by one prefills those positions again (same values). `runner`: the engine's
    `ModelRunner`."""
    m = runner.model
    varlen = varlen_causal_available(
        runner.device, m.embeddings.weight.dtype, m.config.head_dim, cached_prefix=True
    )
    limit = model_runner.PACKED_PREFILL_TOKENS
    group: list[Extension] = []
    size = keys = alone = 0

    def flush() -> None:
        nonlocal alone
        if len(group) == 1:
            prefill_extend(runner, *group[0])
            alone += 1
        elif group:
            _extend_pass(runner, group, varlen)

    for prompt, table, start in extensions:
        T = prompt.shape[0] - 1
        n = T - start
        if n <= 0:
            continue
        fits = (
            size + n <= limit
            and keys + T <= PACKED_EXTEND_KEYS
            and (varlen or (size + n) * (keys + T) <= PACKED_EXTEND_MASK_ELEMENTS)
        )
        if group and not fits:
            flush()
            group, size, keys = [], 0, 0
        group.append((prompt, table, start))
        size, keys = size + n, keys + T
    flush()
    return alone


@torch.inference_mode()
def _extend_pass(runner, group: list[Extension], varlen: bool) -> None:
    """One packed extension pass over `group` (two or more sequences with new columns); counted in
    `runner.prefill_passes` once it has run."""
    m, kv, dev = runner.model, runner.kv, runner.device
    lengths, news, frames, positions, key_slots, slots = [], [], [], [], [], []
    for prompt, table, start in group:
        T = prompt.shape[0] - 1  # the keys of this sequence: positions 0 .. T - 1
        seq_slots = paged_slots(torch.tensor(table, dtype=torch.int64), torch.arange(T), kv.block_size)
        lengths.append(T)
        news.append(T - start)
        frames.append(prompt[start:T])
        positions.append(torch.arange(start, T))
        key_slots.append(seq_slots)
        slots.append(seq_slots[start:])
    new_positions = torch.cat(positions).to(dev)
    new_slots, all_slots = torch.cat(slots).to(dev), torch.cat(key_slots).to(dev)
    if varlen:
        cu_q = torch.tensor([0, *itertools.accumulate(news)], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)
        max_q, max_k = max(news), max(lengths)

        def attention(q, keys, values):
            return varlen_causal_attend(q, keys, values, cu_q, max_q, cu_k, max_k)
    else:
        q_seq = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(news)).to(dev)
        k_seq = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(lengths)).to(dev)
        k_pos = torch.cat([torch.arange(T) for T in lengths]).to(dev)
        # query (sequence s, position p) sees the keys of sequence s at positions <= p
        mask = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= new_positions[:, None])

        def attention(q, keys, values):
            return packed_causal_attend(q, keys, values, mask)

    def write_kv(i, k, v):
        kv.write(i, new_slots, k[0], v[0])

    def attend_layer(i):
        def attend(q, k, v):
            write_kv(i, k, v)
            keys = kv.k[i].view(-1, *kv.k.shape[-2:]).index_select(0, all_slots).unsqueeze(0)
            values = kv.v[i].view(-1, *kv.v.shape[-2:]).index_select(0, all_slots).unsqueeze(0)
            return attention(q, keys.to(q.dtype), values.to(q.dtype))

        return attend

    x = m.embed(torch.cat(frames).to(dev).unsqueeze(0))
    run_layers_kv_only(m.layers, x, m.freqs_cis[new_positions], attend_layer, write_kv)
    runner.prefill_passes += 1
