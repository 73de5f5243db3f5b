"""The frame step on a CPU: `ModelRunner.decode_step`'s data flow, run eagerly and fast.

A CPU has no graphs, so its step may do what a captured step may not, and does, to cut op dispatch
(the CPU step is bound by it): read the block tables only as wide as the batch's longest context; run
the layers through `cpu_decode` (the modules' math without the modules, bit-identical; RoPE factors
built once, KV pool views made once; a lone row's consecutive KV blocks read as a slice,
`SlicedDecodeAttention`); make the sampler's noise for the next frames in one batch and keep
the sampler settings while the rows' parameters do not change (same values as made per frame); skip
the repetition penalty when every row's is 1 (an exact no-op). Same contract as the captured step:
`decode_step(b, variant)` on the runner's buffers, one frame for rows `[:b]`; the codes equal the
module path's (tests/test_cpu_decode.py, tests/test_engine.py).

The engine picks it at construction for a CPU device. With the Triton kernels on (the interpreter in
tests) it runs the runner's own step, at the trimmed table width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tts.engine.cpu_decode import LayerWeights, block_weights, decode_layers, decode_layers_kv_only
from tts.engine.model_runner import ModelRunner
from tts.model.kernels import fused_kernels_enabled
from tts.model.kv_cache import SCRATCH_BLOCK, PagedDecodeAttention, paged_decode_attention
from tts.model.layers import Rope
from tts.model.sampling import DrawSettings, FrameDraws, frame_log_noise, ras_counted, ras_high_settings

# Frames of sampler noise made in one batch, and the most rows x frames of one batch.
NOISE_FRAMES_AHEAD = 16
NOISE_ROWS = 64


class SlicedDecodeAttention(PagedDecodeAttention):
    """`PagedDecodeAttention` that reads a single row's blocks as a slice of the pool when they are
    consecutive (a lone request's usual layout) instead of gathering a copy: the same contiguous layout
    and alignment, so the same results, one copy less per layer. The table's tail past the row's blocks
    (scratch entries: blocks are taken as a request grows) is read as the pool's next blocks instead of
    the scratch block: those positions are past the context and masked, and a masked position adds
    exactly zero whatever finite K/V it holds (the pool only ever holds finite values). It reads the
    block table on the host, which a captured CUDA graph must not: the CPU frame step only."""

    def __init__(self, block_tables: Tensor, context_lens: Tensor, block_size: int):
        super().__init__(block_tables, context_lens, block_size)
        self.first_block: int | None = None
        if block_tables.shape[0] == 1:
            ids = self.index.tolist()
            n = len(ids)
            while n > 1 and ids[n - 1] == SCRATCH_BLOCK:
                n -= 1
            if ids[0] != SCRATCH_BLOCK and ids[:n] == list(range(ids[0], ids[0] + n)):
                self.first_block = ids[0]

    def _gather(self, cache: Tensor) -> Tensor:
        if self.first_block is not None and self.first_block + self.index.shape[0] <= cache.shape[0]:
            blocks = cache[self.first_block : self.first_block + self.index.shape[0]]
            if blocks.data_ptr() % 64 == 0:  # the alignment of a fresh CPU allocation
                return blocks.view(1, -1, *cache.shape[2:])
        return super()._gather(cache)


class CpuFrameStep:
    """`decode_step(b, variant)` for a CPU engine over `runner`'s model, KV cache and buffers (see the
    module docstring). The model must be in the CPU decode layout (`use_cpu_decode_layout`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        model, c = runner.model, runner.config
        # The runner's semantic head as the transpose of a contiguous [dim, n] matrix: the layout a CPU
        # matrix-vector product reads fastest (docs/benchmarks.md); same values.
        runner.semantic_head = runner.semantic_head.t().contiguous().t()
        # RoPE factors built once: the fast AR's for each codebook position, `[1, 1, D]`, and the slow
        # AR's for every position, `[max_seq_len, 1, D]` fp32 (1 MB for the default model), of which a
        # step picks its rows'.
        fast = [Rope(model.fast_freqs_cis[k : k + 1]).factors() for k in range(c.num_codebooks)]
        cos, sin = Rope(model.freqs_cis).factors()  # [1, max_seq_len, 1, D]
        self.fast_rope = [(fc[0], fs[0]) for fc, fs in fast]
        self.slow_rope = cos[0], sin[0]
        # None where cpu_decode does not apply (then the modules run).
        slow_layers = block_weights(model.layers, model.norm)
        fast_layers = block_weights(model.fast_layers, model.fast_norm)
        self.layers: tuple[LayerWeights, LayerWeights] | None = None  # (slow, fast)
        if slow_layers is not None and fast_layers is not None:
            self.layers = slow_layers, fast_layers
        # Per-(batch size, position) attend functions over fixed views of the fast KV buffers, the last
        # frame's sampler settings with the values they came from, the sampler noise of the coming
        # frames, and each slow layer's KV pool views.
        self._fast_slots: dict[tuple[int, int], tuple] = {}
        self._settings: tuple[tuple, DrawSettings, DrawSettings, Tensor] | None = None
        self._noise: tuple[tuple, list[int], Tensor] | None = None
        self._kv_views: list[tuple[Tensor, Tensor, Tensor, Tensor]] | None = None

    def decode_step(self, b: int, variant: str | None = None) -> None:
        """One frame for rows `[:b]`, as `ModelRunner.decode_step` (variant is a CUDA sampler's and
        ignored here)."""
        r, bufs = self.runner, self.runner.buffers
        width = self._table_width(b)
        if fused_kernels_enabled(bufs.input_columns):  # (the Triton interpreter in tests)
            r.decode_step(b, variant, table_width=width)
            return
        with torch.inference_mode():
            h_pre, h_post = self._slow_step(b, width)
            penalty = None
            if r.repetition is not None and any(p != 1.0 for p in bufs.rep_penalty.tolist()[:b]):
                penalty = r.repetition_penalty(b)  # (all 1: an exact no-op, skipped)
            sem_logits = r.main_logits(b, h_post, penalty)
            rows = r.row_params(b)
            frame = FrameDraws(self._frame_noise(b, *r.noise_shape(sem_logits)), *self._draw_settings(b))
            idx = r.sample_main(b, sem_logits, rows, None, frame)
            token, codes = r.first_codes(idx)
            draw = r.drawer(b, rows, penalty, None, frame)
            if self.layers is None:
                r.fast_ar(b, h_pre, h_post, codes, draw)
            elif r.config.num_codebooks > 1:
                self._fast_ar(b, r.model.fast_input(h_pre, h_post), codes, draw)
            r.end_frame(b, token, codes, idx)

    def _table_width(self, b: int) -> int:
        """Blocks of the block tables this step reads: a power of two covering the longest context in
        the batch (few distinct shapes), at most the table's width. Masked slots contribute exact
        zeros, so a row's result does not depend on the width (tested: batched == solo codes)."""
        r = self.runner
        longest = int(r.buffers.positions[:b].max())
        return min(r.max_blocks_per_seq, 1 << (longest // r.kv.block_size).bit_length())

    def _slow_step(self, b: int, width: int) -> tuple[Tensor, Tensor]:
        """`ModelRunner.slow_step` through cpu_decode: the same K/V writes (`kv.write`'s index_copy_)
        and paged attention, on each layer's pool and flat slot view made once (`kv.k[i]` and its
        view are ops, 6 a layer)."""
        r = self.runner
        if self.layers is None or r.paged_attention is not paged_decode_attention:
            return r.slow_step(b, width)
        kv, bufs = r.kv, r.buffers
        pos = bufs.positions[:b]
        slots = r.kv_slots(b)
        torch_attention = SlicedDecodeAttention(bufs.block_tables[:b, :width], pos + 1, kv.block_size)
        if self._kv_views is None:
            self._kv_views = [
                (kv.k[i], kv.v[i], kv.k[i].view(-1, *kv.k.shape[-2:]), kv.v[i].view(-1, *kv.v.shape[-2:]))
                for i in range(kv.k.shape[0])
            ]
        views = self._kv_views

        aligner = r.aligner.layer if r.aligner is not None else -1
        tables = bufs.block_tables[:b, :width]

        def attend(i, q, k, v):
            k_pool, v_pool, k_flat, v_flat = views[i]
            k_flat.index_copy_(0, slots, k)
            v_flat.index_copy_(0, slots, v)
            if i == aligner:  # the text positions: spans only as long as the batch's longest
                r.write_alignment(b, q, tables, max(1, int(bufs.align_len[:b].max())))
            return torch_attention(q, k_pool, v_pool, r.scale)

        (blocks, final_norm), _ = self.layers
        cos, sin = self.slow_rope
        x = r.model.embed(bufs.input_columns[:b])
        return decode_layers(
            blocks, final_norm, x, cos.index_select(0, pos), sin.index_select(0, pos), attend
        )

    def _fast_ar(self, b: int, x: Tensor, codes: list[Tensor], draw) -> None:
        """`ModelRunner.fast_ar` through cpu_decode: position 0 on `x [b, fast_dim]` (only its K/V are
        ever read, so its last layer stops there), then one position per remaining codebook, appending
        `draw(logits, k)` to `codes`."""
        r, m = self.runner, self.runner.model
        assert self.layers is not None  # (decode_step checked)
        _, (blocks, final_norm) = self.layers
        rope = self.fast_rope
        decode_layers_kv_only(blocks, x, *rope[0], *self._fast_slot(b, 0))
        for k in range(1, r.config.num_codebooks):
            attend = self._fast_slot(b, k)[0]
            _, y = decode_layers(blocks, final_norm, m.fast_embeddings(codes[k - 1]), *rope[k], attend)
            codes.append(draw(m.fast_logits(y)[:, : r.n_residual], k))

    def _fast_slot(self, b: int, k_pos: int):
        """`(attend, write_kv)` in cpu_decode's form for fast position k_pos of rows `[:b]`: the same
        writes and SDPA as `ModelRunner._fast_attend`, on views of the fast KV buffers made once per (b,
        k_pos) instead of by indexing every call (each view is an op). The buffers are never
        reallocated, so the views stay valid."""
        slot = self._fast_slots.get((b, k_pos))
        if slot is None:
            bufs, scale = self.runner.buffers, self.runner.fast_scale
            views = [
                (
                    bufs.fast_k[i, :b, :, k_pos],
                    bufs.fast_v[i, :b, :, k_pos],
                    bufs.fast_k[i, :b, :, : k_pos + 1],
                    bufs.fast_v[i, :b, :, : k_pos + 1],
                )
                for i in range(bufs.fast_k.shape[0])
            ]

            def write_kv(i, k, v):
                views[i][0].copy_(k)
                views[i][1].copy_(v)

            def attend(i, q, k, v):
                write_kv(i, k, v)
                o = F.scaled_dot_product_attention(
                    q.unsqueeze(2), views[i][2], views[i][3], scale=scale, enable_gqa=True
                )
                return o.squeeze(2)

            slot = self._fast_slots[(b, k_pos)] = attend, write_kv
        return slot

    def _draw_settings(self, b: int) -> tuple[DrawSettings, DrawSettings, Tensor]:
        """The frame's sampler settings `(settings, RAS high settings, RAS counted mask)`, kept while
        rows `[:b]`'s sampling parameters are unchanged (about 25 ops a frame otherwise).

        The key is the parameters' values (reading them costs no sync on a CPU). Version counters
        would be cheaper but buffers made under `torch.inference_mode()` have none."""
        bufs = self.runner.buffers
        params = (bufs.temperature, bufs.top_p, bufs.top_k, bufs.ras_len)
        values = [tuple(t.tolist()[:b]) for t in params]
        key = (b, *values)
        if self._settings is None or self._settings[0] != key:
            temperature, top_p, top_k = bufs.temperature[:b], bufs.top_p[:b], bufs.top_k[:b]
            settings = DrawSettings(temperature, top_p, top_k)
            high = ras_high_settings(temperature, top_p, top_k, settings)
            settings.all_sampled = all(t > 0 for t in values[0])  # values[0]: the temperatures; no greedy row
            high.all_sampled = True  # (temperature 1.0 in every row)
            self._settings = key, settings, high, ras_counted(bufs.ras_history[:b], bufs.ras_len[:b])
        return self._settings[1:]

    def _frame_noise(self, b: int, streams: int, n: int) -> Tensor:
        """`frame_log_noise` of rows `[:b]` for this frame, `[b, streams, n]`.

        The noise depends only on (seed, step, stream, token id), so the next frames' noise is made
        in the same batch (`NOISE_FRAMES_AHEAD` frames while every row is active, at most
        `NOISE_ROWS` rows in all) and used while each row's step advances by one a frame: about 60
        small ops once per 16 frames instead of every frame, the same values. Any other change (a
        row joins, leaves or stops, other seeds) makes it again."""
        bufs = self.runner.buffers
        seeds, steps = bufs.seeds.tolist()[:b], bufs.steps.tolist()[:b]
        key = (b, tuple(seeds), streams, n)
        if self._noise is not None and self._noise[0] == key:
            first_steps, noise = self._noise[1:]
            j = steps[0] - first_steps[0]
            if 0 <= j < noise.shape[1] and all(s - f == j for s, f in zip(steps, first_steps, strict=True)):
                return noise[:, j]
        ahead = max(1, min(NOISE_FRAMES_AHEAD, NOISE_ROWS // b)) if all(bufs.active.tolist()[:b]) else 1
        step_grid = bufs.steps[:b].unsqueeze(1) + torch.arange(ahead, device=bufs.steps.device)  # [b, ahead]
        seed_grid = bufs.seeds[:b].unsqueeze(1).expand(b, ahead)
        noise = frame_log_noise(seed_grid.reshape(-1), step_grid.reshape(-1), streams, n)
        noise = noise.view(b, ahead, streams, n)
        self._noise = key, steps, noise
        return noise[:, 0]
