"""The "modded DAC" codec of OpenAudio S1 and Fish Audio S2-Pro (docs/fish_dual_ar.md §5.1) behind
the `Codec` interface: `DACCodec` and its streaming decoder.

44.1 kHz mono, one token frame = 2048 samples (21.53 Hz), one semantic codebook (4096 entries) plus 9
residual codebooks (1024 entries). The codec is split by concept; imports run downhill:

* tts/codec/dac_net.py: the network (`DACConfig`, the building blocks, `ModdedDAC`);
* tts/codec/dac_checkpoint.py: checkpoint I/O (read a `codec.pth`, fuse weight norms, infer the
  config, load strictly);
* tts/codec/dac_random.py: random-weight codecs for tests, benchmarks and tiny checkpoints;
* this module: `DACCodec` (loads a `codec.pth` with the checkpoint I/O) and `DACStreamingDecoder`;
* tts/codec/dac_batched.py: `BatchedDACDecoder`, many streams continued in one call.

Streaming: every stage is causal, so `DACStreamingDecoder` keeps state between pushes (the left
context of each convolution, the last input frame of each transposed convolution, the last 127 keys and
values of each transformer layer at their absolute RoPE positions) and the concatenated stream equals an
offline `decode` of all codes up to float rounding. Re-decoding a left-context window instead would need
8 x 127 + 10 frames of context per push: the eight stacked 128-frame windows reach back 1016 frames.
`DACCodec.batched_stream` (tts/codec/dac_batched.py) keeps the same state for many streams in buffers
and continues them all in one call (the codec stage's batched decode, CUDA-graph safe).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tts.codec.base import Codec, CodecCheckpointError, StatefulStreamingDecoder
from tts.codec.dac.net import ModdedDAC
from tts.codec.dac.weights import fuse_weight_norm, infer_config, load_state_strict, read_codec_state

if TYPE_CHECKING:
    from tts.codec.dac.batched import BatchedDACDecoder


class DACCodec(Codec):
    """The modded DAC behind the `Codec` interface: 44.1 kHz mono, 2048 samples per frame, 10 codebooks
    (row 0 semantic, 4096 entries; rows 1-9 residual, 1024 entries; out-of-range codes are clamped).

    Runs on `device`: the encoder, quantizer and codebook lookups in float32, the decode path (post
    transformer, upsampling, decoder; `ModdedDAC.decode_path`) in `dtype` (float32 or bfloat16; the
    weights are cast once, here, and `model` is modified in place). `decode` and `stream()` return CPU
    float32 samples; `batched_stream` float32 samples on `device`. bfloat16 is not bit-compatible: on the
    tiny random-weight codec its audio is about 30 dB SNR from float32 (relative RMS error 0.033, peaks
    0.19; tests/test_dac_batched.py), and streamed bf16 audio differs from an offline bf16 decode by as
    much. Raises ValueError for another dtype.
    """

    def __init__(
        self, model: ModdedDAC, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the DAC decode path runs in float32 or bfloat16, not {dtype}")
        self.model = model.to(device=device, dtype=torch.float32).eval()
        for module in self.model.decode_path():
            module.to(dtype)
        self.dtype = dtype
        c = model.cfg
        self.cfg = c
        self.device = torch.device(device)
        self.sample_rate = c.sample_rate
        self.frame_length = c.frame_length
        self.num_codebooks = c.num_codebooks
        self.codebook_size = c.semantic_codebook_size
        self.residual_codebook_size = c.codebook_size
        self.context_frames = model.context_frames

    @classmethod
    def from_file(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> DACCodec:
        """Load a fish-speech `codec.pth` (any weight-norm storage form; sizes read off the shapes) to run
        on `device`, its decode path in `dtype` (see the class). Raises CodecCheckpointError naming the
        problem."""
        state = fuse_weight_norm(read_codec_state(path))
        cfg = infer_config({k: tuple(v.shape) for k, v in state.items()})
        try:
            cfg.check()
            with torch.device("meta"):
                model = ModdedDAC(cfg)
        except CodecCheckpointError as exc:
            raise CodecCheckpointError(f"{path}: {exc}") from exc
        load_state_strict(model, state, Path(path).name)
        return cls(model, device, dtype)

    def config(self) -> dict:
        return {"type": "modded_dac", "file": "codec.pth"}

    def check_codes(self, codes: Tensor) -> Tensor:
        codes = torch.as_tensor(codes, dtype=torch.int64)
        if codes.dim() != 2 or codes.shape[0] != self.num_codebooks:
            raise ValueError(f"codes must be [{self.num_codebooks}, T], got {tuple(codes.shape)}")
        return self.model.clamp_codes(codes.unsqueeze(0))[0]

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        codes = self.check_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0, dtype=torch.float32)
        return self.model.decode(codes.unsqueeze(0).to(self.device))[0, 0].float().cpu()

    @torch.inference_mode()
    def encode_audio(self, audio: Tensor) -> Tensor:
        x = torch.as_tensor(audio, dtype=torch.float32).reshape(1, 1, -1).to(self.device)
        return self.model.encode(x)[0].cpu()

    def stream(self) -> DACStreamingDecoder:
        return DACStreamingDecoder(self)

    def batched_stream(self, max_streams: int, max_frames: int = 2**16) -> BatchedDACDecoder:
        """A `BatchedDACDecoder` for up to `max_streams` streams of up to `max_frames` frames each (the
        RoPE table's length; 2**16 frames is 50.7 minutes of audio). Allocates its state on `device`."""
        from tts.codec.dac.batched import BatchedDACDecoder

        return BatchedDACDecoder(self, max_streams, max_frames)


class DACStreamingDecoder(StatefulStreamingDecoder):
    """`DACCodec.stream()`: the modded DAC's stateful incremental decode (`StatefulStreamingDecoder`);
    its transformers place each push at absolute RoPE positions from `frames_decoded`."""

    codec: DACCodec

    def _decode(self, codes: Tensor) -> Tensor:
        return self.codec.model.decode(codes.to(self.codec.device), self.frames_decoded, self.state)
