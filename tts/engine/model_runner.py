"""The model runner: persistent step buffers, prefill, and the one frame step (`decode_step`).

`decode_step(b)` is the function a CUDA graph captures, once per batch bucket b (docs/DESIGN.md invariants
1-4). Everything it reads or writes lives in `StepBuffers`, allocated once for the largest batch; the
host only writes rows between steps (`load_row`, `move_row`, `clear_row`, `set_active`) and reads the
`out` buffer after a step. The step has no host sync, no data-dependent Python branch and no tensor
created from host data, so replaying a captured step is the same as calling it.

One call = one frame for rows `[:b]`:
slow AR step over the paged KV -> main-token sampling (semantic ids + end token, RAS) -> fast AR
position 0 on the slow hidden state -> c_0 derived from the main token -> for k = 1..N-1 one fast
position and one sampled code -> the frame column written to `out` -> per-row state advanced in place
(next input column, position, step counter, RAS history, repetition history, done flags). Rows `[b:]`
and inactive rows are inert: their K/V writes go to the scratch block and their state does not move.

Repetition penalty (fish-speech 1.5 and the S1-era code; docs/fish_dual_ar.md §4.3), for a runner built with a
`repetition` mode: before each draw, a logit of a token in the row's penalty set is divided by the row's
penalty when positive and multiplied when negative (once per token, however often it occurs). The
reference keeps the frames generated after the first one in a zero-initialized history and reads a
16-frame window of it: the first 16 slots while fewer than 16 such frames exist (unwritten slots hold
0), the last 16 frames after that. Here the history is a ring of 16 slots per row, `rep_history [B,
1 + N, 16]`, zeros at the start: as a set of values per row it is exactly that window. The first frame
has no penalty. Codebook k's set is its own codes in the window (codebook 0 is derived, never
penalized). The main token's set depends on the mode:

* "fish-1.5" (v1.5.1): the main tokens in the window (token id 0 of unwritten slots is not a semantic
  id or the end token, so it changes nothing here);
* "s1" (d3df505 indexes the window `[N + 1, 16]` with `[:, 0]`): the whole oldest column of the window
  (slot 0 while fewer than 16 frames exist, else the slot about to be overwritten) read as token ids:
  that frame's main token and its N codes, which only matter where a code value is also a semantic id
  (small vocabularies).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from tts.engine.aligner import ALIGN_MAX_TOKENS, text_alignment
from tts.model.config import AlignerSpec
from tts.model.kernels import fused_kernels_enabled
from tts.model.kv_cache import (
    SCRATCH_BLOCK,
    PagedDecodeAttention,
    PagedKVCache,
    paged_decode_attention,
    paged_slots,
)
from tts.model.sampling import (
    RAS_WINDOW,
    SAMPLER_TOPK_CAP,
    DrawSettings,
    FrameDraws,
    RowParams,
    frame_log_noise,
    sample,
    sample_main_token,
)
from tts.model.transformer import (
    Attend,
    DualARTransformer,
    KVDest,
    dense_causal_attend,
    packed_causal_attend,
    run_layers_kv_only,
    varlen_causal_attend,
    varlen_causal_available,
)

if TYPE_CHECKING:
    from tts.engine.prefill_graphs import PrefillGraphs

# The repetition penalty's window in frames (fish-speech's `win_size`) and the ways a family reads it.
REPETITION_WINDOW = 16
# Prompt positions of one packed prefill pass at most: its attention mask is PACKED_PREFILL_TOKENS^2 bools.
PACKED_PREFILL_TOKENS = 4096
REPETITION_MODES = ("fish-1.5", "s1")


def apply_repetition_penalty(logits: Tensor, ids: Tensor, penalty: Tensor) -> Tensor:
    """fish-speech's repetition penalty on a batch, without host sync or data-dependent branches.

    logits: `[B, V]` (any float dtype); ids: `[B, K]` int64 indices into V, any value outside
    `[0, V)` ignored, repeats counted once; penalty: `[B, 1]` float32 (> 0; 1 is an exact no-op).
    Returns new logits (same dtype): at penalized indices `x / p` where x >= 0 and `x * p` where x < 0,
    computed in float32 and rounded to the logits' dtype (as fish-speech's bf16 tensors compute it).
    """
    B, V = logits.shape
    ids = torch.where((ids >= 0) & (ids < V), ids, V)
    hit = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device).scatter_(1, ids, True)[:, :V]
    x = logits.float()
    penalized = torch.where(x < 0, x * penalty, x / penalty).to(logits.dtype)
    return torch.where(hit, penalized, logits)


@dataclass(frozen=True)
class OutLayout:
    """The columns of the frame step's output `out [B, N+3]` int64, one row per batch row: written by
    `ModelRunner._advance`, read (a host copy) by `Engine.step`.

    `frame`: the frame column `[token, c_0..c_{N-1}]`, whose main token is at `token` and codes at
    `codes`; then `emitted` (1: the row was active, so this is a frame of its request) and `done` (1:
    its request's last frame: the end token, or its budget or context reached).
    """

    num_codebooks: int
    token = 0

    @property
    def frame(self) -> slice:
        return slice(0, self.num_codebooks + 1)

    @property
    def codes(self) -> slice:
        return slice(1, self.num_codebooks + 1)

    @property
    def emitted(self) -> int:
        return self.num_codebooks + 1

    @property
    def done(self) -> int:
        return self.num_codebooks + 2

    @property
    def align(self) -> int:
        return self.num_codebooks + 3

    @property
    def width(self) -> int:
        return self.num_codebooks + 4


@dataclass
class StepBuffers:
    """Persistent per-row state of the frame step, `B = max_batch` rows (docs/DESIGN.md invariant 2).

    Inputs: `input_columns [B, 1+N]` int64 (each row's decode input: the previous frame column, or
    the prompt's last column, fed at `positions`), `positions [B]`,
    `block_tables [B, max_blocks]` int32, `active [B]` bool, `temperature, top_p [B]` float32,
    `top_k [B]`, `seeds [B]`, `steps [B]` (frames generated so far), `budgets [B]` (max_new_frames),
    `min_frames [B]` (min_new_frames: the end token is masked while steps < min_frames),
    `ras_history [B, 10]` (last main-token indices, -1 = empty), `ras_len [B]` int64 (how many of the
    newest count: the request's `ras_window`),
    `rep_penalty [B]` float32 (1 = off), `rep_history [B, 1+N, 16]` int64 (the repetition penalty's
    ring of recent frame columns, see the module docstring), `align_start, align_len [B]` int64 (the
    row's text span for the aligner, `tts.engine.aligner`; length 0 = none).
    Output: `out [B, N+4]` int64 = frame column `[token, c_0..c_{N-1}]`, emitted flag, done flag, text
    position (`OutLayout` names the columns).
    Fast AR static KV: `fast_k, fast_v [n_fast_layer, B, Hkv, N, D]`, rewritten every frame.
    """

    input_columns: Tensor
    positions: Tensor
    block_tables: Tensor
    active: Tensor
    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    seeds: Tensor
    steps: Tensor
    budgets: Tensor
    min_frames: Tensor
    ras_history: Tensor
    ras_len: Tensor
    rep_penalty: Tensor
    rep_history: Tensor
    align_start: Tensor
    align_len: Tensor
    out: Tensor
    fast_k: Tensor
    fast_v: Tensor

    @classmethod
    def allocate(cls, model: DualARTransformer, max_batch: int, max_blocks: int, device) -> StepBuffers:
        c = model.config
        B, N = max_batch, c.num_codebooks
        i64 = dict(dtype=torch.int64, device=device)
        dtype = model.embeddings.weight.dtype
        fast_kv = (c.n_fast_layer, B, c.fast_n_local_heads, N, c.fast_head_dim)
        bufs = cls(
            input_columns=torch.zeros(B, 1 + N, **i64),
            positions=torch.zeros(B, **i64),
            block_tables=torch.full((B, max_blocks), SCRATCH_BLOCK, dtype=torch.int32, device=device),
            active=torch.zeros(B, dtype=torch.bool, device=device),
            temperature=torch.zeros(B, dtype=torch.float32, device=device),
            top_p=torch.ones(B, dtype=torch.float32, device=device),
            top_k=torch.zeros(B, **i64),
            seeds=torch.zeros(B, **i64),
            steps=torch.zeros(B, **i64),
            budgets=torch.ones(B, **i64),
            min_frames=torch.zeros(B, **i64),
            ras_history=torch.full((B, RAS_WINDOW), -1, **i64),
            ras_len=torch.zeros(B, **i64),
            rep_penalty=torch.ones(B, dtype=torch.float32, device=device),
            rep_history=torch.zeros(B, 1 + N, REPETITION_WINDOW, **i64),
            align_start=torch.zeros(B, **i64),
            align_len=torch.zeros(B, **i64),
            out=torch.zeros(B, OutLayout(N).width, **i64),
            fast_k=torch.zeros(fast_kv, dtype=dtype, device=device),
            fast_v=torch.zeros(fast_kv, dtype=dtype, device=device),
        )
        bufs.out[:, OutLayout(N).align] = -1  # (written by the step only where the model has an aligner)
        return bufs

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def data_ptrs(self) -> dict[str, int]:
        """Storage address of every buffer: must never change once a graph has captured them."""
        return {name: t.data_ptr() for name, t in self.tensors().items()}


@dataclass
class RowInit:
    """Host-side values that start a request's row (written by `ModelRunner.load_row`)."""

    last_column: Tensor  # [1 + N] int64: the prompt's last column, the first step's input
    position: int  # its position (prompt length - 1)
    block_table: list[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    budget: int
    ras_len: int
    paused: bool = False
    min_frames: int = 0
    repetition_penalty: float = 1.0
    # the span of prompt positions holding the text the aligner follows (None: no alignment)
    align_span: tuple[int, int] | None = None


@dataclass
class PackedPrompts:
    """The prompt columns of one prefill pass, laid out on the host by `pack_prompts` (CPU tensors):
    columns `[S, 1 + N]` int64; positions `[S]` int64, each column's position in its own prompt; slots
    `[S]` int64, where its K/V go (`block_table[pos // block_size] * block_size + pos % block_size`);
    segments `[S]` int64, its prompt's index (-1: a pad column); cu_seqlens int32, the prompts' bounds
    `[0, end_0, end_1, ...]`, then S for the pad and for every unused sequence; longest: the longest
    prompt's columns."""

    columns: Tensor
    positions: Tensor
    slots: Tensor
    segments: Tensor
    cu_seqlens: Tensor
    longest: int


def pack_prompts(
    group: list[tuple[Tensor, list[int]]],
    block_size: int,
    *,
    pad_to: int | None = None,
    scratch_slot: int = 0,
    sequences: int | None = None,
) -> PackedPrompts:
    """Lay out `group` (prompt `[T_i + 1, 1 + N]` int64, block table) for one prefill pass: every
    prompt's columns but its last, back to back. pad_to: S, padded with pad columns (token 0, position
    0, K/V into `scratch_slot`) after the prompts' columns (default: their total). sequences: the
    prompts cu_seqlens has room for (default: exactly the group's; with more, it is
    `sequences + 2` long: the pad counts as one more sequence, then empty ones)."""
    lengths = [prompt.shape[0] - 1 for prompt, _ in group]
    total = sum(lengths)
    S = total if pad_to is None else pad_to
    if S < total:
        raise ValueError(f"pad_to={pad_to} is below the prompts' {total} columns")
    width = group[0][0].shape[1]
    columns = torch.zeros(S, width, dtype=torch.int64)
    columns[:total] = torch.cat([prompt[:-1] for prompt, _ in group])
    positions = torch.zeros(S, dtype=torch.int64)
    positions[:total] = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.full((S,), scratch_slot, dtype=torch.int64)
    slots[:total] = torch.cat(
        [
            torch.tensor(table, dtype=torch.int64)[torch.arange(n) // block_size] * block_size
            + torch.arange(n) % block_size
            for (_, table), n in zip(group, lengths, strict=True)
        ]
    )
    segments = torch.full((S,), -1, dtype=torch.int64)
    segments[:total] = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(lengths))
    bounds = [0, *itertools.accumulate(lengths)]
    cu_seqlens = torch.full((len(bounds) if sequences is None else sequences + 2,), S, dtype=torch.int32)
    cu_seqlens[: len(bounds)] = torch.tensor(bounds, dtype=torch.int32)
    return PackedPrompts(columns, positions, slots, segments, cu_seqlens, max(lengths))


class ModelRunner:
    """Owns the model, the paged KV cache and the step buffers; runs prefill and the frame step.

    repetition: how the repetition penalty reads the recent frames (`REPETITION_MODES`, see the module
    docstring), or None: the step has no penalty at all (the rows' `rep_penalty` is ignored). Raises
    ValueError for an unknown mode or a config without an end token.
    """

    def __init__(
        self,
        model: DualARTransformer,
        kv_cache: PagedKVCache,
        max_batch: int,
        max_blocks_per_seq: int,
        attention_backend=None,
        ignore_eos: bool = False,
        repetition: str | None = None,
        aligner: AlignerSpec | None = None,
    ):
        c = model.config
        if c.eos_token_id is None:
            raise ValueError("the model config has no eos_token_id (<|im_end|>); cannot serve it")
        self.eos_token_id: int = c.eos_token_id
        if repetition is not None and repetition not in REPETITION_MODES:
            raise ValueError(f"repetition must be one of {REPETITION_MODES} or None, got {repetition!r}")
        self.repetition = repetition
        self.model = model
        self.config = c
        self.kv = kv_cache
        self.device = model.embeddings.weight.device
        self.max_batch = max_batch
        self.max_blocks_per_seq = max_blocks_per_seq
        self.buffers = StepBuffers.allocate(model, max_batch, max_blocks_per_seq, self.device)
        self.out_layout = OutLayout(c.num_codebooks)
        self.paged_attention = attention_backend or paged_decode_attention
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.fast_scale = 1.0 / math.sqrt(c.fast_head_dim)
        # The main token may only be a semantic token or the end token (docs/fish_dual_ar.md §1.4 step 2).
        # Instead of a -inf bias over the whole vocabulary we slice the head to those rows: same logits for
        # the allowed ids, a 40x smaller matmul for S2. Index i < n_sem is semantic id begin + i; the last
        # index is the end token (left out with ignore_eos, for fixed-length benchmarks).
        head = model.lm_head_weight()
        rows = [head[c.semantic_begin_id : c.semantic_end_id + 1]]
        if not ignore_eos:
            rows.append(head[c.eos_token_id : c.eos_token_id + 1])
        self.semantic_head = torch.cat(rows).detach()
        self.has_eos_column = not ignore_eos
        self.n_sem = c.num_semantic_tokens
        # Element offset of (row, fast position k) in a fast KV layer `[B, Hkv, N, D]`, for the fused
        # kernel that writes K/V straight into it: row * Hkv * N * D + k * D.
        fk = self.buffers.fast_k
        row_offsets = torch.arange(max_batch, device=self.device) * fk.stride(1)
        self.fast_row_offset = torch.stack([row_offsets + k * fk.stride(3) for k in range(c.num_codebooks)])
        # Residual codebooks are sampled from the first n_residual fast logits (a static slice).
        self.n_residual = c.residual_codebook_size or c.codebook_size
        self.prefill_passes = 0  # prefill forward passes run (one per request, or one per packed group)
        # A packed prefill's attention: flash over the variable-length sequences where it runs (CUDA),
        # else SDPA with a block-diagonal mask.
        self.varlen_prefill = varlen_causal_available(self.device, model.embeddings.weight.dtype, c.head_dim)
        # The prefill's captured passes (tts.engine.prefill_graphs), when the engine uses graphs.
        self.prefill_graphs: PrefillGraphs | None = None
        # The aligner heads (tts.engine.aligner): their query heads and the KV heads they read.
        self.aligner = aligner
        if aligner is not None:
            group = c.n_head // c.n_local_heads
            self.align_heads = torch.tensor(aligner.heads, dtype=torch.int64, device=self.device)
            self.align_kv_heads = self.align_heads // group

    # ---- host-side row management (between steps only) ---------------------------------------------

    def load_row(self, row: int, init: RowInit) -> None:
        """Start a request in `row`: write its first input and parameters into the buffers."""
        b, dev = self.buffers, self.device
        b.input_columns[row].copy_(init.last_column.to(dev))
        b.positions[row] = init.position
        table = torch.full((self.max_blocks_per_seq,), SCRATCH_BLOCK, dtype=torch.int32)
        table[: len(init.block_table)] = torch.tensor(init.block_table, dtype=torch.int32)
        b.block_tables[row].copy_(table.to(dev))
        b.temperature[row] = init.temperature
        b.top_p[row] = init.top_p
        b.top_k[row] = init.top_k
        b.seeds[row] = init.seed
        b.steps[row] = 0
        b.budgets[row] = init.budget
        b.min_frames[row] = init.min_frames
        b.ras_history[row] = -1
        b.ras_len[row] = init.ras_len
        b.rep_penalty[row] = init.repetition_penalty
        b.rep_history[row] = 0
        start, end = init.align_span or (0, 0)
        b.align_start[row] = start
        b.align_len[row] = end - start
        b.active[row] = not init.paused

    def set_table_entries(self, rows: list[int], cols: list[int], blocks: list[int]) -> None:
        """Write KV block ids into the rows' block tables: `block_tables[rows[i], cols[i]] = blocks[i]`
        (a request's new blocks as it grows), in one indexed write."""
        b = self.buffers
        index = torch.tensor([rows, cols], dtype=torch.int64).to(self.device)
        values = torch.tensor(blocks, dtype=b.block_tables.dtype).to(self.device)
        b.block_tables.index_put_((index[0], index[1]), values)

    def move_row(self, src: int, dst: int) -> None:
        """Copy every per-row buffer of `src` into `dst` (batch compaction)."""
        for name, t in self.buffers.tensors().items():
            if name in ("fast_k", "fast_v"):  # rewritten every frame; nothing to keep
                continue
            t[dst].copy_(t[src])

    def clear_row(self, row: int) -> None:
        """Make `row` an inert pad row: scratch block table, position 0 (context 1), inactive."""
        b = self.buffers
        b.active[row] = False
        b.positions[row] = 0
        b.block_tables[row].fill_(SCRATCH_BLOCK)
        b.input_columns[row].zero_()
        b.steps[row] = 0
        b.min_frames[row] = 0
        b.align_start[row] = 0  # (a pad row's span is empty, and its start inside the scratch block)
        b.align_len[row] = 0

    def rewind_row(self, row: int, frames: int, last_column: Tensor, ras_window: list[int]) -> None:
        """Take back a running row's newest `frames` frames (the loop guard's rewind, `Engine`): its
        position goes back by that many, its next input is `last_column [1 + N]` (the newest kept
        frame's column, or the prompt's last) and its RAS window holds `ras_window` (the kept frames'
        main-token indices, oldest first, at most the window). Its step counter keeps counting, so the
        frames sampled again draw new noise; its budget and min_frames grow by `frames`, so that both
        still count the frames kept (max_new_frames and min_new_frames are about the audio). Only for
        runners without a repetition penalty, whose ring of past frames is not rebuilt here."""
        if self.repetition is not None:
            raise ValueError("rewind_row does not restore the repetition penalty's history")
        b = self.buffers
        b.positions[row] -= frames
        b.budgets[row] += frames
        b.min_frames[row] += frames
        b.input_columns[row].copy_(last_column.to(self.device))
        window = torch.full((b.ras_history.shape[1],), -1, dtype=torch.int64)
        if ras_window:
            kept = torch.tensor(ras_window[-window.shape[0] :], dtype=torch.int64)
            window[window.shape[0] - kept.shape[0] :] = kept
        b.ras_history[row].copy_(window.to(self.device))

    def set_min_frames(self, row: int, frames: int) -> None:
        """A running row's min_frames: the end token is masked while its step counter is below it (a
        refused end token masks the next step; `Engine._refuse_end`)."""
        self.buffers.min_frames[row] = frames

    def set_sampling(self, row: int, temperature: float, top_p: float) -> None:
        """A running row's temperature and top-p from its next frame on (the loop guard's retry)."""
        self.buffers.temperature[row] = temperature
        self.buffers.top_p[row] = top_p

    def set_active(self, row: int, active: bool) -> None:
        self.buffers.active[row] = active

    # ---- prefill (one request or several packed; replayed from a graph per token bucket, or eager) -----

    @torch.inference_mode()
    def prefill(self, prompt: Tensor, block_table: list[int]) -> None:
        """Write the K/V of every prompt column except the last into the request's blocks.

        The last column is the first decode step's input, so the first frame comes out of the same
        `decode_step` as every later one (same math as sampling from the prefill's last position).
        With `prefill_graphs`, a prompt of 2 or more columns to prefill replays its token bucket's graph
        (attention as in `prefill_pass`); otherwise it runs here with the dense causal kernel.
        prompt: `[T, 1 + N]` int64.
        """
        T = prompt.shape[0] - 1
        if T <= 0:
            return
        self.prefill_passes += 1
        if T > 1 and self.prefill_graphs is not None and self.prefill_graphs.run([(prompt, block_table)]):
            return
        m = self.model
        frames = prompt[:T].to(self.device).unsqueeze(0)
        table = torch.tensor(block_table, dtype=torch.int64, device=self.device)
        slots = self.kv.slots_for_positions(table, torch.arange(T, device=self.device))

        def write_kv(i, k, v):
            self.kv.write(i, slots, k[0], v[0])

        def attend_layer(i):
            def attend(q, k, v):
                write_kv(i, k, v)
                return dense_causal_attend(q, k, v)

            return attend

        # Only the K/V are kept, so the last layer stops after projecting them (its attention,
        # feed-forward and the final norm would be a sixth of a 4-layer prefill's work, unused). One
        # position goes the full way: at T == 1 the CUDA decode kernel, not the torch path, makes K.
        if T > 1:
            run_layers_kv_only(m.layers, m.embed(frames), m.freqs_cis[:T], attend_layer, write_kv)
        else:
            m.slow_layers(m.embed(frames), m.freqs_cis[:T], attend_layer)

    @torch.inference_mode()
    def prefill_packed(self, prompts: list[Tensor], block_tables: list[list[int]]) -> None:
        """`prefill` of several requests in one forward pass: their prompt columns (all but each one's
        last) packed into one sequence of at most PACKED_PREFILL_TOKENS positions per pass (with prefill
        graphs, the largest token bucket's; a longer prompt alone), attention causal within each request (on
        CUDA flash attention over the variable-length sequences, elsewhere a block-diagonal mask). On a GPU
        one request's eager prefill is bound by kernel launches (a few hundred per layer stack), so packing
        many costs about as much as one. The K/V equal `prefill`'s up to float rounding (the matrix products
        have other shapes). prompts: `[T_i, 1 + N]` int64 each.
        """
        group: list[tuple[Tensor, list[int]]] = []
        size = 0
        # A pass the graphs can take, where they run (a longer prompt still goes alone, eagerly).
        limit = PACKED_PREFILL_TOKENS if self.prefill_graphs is None else self.prefill_graphs.largest
        for prompt, table in zip(prompts, block_tables, strict=True):
            n = prompt.shape[0] - 1
            if n <= 0:
                continue
            if group and size + n > limit:
                self._prefill_group(group)
                group, size = [], 0
            group.append((prompt, table))
            size += n
        if group:
            self._prefill_group(group)

    def _prefill_group(self, group: list[tuple[Tensor, list[int]]]) -> None:
        if len(group) == 1:  # one prompt: as a request prefilled alone
            self.prefill(*group[0])
            return
        self.prefill_passes += 1
        if self.prefill_graphs is not None and self.prefill_graphs.run(group):
            return
        p = pack_prompts(group, self.kv.block_size)
        dev = self.device
        columns, positions, slots = p.columns.to(dev), p.positions.to(dev), p.slots.to(dev)
        if self.varlen_prefill:
            self.prefill_pass(columns, positions, slots, cu_seqlens=p.cu_seqlens.to(dev), max_len=p.longest)
        else:
            self.prefill_pass(columns, positions, slots, segments=p.segments.to(dev))

    @torch.inference_mode()
    def prefill_pass(
        self,
        frames: Tensor,
        positions: Tensor,
        slots: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        max_len: int = 0,
        segments: Tensor | None = None,
    ) -> None:
        """One packed prefill forward pass on the device, no host sync (what `PrefillGraphs` captures):
        frames `[S, 1 + N]` int64 prompt columns, positions `[S]` int64 (each column's position in its
        own prompt), slots `[S]` int64 (where its K/V go). Attention is causal within each sequence:
        flash varlen over `cu_seqlens` `[n + 1]` int32 (sequences no longer than `max_len`), or SDPA
        with the block-diagonal causal mask of `segments` `[S]` (a sequence id per column)."""
        m = self.model
        if cu_seqlens is not None:

            def attention(q, k, v):
                return varlen_causal_attend(q, k, v, cu_seqlens, max_len)
        else:
            assert segments is not None, "prefill_pass needs cu_seqlens or segments"
            mask = (segments[:, None] == segments[None, :]) & (positions[:, None] >= positions[None, :])

            def attention(q, k, v):
                return packed_causal_attend(q, k, v, mask)

        def write_kv(i, k, v):
            self.kv.write(i, slots, k[0], v[0])

        def attend_layer(i):
            def attend(q, k, v):
                write_kv(i, k, v)
                return attention(q, k, v)

            return attend

        run_layers_kv_only(
            m.layers, m.embed(frames.unsqueeze(0)), m.freqs_cis[positions], attend_layer, write_kv
        )

    # ---- the frame step ------------------------------------------------------------------------------

    def slow_step(self, b: int, table_width: int | None = None) -> tuple[Tensor, Tensor]:
        """Slow AR at each row's position: write K/V (inactive rows -> scratch), attend over the paged
        context. Returns hidden states `(pre_norm, post_norm)`, each `[b, dim]`. table_width: read
        only the first that many blocks of each block table (an eager step may: `CpuFrameStep` does);
        None: the whole table, as a captured step must."""
        m, bufs, kv = self.model, self.buffers, self.kv
        pos = bufs.positions[:b]
        slots = self.kv_slots(b)
        tables = bufs.block_tables[:b, :table_width]
        context_lens = pos + 1
        fused = fused_kernels_enabled(bufs.input_columns)
        slot_offset = slots * (kv.k.shape[-2] * kv.k.shape[-1]) if fused else None
        if self.paged_attention is paged_decode_attention:  # torch path: table work once for all layers
            torch_attention = PagedDecodeAttention(tables, context_lens, kv.block_size)

            def paged_attention(q, i):
                return torch_attention(q, kv.k[i], kv.v[i], self.scale)
        else:

            def paged_attention(q, i):
                return self.paged_attention(q, kv.k[i], kv.v[i], tables, context_lens, self.scale)

        def attend_layer(i):
            def attend(q, k, v):
                if k is not None:  # (else the fused kernel already wrote them to kv_dest)
                    kv.write(i, slots, k[:, 0], v[:, 0])
                if self.aligner is not None and i == self.aligner.layer:
                    self.write_alignment(b, q[:, 0], tables)
                return paged_attention(q[:, 0], i).unsqueeze(1)

            if slot_offset is None:  # not fused
                return Attend(attend)
            return Attend(attend, KVDest(kv.k[i].view(-1), kv.v[i].view(-1), slot_offset, kv.k.shape[-1]))

        x = m.embed(bufs.input_columns[:b].unsqueeze(1))
        h_pre, h_post = m.slow_layers(x, m.freqs_cis[pos].unsqueeze(1), attend_layer)
        return h_pre[:, 0], h_post[:, 0]

    def write_alignment(self, b: int, q: Tensor, tables: Tensor, tokens: int = ALIGN_MAX_TOKENS) -> None:
        """Rows `[:b]`'s text positions into `out`'s align column, from the aligner layer's queries
        `q [b, H, D]` (`tts.engine.aligner.text_alignment`; `tables` as the step reads them)."""
        assert self.aligner is not None  # (callers check)
        bufs = self.buffers
        position = text_alignment(
            q,
            self.kv.k[self.aligner.layer],
            tables,
            bufs.align_start[:b],
            bufs.align_len[:b],
            self.align_heads,
            self.align_kv_heads,
            self.scale,
            tokens,
        )
        bufs.out[:b, self.out_layout.align].copy_(position)

    def kv_slots(self, b: int) -> Tensor:
        """`[b]` int64: the KV pool slot each row's new K/V goes to (inactive rows: the scratch block)."""
        bufs, bs = self.buffers, self.kv.block_size
        pos = bufs.positions[:b]
        slots = paged_slots(bufs.block_tables[:b], pos.unsqueeze(1), bs).squeeze(1)
        return torch.where(bufs.active[:b], slots, SCRATCH_BLOCK * bs)

    def _fast_attend(self, b: int, k_pos: int):
        """attend() for fast position k_pos: write slot k_pos, attend to slots 0..k_pos of this frame.
        Slots above k_pos still hold the previous frame's values and are never read."""
        bufs = self.buffers
        fused = fused_kernels_enabled(bufs.input_columns)

        def attend_layer(i):
            def attend(q, k, v):
                if k is not None:  # (else the fused kernel already wrote them to kv_dest)
                    bufs.fast_k[i, :b, :, k_pos].copy_(k[:, 0])
                    bufs.fast_v[i, :b, :, k_pos].copy_(v[:, 0])
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    bufs.fast_k[i, :b, :, : k_pos + 1],
                    bufs.fast_v[i, :b, :, : k_pos + 1],
                    scale=self.fast_scale,
                    enable_gqa=True,
                )
                return o.transpose(1, 2)

            if not fused:
                return Attend(attend)
            head_stride = bufs.fast_k.shape[-2] * bufs.fast_k.shape[-1]
            dest = KVDest(
                bufs.fast_k[i].view(-1), bufs.fast_v[i].view(-1), self.fast_row_offset[k_pos, :b], head_stride
            )
            return Attend(attend, dest)

        return attend_layer

    def decode_step(self, b: int, variant: str | None = None, table_width: int | None = None) -> None:
        """One frame for rows `[:b]` (see the module docstring). Graph-capturable.

        variant "topk": every row's top_k is in [1, SAMPLER_TOPK_CAP], so the CUDA sampler may select
        that many candidates before sorting (identical draws, far fewer sorted elements).
        table_width: as for `slow_step` (eager steps only). A CPU engine runs `CpuFrameStep` instead."""
        cap = SAMPLER_TOPK_CAP if variant == "topk" else None
        with torch.inference_mode():
            h_pre, h_post = self.slow_step(b, table_width)
            penalty = self.repetition_penalty(b)
            sem_logits = self.main_logits(b, h_post, penalty)
            rows = self.row_params(b)
            # The torch sampler takes the frame's noise for every draw from one batched computation
            # (streams 0 = main token, k = codebook k, N + 1 = RAS fallback); the CUDA kernels hash
            # their own noise.
            frame = None
            if not fused_kernels_enabled(sem_logits):
                noise = frame_log_noise(rows.seeds, rows.steps, *self.noise_shape(sem_logits))
                frame = FrameDraws(noise, DrawSettings(rows.temperature, rows.top_p, rows.top_k))
            idx = self.sample_main(b, sem_logits, rows, cap, frame)
            token, codes = self.first_codes(idx)
            self.fast_ar(b, h_pre, h_post, codes, self.drawer(b, rows, penalty, cap, frame))
            self.end_frame(b, token, codes, idx)

    # The parts of the frame step (`CpuFrameStep` composes them too).

    def main_logits(self, b: int, h_post: Tensor, penalty: Tensor | None) -> Tensor:
        """`[b, n_sem (+1)]` logits of the main token over [semantic ids..., end token] from the slow
        hidden state `h_post [b, dim]`: no end token before a row's min_new_frames, then the
        repetition penalty `[b, 1]` (None: none)."""
        bufs = self.buffers
        sem_logits = F.linear(h_post, self.semantic_head)
        if self.has_eos_column:  # min_new_frames: no end token before that many frames
            sem_logits[:, -1].masked_fill_(bufs.steps[:b] < bufs.min_frames[:b], float("-inf"))
        if penalty is not None:
            sem_logits = apply_repetition_penalty(sem_logits, self._main_penalty_ids(b), penalty)
        return sem_logits

    def noise_shape(self, sem_logits: Tensor) -> tuple[int, int]:
        """(streams, ids) of the torch sampler's noise for one frame: the main token (0), each codebook
        (k), the RAS fallback (N + 1); as many ids as the widest of the main and residual logits."""
        return self.config.num_codebooks + 2, max(sem_logits.shape[1], self.n_residual)

    def row_params(self, b: int) -> RowParams:
        """Rows `[:b]`'s sampling parameters and keys (views of the buffers)."""
        bufs = self.buffers
        return RowParams(bufs.temperature[:b], bufs.top_p[:b], bufs.top_k[:b], bufs.seeds[:b], bufs.steps[:b])

    def sample_main(
        self, b: int, sem_logits: Tensor, rows: RowParams, cap: int | None, frame: FrameDraws | None
    ) -> Tensor:
        """`[b]` int64: the main token's index in [semantic ids..., end token] (RAS applied)."""
        bufs, high = self.buffers, self.config.num_codebooks + 1
        window, window_len = bufs.ras_history[:b], bufs.ras_len[:b]
        return sample_main_token(sem_logits, rows, window, window_len, self.n_sem, high, cap, frame)

    def first_codes(self, idx: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The main token id `[b]` for index `idx` and the frame's codes so far: `[c_0]`, derived from
        the main token (docs/fish_dual_ar.md §1.4 step 5)."""
        c = self.config
        token = torch.where(idx == self.n_sem, self.eos_token_id, idx + c.semantic_begin_id)
        return token, [torch.clamp(token - c.semantic_begin_id, 0, c.codebook_size - 1)]

    def drawer(
        self, b: int, rows: RowParams, penalty: Tensor | None, cap: int | None, frame: FrameDraws | None
    ):
        """`draw(logits [b, n], k) -> [b]`: codebook k's code from its fast logits (penalty, sampler)."""
        rep_history = self.buffers.rep_history[:b]

        def draw(logits: Tensor, k: int) -> Tensor:
            if penalty is not None:
                logits = apply_repetition_penalty(logits, rep_history[:, k + 1], penalty)
            return sample(logits, rows, stream=k, top_k_cap=cap, frame=frame)

        return draw

    def fast_ar(self, b: int, h_pre: Tensor, h_post: Tensor, codes: list[Tensor], draw) -> None:
        """The fast AR through the model's modules: position 0 on the slow hidden state (its logits are
        never used), then one position per remaining codebook, appending `draw(logits, k)` to `codes`
        (docs/fish_dual_ar.md §1.4 steps 4-6)."""
        m, c = self.model, self.config
        if c.num_codebooks == 1:
            return
        x = m.fast_input(h_pre, h_post).unsqueeze(1)
        m.fast_layers_forward(x, m.fast_freqs_cis[0:1], self._fast_attend(b, 0))
        for k in range(1, c.num_codebooks):
            x = m.fast_embeddings(codes[k - 1]).unsqueeze(1)
            y = m.fast_layers_forward(x, m.fast_freqs_cis[k : k + 1], self._fast_attend(b, k))
            codes.append(draw(m.fast_logits(y[:, 0])[:, : self.n_residual], k))

    def end_frame(self, b: int, token: Tensor, codes: list[Tensor], idx: Tensor) -> None:
        """Write the frame `[token, c_0 .. c_N-1]` to `out` and advance every active row."""
        self._advance(b, torch.stack([token, *codes], dim=1), idx)

    def repetition_penalty(self, b: int) -> Tensor | None:
        """`[b, 1]` float32: each row's penalty for this frame (1 on a row's first frame), or None when
        the runner has no repetition mode."""
        if self.repetition is None:
            return None
        bufs = self.buffers
        return torch.where(bufs.steps[:b] > 0, bufs.rep_penalty[:b], 1.0).unsqueeze(1)

    def _main_penalty_ids(self, b: int) -> Tensor:
        """`[b, K]` int64 indices into the main-token logits (`[semantic ids..., end token]`) that the
        repetition penalty hits this frame; other token ids map outside them (ignored). See the module
        docstring for the two modes."""
        c, hist = self.config, self.buffers.rep_history[:b]
        if self.repetition == "s1":
            i = self.buffers.steps[:b] - 1  # frames in the history (the first frame is never in it)
            oldest = torch.where(i >= REPETITION_WINDOW, i % REPETITION_WINDOW, 0)
            tokens = hist.gather(2, oldest.view(b, 1, 1).expand(b, hist.shape[1], 1)).squeeze(2)
        else:
            tokens = hist[:, 0]
        index = tokens - c.semantic_begin_id
        index = torch.where((tokens < c.semantic_begin_id) | (tokens > c.semantic_end_id), -1, index)
        if self.has_eos_column:
            index = torch.where(tokens == self.eos_token_id, self.n_sem, index)
        return index

    def _advance(self, b: int, frame: Tensor, idx: Tensor) -> None:
        """Write the frame to `out` and move every active row's state one frame forward, in place."""
        bufs, cols = self.buffers, self.out_layout
        active = bufs.active[:b]
        steps = bufs.steps[:b]
        done = active & (
            (frame[:, 0] == self.eos_token_id)
            | (steps + 1 >= bufs.budgets[:b])
            | (bufs.positions[:b] + 2 > self.max_blocks_per_seq * self.kv.block_size)
        )
        # The RAS window takes every main token except the first frame's (docs/fish_dual_ar.md §4.1).
        push = (active & (steps > 0)).unsqueeze(1)
        history = bufs.ras_history[:b]
        history.copy_(torch.where(push, torch.cat([history[:, 1:], idx.unsqueeze(1)], dim=1), history))
        if self.repetition is not None:  # the repetition ring takes every frame but the first, too
            hist = bufs.rep_history[:b]
            slot = ((steps - 1).clamp(min=0) % REPETITION_WINDOW).view(b, 1, 1).expand(b, hist.shape[1], 1)
            written = hist.scatter(2, slot, frame.unsqueeze(2))
            hist.copy_(torch.where(push.unsqueeze(2), written, hist))
        out = bufs.out[:b]
        out[:, cols.frame].copy_(frame)
        out[:, cols.emitted].copy_(active)
        out[:, cols.done].copy_(done)
        bufs.input_columns[:b].copy_(torch.where(active.unsqueeze(1), frame, bufs.input_columns[:b]))
        bufs.positions[:b].add_(active.long())
        steps.add_(active.long())
        active.logical_and_(~done)
