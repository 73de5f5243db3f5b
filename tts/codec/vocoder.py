"""A learned causal vocoder for the mel codecs: log-mel frames -> STFT frames -> audio.

Why: without it, a mel codec turns its log-mel frames into audio with Griffin-Lim
(`melrvq.WindowedGriffinLim`), whose phase estimate on short windows sounds phasey and costs 16 FFT round
trips per window; the default codec names this vocoder in its codec.json (training/RESULTS.md: lower WER and
spectral distance). This model predicts each STFT frame's magnitude and phase directly from the log-mel
frames, in the manner of Vocos (Siuzdenko, "Vocos: Closing the gap between time-domain and Fourier-based
neural vocoders", 2023: a ConvNeXt stack over mel frames, a linear head to log-magnitude and phase, an inverse
STFT), made causal so that it streams with bounded left context.

Layout (the codec's, `melrvq`): 22050 Hz, log-mel of 80 Slaney mels, n_fft 1024, hop 256, centred
frames (mel frame j is centred on signal sample 256 j), four mel frames per codec frame.

* **Network.** A causal convolution (kernel 7) from 80 mels to `channels`, then `blocks` ConvNeXt blocks
  (causal depthwise convolution, kernel 7; LayerNorm; pointwise MLP of 3x width with GELU; learned
  per-channel scale; residual), a final LayerNorm and a linear head to 513 log-magnitudes and 513
  phases. STFT frame j depends on mel frames j - `receptive_frames` .. j only.
* **Synthesis.** The STFT frames go through an inverse real FFT and the Hann window, and are overlap-
  added at 256-sample steps, divided by the window's constant squared overlap (1.5 for a Hann window at
  a quarter hop). Audio comes out with the codec's 512-sample delay: emitted sample i is signal sample
  i - 512, so STFT frame j adds into emitted samples [256 j, 256 j + 1024), and once mel frame 4t + 3
  (the last of codec frame t) is known, every sample of codec frame t, emitted [1024 t, 1024 (t + 1)),
  is final: the vocoder adds no latency beyond Griffin-Lim's.
* **Streaming state** (`VocoderState`): the last `receptive_frames` log-mel frames (a fresh stream: the
  log floor, i.e. silence) and the not yet emitted overlap of the last three STFT frames (768 samples;
  fresh: zeros). `stream` continues from it, so streaming a clip in pieces equals `synthesize` of the
  whole clip up to float rounding (the convolutions see the same inputs; only their blocking may round
  differently).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tts.codec.mel import FRAME_LENGTH, HOP, LOG_FLOOR, N_FFT, N_MELS, SUBFRAMES

# Hann window (periodic) at hop N_FFT / 4: the squared windows overlap-add to exactly 1.5 everywhere.
OVERLAP = N_FFT // HOP
ENVELOPE = 1.5
TAIL = N_FFT - HOP  # samples of the last three STFT frames not yet emitted
MAX_LOG_MAGNITUDE = math.log(100.0)  # as Vocos clips its magnitudes


class CausalConv(nn.Conv1d):
    """Conv1d over `[B, C, T]` padded on the left only: output t sees inputs t - (kernel - 1) .. t."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv -> LayerNorm -> Linear (3x) -> GELU -> Linear -> scale, plus the input."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.dwconv = CausalConv(channels, channels, kernel, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up = nn.Linear(channels, 3 * channels)
        self.down = nn.Linear(3 * channels, channels)
        self.scale = nn.Parameter(torch.full((channels,), 1e-2))

    def forward(self, x: Tensor) -> Tensor:
        """x `[B, C, T]` -> `[B, C, T]`."""
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.down(F.gelu(self.up(h))) * self.scale
        return x + h.transpose(1, 2)


class CausalVocoder(nn.Module):
    """Log-mel `[B, M, 80]` (the codec's `log(max(mel, 1e-5))`) -> complex STFT frames `[B, M, 513]`,
    causal in the mel frames (module docstring). `synthesize` and `stream` turn them into audio."""

    def __init__(self, channels: int = 256, blocks: int = 6, kernel: int = 7):
        super().__init__()
        self.shape = {"channels": channels, "blocks": blocks, "kernel": kernel}
        self.embed = CausalConv(N_MELS, channels, kernel)
        self.blocks = nn.ModuleList(ConvNeXtBlock(channels, kernel) for _ in range(blocks))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, 2 * (N_FFT // 2 + 1))
        self.receptive_frames = (kernel - 1) * (blocks + 1)
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)

    def spectrum(self, logmel: Tensor) -> Tensor:
        """Log-mel `[B, M, 80]` float32 -> complex64 STFT frames `[B, M, 513]`. The input is scaled as
        `(logmel + 5) / 5` so that speech sits around 0 (the log floor is -11.5)."""
        x = self.embed(((logmel + 5.0) / 5.0).transpose(1, 2))
        for block in self.blocks:
            x = block(x)
        out = self.head(self.norm(x.transpose(1, 2))).float()
        log_mag, phase = out.chunk(2, dim=-1)
        mag = torch.exp(log_mag.clamp(max=MAX_LOG_MAGNITUDE))
        return torch.polar(mag, phase)

    def frames(self, logmel: Tensor) -> Tensor:
        """Log-mel `[B, M, 80]` -> windowed time-domain frames `[B, M, 1024]` (before overlap-add)."""
        return torch.fft.irfft(self.spectrum(logmel), n=N_FFT, dim=-1) * self.window

    def synthesize(self, logmel: Tensor) -> Tensor:
        """Offline: log-mel `[B, 4T, 80]` of whole codec frames, as a fresh stream (silence before it)
        -> audio `[B, 1024 T]` float32 with the codec's 512-sample delay, clamped to [-1, 1]."""
        state = self.initial_state(logmel.shape[0], logmel.device)
        return self.stream(logmel, state)

    def slots(self, max_streams: int, device: torch.device) -> VocoderSlots:
        """Per-slot streaming state for `max_streams` streams on `device` (the batched codec stage),
        running this vocoder there (a copy when it lives elsewhere)."""
        model = self if next(self.parameters()).device == device else copy.deepcopy(self).to(device)
        return VocoderSlots(model, max_streams, device)

    def initial_state(self, batch: int, device=None) -> VocoderState:
        """A fresh stream's state for `batch` rows: silence context, nothing pending."""
        context = torch.full((batch, self.receptive_frames, N_MELS), math.log(LOG_FLOOR), device=device)
        return VocoderState(context, torch.zeros(batch, TAIL, device=device))

    def stream(self, logmel: Tensor, state: VocoderState) -> Tensor:
        """Continue `state`'s streams by log-mel `[B, M, 80]` (M a multiple of 4 for whole codec frames)
        -> the M * 256 samples `[B, 256 M]` that are now final; `state` is updated in place."""
        B, M, _ = logmel.shape
        R = self.receptive_frames
        x = torch.cat([state.context, logmel.float()], dim=1)
        frames = self.frames(x)[:, R:]  # [B, M, 1024]: STFT frames of the new mel frames only
        out = overlap_add(frames)  # [B, 256 M + 768]
        out[:, :TAIL] += state.pending
        state.context = x[:, -R:] if R else x[:, :0]
        state.pending = out[:, HOP * M :].clone()
        return (out[:, : HOP * M] / ENVELOPE).clamp(-1.0, 1.0)


@dataclass
class VocoderState:
    """Per-row streaming state: context `[B, receptive_frames, 80]` log-mel, pending `[B, 768]` overlap."""

    context: Tensor
    pending: Tensor


def overlap_add(frames: Tensor) -> Tensor:
    """Windowed frames `[B, M, 1024]` -> `[B, 256 (M + 3)]`: frame j added at offset 256 j. Written with
    four slice additions (no fold), so that the summation order is the same for every length."""
    B, M, _ = frames.shape
    quarters = frames.reshape(B, M, OVERLAP, HOP)
    blocks = frames.new_zeros(B, M + OVERLAP - 1, HOP)
    for q in range(OVERLAP):
        blocks[:, q : q + M] += quarters[:, :, q]
    return blocks.reshape(B, -1)


class VocoderSlots:
    """A `CausalVocoder`'s streaming state for many streams in fixed slots: the batched codec stage's
    vocoder (`melrvq.MelStreamDecoder` with a learned vocoder; `melrvq.GriffinLimSlots` is Griffin-Lim's).

    Per slot (`max_streams + 1` rows allocated once on `device`, the last a scratch slot for pad rows):
    the last `receptive_frames` log-mel frames `[R, 80]` and the pending overlap `[768]`, as in
    `VocoderState`. `decode` has no host sync and no data-dependent branch (CUDA-graph safe): every row
    computes all T frames, frames past a row's length are replaced by zeros before the overlap-add so
    that they add nothing (not even a NaN of a padding frame), and each row's new state is gathered at
    its own end. A row of length 0 keeps its state.
    """

    def __init__(self, model: CausalVocoder, max_streams: int, device):
        self.model, self.device = model, torch.device(device)
        R = model.receptive_frames
        self._context = torch.empty(max_streams + 1, R, N_MELS, device=self.device)
        self._pending = torch.empty(max_streams + 1, TAIL, device=self.device)
        self._silence = math.log(LOG_FLOOR)
        self._context_offsets = torch.arange(R, device=self.device).view(1, R, 1)
        self._tail_offsets = torch.arange(TAIL, device=self.device).view(1, TAIL)
        self.reset(torch.arange(max_streams + 1, device=self.device))

    @torch.no_grad()
    def reset(self, slots: Tensor) -> None:
        """Fresh streams in `slots` (`[k]` int64): silence context, nothing pending."""
        self._context.index_fill_(0, slots, self._silence)
        self._pending.index_fill_(0, slots, 0.0)

    @torch.no_grad()
    def decode(self, slots: Tensor, logmel: Tensor, lengths: Tensor) -> Tensor:
        """Continue streams `slots` `[B]` by log-mel `[B, 4T, 80]` of which row i's first 4 lengths[i]
        frames are real -> audio `[B, 1024 T]` float32 (row i's first 1024 lengths[i] samples are its)."""
        B, M, _ = logmel.shape
        R = self.model.receptive_frames
        x = torch.cat([self._context.index_select(0, slots), logmel.float()], dim=1)  # [B, R + M, 80]
        frames = self.model.frames(x)[:, R:]  # [B, M, 1024]
        valid = torch.arange(M, device=self.device).view(1, M) < lengths.view(B, 1) * SUBFRAMES
        out = overlap_add(torch.where(valid.unsqueeze(-1), frames, 0.0))  # [B, 256 M + 768]
        out[:, :TAIL] += self._pending.index_select(0, slots)
        # New state at each row's end: context = the R mel frames before it, pending = the overlap after it.
        end_mel = (lengths * SUBFRAMES).view(B, 1, 1)
        self._context.index_copy_(
            0, slots, x.gather(1, (end_mel + self._context_offsets).expand(-1, -1, N_MELS))
        )
        end_sample = (lengths * FRAME_LENGTH).view(B, 1)
        self._pending.index_copy_(0, slots, out.gather(1, end_sample + self._tail_offsets))
        return (out[:, : HOP * M] / ENVELOPE).clamp(-1.0, 1.0)
