"""The default model's learned codec: a small VQ-VAE on log-mel frames, decoded by windowed Griffin-Lim.

Same features and frame layout as `tts.codec.melrvq` (22050 Hz, 1024 samples = four 256-hop log-mel
frames of 80 Slaney mels per codec frame, 21.53 frames/s), but the codes come from a learned encoder
and are turned back into log-mel by a learned causal decoder, both trained with the codebooks by
`training/train_codec.py`:

* **Encoder** (`MelVQNet.encode`): the standardized `[T, 320]` frame vectors -> 1x1 conv to `channels`
  -> residual blocks of centred kernel-3 convolutions (non-causal; encoding is offline) -> 1x1 conv to
  the `latent`-dim vector of each frame.
  (The shipped default codec's encoder is its seeded random initialization: it was trained with
  `--freeze-encoder` behaviour, by a bug since fixed; a random convolutional encoder with learned
  codebooks and decoder still beat the k-means codec. See training/RESULTS.md.)
* **Quantizer**: residual VQ, `num_codebooks` stages of `codebook_size` vectors (codebooks learned by
  exponential moving averages of their assigned encoder outputs, as in VQ-VAE-2 / SoundStream, with
  unused vectors re-seeded from the batch). Stage 0 is the coarse code the slow AR predicts.
* **Decoder** (`MelVQNet.decode`): the sum of the chosen vectors -> 1x1 conv -> residual blocks of
  *causal* kernel-3 convolutions -> 1x1 conv to the four log-mel frames. Frame t's mel depends on codes
  t - R .. t only, with R = 2 * sum(dilations) (`receptive_frames`).
* **Vocoder**: `melrvq.WindowedGriffinLim` over `gl_context + 1` frames (its own bounded window), so
  frame t's samples depend on codes t - R - gl_context - 1 .. t: `context_frames`. Streaming decode
  (`decode_tail`) therefore equals offline decode. Or, when codec.json names one (`"vocoder": {"type":
  "causal_vocos", ...}`), the learned causal vocoder of `tts.codec.vocoder` (its weights in
  `vocoder.safetensors`): frame t's samples then depend on mel frames 4 t - 3 - R_v .. 4 t + 3 (R_v
  its `receptive_frames`), i.e. on ceil((R_v + 3) / 4) codec frames before t, and streamed audio equals
  offline audio up to float rounding (the convolutions see the same inputs).

Inference runs the decoder through `MelVQNet.decode_frames` (the same function as `decode`, frame-major,
as row products with a multiple of 4 rows, continuable from each block's last inputs), so a frame's
log-mel does not depend on how many frames or streams are decoded with it. That makes `stream()` and
`batched_stream()` (`MelVQStreamDecoder`: per-slot decoder history plus the vocoder's per-slot state,
`melrvq.GriffinLimSlots` or `vocoder.VocoderSlots`) equal `decode()`: with Griffin-Lim bit for bit on
the CPU and within ~1e-2 on CUDA (its chaotic amplification of rounding, see `tts.codec.melrvq`); with
the learned vocoder (the shipped default) to float rounding, its convolutions blocking differently with
the batch (~2e-7 on the CPU).

Devices: `MelVQCodec.to(device)` moves the net, codebooks, mean/std and the vocoder's constants;
`encode`/`decode` keep CPU inputs and outputs and compute on that device, and `batched_stream(n)` builds
its decoder there (or on the `device` it is given, with its own copy of the net).

Files: `codec.json` (type `mel_vqvae` and the shape above) and `codec.safetensors` (the net's weights,
its codebooks, and the feature mean/std).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tts.codec.base import Codec, CodecCheckpointError
from tts.codec.mel import (
    DELAY,
    FRAME_LENGTH,
    N_MELS,
    SAMPLE_RATE,
    SUBFRAMES,
    LogMel,
    MelStreamDecoder,
    WindowedGriffinLim,
    stack_frames,
    unstack_frames,
)
from tts.codec.melrvq import residual_quantize
from tts.codec.vocoder import CausalVocoder

FEATURE_DIM = SUBFRAMES * N_MELS  # 320
VOCODER_TYPE = "causal_vocos"  # codec.json's name for tts.codec.vocoder.CausalVocoder
VOCODER_WEIGHTS = "vocoder.safetensors"


def rows_linear(x: Tensor, conv: nn.Conv1d) -> Tensor:
    """A convolution applied as a matrix product to rows that already hold its taps: `x [..., in * k]`
    (each input channel's k taps next to each other, `conv.weight`'s own layout) -> `[..., out]`.

    The row count is padded to a multiple of 4 because MKL's SGEMM computes a trailing group of fewer
    than 4 rows (and, with several threads, some row counts under 12) with a kernel that rounds
    differently; with whole groups every row's result is the same whatever the row count, so a frame
    decodes to the same bits alone, in a chunk or in a batch. Griffin-Lim turns a 1-ulp change of its
    input into audible-scale sample differences (~1e-2), so this is what lets streamed audio equal the
    offline decode on the CPU.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    pad = -rows.shape[0] % 4
    if pad:  # depends on the shape only, not on values (graph-safe)
        rows = F.pad(rows, (0, 0, 0, pad))
    y = F.linear(rows, conv.weight.flatten(1), conv.bias)
    return (y[: y.shape[0] - pad] if pad else y).reshape(*lead, -1)


