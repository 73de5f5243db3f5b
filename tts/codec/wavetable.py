"""A small deterministic codec for tests and the tiny model: residual wave tables with overlap-add.

Each codebook i is a table of `codebook_size` smooth waveforms, each `2 * frame_length` samples long
(a few random sinusoids under a Hann window, fixed by `seed`). Frame t sums one waveform per codebook
and is overlap-added at offset `t * frame_length`, so the samples of frame t depend on frames t-1 and t
(`context_frames = 1`): causal, streamable, and exactly what the codec interface promises. Encoding is
greedy residual matching of each frame's samples against the first half of the waveforms. It is not a
good codec; it is a real one, small enough to run every test in milliseconds.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from tts.codec.base import Codec


class WaveTableCodec(Codec):
    context_frames = 1

    def __init__(
        self,
        sample_rate: int = 16000,
        frame_length: int = 640,
        num_codebooks: int = 4,
        codebook_size: int = 64,
        seed: int = 0,
    ):
        self.sample_rate = sample_rate
        self.frame_length = frame_length
        self.num_codebooks = num_codebooks
        self.codebook_size = codebook_size
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        n = 2 * frame_length
        t = torch.arange(n, dtype=torch.float64) / sample_rate
        freqs = 80 + 3000 * torch.rand(num_codebooks, codebook_size, 3, generator=g, dtype=torch.float64)
        amps = torch.rand(num_codebooks, codebook_size, 3, generator=g, dtype=torch.float64)
        # Later codebooks are quieter, like the residual stages of an RVQ.
        amps = amps * (0.5 ** torch.arange(num_codebooks, dtype=torch.float64)).view(-1, 1, 1) * 0.15
        waves = (amps.unsqueeze(-1) * torch.sin(2 * math.pi * freqs.unsqueeze(-1) * t)).sum(dim=2)
        self.tables = (waves * torch.hann_window(n, periodic=False, dtype=torch.float64)).to(torch.float32)

    def config(self) -> dict:
        return {
            "type": "wavetable",
            "sample_rate": self.sample_rate,
            "frame_length": self.frame_length,
            "num_codebooks": self.num_codebooks,
            "codebook_size": self.codebook_size,
            "seed": self.seed,
        }

    def decode(self, codes: Tensor) -> Tensor:
        codes = self.check_codes(codes)
        L, T = self.frame_length, codes.shape[1]
        # [T, 2L]; num_codebooks >= 1, so a tensor, never `sum`'s int start (which its stubs allow)
        frames = cast(Tensor, sum(self.tables[i][codes[i]] for i in range(self.num_codebooks)))
        if T == 0:
            return torch.zeros(0)
        out = torch.zeros(T + 1, L)
        out[:T] += frames[:, :L]
        out[1:] += frames[:, L:]
        return out[:T].reshape(-1).clamp(-1.0, 1.0)

    def encode_audio(self, audio: Tensor) -> Tensor:
        L = self.frame_length
        T = max(1, math.ceil(audio.numel() / L))
        x = torch.nn.functional.pad(audio, (0, T * L - audio.numel())).view(T, L)
        codes = torch.zeros(self.num_codebooks, T, dtype=torch.int64)
        for i in range(self.num_codebooks):
            heads = self.tables[i][:, :L]  # [K, L]
            score = x @ heads.T / heads.pow(2).sum(-1).clamp_min(1e-8)
            codes[i] = score.argmax(dim=1)
            x = x - heads[codes[i]]
        return codes
