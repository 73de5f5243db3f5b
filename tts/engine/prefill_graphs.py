"""The prefill as CUDA graphs: one captured forward pass per token bucket.

Why: on a GPU one prefill pass is bound by kernel launches. S2-Pro's slow transformer is about 2,500
torch ops, which measured 49 ms of host time against 6.4 ms of device time for one request on an H200
(docs/benchmarks.md), and the engine thread does nothing else meanwhile: no frame step runs and the new
request's first frame waits. At 16 clients the prefill was about half of the server's time to first
audio. Replaying a captured pass costs one launch (measured: the first frame 48 -> 14 ms after the
request at one client, docs/benchmarks.md).

How: the prompts of one pass (a packed group of `ModelRunner.prefill_packed`, or one request) are laid
out by `model_runner.pack_prompts`, padded to the token bucket, the smallest of `TOKEN_BUCKETS` that
holds their columns, and copied into persistent buffers: prompt columns `[P, 1 + N]`, positions `[P]`
and K/V slots `[P]`. Pad columns are token 0 at position 0 and write their K/V into the scratch block,
which no real request reads. Attention stays causal within each prompt: with flash varlen attention
(CUDA, 16-bit weights) through `cu_seqlens` of a fixed length, `max_sequences + 2` (the prompts, the pad
as one more sequence, then empty sequences at the end); otherwise through the block-diagonal causal mask
that `ModelRunner.prefill_pass` builds inside the graph from one sequence id per column (pad columns
share an id of their own). The captured function is `ModelRunner.prefill_pass`, the same code the eager
prefill runs. A pass longer than the largest bucket, or of more prompts than max_sequences, runs
eagerly and is counted (`stats.eager_over_max`).

Buckets go through `graphs.runner.GraphRunner` (its own memory pool, warm-up then capture, fallback to
eager, the stand-in graphs on a CPU that the tests use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from graphs.runner import GraphRunner
from tts.engine.model_runner import pack_prompts
from tts.model.kv_cache import SCRATCH_BLOCK

if TYPE_CHECKING:
    from tts.engine.model_runner import ModelRunner

# Prompt columns per captured pass: between the powers of two, 1.5x steps (a pad column costs a real
# one's FLOPs, which matter little at these sizes: the pass is bound by launches). 2,048 is the engine's
# default prefill budget per iteration (`EngineConfig.max_prefill_tokens`).
TOKEN_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


class PrefillGraphs:
    """Captured prefill passes of one `ModelRunner` (see the module docstring).

    runner: the ModelRunner (its model, KV cache, `prefill_pass` and `varlen_prefill`). max_sequences:
    prompts per pass at most (the engine admits at most max_batch per iteration). `graphs.stats` counts
    replays, eager passes and captures.
    """

    def __init__(self, runner: ModelRunner, max_sequences: int):
        self.runner = runner
        self.max_sequences = max_sequences
        dev, width = runner.device, 1 + runner.config.num_codebooks
        self.buckets = TOKEN_BUCKETS
        P = self.largest = self.buckets[-1]
        self.varlen = runner.varlen_prefill
        self.scratch_slot = SCRATCH_BLOCK * runner.kv.block_size
        self.columns = torch.zeros(P, width, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(P, dtype=torch.int64, device=dev)
        self.slots = torch.full((P,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.cu_seqlens = torch.zeros(max_sequences + 2, dtype=torch.int32, device=dev)  # varlen bounds
        self.segments = torch.full((P,), -1, dtype=torch.int64, device=dev)  # masked attention's ids
        self.graphs = GraphRunner(
            self._pass,
            max_batch=P,
            buckets=self.buckets,
            device=dev,
            buffer_ptrs=self._ptrs,
        )

    def _ptrs(self) -> dict[str, int]:
        names = ("columns", "positions", "slots", "cu_seqlens", "segments")
        return {name: getattr(self, name).data_ptr() for name in names}

    def _pass(self, tokens: int, variant=None) -> None:
        """The captured step: a prefill pass over the first `tokens` columns of the buffers."""
        columns, positions, slots = self.columns[:tokens], self.positions[:tokens], self.slots[:tokens]
        if self.varlen:
            self.runner.prefill_pass(columns, positions, slots, cu_seqlens=self.cu_seqlens, max_len=tokens)
        else:
            self.runner.prefill_pass(columns, positions, slots, segments=self.segments[:tokens])

    def capture_all(self) -> None:
        """Warm up and capture every bucket now, largest first (start-up capture), each on pad columns
        only: their K/V go to the scratch block."""
        for P in reversed(self.buckets):
            self._load_pad(P)
            self.graphs.capture(P)

    def run(self, group: list[tuple[Tensor, list[int]]]) -> bool:
        """Prefill `group` (prompt `[T_i + 1, 1 + N]` int64 on the CPU, block table) in one replayed
        pass: the K/V of every prompt column but each one's last. False (nothing done) when the group
        has no column or does not fit (more columns than the largest bucket, or more prompts than
        max_sequences: counted as `stats.eager_over_max`); the caller then prefills eagerly."""
        g = self.graphs
        total = sum(prompt.shape[0] - 1 for prompt, _ in group)
        if total <= 0:
            return False
        if total > self.largest or len(group) > self.max_sequences:
            g.stats.eager_over_max += 1
            return False
        P = g.bucket_for(total)
        assert P is not None  # total <= the largest bucket
        p = pack_prompts(
            group,
            self.runner.kv.block_size,
            pad_to=P,
            scratch_slot=self.scratch_slot,
            sequences=self.max_sequences,
        )
        self.columns[:P].copy_(p.columns)
        self.positions[:P].copy_(p.positions)
        self.slots[:P].copy_(p.slots)
        if self.varlen:
            self.cu_seqlens.copy_(p.cu_seqlens)
        else:
            self.segments[:P].copy_(p.segments)
        # P, not total: a bucket whose capture failed runs eagerly at the size its buffers were laid out for
        # (the varlen bounds end at P).
        computed = g.run(P)
        assert computed == P, (computed, P)
        return True

    def _load_pad(self, P: int) -> None:
        self.columns[:P].zero_()
        self.positions[:P].zero_()
        self.slots[:P].fill_(self.scratch_slot)
        self.cu_seqlens.fill_(P)  # [0, P, P, ...]: one pad sequence of P columns, then empty ones
        self.cu_seqlens[0] = 0
        self.segments[:P].fill_(-1)
