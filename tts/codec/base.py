"""The codec interface: audio <-> frame codes, with incremental (streaming) decode.

A codec turns mono float32 PCM at `sample_rate` into codes `[num_codebooks, T]` (one column per
frame of `frame_length` samples) and back. Streaming decode relies on one property every codec here
has: the samples of frame t depend only on codes `t - context_frames .. t` (a causal decoder with a
bounded receptive field). `StreamingDecoder` keeps that many frames of left context, decodes the
window, and emits only the new frames' samples, so the concatenated stream equals `decode()` of all
codes up to float rounding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from tts.codec.torchaudio_load import torchaudio


class AudioError(ValueError):
    """Audio that cannot be used (empty, silent, non-finite, unreadable)."""


class CodecCheckpointError(ValueError):
    """A codec file that cannot be loaded (unreadable, missing or unexpected keys, wrong shapes)."""


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether `a` and `b` name the same device; `cuda` without an index is the current CUDA device, so
    `cuda` and `cuda:0` match (torch.device equality says they differ)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    if a.type != "cuda":
        return (a.index or 0) == (b.index or 0)
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def prepare_audio(audio, sample_rate: int, target_rate: int) -> Tensor:
    """Mix to mono and resample (torchaudio) to `target_rate`.

    audio: `[samples]` or `[channels, samples]` float (numpy or torch). Returns `[samples']` float32.
    Raises AudioError for empty or non-finite audio or a non-positive rate.
    """
    x = torch.as_tensor(np.asarray(audio) if not isinstance(audio, Tensor) else audio).to(torch.float32)
    if x.dim() == 2:
        x = x.mean(dim=0)
    elif x.dim() != 1:
        raise AudioError(f"audio must be [samples] or [channels, samples], got shape {tuple(x.shape)}")
    if sample_rate <= 0:
        raise AudioError(f"sample rate must be positive, got {sample_rate}")
    if x.numel() == 0:
        raise AudioError("audio is empty")
    if not torch.isfinite(x).all():
        raise AudioError("audio contains NaN or infinite samples")
    if sample_rate != target_rate:
        x = torchaudio.functional.resample(x, sample_rate, target_rate)
    return x


class Codec(ABC):
    """Frame codec. Subclasses set `sample_rate` (Hz), `frame_length` (samples per frame),
    `num_codebooks`, `codebook_size` and `context_frames`, and implement `encode_audio` / `decode`.

    delay: samples by which decoded audio lags the audio its codes were encoded from (sample i of
    `decode(encode(x))` carries x's sample i - delay; frame t's sound is at `t * frame_length + delay`).
    Word timings place words on the audio's clock with it (`tts.runtime.timings`)."""

    sample_rate: int
    frame_length: int
    num_codebooks: int
    codebook_size: int
    context_frames: int = 0
    delay: int = 0

    @property
    def frame_rate(self) -> float:
        """Frames per second of audio."""
        return self.sample_rate / self.frame_length

    def encode(self, audio, sample_rate: int) -> Tensor:
        """Codes `[num_codebooks, T]` int64 for audio at any rate and channel count (mixed to mono and
        resampled first); T = ceil(samples / frame_length) after resampling."""
        return self.encode_audio(prepare_audio(audio, sample_rate, self.sample_rate))

    @abstractmethod
    def config(self) -> dict:
        """What rebuilds this codec (its kind and sizes; JSON-serializable): a bundle's codec.json."""

    @abstractmethod
    def encode_audio(self, audio: Tensor) -> Tensor:
        """Codes `[num_codebooks, T]` int64 for mono float32 audio `[samples]` at `sample_rate`."""

    @abstractmethod
    def decode(self, codes: Tensor) -> Tensor:
        """Float32 PCM `[T * frame_length]` in [-1, 1] for codes `[num_codebooks, T]`."""

    def decode_tail(self, codes: Tensor, frames: int) -> Tensor:
        """The samples of the last `frames` frames of `decode(codes)` (`[frames * frame_length]`).
        Codecs whose decode has per-frame work override this to skip the frames that are only context."""
        return self.decode(codes)[-frames * self.frame_length :] if frames > 0 else torch.zeros(0)

    def stream(self) -> FrameStream:
        """A fresh incremental decoder for one stream of frames."""
        return StreamingDecoder(self)

    def batched_stream(self, max_streams: int) -> BatchedStreamDecoder:
        """A decoder that continues up to `max_streams` streams in one call (the codec stage's).
        Codecs with a batched implementation override this; the default loops over per-stream
        decoders on the CPU."""
        return LoopedStreamDecoder(self, max_streams)

    def check_codes(self, codes: Tensor) -> Tensor:
        codes = torch.as_tensor(codes, dtype=torch.int64)
        if codes.dim() != 2 or codes.shape[0] != self.num_codebooks:
            raise ValueError(f"codes must be [{self.num_codebooks}, T], got {tuple(codes.shape)}")
        return codes.clamp(0, self.codebook_size - 1)


