"""Mel features of the default model's codecs: the log-mel transform, frame stacking, and mel inversion
(Griffin-Lim, windowed and batched per stream slot) with the streaming decoder both mel codecs share.

A codec frame is FRAME_LENGTH samples at SAMPLE_RATE: SUBFRAMES log-mel frames of N_MELS bins (hop HOP).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tts.codec.base import BatchedStreamDecoder
from tts.codec.torchaudio_load import torchaudio

SAMPLE_RATE = 22050
FRAME_LENGTH = 1024
N_FFT = 1024
HOP = 256
N_MELS = 80
LOG_FLOOR = 1e-5
SUBFRAMES = FRAME_LENGTH // HOP  # mel frames per codec frame
DELAY = N_FFT // 2  # samples
CROSSFADE = HOP


class LogMel:
    """Log-mel analysis shared by the corpus script and the codec (parameters in the module docstring).

    `__call__(audio [samples] float32 at 22050 Hz)` -> `[T * 4, 80]` float32 with T = ceil(samples / 1024);
    the audio is zero-padded on the right to whole frames first.
    """

    def __init__(self):
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=SAMPLE_RATE,
            n_fft=N_FFT,
            win_length=N_FFT,
            hop_length=HOP,
            f_min=0.0,
            f_max=SAMPLE_RATE / 2,
            n_mels=N_MELS,
            power=1.0,
            norm="slaney",
            mel_scale="slaney",
            center=True,
        )

    def __call__(self, audio: Tensor) -> Tensor:
        audio = torch.as_tensor(audio, dtype=torch.float32)
        T = max(1, math.ceil(audio.numel() / FRAME_LENGTH))
        audio = F.pad(audio, (0, T * FRAME_LENGTH - audio.numel()))
        with torch.no_grad():
            m = self.mel(audio)[:, : T * SUBFRAMES]  # [80, 4T]
        return torch.log(m.clamp_min(LOG_FLOOR)).T.contiguous()

    @property
    def filterbank(self) -> Tensor:
        """`[n_freq=513, 80]` mel filterbank (torchaudio's layout)."""
        return self.mel.mel_scale.fb


def stack_frames(mel: Tensor) -> Tensor:
    """`[4T, 80]` -> `[T, 320]` (the four mel frames of each codec frame, in time order)."""
    return mel.reshape(-1, SUBFRAMES * N_MELS)


def unstack_frames(x: Tensor) -> Tensor:
    """`[..., T, 320]` -> `[..., 4T, 80]`."""
    return x.reshape(*x.shape[:-2], -1, N_MELS)


class GriffinLim:
    """Griffin-Lim phase recovery for spectrograms of a fixed number of STFT frames, written with
    `torch.fft.rfft` / `irfft` so that it runs on any device without a host sync.

    The math is `torchaudio.functional.griffinlim(mag, hann_window(1024), 1024, 256, 1024, power=1.0,
    n_iter=iters, momentum=momentum, length=256 * (frames - 1), rand_init=False)`: zero-phase start,
    fast Griffin-Lim momentum, centred STFT with reflect padding. It is bit-identical to torchaudio on
    the CPU (the same operations in the same order), without torch.istft's NOLA check (a `.item()` on
    the device, so torchaudio's version cannot be captured in a CUDA graph) and without recomputing the
    window envelope, a constant for a fixed frame count. Every window is processed independently:
    a window's result does not depend on the other windows in the batch.

    `__call__(mag)`: mag `[N, frames, 513]` float32 (frame-major: the transpose of torchaudio's
    `[..., freq, frames]`), on `window.device` -> `[N, 256 * (frames - 1)]` float32.
    """

    # On a CPU the ~17 passes per iteration over the batch's spectra run from cache while a chunk of
    # windows fits in L2 (24 windows: ~1.3 ms each on the development machine, 2x that at 128); on a
    # GPU the whole batch is one launch per op.
    CPU_CHUNK = 24

    def __init__(self, frames: int, iters: int, momentum: float = 0.99, device=None):
        if frames < 2:
            raise ValueError(f"Griffin-Lim needs at least 2 STFT frames, got {frames}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.frames, self.iters = frames, iters
        self.momentum = momentum / (1 + momentum)  # torchaudio's form of the fast-GL coefficient
        self.length = HOP * (frames - 1)
        self.window = torch.hann_window(N_FFT, device=device)
        # The iSTFT divides by the overlap-added squared window. Summed in the same order as the
        # signal (see `istft`) so that the division matches torch.istft bit for bit.
        self.envelope = self._overlap_add(self.window.pow(2).expand(1, frames, N_FFT))[0]

    def to(self, device) -> GriffinLim:
        """Move the window and envelope to `device`; returns self."""
        self.window, self.envelope = self.window.to(device), self.envelope.to(device)
        return self

    def _overlap_add(self, frames: Tensor) -> Tensor:
        """`[N, F, 1024]` windowed frames -> the centred, trimmed overlap-add `[N, 256 (F - 1)]`."""
        N, F_ = frames.shape[0], self.frames
        quarters = frames.reshape(N, F_, N_FFT // HOP, HOP)
        blocks = frames.new_zeros(N, F_ + N_FFT // HOP - 1, HOP)
        # Output block b sums quarter j of frame b - j. Adding j = 3, 2, 1, 0 sums the frames in
        # increasing order, as torch.istft's fold does (other orders round differently).
        for j in reversed(range(N_FFT // HOP)):
            blocks[:, j : j + F_] += quarters[:, :, j]
        start = (N_FFT // 2) // HOP  # centred: drop the first and last 512 samples
        return blocks[:, start : start + F_ - 1].reshape(N, self.length)

    def istft(self, spec: Tensor) -> Tensor:
        """Complex `[N, F, 513]` -> `[N, 256 (F - 1)]`, as torch.istft(center=True, length=...)."""
        frames = torch.fft.irfft(spec, n=N_FFT, dim=-1) * self.window
        return self._overlap_add(frames) / self.envelope

    def stft(self, y: Tensor) -> Tensor:
        """`[N, L]` -> complex `[N, F, 513]`, as torch.stft(center=True, pad_mode="reflect")."""
        padded = F.pad(y.unsqueeze(1), (N_FFT // 2, N_FFT // 2), mode="reflect").squeeze(1)
        return torch.fft.rfft(padded.unfold(-1, N_FFT, HOP) * self.window, dim=-1)

    def __call__(self, mag: Tensor) -> Tensor:
        if mag.dim() != 3 or mag.shape[1:] != (self.frames, N_FFT // 2 + 1):
            raise ValueError(f"mag must be [N, {self.frames}, {N_FFT // 2 + 1}], got {tuple(mag.shape)}")
        N = mag.shape[0]
        if mag.device.type == "cpu" and N > self.CPU_CHUNK:
            return torch.cat([self._run(mag[i : i + self.CPU_CHUNK]) for i in range(0, N, self.CPU_CHUNK)])
        return self._run(mag)

    def _run(self, mag: Tensor) -> Tensor:
        # torchaudio's `mag * angles` promotes mag to complex inside every product; promoting it once
        # gives the same values. The zero-phase start (angles = 1) makes the first spectrum mag itself.
        mag_c = mag.to(torch.complex64)
        spec, tprev = mag_c, None
        for _ in range(self.iters):
            rebuilt = self.stft(self.istft(spec))
            # torchaudio subtracts momentum * 0 on the first pass: the same values
            angles = rebuilt if tprev is None else rebuilt - tprev * self.momentum
            spec = mag_c * angles.div(angles.abs().add(1e-16))
            tprev = rebuilt
        return self.istft(spec)


class WindowedGriffinLim:
    """Log-mel `[4T, 80]` -> float32 audio `[T * 1024]` in [-1, 1] by Griffin-Lim on bounded windows.

    The window layout, the 512-sample delay and the cross-fade are described in the module docstring:
    frame t's samples depend only on mel frames of codec frames t - context - 1 .. t. `last=k` returns
    the samples of the last k frames only and runs only their k + 1 windows (streaming decode).
    Runs where its constants are (`to(device)`; CPU by default); `__call__` takes its input there.

    The pieces (`magnitudes`, `gl`, `emit`) are shared with `GriffinLimSlots`, which keeps the last
    `context` frames' magnitudes and the previous window's cross-fade tail per stream instead of
    recomputing them; both paths do the same per-window arithmetic.
    """

    def __init__(self, context: int, iters: int):
        self.context = context
        self.iters = iters
        self.window_frames = (context + 1) * SUBFRAMES  # mel frames per Griffin-Lim window
        self.gl = GriffinLim(self.window_frames, iters)
        self.inverse_fb = torch.linalg.pinv(LogMel().filterbank.T)  # [513, 80]: mel -> linear magnitude
        ramp = torch.arange(CROSSFADE, dtype=torch.float32) + 0.5
        self.fade_in = 0.5 - 0.5 * torch.cos(math.pi * ramp / CROSSFADE)
        # Window W_t starts at signal position L (t - C). Frame t emits [L t - 512, L (t+1) - 512):
        # offset L C - 512 in W_t. The cross-fade's other half comes from W_{t-1} at offset L (C+1) - 512.
        self.start = FRAME_LENGTH * context - DELAY

    @property
    def device(self) -> torch.device:
        return self.inverse_fb.device

    def to(self, device) -> WindowedGriffinLim:
        """Move the filterbank inverse, fade ramp and Griffin-Lim window to `device`; returns self."""
        self.inverse_fb, self.fade_in = self.inverse_fb.to(device), self.fade_in.to(device)
        self.gl.to(device)
        return self

    def slots(self, max_streams: int, device: torch.device) -> GriffinLimSlots:
        """Per-slot streaming state for `max_streams` streams on `device` (the batched codec stage)."""
        return GriffinLimSlots(self, max_streams, device)

    def magnitudes(self, logmel: Tensor) -> Tensor:
        """Log-mel `[..., M, 80]` -> linear STFT magnitudes `[..., M, 513]` (pseudo-inverse of the
        filterbank, clamped at 0). One matrix row per mel frame: M is a multiple of 4 here, which keeps
        each row's rounding independent of how many rows there are (see `MelVQNet.decode_frames`)."""
        return F.linear(torch.exp(logmel), self.inverse_fb).clamp_min(0.0)

    def silence(self, frames: int) -> Tensor:
        """Log-mel `[frames, 80]` of silence (the floor), the padding before a stream's first frame."""
        return torch.full((frames, N_MELS), math.log(LOG_FLOOR), device=self.device)

    def windows(self, mag: Tensor) -> Tensor:
        """Magnitudes `[..., 4 (C + k), 513]` -> the k Griffin-Lim windows `[..., k, 4 (C + 1), 513]`."""
        win = mag.unfold(-2, self.window_frames, SUBFRAMES)  # [..., k, 513, 4 (C + 1)]
        return win.transpose(-1, -2)

    def emit(self, y: Tensor, prev_tail: Tensor) -> tuple[Tensor, Tensor]:
        """Griffin-Lim outputs `[..., 256 (4C + 3)]` of windows W_t and the tails `[..., 256]` of their
        predecessors W_{t-1} -> (frame t's samples `[..., 1024]` clamped to [-1, 1], W_t's own tail
        `[..., 256]` for frame t + 1)."""
        cur = y[..., self.start : self.start + FRAME_LENGTH]
        tail = y[..., self.start + FRAME_LENGTH : self.start + FRAME_LENGTH + CROSSFADE]
        head = prev_tail * (1 - self.fade_in) + cur[..., :CROSSFADE] * self.fade_in
        return torch.cat([head, cur[..., CROSSFADE:]], dim=-1).clamp(-1.0, 1.0), tail

    def __call__(self, logmel: Tensor, last: int | None = None) -> Tensor:
        T = logmel.shape[0] // SUBFRAMES
        last = T if last is None else min(last, T)
        if last <= 0:
            return torch.zeros(0, device=self.device)
        # Windows W_{-1}..W_{T-1}: W_t = codec frames t-C..t, left-padded with silence frames.
        padded = torch.cat([self.silence((self.context + 1) * SUBFRAMES), logmel.float()])
        win = self.windows(self.magnitudes(padded))  # [T+1, 4(C+1), 513]: W_{t-1} = row t
        win = win[T - last :]  # the windows of the last `last` frames and their predecessor
        y = self.gl(win.contiguous())  # [last+1, 256 (4C + 3)]
        tails = y[:-1, self.start + FRAME_LENGTH : self.start + FRAME_LENGTH + CROSSFADE]
        out, _ = self.emit(y[1:], tails)
        return out.reshape(-1)


class GriffinLimSlots:
    """`WindowedGriffinLim`'s streaming state for many streams in fixed slots (the mel codecs' batched
    codec stage, `MelStreamDecoder`), continuing every stream instead of re-decoding context.

    Per slot (`max_streams + 1` rows, allocated once on `device`): the STFT magnitudes of the stream's
    last `context` codec frames (`[4 C, 513]`: what the next frames' Griffin-Lim windows reach back to)
    and the cross-fade tail of its last window (`[256]`: the half of the next frame's cross-fade that
    comes from the previous window). A fresh slot holds what `WindowedGriffinLim.__call__` pads a stream
    with: silence magnitudes and the tail of the all-silence window. So a `decode` of T frames runs
    exactly the T Griffin-Lim windows of those frames, the same windows with the same inputs as the
    offline call, and nothing twice. `decode` has no host sync and no data-dependent branch: every row
    computes its T frames and each row's new state is gathered at its own valid end.
    """

    def __init__(self, vocoder: WindowedGriffinLim, max_streams: int, device: torch.device):
        voc = WindowedGriffinLim(vocoder.context, vocoder.iters).to(device)  # this stage's own constants
        self.vocoder, self.device = voc, device
        keep = voc.context * SUBFRAMES
        with torch.no_grad():
            # What a fresh stream continues from: C codec frames of silence before frame 0, and the
            # tail of window W_{-1} (all silence), exactly as the offline decode pads.
            self._silence_mag = voc.magnitudes(voc.silence(keep))  # [4C, 513]
            w_prev = voc.windows(voc.magnitudes(voc.silence(voc.window_frames)))  # [1, 4(C+1), 513]
            self._silence_tail = voc.emit(
                voc.gl(w_prev.contiguous()), torch.zeros(1, CROSSFADE, device=device)
            )[1]
        slots = max_streams + 1
        self._mag = torch.empty(slots, keep, N_FFT // 2 + 1, device=device)
        self._tail = torch.empty(slots, CROSSFADE, device=device)
        self._mag_offsets = torch.arange(keep, device=device).view(1, keep, 1)

    @torch.no_grad()
    def reset(self, slots: Tensor) -> None:
        """Fresh streams in `slots` (`[k]` int64 on `device`)."""
        k = slots.shape[0]
        self._mag.index_copy_(0, slots, self._silence_mag.expand(k, -1, -1))
        self._tail.index_copy_(0, slots, self._silence_tail.expand(k, -1))

    @torch.no_grad()
    def decode(self, slots: Tensor, logmel: Tensor, lengths: Tensor) -> Tensor:
        """Continue streams `slots` `[B]` by log-mel `[B, 4T, 80]` of which row i's first 4 lengths[i]
        frames are real -> audio `[B, 1024 T]` float32 (row i's first 1024 lengths[i] samples are its)."""
        voc = self.vocoder
        B, T = logmel.shape[0], logmel.shape[1] // SUBFRAMES
        mag = torch.cat([self._mag.index_select(0, slots), voc.magnitudes(logmel)], dim=1)  # [B, 4(C+T), 513]
        y = voc.gl(voc.windows(mag).reshape(B * T, voc.window_frames, -1)).view(B, T, -1)
        end = voc.start + FRAME_LENGTH
        # tails[:, t] is the tail of the window before frame t (t = 0: the slot's stored tail)
        tails = torch.cat(
            [self._tail.index_select(0, slots).unsqueeze(1), y[..., end : end + CROSSFADE]], dim=1
        )
        audio, _ = voc.emit(y, tails[:, :T])
        # New state at each row's valid end: a row of length 0 writes back what it read.
        mag_idx = (lengths.view(B, 1, 1) * SUBFRAMES + self._mag_offsets).expand(-1, -1, mag.shape[-1])
        self._mag.index_copy_(0, slots, mag.gather(1, mag_idx))
        tail_idx = lengths.view(B, 1, 1).expand(-1, 1, CROSSFADE)
        self._tail.index_copy_(0, slots, tails.gather(1, tail_idx).squeeze(1))
        return audio.reshape(B, T * FRAME_LENGTH)


class MelStreamDecoder(BatchedStreamDecoder):
    """Batched streaming decode for the mel codecs: codes -> log-mel (the subclass's `_logmel`, which
    keeps its own per-slot state) -> audio by the vocoder's per-slot stage (`vocoder.slots(...)`:
    `GriffinLimSlots` for Griffin-Lim, `tts.codec.vocoder.VocoderSlots` for the learned vocoder).

    `decode` has no host sync and no data-dependent Python branch (`graph_safe`): ragged lengths are
    handled by computing every row's T frames and gathering each row's new state at its own valid end,
    and `reset` is index writes. Inputs on another device are moved to `device` (a copy; capture-safe
    only when they already live there). See `BatchedStreamDecoder` for the slot, length and padding
    contract, and the codec modules for the tolerance against `decode`.
    """

    graph_safe = True

    def __init__(self, vocoder, num_codebooks: int, codebook_size: int, max_streams: int, device):
        """vocoder: `WindowedGriffinLim` or `tts.codec.vocoder.CausalVocoder` (anything with
        `slots(max_streams, device)` returning a stage with `reset(slots)` and `decode(slots, logmel,
        lengths)`)."""
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current device
            device = torch.device("cuda", torch.cuda.current_device())
        self.max_streams, self.device = max_streams, device
        self.num_codebooks, self.codebook_size = num_codebooks, codebook_size
        self.stage = vocoder.slots(max_streams, device)

    def _init_slots(self) -> None:
        """Reset every slot, the scratch slot included (subclasses call this once their state exists)."""
        self.reset(torch.arange(self.max_streams + 1, device=self.device))

    @torch.no_grad()
    def reset(self, slots: Tensor) -> None:
        slots = slots.to(self.device)
        self.stage.reset(slots)
        self._reset(slots)

    def _reset(self, slots: Tensor) -> None:
        """Reset the subclass's own per-slot state."""

    def _logmel(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        """Log-mel `[B, 4T, 80]` of codes `[B, N, T]` (clamped) continuing each slot's stream; the
        subclass also moves its own state to each row's valid end here."""
        raise NotImplementedError

    @torch.no_grad()
    def decode(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        slots, codes, lengths = (t.to(self.device) for t in (slots, codes, lengths))
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise ValueError(f"codes must be [B, {self.num_codebooks}, T], got {tuple(codes.shape)}")
        B, _, T = codes.shape
        if slots.shape != (B,) or lengths.shape != (B,):
            raise ValueError(
                f"slots and lengths must be [{B}], got {tuple(slots.shape)}, {tuple(lengths.shape)}"
            )
        if T == 0:
            return torch.zeros(B, 0, device=self.device)
        logmel = self._logmel(slots, codes.clamp(0, self.codebook_size - 1), lengths)  # [B, 4T, 80]
        return self.stage.decode(slots, logmel, lengths)
