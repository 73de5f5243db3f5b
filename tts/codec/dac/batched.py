"""Batched streaming decode for the modded DAC: many streams continued in one call, state in buffers.

`BatchedDACDecoder` is the `BatchedStreamDecoder` of `DACCodec` (`codec.batched_stream(max_streams)`),
what the codec stage calls once per engine iteration for every stream with a chunk due. It computes what
`DACStreamingDecoder` computes, for B streams at once, but keeps every stream's state in buffers
allocated once (one slot per stream plus a scratch slot for pad rows) and never syncs with the host, so
that a CUDA graph can capture `decode` for a fixed (B, T):

* every stride-1 causal conv of the decode path (the ConvNeXt depthwise convs, the decoder's convs and
  residual units) keeps its last `padding` input samples, `[S + 1, C, padding]`;
* every transposed conv that overlaps its neighbours (the decoder blocks', kernel 2 x stride) keeps its
  last `context` input frames, `[S + 1, C, context]` (the quantizer's upsampling convs do not overlap
  and keep nothing);
* every post-transformer layer keeps its last `window - 1` keys and values, already rotated at their
  absolute RoPE positions, `[S + 1, heads, window - 1, head_dim]`, oldest first;
* `positions [S + 1]` int64: frames decoded so far per slot (the absolute position of the next frame).

A call prepends each row's state to its input at every stage, runs the stage over `[B, C, state + T x
rate]`, and takes the row's new state as the window that ends at the row's own valid end (`lengths[i]`
frames times the stage's samples per frame), so pad frames at the end of a short row never reach the
state, and a row of length 0 writes its old state back unchanged. Everything is causal, so pad frames
never influence a valid sample either.

On CUDA (Triton, `tts.model.kernels`) the decoder's elementwise work is fused: a conv followed by a Snake or a
residual unit runs without its bias, and one pass adds the bias (and a residual unit's input) and
applies the next Snake (`tts/kernels/snake.py`; the same arithmetic up to float rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.codec.base import BatchedStreamDecoder
from tts.codec.dac.net import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    Decoder,
    DecoderBlock,
    Identity,
    ResidualUnit,
    Snake1d,
    StreamSequential,
    Tanh,
)
from tts.model.kernels import fused_kernels_enabled, snake_ops
from tts.model.layers import Rope, precompute_freqs_cis

if TYPE_CHECKING:
    from tts.codec.dac.codec import DACCodec


def _window(x: Tensor, start: Tensor, n: int, dim: int) -> Tensor:
    """Row b of the result is `x[b].narrow(dim - 1, start[b], n)`: a per-row window along `dim`.

    x: `[B, ...]`; start: `[B]` int64 on x's device, each in `[0, x.shape[dim] - n]` (not checked: no
    host sync). Returns a new tensor shaped like x with `n` at `dim`. One `gather` with an expanded
    (not materialized) index.
    """
    B = x.shape[0]
    shape = [1] * x.dim()
    shape[0], shape[dim] = B, n
    index = (start.view(B, 1) + torch.arange(n, device=x.device)).view(shape)
    return x.gather(dim, index.expand(*x.shape[:dim], n, *x.shape[dim + 1 :]))


class _Rows:
    """The per-call view of the batch: which slots the rows continue, their valid lengths, and the
    current stage's samples per frame (`rate`, multiplied by each transposed conv's stride)."""

    __slots__ = ("slots", "lengths", "rate", "_ends")

    def __init__(self, slots: Tensor, lengths: Tensor):
        self.slots, self.lengths, self.rate = slots, lengths, 1
        self._ends: dict[int, Tensor] = {}

    def ends(self) -> Tensor:
        """`[B]` int64: each row's valid samples at the current stage (`lengths * rate`)."""
        end = self._ends.get(self.rate)
        if end is None:
            end = self._ends[self.rate] = self.lengths * self.rate
        return end


