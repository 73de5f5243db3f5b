"""The default model's codec: stacked log-mel frames, residual VQ, windowed Griffin-Lim.

Frame layout (22050 Hz, 1024 samples per frame = 21.53 frames/s, the Fish frame rate):

* **Features**: a log-mel spectrogram (n_fft 1024, hop 256, Hann window, 80 Slaney mels over
  0-11025 Hz, magnitude, `log(max(mel, 1e-5))`), centred STFT frames. Codec frame t owns mel frames
  4t..4t+3, stacked into one 320-dim vector and standardized with the corpus mean and std.
* **Quantizer**: residual vector quantization, `num_codebooks` stages of `codebook_size` centroids,
  each stage fitted by k-means on the previous stage's residuals (`fit_rvq`). Stage 0 is the coarse
  "semantic" code the slow AR predicts; the later stages refine it. Any prefix of the stages is a valid
  coarser codec.
* **Decoder**: codes -> mel (sum of centroids) -> linear magnitude (pseudo-inverse of the mel
  filterbank) -> Griffin-Lim (`GriffinLim`: torchaudio's algorithm, momentum 0.99, zero-phase start,
  written with torch.fft so that it has no host sync; bit-identical to torchaudio on the CPU). Griffin-Lim
  is not causal, so it runs on a bounded window: for frame t, window W_t spans codec frames t-C..t (C =
  `gl_context`). The samples emitted for frame t are positions `[1024 t - 512, 1024 (t+1) - 512)` of
  the signal (the codec has a fixed 512-sample, 23 ms delay, so every emitted sample has full STFT
  overlap), taken from W_t, with the first 256 of them cross-faded (raised cosine) from the end of
  W_{t-1}. Frame t's samples are therefore a deterministic function of codes t-C-1..t only
  (`context_frames = C + 1`).

Streaming. The base `StreamingDecoder` (decode a window of left context, keep the new frames' samples)
and `MelStreamDecoder` (`batched_stream`: many streams per call, each continuing from per-slot state,
`GriffinLimSlots`: the last C frames' magnitudes and the previous window's cross-fade tail) both equal
`decode()` of all codes **bit for bit on the CPU**: every window is computed by the same operations whatever
the batch around it (FFTs and element-wise ops are per row; the one matrix product has a multiple of 4 rows,
see `melvq.rows_linear`). Measured with 1, 2 and 8 torch threads on the development machine (MKL, AVX-512);
this rests on the BLAS computing a row independently of the other rows, which it does not promise. That
exactness matters because Griffin-Lim's 16-32 momentum iterations are chaotic: a 1-ulp change of one magnitude
moves samples by up to ~1e-2 (~1% of the signal's RMS). So on CUDA (cuFFT and cuBLAS round differently from
the CPU, and cuBLAS by batch shape) streamed, batched and offline audio agree to that level, not bit for bit.

Devices: `to(device)` moves the codebooks, mean/std and the vocoder's constants; `decode` still takes
and returns CPU tensors. All windows of one `decode` call run as one batch (on a CPU in chunks of 24
windows, which stay in cache), so decoding T frames costs T + 1 Griffin-Lim windows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tts.codec.base import Codec
from tts.codec.mel import (
    DELAY,
    FRAME_LENGTH,
    SAMPLE_RATE,
    LogMel,
    MelStreamDecoder,
    WindowedGriffinLim,
    stack_frames,
    unstack_frames,
)


def _kmeans(x: Tensor, k: int, iters: int, generator: torch.Generator) -> Tensor:
    """Lloyd's k-means on `x [n, d]` float32 with k-means++-style seeding on a subsample; empty clusters
    are re-seeded from the points farthest from their centroid. Returns centroids `[k, d]`."""
    n = x.shape[0]
    idx = torch.randperm(n, generator=generator)[:k].to(x.device)
    c = x[idx].clone()
    x_sq = x.pow(2).sum(1, keepdim=True)
    for _ in range(iters):
        assign, dist = nearest_centroid(x, c, x_sq)
        counts = torch.bincount(assign, minlength=k).float()
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        empty = counts == 0
        c = torch.where(empty.unsqueeze(1), c, sums / counts.clamp_min(1).unsqueeze(1))
        if empty.any():
            far = torch.topk(dist, int(empty.sum())).indices
            c[empty] = x[far]
    return c


def nearest_centroid(
    x: Tensor, c: Tensor, x_sq: Tensor | None = None, chunk: int = 65536
) -> tuple[Tensor, Tensor]:
    """Nearest centroid (squared L2) of each row of `x [n, d]` among `c [k, d]`, in chunks of rows.
    Returns (index `[n]` int64, squared distance `[n]`). Shared by k-means, RVQ encoding and the learned
    codec's quantizer."""
    c_sq = c.pow(2).sum(1)
    idx, dist = [], []
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk]
        xsq = x_sq[s : s + chunk] if x_sq is not None else xs.pow(2).sum(1, keepdim=True)
        d = xsq - 2 * xs @ c.T + c_sq
        m = d.min(1)
        idx.append(m.indices)
        dist.append(m.values)
    return torch.cat(idx), torch.cat(dist)


