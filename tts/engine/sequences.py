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

On CUDA the extension prefill runs eagerly (the prefill graphs pad prompts to token buckets starting at
position 0 and attend only within the pass, not to a cached prefix): counted in
`Engine.prefix_prefills_eager`. The frame step needs nothing new: positions and block tables are per row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tts.model.kv_cache import paged_slots
from tts.model.transformer import run_layers_kv_only


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
    rounding (other matrix shapes). Eager on every device (see the module docstring). `runner`: the
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