class FrameStream(Protocol):
    """What `Codec.stream()` returns: `StreamingDecoder`, or a codec's own stateful decoder."""

    def push(self, codes: Tensor) -> Tensor:
        """Codes `[N, t]` -> the `t * frame_length` new samples."""
        ...

    def flush(self) -> Tensor:
        """Samples still held back at the end of the stream."""
        ...


class StreamingDecoder:
    """Incremental decode: `push(codes [N, t])` returns the `t * frame_length` new samples.

    Keeps the last `codec.context_frames` frames as left context (bounded memory, whatever the
    stream's length).
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self._context = torch.zeros(codec.num_codebooks, 0, dtype=torch.int64)
        self.frames_decoded = 0

    def push(self, codes: Tensor) -> Tensor:
        codes = self.codec.check_codes(codes)
        t = codes.shape[1]
        if t == 0:
            return torch.zeros(0, dtype=torch.float32)
        window = torch.cat([self._context, codes], dim=1)
        audio = self.codec.decode_tail(window, t)
        keep = self.codec.context_frames
        self._context = window[:, max(0, window.shape[1] - keep) :] if keep else window[:, :0]
        self.frames_decoded += t
        return audio

    def flush(self) -> Tensor:
        """Samples still held back at the end of the stream (none for the causal codecs here)."""
        return torch.zeros(0, dtype=torch.float32)


class StatefulStreamingDecoder(ABC):
    """Incremental decode through a causal net that carries its state between calls (the modded DAC's
    and Firefly's: a dict of each module's left context, `dac_net.StreamState`): `push(codes [N, t])`
    returns the `t * frame_length` new float32 samples, and the concatenation of all pushes equals the
    codec's `decode` of all codes to float rounding. A codec subclasses it with `_decode`."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.frames_decoded = 0
        self.state: dict = {}

    @abstractmethod
    def _decode(self, codes: Tensor) -> Tensor:
        """`[1, N, t]` int64 (checked, on the CPU) -> `[1, 1, t * frame_length]` audio on the codec's
        device, updating `self.state`."""

    @torch.inference_mode()
    def push(self, codes: Tensor) -> Tensor:
        codes = self.codec.check_codes(codes)
        t = codes.shape[1]
        if t == 0:
            return torch.zeros(0, dtype=torch.float32)
        audio = self._decode(codes.unsqueeze(0))
        self.frames_decoded += t
        return audio[0, 0].float().cpu()

    def flush(self) -> Tensor:
        """Nothing is held back: every pushed frame's samples were returned."""
        return torch.zeros(0, dtype=torch.float32)


