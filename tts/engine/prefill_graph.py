"""The prefill as CUDA graphs: one captured forward pass per token bucket.

Why: on a GPU one prefill pass is bound by kernel launches. S2-Pro's slow transformer is about 2,500
torch ops, which measured 49 ms of host time against 6.4 ms of device time for one request on an H200
(BENCHMARKS.md), and the engine thread does nothing else meanwhile: no frame step runs and the new
request's first frame waits. At 16 clients the prefill was about half of the server's time to first
audio. Replaying a captured pass costs one launch.

How: the prompts of one pass (a packed group of `ModelRunner.prefill_packed`, or one request) are laid
out in persistent buffers and padded to the token bucket P, the smallest of `TOKEN_BUCKETS` that holds
their columns: prompt columns `[P, 1 + N]`, positions `[P]` and K/V slots `[P]`. Pad columns are token 0
at position 0 and write their K/V into the scratch block, which nothing reads. Attention stays causal
within each prompt: with flash varlen attention (CUDA, 16-bit weights) through `cu_seqlens` of a fixed
length, `max_sequences + 2` (the prompts, the pad as one more sequence, then empty sequences at the
end); otherwise through the block-diagonal causal mask built inside the graph from one sequence id per
column (pad columns share an id of their own). The pass itself is `ModelRunner.prefill_pass`, the
same code the eager prefill runs. A pass longer than the largest bucket runs eagerly.

Buckets go through `graphs.runner.GraphRunner` (its own memory pool, warm-up then capture, fallback to
eager, the stand-in graphs on a CPU that the tests use).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from graphs.runner import GraphRunner

from ..kv_cache import SCRATCH_BLOCK

# Prompt columns per captured pass: between the powers of two, 1.5x steps (a pad column costs a real
# one's FLOPs, which matter little at these sizes: the pass is bound by launches). 2,048 is the engine's
# default prefill budget per iteration (`EngineConfig.max_prefill_tokens`).
TOKEN_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


class PrefillGraph:
    """Captured prefill passes of one `ModelRunner` (see the module docstring).

    runner: the ModelRunner (its model, KV cache, `prefill_pass` and `varlen_prefill`). max_sequences:
    prompts per pass at most (the engine admits at most max_batch per iteration). enabled: False keeps
    every pass eager (`run` returns False). buckets: token buckets (those above max_tokens are dropped).
    """

    def __init__(
        self,
        runner,
        max_sequences: int,
        *,
        enabled: bool = True,
        buckets: tuple[int, ...] = TOKEN_BUCKETS,
        max_tokens: int | None = None,
    ):
        self.runner = runner
        self.max_sequences = max_sequences
        dev, width = runner.device, 1 + runner.config.num_codebooks
        top = max(buckets) if max_tokens is None else max_tokens
        self.buckets = tuple(b for b in sorted(set(buckets)) if b <= top)
        P = self.buckets[-1] if self.buckets else 0
        self.varlen = runner.varlen_prefill
        self.columns = torch.zeros(P, width, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(P, dtype=torch.int64, device=dev)
        bs = runner.kv.block_size
        self.scratch_slot = SCRATCH_BLOCK * bs
        self.slots = torch.full((P,), self.scratch_slot, dtype=torch.int64, device=dev)
        # varlen: [0, prompt ends..., P, P, ...] (at capture: one pad sequence of P columns)
        self.cu_seqlens = torch.full((max_sequences + 2,), P, dtype=torch.int32, device=dev)
        self.cu_seqlens[0] = 0
        self.segments = torch.full((P,), -1, dtype=torch.int64, device=dev)  # masked attention's ids
        self.graphs = GraphRunner(
            self._pass,
            max_batch=max(P, 1),
            buckets=self.buckets or (1,),
            enabled=enabled and bool(self.buckets),
            device=dev,
            buffer_ptrs=self._ptrs,
        )

    def _ptrs(self) -> dict[str, int]:
        return {
            name: t.data_ptr()
            for name, t in (
                ("columns", self.columns),
                ("positions", self.positions),
                ("slots", self.slots),
                ("cu_seqlens", self.cu_seqlens),
                ("segments", self.segments),
            )
        }

    def _pass(self, P: int, variant=None) -> None:
        """The captured step: a prefill pass over the first P columns of the buffers."""
        if self.varlen:
            self.runner.prefill_pass(
                self.columns[:P],
                self.positions[:P],
                self.slots[:P],
                cu_seqlens=self.cu_seqlens,
                max_len=P,
            )
        else:
            self.runner.prefill_pass(
                self.columns[:P], self.positions[:P], self.slots[:P], segments=self.segments[:P]
            )

    def capture_all(self) -> None:
        """Warm up and capture every bucket now, largest first (start-up capture), each on pad columns
        only (their K/V go to the scratch block)."""
        if not self.graphs.enabled:
            return
        for P in reversed(self.buckets):
            self._load_pad(P)
            for _ in range(2):  # GraphRunner: the first use warms up, the second captures (and replays)
                self.graphs.run(P)

    def run(self, group: list[tuple[Tensor, list[int]]]) -> bool:
        """Prefill `group` (prompt `[T_i + 1, 1 + N]` int64 on the CPU, block table) in one replayed
        pass: the K/V of every prompt column but each one's last. False (nothing done) when the group
        does not fit: graphs disabled, more columns than the largest bucket, or more prompts than
        max_sequences."""
        lengths = [prompt.shape[0] - 1 for prompt, _ in group]
        total = sum(lengths)
        g = self.graphs
        if not g.enabled or total > self.buckets[-1] or len(group) > self.max_sequences:
            return False
        P = g.bucket_for(total)
        assert P is not None  # total <= the largest bucket
        bs = self.runner.kv.block_size
        columns = torch.zeros(P, self.columns.shape[1], dtype=torch.int64)
        columns[:total] = torch.cat([prompt[:-1] for prompt, _ in group])
        positions = torch.zeros(P, dtype=torch.int64)
        positions[:total] = torch.cat([torch.arange(n) for n in lengths])
        slots = torch.full((P,), self.scratch_slot, dtype=torch.int64)
        slots[:total] = torch.cat(
            [
                torch.tensor(table, dtype=torch.int64)[torch.arange(n) // bs] * bs + torch.arange(n) % bs
                for (_, table), n in zip(group, lengths, strict=True)
            ]
        )
        self.columns[:P].copy_(columns)
        self.positions[:P].copy_(positions)
        self.slots[:P].copy_(slots)
        if self.varlen:
            cu = torch.full((self.max_sequences + 2,), P, dtype=torch.int32)
            cu[: len(group) + 1] = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            self.cu_seqlens.copy_(cu)
        else:
            segments = torch.full((P,), -1, dtype=torch.int64)
            segments[:total] = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(lengths))
            self.segments[:P].copy_(segments)
        # P, not total: a bucket whose capture failed runs eagerly at the size its buffers were laid out for
        # (the varlen bounds end at P).
        computed = g.run(P)
        assert computed == P, (computed, P)
        return True

    def _load_pad(self, P: int) -> None:
        self.columns[:P].zero_()
        self.positions[:P].zero_()
        self.slots[:P].fill_(self.scratch_slot)
        self.cu_seqlens.fill_(P)
        self.cu_seqlens[0] = 0
        self.segments[:P].fill_(-1)