def residual_quantize(x: Tensor, books) -> tuple[Tensor, Tensor]:
    """Residual VQ of `x [n, d]` through `books` (a sequence of `[k, d]` codebooks): each stage codes
    what the previous ones left. Returns (codes `[N, n]` int64, their summed vectors `[n, d]`).
    Shared by the k-means codec and the learned codec's quantizer."""
    residual, total, codes = x, torch.zeros_like(x), []
    for book in books:
        idx, _ = nearest_centroid(residual, book)
        q = book[idx]
        residual = residual - q
        total = total + q
        codes.append(idx)
    return torch.stack(codes), total


def fit_rvq(
    vectors: Tensor, num_codebooks: int, codebook_size: int, iters: int = 20, seed: int = 0, log=None
) -> Tensor:
    """Fit residual-VQ codebooks by k-means, stage by stage.

    vectors: `[n, d]` float32 standardized frame vectors. Returns `[num_codebooks, codebook_size, d]`.
    """
    g = torch.Generator().manual_seed(seed)
    residual = vectors.clone()
    books = []
    for i in range(num_codebooks):
        c = _kmeans(residual, codebook_size, iters, g)
        assign, _ = nearest_centroid(residual, c)
        residual = residual - c[assign]
        books.append(c)
        if log:
            log(f"rvq stage {i}: residual rms {residual.pow(2).mean().sqrt():.4f}")
    return torch.stack(books)