class BatchedStreamDecoder(ABC):
    """Streaming decode of many independent streams in one call: the codec stage's batched decode.

    Each stream lives in a state slot `0 .. max_streams - 1`; slot `max_streams` is a scratch slot for
    pad rows. `reset(slots)` starts fresh streams in those slots (position 0, empty history).
    `decode(slots, codes, lengths)` continues every listed stream by `lengths[i]` frames:

    * slots: `[B]` int64, distinct except for the scratch slot (pad rows);
    * codes: `[B, num_codebooks, T]` int64; frames at `lengths[i]` and beyond are padding (any valid
      code; they influence nothing);
    * lengths: `[B]` int64 in `[0, T]`; a row of length 0 leaves its slot unchanged;
    * returns `[B, T * frame_length]` float32: row i's first `lengths[i] * frame_length` samples
      continue stream `slots[i]`; the rest is undefined.

    All three inputs and the output live on `device`. For each stream, the concatenation of its
    outputs equals `codec.decode(all of its codes)` within the codec's stated tolerance, whatever the
    batch composition, the mix of lengths and the streams' positions. Implementations that set
    `graph_safe = True` have no host sync and no data-dependent Python branch in `decode` for a fixed
    (B, T), so a CUDA graph may capture it (their state lives in buffers allocated once).
    """

    max_streams: int
    device: torch.device = torch.device("cpu")
    graph_safe: bool = False

    @property
    def scratch_slot(self) -> int:
        return self.max_streams

    def check_slots(self, t: Tensor, name: str = "slots") -> Tensor:
        """`t` if it is a `[B]` int64 tensor on `device`; else ValueError (host-side, no sync)."""
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int64:
            raise ValueError(f"{name} must be a [B] int64 tensor")
        if not same_device(t.device, self.device):
            raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        return t

    def check_inputs(self, slots: Tensor, codes: Tensor, lengths: Tensor, num_codebooks: int) -> None:
        """Host-side checks of `decode`'s inputs (ranks, sizes, dtypes, device; never values, which would
        sync): raise ValueError naming the first that is wrong."""
        for name, t in (("slots", slots), ("lengths", lengths)):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype != torch.int64:
                raise ValueError(f"{name} must be a [B] int64 tensor")
        if codes.dim() != 3 or codes.shape[0] != slots.shape[0] or codes.shape[1] != num_codebooks:
            raise ValueError(
                f"codes must be [B={slots.shape[0]}, {num_codebooks}, T], got {tuple(codes.shape)}"
            )
        if codes.shape[2] == 0:
            raise ValueError("codes must hold at least one frame (T >= 1)")
        if codes.dtype != torch.int64:
            raise ValueError(f"codes must be int64, got {codes.dtype}")
        if lengths.shape != slots.shape:
            raise ValueError(f"lengths must be [B={slots.shape[0]}], got {tuple(lengths.shape)}")
        for name, t in (("slots", slots), ("codes", codes), ("lengths", lengths)):
            if not same_device(t.device, self.device):
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")

    @abstractmethod
    def reset(self, slots: Tensor) -> None:
        """Start fresh streams in `slots` (`[k]` int64 on `device`)."""

    @abstractmethod
    def decode(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        """See the class docstring."""


class LoopedStreamDecoder(BatchedStreamDecoder):
    """The generic `BatchedStreamDecoder`: one `codec.stream()` decoder per slot, called row by row on
    the CPU (for small codecs whose per-call cost is negligible, e.g. the test codec)."""

    def __init__(self, codec: Codec, max_streams: int):
        self.codec = codec
        self.max_streams = max_streams
        self._streams: list[FrameStream | None] = [None] * (max_streams + 1)

    def reset(self, slots: Tensor) -> None:
        for s in slots.tolist():
            self._streams[s] = self.codec.stream()

    def decode(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        B, _, T = codes.shape
        out = torch.zeros(B, T * self.codec.frame_length)
        for i, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
            if n == 0 or s == self.scratch_slot:
                continue
            stream = self._streams[s]
            if stream is None:
                raise RuntimeError(f"slot {s} was never reset")
            out[i, : n * self.codec.frame_length] = stream.push(codes[i, :, :n].cpu())
        return out