class BatchedDACDecoder(BatchedStreamDecoder):
    """Streaming decode of up to `max_streams` DAC streams in one call (see `BatchedStreamDecoder` for
    the contract: slots, the scratch slot `max_streams`, ragged `lengths`, output
    `[B, T * frame_length]` float32 on `device`).

    State lives in buffers allocated here, once, on the codec's device and in its decode dtype (the module
    docstring lists them; `positions` is public and read-only for callers). `decode` makes no host sync
    and no data-dependent Python branch and allocates only intermediates, so a CUDA graph may capture it
    for a fixed (B, T) (`graph_safe`); its inputs must then be static tensors the caller writes into.

    Stream length limit: RoPE rows come from a precomputed table of `max_frames` positions (the same bf16
    values as `precompute_freqs_cis`). Checking a stream against it would need the positions on the host
    (a sync), so `decode` does not check: the caller (the codec stage) counts each stream's frames on the
    host and must end or reset a stream before it passes `max_frames`. Frames past the limit are rotated
    as if at position `max_frames - 1` (clamped on the device, so an overrun never indexes out of bounds):
    wrong audio, no crash. The scratch slot's position is reset to 0 after every call, so pad rows of any
    length never overrun.

    Raises ValueError for `max_streams` or `max_frames` below 1, and in `decode` / `reset` (host-side
    checks only) for inputs of the wrong rank, size, dtype or device.
    """

    graph_safe = True

    def __init__(self, codec: DACCodec, max_streams: int, max_frames: int = 2**16):
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        if max_frames < 1:
            raise ValueError(f"max_frames must be at least 1, got {max_frames}")
        self.codec = codec
        self.model = codec.model
        self.max_streams = max_streams
        self.max_frames = max_frames
        self.device = codec.device
        self.dtype = self.model.decode_dtype
        self.frame_length = codec.frame_length
        slots = max_streams + 1

        def zeros(*size: int) -> Tensor:
            return torch.zeros(*size, device=self.device, dtype=self.dtype)

        # Conv states, keyed by module (the walk in `_run` looks them up as it meets the modules).
        self._state: dict[nn.Module, Tensor] = {}
        for module in self._decode_modules():
            if isinstance(module, CausalConv1d):
                if module.stride != 1:
                    raise ValueError("streaming is only defined for stride-1 convolutions")
                if module.padding:
                    self._state[module] = zeros(slots, module.conv.in_channels, module.padding)
            elif isinstance(module, CausalConvTranspose1d) and module.context:
                self._state[module] = zeros(slots, module.conv.in_channels, module.context)
        post = self.model.quantizer.post_module
        self.window = post.window
        keep = self.window - 1
        self._keys, self._values = [], []
        for layer in post.transformer_layers():
            a = layer.attention
            self._keys.append(zeros(slots, a.n_head, keep, a.head_dim))
            self._values.append(zeros(slots, a.n_head, keep, a.head_dim))
        # The decoder as one list for `_decoder_fused`: its blocks opened up, residual units whole.
        self._decoder_ops: list[nn.Module] = []
        for module in self.model.decoder.model:
            self._decoder_ops += list(module.block) if isinstance(module, DecoderBlock) else [module]
        self.positions = torch.zeros(slots, dtype=torch.int64, device=self.device)
        # Dilated convs by phases on CUDA (`_conv_by_phases`): cuDNN runs some dilated shapes of the
        # decoder's residual units in a generic kernel, 10x slower than the same conv undilated
        # (docs/benchmarks.md, "Where a codec call's time goes").
        self.dilated_by_phases = self.device.type == "cuda"
        # Row p depends only on p, so this equals every slice `WindowTransformer._freqs` takes.
        self._rope = precompute_freqs_cis(max_frames, post.head_dim, post.rope_base).to(self.device)

    def _decode_modules(self):
        q = self.model.quantizer
        yield from q.upsample.modules()
        yield from self.model.decoder.modules()

    def state_bytes(self) -> int:
        """Bytes of state held for all slots (conv contexts, keys and values, positions)."""
        tensors = [*self._state.values(), *self._keys, *self._values, self.positions]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def reset(self, slots: Tensor) -> None:
        """Start fresh streams in `slots` (`[k]` int64 on `device`): zero their state and positions.
        Device ops only (`index_fill_`); resetting the scratch slot is harmless."""
        slots = self.check_slots(slots)
        for buf in (*self._state.values(), *self._keys, *self._values, self.positions):
            buf.index_fill_(0, slots, 0)

    @torch.inference_mode()
    def decode(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        """Continue the streams in `slots` by `lengths` frames each.

        slots: `[B]` int64, distinct real slots plus any number of scratch-slot (`max_streams`) pad rows;
        codes: `[B, num_codebooks, T]` int64 (clamped into the codebooks; frames at `lengths[i]` and
        beyond influence nothing); lengths: `[B]` int64 in `[0, T]`. All on `device`. Returns
        `[B, T * frame_length]` float32 on `device`: row i's first `lengths[i] * frame_length` samples
        continue its stream, the rest is undefined. Raises ValueError for a wrong shape, dtype or device
        (T = 0 included). Values are not checked (that would sync): slots out of range or lengths outside
        `[0, T]` give undefined results or a device-side error.
        """
        self.check_inputs(slots, codes, lengths, self.codec.num_codebooks)
        rows = _Rows(slots, lengths)
        positions = self.positions.index_select(0, slots)
        z = self._transformer(self.model.lookup(codes), rows, positions)
        for stage in self.model.quantizer.upsample:
            z = self._run(stage, z, rows)
        if fused_kernels_enabled(z):
            audio = self._decoder_fused(z, rows)
        else:
            audio = self._run(self.model.decoder, z, rows)
        self.positions.index_copy_(0, slots, positions + lengths)
        # Pad rows may carry any length; keeping the scratch slot at 0 means they never walk off the RoPE
        # table, and its (finite) garbage keys stay masked as "before the stream started".
        self.positions[self.max_streams :].zero_()
        return audio[:, 0].float()

    # ---- the decode path, stage by stage -------------------------------------------------------------

    def _transformer(self, x: Tensor, rows: _Rows, positions: Tensor) -> Tensor:
        """The post transformer over `x [B, dim, T]` with each row's cached keys and values (the
        `WindowTransformer.forward` of one stream, per row). Cached key j of a row (j in 0..window-2,
        oldest first) sits at absolute position `positions - (window - 1) + j`, so in the concatenation
        [cache | new] every key k is at `positions - (window - 1) + k` and query t (key `window - 1 + t`)
        sees keys `t .. t + window - 1`: the window does not depend on the position, only the test
        "k holds a real frame" (`k >= window - 1 - positions`) does."""
        post = self.model.quantizer.post_module
        x = x.transpose(1, 2)
        B, T, _ = x.shape
        keep = self.window - 1
        steps = torch.arange(T, device=x.device)
        index = (positions.unsqueeze(1) + steps).clamp_(max=self.max_frames - 1)  # see the class docstring
        # [B, T, D/2, 2]; one Rope, so its fp32 factors are built once per call, not per layer.
        freqs = Rope(self._rope.index_select(0, index.flatten()).view(B, T, *self._rope.shape[1:]))
        k_idx = torch.arange(keep + T, device=x.device)
        in_window = (k_idx >= steps.unsqueeze(1)) & (k_idx <= steps.unsqueeze(1) + keep)  # [T, K]
        real = k_idx >= (keep - positions).unsqueeze(1)  # [B, K]
        mask = (in_window.unsqueeze(0) & real.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, K]
        for layer, k_cache, v_cache in zip(post.transformer_layers(), self._keys, self._values, strict=True):
            q, k, v = layer.qkv(x, freqs)
            k = torch.cat([k_cache.index_select(0, rows.slots), k], dim=2)
            v = torch.cat([v_cache.index_select(0, rows.slots), v], dim=2)
            k_cache.index_copy_(0, rows.slots, _window(k, rows.lengths, keep, dim=2))
            v_cache.index_copy_(0, rows.slots, _window(v, rows.lengths, keep, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = layer.finish(x, y)
        return post.norm(x).transpose(1, 2)

    def _run(self, module: nn.Module, x: Tensor, rows: _Rows) -> Tensor:
        """One module of the upsampling stages or the decoder over `x [B, C, T x rate]`, with state."""
        if isinstance(module, StreamSequential):
            for child in module:
                x = self._run(child, x, rows)
            return x
        if isinstance(module, Decoder):
            return self._run(module.model, x, rows)
        if isinstance(module, DecoderBlock):
            return self._run(module.block, x, rows)
        if isinstance(module, ResidualUnit):
            return x + self._run(module.block, x, rows)
        if isinstance(module, ConvNeXtBlock):
            return module.mix(x, self._conv(module.dwconv, x, rows))
        if isinstance(module, CausalConv1d):
            return self._conv(module, x, rows)
        if isinstance(module, CausalConvTranspose1d):
            return self._conv_transpose(module, x, rows)
        if isinstance(module, Snake1d | Tanh | Identity):
            return module(x)
        raise TypeError(f"no batched streaming rule for {type(module).__name__}")

    def _decoder_fused(self, x: Tensor, rows: _Rows) -> Tensor:
        """`_run(self.model.decoder, x, rows)` with the elementwise work fused (see the module docstring).

        `bias`: the last conv's bias, not yet added to x (the pass that follows adds it); `snaked`:
        snake(x) for the next module's first Snake, made by the pass that made x."""
        K = snake_ops()
        ops = self._decoder_ops
        bias: Tensor | None = None
        snaked: Tensor | None = None
        for i, module in enumerate(ops):
            following = ops[i + 1] if i + 1 < len(ops) else None
            if isinstance(module, Snake1d):
                x = snaked if snaked is not None else K.snake(x, module.alpha, bias)
                bias = snaked = None
            elif isinstance(module, ResidualUnit):
                s1, c1, s2, c2 = cast(
                    "tuple[Snake1d, CausalConv1d, Snake1d, CausalConv1d]", tuple(module.block)
                )
                if snaked is not None:
                    h = snaked
                elif bias is not None:  # x is a conv's output still without its bias
                    x, h = K.add_snake(x, bias, None, s1.alpha)
                else:
                    h = K.snake(x, s1.alpha)
                h = self._conv(c1, h, rows, bias=False)
                h = K.snake(h, s2.alpha, c1.conv.bias)
                h = self._conv(c2, h, rows, bias=False)
                alpha = _first_snake(following)
                x, snaked = K.add_snake(h, c2.conv.bias, x, alpha.alpha if alpha is not None else None)
                bias = None
            elif isinstance(module, CausalConv1d | CausalConvTranspose1d):
                assert bias is None, "two convs in a row: the decoder's layout changed"
                keep_bias = _first_snake(following) is None
                if isinstance(module, CausalConv1d):
                    x = self._conv(module, x, rows, bias=keep_bias)
                else:
                    x = self._conv_transpose(module, x, rows, bias=keep_bias)
                bias = None if keep_bias else module.conv.bias
            elif isinstance(module, Tanh | Identity):
                assert bias is None, "an unexpected module after a conv: the decoder's layout changed"
                x = module(x)
            else:
                raise TypeError(f"no fused batched rule for {type(module).__name__}")
        return x

    def _conv(self, module: CausalConv1d, x: Tensor, rows: _Rows, bias: bool = True) -> Tensor:
        """Stride-1 causal conv: the row's last `padding` samples in front instead of zeros. bias=False:
        without the conv's bias (the caller adds it)."""
        state = self._state.get(module)
        if state is not None:  # (kernel 1: no context)
            x = torch.cat([state.index_select(0, rows.slots), x], dim=-1)
            state.index_copy_(0, rows.slots, _window(x, rows.ends(), module.padding, dim=2))
        c = module.conv
        if self.dilated_by_phases and c.dilation[0] > 1:  # (stride 1: checked at init; it pads nothing)
            return _conv_by_phases(x, c.weight, c.bias if bias else None, c.dilation[0], c.groups)
        if bias:
            return c(x)
        return F.conv1d(x, c.weight, None, c.stride, c.padding, c.dilation, c.groups)

    def _conv_transpose(
        self, module: CausalConvTranspose1d, x: Tensor, rows: _Rows, bias: bool = True
    ) -> Tensor:
        """Causal transposed conv: with overlap, the row's last `context` input frames in front, and only
        the new frames' `T * stride` samples kept; then the stage's rate grows by the stride. bias=False:
        without the conv's bias (the caller adds it)."""
        T, stride = x.shape[-1], module.stride
        c = module.conv
        state = self._state.get(module)
        if state is not None:
            x = torch.cat([state.index_select(0, rows.slots), x], dim=-1)
            state.index_copy_(0, rows.slots, _window(x, rows.ends(), module.context, dim=2))
        if bias:
            y = c(x)
        else:
            padding = cast(tuple[int, ...], c.padding)  # ConvTranspose1d pads by numbers, never 'same'
            y = F.conv_transpose1d(
                x, c.weight, None, c.stride, padding, c.output_padding, c.groups, c.dilation
            )
        if state is None:
            y = y[..., : y.shape[-1] - module.overlap]
        else:
            skip = module.context * stride
            y = y[..., skip : skip + T * stride]
        rows.rate *= stride
        return y


def _conv_by_phases(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: int, groups: int = 1) -> Tensor:
    """`F.conv1d(x, weight, bias, dilation=dilation, groups=groups)` (stride 1, no padding) computed as an
    undilated conv over the `dilation` phases of x: output sample `q * d + r` only reads input samples
    `(q + j) * d + r`, so phase r (every d-th sample from r) convolved with the kernel undilated gives
    every d-th output from r. x: `[B, C, L]`; weight: `[O, C / groups, k]`; returns
    `[B, O, L - (k - 1) * d]` in x's dtype, the same sums in another order (equal up to float
    rounding). The phases are a reshape of x padded on the right to a multiple of d (the pad's outputs
    are dropped); shapes only, no host sync."""
    B, C, L = x.shape
    k = weight.shape[-1]
    n = L - (k - 1) * dilation  # outputs
    q = -(-n // dilation)  # outputs per phase
    x = F.pad(x, (0, (q + k - 1) * dilation - L))
    phases = x.view(B, C, q + k - 1, dilation).permute(0, 3, 1, 2).reshape(B * dilation, C, q + k - 1)
    y = F.conv1d(phases, weight, bias, groups=groups)  # [B * d, O, q]
    out = y.shape[1]
    y = y.view(B, dilation, out, q).permute(0, 2, 3, 1).reshape(B, out, q * dilation)
    return y[..., :n].contiguous()  # (copies only where the slice is not contiguous already)


def _first_snake(module: nn.Module | None) -> Snake1d | None:
    """The Snake a module applies first to its input (itself, or a residual unit's first), else None."""
    if isinstance(module, Snake1d):
        return module
    if isinstance(module, ResidualUnit) and isinstance(module.block[0], Snake1d):
        return module.block[0]
    return None