class MelRVQCodec(Codec):
    """See the module docstring. `codebooks [N, K, 320]`, `mean, std [320]` are the fitted parameters."""

    sample_rate = SAMPLE_RATE
    frame_length = FRAME_LENGTH
    delay = DELAY  # (Griffin-Lim's: `tts.codec.mel`)

    def __init__(
        self,
        codebooks: Tensor,
        mean: Tensor,
        std: Tensor,
        gl_context: int = 3,
        gl_iters: int = 32,
        num_codebooks: int | None = None,
    ):
        if num_codebooks is not None:
            codebooks = codebooks[:num_codebooks]
        self.codebooks = codebooks.float().contiguous()
        self.mean = mean.float()
        self.std = std.float()
        self.num_codebooks = int(self.codebooks.shape[0])
        self.codebook_size = int(self.codebooks.shape[1])
        self.gl_context = gl_context
        self.gl_iters = gl_iters
        self.context_frames = gl_context + 1
        self.logmel = LogMel()
        self.vocoder = WindowedGriffinLim(gl_context, gl_iters)

    # ---- files ---------------------------------------------------------------------------------------

    def config(self) -> dict:
        return {
            "type": "mel_rvq",
            "sample_rate": self.sample_rate,
            "frame_length": self.frame_length,
            "num_codebooks": self.num_codebooks,
            "codebook_size": self.codebook_size,
            "gl_context": self.gl_context,
            "gl_iters": self.gl_iters,
            "weights": "codec.safetensors",
        }

    def save(self, directory: str | Path) -> None:
        """Write `codec.json` and `codec.safetensors` into `directory`."""
        directory = Path(directory)
        save_file(
            {"codebooks": self.codebooks.cpu().contiguous(), "mean": self.mean.cpu(), "std": self.std.cpu()},
            str(directory / "codec.safetensors"),
        )
        (directory / "codec.json").write_text(json.dumps(self.config(), indent=2))

    @classmethod
    def load(cls, directory: str | Path, cfg: dict | None = None) -> MelRVQCodec:
        directory = Path(directory)
        cfg = cfg if cfg is not None else json.loads((directory / "codec.json").read_text())
        w = load_file(str(directory / cfg.get("weights", "codec.safetensors")))
        return cls(
            w["codebooks"],
            w["mean"],
            w["std"],
            gl_context=cfg.get("gl_context", 3),
            gl_iters=cfg.get("gl_iters", 32),
            num_codebooks=cfg.get("num_codebooks"),
        )

    # ---- encode --------------------------------------------------------------------------------------

    def features(self, audio: Tensor) -> Tensor:
        """Standardized frame vectors `[T, 320]` of mono 22050 Hz audio."""
        return self.standardize(self.logmel(audio))

    def standardize(self, logmel: Tensor) -> Tensor:
        """A `LogMel` output `[4T, 80]` -> standardized frame vectors `[T, 320]` (on the codec's device)."""
        return (stack_frames(logmel.float()).to(self.device) - self.mean) / self.std

    def quantize(self, vectors: Tensor) -> Tensor:
        """Residual VQ of `[T, 320]` standardized vectors -> codes `[N, T]` int64 (on the CPU)."""
        return residual_quantize(vectors.float().to(self.device), self.codebooks)[0].cpu()

    def encode_logmel(self, logmel: Tensor) -> Tensor:
        """Codes `[N, T]` int64 of a `LogMel` output `[4T, 80]` (the corpus stores log-mel, not audio)."""
        return self.quantize(self.standardize(logmel))

    def encode_audio(self, audio: Tensor) -> Tensor:
        return self.quantize(self.features(audio))

    # ---- decode --------------------------------------------------------------------------------------

    def dequantize(self, codes: Tensor) -> Tensor:
        """Codes `[N, T]` -> log-mel `[4T, 80]` (on the codec's device)."""
        codes = self.check_codes(codes).to(self.device)
        vec = sum(self.codebooks[i][codes[i]] for i in range(self.num_codebooks))
        return unstack_frames(vec * self.std + self.mean)

    def decode(self, codes: Tensor) -> Tensor:
        codes = self.check_codes(codes)
        return self.vocoder(self.dequantize(codes)).cpu()

    def decode_tail(self, codes: Tensor, frames: int) -> Tensor:
        """Float32 samples `[frames * 1024]` of the last `frames` frames; Griffin-Lim runs on just their
        windows."""
        return self.vocoder(self.dequantize(self.check_codes(codes)), last=frames).cpu()

    # ---- device and batched streaming ----------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.codebooks.device

    def to(self, device) -> MelRVQCodec:
        """Move the codebooks, mean/std and the vocoder's constants to `device`; returns self. `encode`,
        `decode` and `decode_tail` still take and return CPU tensors; their work runs on `device`."""
        self.codebooks, self.mean, self.std = (t.to(device) for t in (self.codebooks, self.mean, self.std))
        self.vocoder.to(device)
        return self

    def batched_stream(self, max_streams: int, device=None) -> MelRVQStreamDecoder:
        """A `MelRVQStreamDecoder` for up to `max_streams` streams on `device` (default: the codec's,
        see `to`)."""
        return MelRVQStreamDecoder(self, max_streams, self.device if device is None else device)


class MelRVQStreamDecoder(MelStreamDecoder):
    """`MelStreamDecoder` for `MelRVQCodec`: the log-mel of a frame is its summed centroids, which
    needs no state of its own. Holds copies of the codebooks and mean/std on `device`."""

    def __init__(self, codec: MelRVQCodec, max_streams: int, device):
        super().__init__(codec.vocoder, codec.num_codebooks, codec.codebook_size, max_streams, device)
        self.codebooks, self.mean, self.std = (
            t.to(self.device) for t in (codec.codebooks, codec.mean, codec.std)
        )
        self._init_slots()

    def _logmel(self, slots: Tensor, codes: Tensor, lengths: Tensor) -> Tensor:
        vec = sum(self.codebooks[i][codes[:, i]] for i in range(self.num_codebooks))  # [B, T, 320]
        return unstack_frames(vec * self.std + self.mean)
