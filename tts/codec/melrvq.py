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
  filterbank) -> Griffin-Lim (torchaudio, momentum 0.99, zero-phase start). Griffin-Lim is not causal,
  so it runs on a bounded window: for frame t, window W_t spans codec frames t-C..t (C =
  `gl_context`). The samples emitted for frame t are positions `[1024 t - 512, 1024 (t+1) - 512)` of
  the signal (the codec has a fixed 512-sample, 23 ms delay, so every emitted sample has full STFT
  overlap), taken from W_t, with the first 256 of them cross-faded (raised cosine) from the end of
  W_{t-1}. Frame t's samples are therefore a deterministic function of codes t-C-1..t only
  (`context_frames = C + 1`), and the base `StreamingDecoder` (decode a window of left context,
  keep the new frames' samples) reproduces `decode()` of all codes up to float rounding (< 1e-4).

All windows of one `decode` call run as one batch, so decoding T frames costs about C + 1 times a
single Griffin-Lim pass over the utterance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import torchaudio
from safetensors.torch import load_file, save_file
from torch import Tensor

from .base import Codec

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
            sample_rate=SAMPLE_RATE, n_fft=N_FFT, win_length=N_FFT, hop_length=HOP, f_min=0.0,
            f_max=SAMPLE_RATE / 2, n_mels=N_MELS, power=1.0, norm="slaney", mel_scale="slaney", center=True,
        )  # fmt: skip

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

    def __init__(
        self, codebooks: Tensor, mean: Tensor, std: Tensor, gl_context: int = 3, gl_iters: int = 32,
        num_codebooks: int | None = None,
    ):  # fmt: skip
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
            {"codebooks": self.codebooks.contiguous(), "mean": self.mean, "std": self.std},
            str(directory / "codec.safetensors"),
        )
        (directory / "codec.json").write_text(json.dumps(self.config(), indent=2))

    @classmethod
    def load(cls, directory: str | Path, cfg: dict | None = None) -> MelRVQCodec:
        directory = Path(directory)
        cfg = cfg if cfg is not None else json.loads((directory / "codec.json").read_text())
        w = load_file(str(directory / cfg.get("weights", "codec.safetensors")))
        return cls(
            w["codebooks"], w["mean"], w["std"], gl_context=cfg.get("gl_context", 3),
            gl_iters=cfg.get("gl_iters", 32), num_codebooks=cfg.get("num_codebooks"),
        )  # fmt: skip

    # ---- encode --------------------------------------------------------------------------------------

    def features(self, audio: Tensor) -> Tensor:
        """Standardized frame vectors `[T, 320]` of mono 22050 Hz audio."""
        return self.standardize(self.logmel(audio))

    def standardize(self, logmel: Tensor) -> Tensor:
        """A `LogMel` output `[4T, 80]` -> standardized frame vectors `[T, 320]`."""
        return (stack_frames(logmel.float()) - self.mean) / self.std

    def quantize(self, vectors: Tensor) -> Tensor:
        """Residual VQ of `[T, 320]` standardized vectors -> codes `[N, T]` int64."""
        return residual_quantize(vectors.float(), self.codebooks)[0]

    def encode_logmel(self, logmel: Tensor) -> Tensor:
        """Codes `[N, T]` int64 of a `LogMel` output `[4T, 80]` (the corpus stores log-mel, not audio)."""
        return self.quantize(self.standardize(logmel))

    def encode_audio(self, audio: Tensor) -> Tensor:
        return self.quantize(self.features(audio))

    # ---- decode --------------------------------------------------------------------------------------

    def dequantize(self, codes: Tensor) -> Tensor:
        """Codes `[N, T]` -> log-mel `[4T, 80]`."""
        codes = self.check_codes(codes)
        vec = sum(self.codebooks[i][codes[i]] for i in range(self.num_codebooks))
        return unstack_frames(vec * self.std + self.mean)

    def decode(self, codes: Tensor) -> Tensor:
        codes = self.check_codes(codes)
        return self.vocoder(self.dequantize(codes))

    def decode_tail(self, codes: Tensor, frames: int) -> Tensor:
        """Float32 samples `[frames * 1024]` of the last `frames` frames; Griffin-Lim runs on just their
        windows."""
        return self.vocoder(self.dequantize(self.check_codes(codes)), last=frames)


class WindowedGriffinLim:
    """Log-mel `[4T, 80]` -> float32 audio `[T * 1024]` in [-1, 1] by Griffin-Lim on bounded windows.

    The window layout, the 512-sample delay and the cross-fade are described in the module docstring:
    frame t's samples depend only on mel frames of codec frames t - context - 1 .. t. `last=k` returns
    the samples of the last k frames only and runs only their k + 1 windows (streaming decode).
    """

    def __init__(self, context: int, iters: int):
        self.context = context
        self.iters = iters
        self.inverse_fb = torch.linalg.pinv(LogMel().filterbank.T)  # [513, 80]: mel -> linear magnitude
        self.window = torch.hann_window(N_FFT)
        ramp = torch.arange(CROSSFADE, dtype=torch.float32) + 0.5
        self.fade_in = 0.5 - 0.5 * torch.cos(math.pi * ramp / CROSSFADE)

    def __call__(self, logmel: Tensor, last: int | None = None) -> Tensor:
        T = logmel.shape[0] // SUBFRAMES
        last = T if last is None else min(last, T)
        if last <= 0:
            return torch.zeros(0)
        C = self.context
        L = FRAME_LENGTH
        # Windows W_{-1}..W_{T-1}: W_t = codec frames t-C..t, left-padded with silence frames.
        silence = math.log(LOG_FLOOR)
        padded = torch.cat([torch.full(((C + 1) * SUBFRAMES, N_MELS), silence), logmel.float()])
        win = padded.unfold(0, (C + 1) * SUBFRAMES, SUBFRAMES)  # [T+1, 80, 4(C+1)]: W_{t-1} = row t
        win = win[T - last :]  # the windows of the last `last` frames and their predecessor
        mag = (self.inverse_fb @ torch.exp(win)).clamp_min(0.0)  # [last+1, 513, 4(C+1)]
        n_mel_frames = mag.shape[-1]
        # Griffin-Lim on every window at once; centred iSTFT gives 256 * (frames - 1) samples.
        y = torchaudio.functional.griffinlim(
            mag, self.window, N_FFT, HOP, N_FFT, power=1.0, n_iter=self.iters, momentum=0.99,
            length=HOP * (n_mel_frames - 1), rand_init=False,
        )  # fmt: skip  # [last+1, 256 (4C + 3)]
        # Window W_t starts at signal position L (t - C). Frame t emits [L t - 512, L (t+1) - 512):
        # offset L C - 512 in W_t. The cross-fade's other half comes from W_{t-1} at offset L (C+1) - 512.
        start = L * C - DELAY
        cur = y[1:, start : start + L]  # [last, L] from W_t
        prev = y[:-1, start + L : start + L + CROSSFADE]  # [last, 256] from W_{t-1}
        head = prev * (1 - self.fade_in) + cur[:, :CROSSFADE] * self.fade_in
        out = torch.cat([head, cur[:, CROSSFADE:]], dim=1).reshape(-1)
        return out.clamp(-1.0, 1.0)