class ConvBlock(nn.Module):
    """Residual block: GELU -> kernel-3 dilated conv -> GELU -> 1x1 conv, added to the input.
    `causal` pads only on the left (output t sees inputs t - 2d .. t); otherwise both sides."""

    def __init__(self, channels: int, dilation: int, causal: bool):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, dilation=dilation)
        self.proj = nn.Conv1d(channels, channels, 1)
        self.pad = (2 * dilation, 0) if causal else (dilation, dilation)

    def forward(self, x: Tensor) -> Tensor:
        """`[B, channels, T]` -> `[B, channels, T]`."""
        return x + self.proj(F.gelu(self.conv(F.pad(F.gelu(x), self.pad))))


class MelVQNet(nn.Module):
    """Encoder, residual-VQ codebooks and causal decoder (see the module docstring).

    Tensors are channel-first: features `[B, 320, T]`, latents `[B, latent, T]`, codes `[B, N, T]` int64.
    """

    codebooks: Tensor  # a buffer (`register_buffer` attributes are `Tensor | Module` to the type checker)

    def __init__(
        self,
        num_codebooks: int = 4,
        codebook_size: int = 1024,
        channels: int = 256,
        latent: int = 128,
        encoder_dilations: tuple[int, ...] = (1, 2, 4, 1),
        decoder_dilations: tuple[int, ...] = (1, 2, 1),
    ):
        super().__init__()
        self.num_codebooks, self.codebook_size, self.latent = num_codebooks, codebook_size, latent
        self.shape = dict(
            num_codebooks=num_codebooks,
            codebook_size=codebook_size,
            channels=channels,
            latent=latent,
            encoder_dilations=list(encoder_dilations),
            decoder_dilations=list(decoder_dilations),
        )
        self.enc_in = nn.Conv1d(FEATURE_DIM, channels, 1)
        self.enc_blocks = nn.Sequential(*[ConvBlock(channels, d, causal=False) for d in encoder_dilations])
        self.enc_out = nn.Conv1d(channels, latent, 1)
        self.dec_in = nn.Conv1d(latent, channels, 1)
        self.dec_blocks = nn.Sequential(*[ConvBlock(channels, d, causal=True) for d in decoder_dilations])
        self.dec_out = nn.Conv1d(channels, FEATURE_DIM, 1)
        self.register_buffer("codebooks", torch.zeros(num_codebooks, codebook_size, latent))
        self.receptive_frames = 2 * sum(decoder_dilations)

    def decoder_blocks(self) -> Sequence[ConvBlock]:
        """`dec_blocks`, typed: torch's stubs type an nn.Sequential's items as plain `nn.Module`."""
        return cast("Sequence[ConvBlock]", self.dec_blocks)

    def encode(self, features: Tensor) -> Tensor:
        """Standardized features `[B, 320, T]` -> latents `[B, latent, T]`."""
        return self.enc_out(F.gelu(self.enc_blocks(self.enc_in(features))))

    def quantize(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Residual VQ of latents `[B, latent, T]` -> (codes `[B, N, T]` int64,
        quantized `[B, latent, T]`)."""
        B, D, T = z.shape
        codes, total = residual_quantize(z.transpose(1, 2).reshape(-1, D), self.codebooks)
        codes_t = codes.reshape(self.num_codebooks, B, T).transpose(0, 1)
        return codes_t, total.reshape(B, T, D).transpose(1, 2)

    def lookup(self, codes: Tensor) -> Tensor:
        """Codes `[B, N, T]` -> the sum of their codebook vectors `[B, latent, T]`."""
        return self.lookup_frames(codes).transpose(1, 2)

    def decode(self, q: Tensor) -> Tensor:
        """Quantized latents `[B, latent, T]` -> standardized features `[B, 320, T]` (causal)."""
        return self.dec_out(F.gelu(self.dec_blocks(self.dec_in(q))))

    def lookup_frames(self, codes: Tensor) -> Tensor:
        """Codes `[B, N, T]` -> the sum of their codebook vectors, frame-major `[B, T, latent]`."""
        # num_codebooks >= 1, so the sum is a tensor, never `sum`'s int start (which its stubs allow)
        return cast(Tensor, sum(self.codebooks[i][codes[:, i]] for i in range(self.num_codebooks)))

    def decode_frames(self, q: Tensor, history: list[Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """`decode` frame-major and continuable: the inference path of the codec and its stream decoder.

        q: `[B, T, latent]`; history: per decoder block `[B, 2 * dilation, channels]`, the block's GELU'd
        inputs of the frames before these (what its causal zero padding stands for; None = zeros, a
        stream's start). Returns (standardized features `[B, T, 320]`, per block the GELU'd input
        sequence `[B, 2 * dilation + T, channels]` that the next call's history is cut from).
        Same function as `decode`; it runs the convolutions as row products (`rows_linear`) so that a
        frame's result does not depend on T or B.
        """
        B, T, _ = q.shape
        x = rows_linear(q, self.dec_in)
        inputs = []
        for i, block in enumerate(self.decoder_blocks()):
            d = block.conv.dilation[0]
            g = F.gelu(x)
            h = g.new_zeros(B, 2 * d, g.shape[-1]) if history is None else history[i]
            seq = torch.cat([h, g], dim=1)
            taps = torch.stack(
                [seq[:, :T], seq[:, d : d + T], seq[:, 2 * d : 2 * d + T]], dim=-1
            )  # t-2d, t-d, t
            x = x + rows_linear(F.gelu(rows_linear(taps.reshape(B, T, -1), block.conv)), block.proj)
            inputs.append(seq)
        return rows_linear(F.gelu(x), self.dec_out), inputs


class MelVQCodec(Codec):
    """Learned mel codec (module docstring). `net` holds the weights; `mean`, `std` `[320]` standardize
    the stacked log-mel features. Runs on the CPU unless `to(device)` moves it (corpus encoding, GPU
    decoding); inputs and outputs of encode/decode stay on the CPU either way."""

    sample_rate = SAMPLE_RATE
    frame_length = FRAME_LENGTH
    delay = DELAY  # (the vocoder's, Griffin-Lim or learned: `tts.codec.mel`)

    def __init__(
        self,
        net: MelVQNet,
        mean: Tensor,
        std: Tensor,
        gl_context: int = 2,
        gl_iters: int = 16,
        vocoder_net: CausalVocoder | None = None,
    ):
        """vocoder_net: a learned vocoder in place of Griffin-Lim (None: Griffin-Lim)."""
        self.net = net.eval()
        self.mean = mean.float()
        self.std = std.float()
        self.num_codebooks = net.num_codebooks
        self.codebook_size = net.codebook_size
        self.gl_context, self.gl_iters = gl_context, gl_iters
        self.logmel = LogMel()
        self.vocoder = WindowedGriffinLim(gl_context, gl_iters)
        # (on the net's device, where `decode_logmel` puts the log-mel it vocodes)
        self.vocoder_net = vocoder_net.eval().to(self.device) if vocoder_net is not None else None
        if vocoder_net is None:
            self.context_frames = net.receptive_frames + gl_context + 1
        else:
            self.context_frames = net.receptive_frames + -(-(vocoder_net.receptive_frames + 3) // SUBFRAMES)

    @property
    def device(self) -> torch.device:
        return self.net.codebooks.device

    def to(self, device) -> MelVQCodec:
        """Move the net (encoder, codebooks, decoder), mean/std and the vocoder's constants to `device`;
        returns self. `encode`, `decode`, `decode_tail` and `dequantize` still take and return CPU
        tensors; their work runs on `device`. `batched_stream` decoders are made on this device."""
        self.net.to(device)
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        self.vocoder.to(device)
        if self.vocoder_net is not None:
            self.vocoder_net.to(device)
        return self

    # ---- files ---------------------------------------------------------------------------------------

    def config(self) -> dict:
        """The `codec.json` contents: type, frame layout, net shape and vocoder settings."""
        return {
            "type": "mel_vqvae",
            "sample_rate": self.sample_rate,
            "frame_length": self.frame_length,
            **self.net.shape,
            "gl_context": self.gl_context,
            "gl_iters": self.gl_iters,
            "weights": "codec.safetensors",
            **(
                {}
                if self.vocoder_net is None
                else {"vocoder": {"type": VOCODER_TYPE, **self.vocoder_net.shape, "weights": VOCODER_WEIGHTS}}
            ),
        }

    def save(self, directory: str | Path) -> None:
        """Write `codec.json` and `codec.safetensors` into `directory`: the convolution weights in
        float16 (half the file; loaded back as float32), the codebooks and mean/std in float32; a learned
        vocoder's weights in float16 too, in `vocoder.safetensors`."""
        directory = Path(directory)
        state = {
            k: v.detach().cpu().to(torch.float32 if k == "codebooks" else torch.float16).contiguous()
            for k, v in self.net.state_dict().items()
        }
        mean_std = {"mean": self.mean.cpu(), "std": self.std.cpu()}
        save_file({**state, **mean_std}, str(directory / "codec.safetensors"))
        if self.vocoder_net is not None:
            weights = {
                k: v.detach().cpu().to(torch.float16).contiguous()
                for k, v in self.vocoder_net.state_dict().items()
            }
            save_file(weights, str(directory / VOCODER_WEIGHTS))
        (directory / "codec.json").write_text(json.dumps(self.config(), indent=2))

    @classmethod
    def load(cls, directory: str | Path, cfg: dict | None = None) -> MelVQCodec:
        """Read a folder written by `save` (`cfg`: its codec.json, when already parsed). Raises
        FileNotFoundError, KeyError or RuntimeError (safetensors / state dict) for broken folders, and
        CodecCheckpointError for a bad `"vocoder"` entry (`load_vocoder`)."""
        directory = Path(directory)
        cfg = cfg if cfg is not None else json.loads((directory / "codec.json").read_text())
        w = load_file(str(directory / cfg.get("weights", "codec.safetensors")))
        net = MelVQNet(
            num_codebooks=cfg["num_codebooks"],
            codebook_size=cfg["codebook_size"],
            channels=cfg["channels"],
            latent=cfg["latent"],
            encoder_dilations=tuple(cfg["encoder_dilations"]),
            decoder_dilations=tuple(cfg["decoder_dilations"]),
        )
        mean, std = w.pop("mean"), w.pop("std")
        net.load_state_dict({k: v.float() for k, v in w.items()})
        vocoder_net = None
        if cfg.get("vocoder") is not None:
            vocoder_net = load_vocoder(directory, cfg["vocoder"])
        return cls(
            net,
            mean,
            std,
            gl_context=cfg.get("gl_context", 2),
            gl_iters=cfg.get("gl_iters", 16),
            vocoder_net=vocoder_net,
        )

    # ---- encode --------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_logmel(self, logmel: Tensor) -> Tensor:
        """Codes `[N, T]` int64 (on the CPU) of a `LogMel` output `[4T, 80]`."""
        x = (stack_frames(logmel.float()).to(self.device) - self.mean) / self.std  # [T, 320]
        codes, _ = self.net.quantize(self.net.encode(x.T.unsqueeze(0)))
        return codes[0].cpu()

    def encode_audio(self, audio: Tensor) -> Tensor:
        return self.encode_logmel(self.logmel(audio))

    # ---- decode --------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode_logmel(self, codes: Tensor) -> Tensor:
        """Codes `[N, T]` (clamped) -> log-mel `[4T, 80]` float32 on the codec's device (causal decoder)."""
        q = self.net.lookup_frames(codes.to(self.device).unsqueeze(0))
        feats, _ = self.net.decode_frames(q)
        return unstack_frames(feats[0] * self.std + self.mean)

    def dequantize(self, codes: Tensor) -> Tensor:
        """Codes `[N, T]` -> log-mel `[4T, 80]` (CPU float32) through the causal decoder."""
        return self.decode_logmel(self.check_codes(codes)).cpu()

    def decode(self, codes: Tensor) -> Tensor:
        codes = self.check_codes(codes)
        if codes.shape[1] == 0:
            return torch.zeros(0)
        return self._vocode(self.decode_logmel(codes)).cpu()

    def decode_tail(self, codes: Tensor, frames: int) -> Tensor:
        """Float32 samples `[frames * 1024]` of the last `frames` frames; Griffin-Lim runs on their
        windows only (a learned vocoder on all of `codes`: it is cheap)."""
        codes = self.check_codes(codes)
        if frames <= 0 or codes.shape[1] == 0:
            return torch.zeros(0)
        if self.vocoder_net is not None:
            return self._vocode(self.decode_logmel(codes))[
                -min(frames, codes.shape[1]) * FRAME_LENGTH :
            ].cpu()
        return self.vocoder(self.decode_logmel(codes), last=frames).cpu()

    @torch.no_grad()
    def _vocode(self, logmel: Tensor) -> Tensor:
        """Log-mel `[4T, 80]` -> audio `[1024 T]` by the learned vocoder if there is one, else Griffin-Lim."""
        if self.vocoder_net is None:
            return self.vocoder(logmel)
        return self.vocoder_net.synthesize(logmel.unsqueeze(0))[0]

    def batched_stream(self, max_streams: int, device=None) -> MelVQStreamDecoder:
        """A `MelVQStreamDecoder` for up to `max_streams` streams on `device` (default: the codec's, i.e.
        where `to` put the net)."""
        return MelVQStreamDecoder(self, max_streams, self.device if device is None else device)


def load_vocoder(directory: Path, entry) -> CausalVocoder:
    """The learned vocoder that codec.json's `"vocoder"` entry names: `{"type": "causal_vocos",
    "channels": C, "blocks": B, "kernel": K, "weights": "vocoder.safetensors"}`, its weights read from
    `directory`. Raises CodecCheckpointError naming the file and what is wrong (an entry that is not
    such an object, missing weights), or RuntimeError (weights of another shape)."""
    where = directory / "codec.json"
    if not isinstance(entry, dict):
        raise CodecCheckpointError(f'{where}: "vocoder" must be an object, got {entry!r}')
    if entry.get("type") != VOCODER_TYPE:
        raise CodecCheckpointError(
            f"{where}: unknown vocoder type {entry.get('type')!r} (known: {VOCODER_TYPE})"
        )
    missing = [k for k in ("channels", "blocks", "kernel") if not isinstance(entry.get(k), int)]
    if missing:
        raise CodecCheckpointError(f"{where}: the vocoder entry needs integer {', '.join(missing)}")
    net = CausalVocoder(channels=entry["channels"], blocks=entry["blocks"], kernel=entry["kernel"])
    path = directory / entry.get("weights", VOCODER_WEIGHTS)
    if not path.is_file():
        raise CodecCheckpointError(f"{where} names vocoder weights {path.name}, which are missing")
    net.load_state_dict({k: t.float() for k, t in load_file(str(path)).items()})
    return net


class MelVQStreamDecoder(MelStreamDecoder):
    """The default codec's `BatchedStreamDecoder`: `MelStreamDecoder`'s vocoder state plus, per
    slot, each causal decoder block's last `2 * dilation` GELU'd inputs (`[2 d, channels]`, zeros for a
    fresh stream: the block's causal zero padding), so a call decodes only its new frames.

    Uses the codec's net when it already lives on `device`, else a copy moved there (either way it
    reads the net's weights at every call: do not train the net while decoding). Per-slot state for the
    default codec (C = 2, 384 channels, dilations 1, 2, 4, 1): 16 x 384 + 8 x 513 + 256 floats, about
    42 KB.
    """

    def __init__(self, codec: MelVQCodec, max_streams: int, device):
        vocoder = codec.vocoder if codec.vocoder_net is None else codec.vocoder_net
        super().__init__(vocoder, codec.num_codebooks, codec.codebook_size, max_streams, device)
        net = codec.net
        self.net = net if codec.device == self.device else copy.deepcopy(net).to(self.device)
        self.mean, self.std = codec.mean.to(self.device), codec.std.to(self.device)
        channels = net.dec_in.out_channels
        dilations = [block.conv.dilation[0] for block in net.decoder_blocks()]
        self._history = [torch.zeros(max_streams + 1, 2 * d, channels, device=self.device) for d in dilations]
        self._history_offsets = [torch.arange(2 * d, device=self.device).view(1, 2 * d, 1) for d in dilations]
        self._init_slots()

    def _reset(self, slots: Tensor) -> None:
        for h in self._history:
            h.index_fill_(0, slots, 0.0)

    def _logmel(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        B = codes.shape[0]
        feats, inputs = self.net.decode_frames(
            self.net.lookup_frames(codes), [h.index_select(0, slots) for h in self._history]
        )
        for h, seq, offsets in zip(self._history, inputs, self._history_offsets, strict=True):
            idx = (lengths.view(B, 1, 1) + offsets).expand(-1, -1, seq.shape[-1])  # the 2d before the end
            h.index_copy_(0, slots, seq.gather(1, idx))
        return unstack_frames(feats * self.std + self.mean)
