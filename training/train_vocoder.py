"""Train the learned causal vocoder (`tts.codec.vocoder.CausalVocoder`) and compare it with Griffin-Lim.

Data: the corpus's utterances (`training/corpus.py text` writes WORK/sentences.jsonl), spoken here by the
teacher each row names, espeak-ng or flite (`--utterances` training ones, plus the held-out ones for
`evaluate`) and kept as float16 audio in WORK/vocoder_audio.pt, so that a resumed run reads them back
instead of speaking them again. The vocoder's input is what it meets at run time: the codec's round trip
of the clip (`--input codec`: log-mel -> codes -> the codec's causal decoder -> log-mel), or the clip's
own log-mel (`--input mel`). Its target is the clip itself.

Reconstruction loss: multi-resolution STFT loss at (FFT, hop) = (512, 128), (1024, 256) and (2048,
512), each the spectral convergence plus the L1 distance of log magnitudes (Yamamoto et al., "Parallel
WaveGAN", 2020, section 2.3), plus the L1 distance of the output's log-mel to the clip's log-mel.
Training crops are `--crop-frames` mel frames with the vocoder's receptive field of true left context
before them; the loss covers the samples that all four overlapping STFT frames reach.

`--adversarial` adds discriminators, as HiFi-GAN and Vocos train theirs: five period discriminators
and three resolution discriminators (`Discriminators`), least-squares GAN losses and feature matching;
the generator's loss is then `--rec-weight` x the reconstruction loss + the adversarial loss +
`--fm-weight` x the feature-matching loss. For their first `--adv-warmup` steps, fresh discriminators
train while the generator trains on the reconstruction loss only, so that a trained generator
(`--init`) is not pushed around by discriminators that know nothing yet.

`evaluate` (`--eval`, or after training) scores held-out clips through the codec both ways, Griffin-Lim
(the codec's fallback, and what shipped before v2) and the vocoder: the multi-resolution log-spectral
distance to the original clip (the loss's log-magnitude L1 term, in nats, averaged over the three
resolutions; lower is better), an MFCC distance (the mel-cepstral distortion formula, dB; not a training
loss), the decode time per audio time and, unless `--no-asr` (needs the tools extra), the word error rate
of Whisper tiny.en transcripts (per corpus speaker too, when the clips have several). The held-out clips
are 60 sentences of one speaker; `--eval-from K` scores training clips from row K on instead, of every
speaker (K past the clips the vocoder, and for an unseen round trip the codec, trained on).

`--init DIR` starts a new run from a trained vocoder's weights (a run folder or a bundle such as
tts/assets/default) with a fresh optimizer and learning-rate schedule: a second stage that anneals
the learning rate of a run that was cut short.

Resumable: every run writes into `--out` (vocoder.safetensors, vocoder.json, checkpoint.pt with the
optimizer and the seconds trained, loss.csv, eval.json) and `--resume` continues from checkpoint.pt; a
run stops itself after `--max-seconds`, and `--schedule-seconds` spreads one learning-rate schedule
over several resumed runs.

    python training/train_vocoder.py --work training/work --codec tts/assets/default --out OUT \
        --utterances 2000 --max-seconds 1800
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

from tts.codec.base import CodecCheckpointError  # noqa: E402
from tts.codec.mel import FRAME_LENGTH, HOP, LOG_FLOOR, SUBFRAMES, LogMel  # noqa: E402
from tts.codec.melvq import VOCODER_TYPE, load_vocoder  # noqa: E402
from tts.codec.vocoder import ENVELOPE, TAIL, CausalVocoder, overlap_add  # noqa: E402

RESOLUTIONS = ((512, 128), (1024, 256), (2048, 512))
DELAY = 512  # the codec's: emitted sample i is signal sample i - 512


# ---- data ------------------------------------------------------------------------------------------


def one_torch_thread() -> None:
    """Pool initializer of `speak_all`'s workers: torch on one thread each.

    flite's resampling runs torch in every worker, and torch's default is a thread per core it sees.
    On a 16-core machine 16 workers without this had not finished speaking 8,060 clips after 565 s; with
    it they spoke them in 54 s."""
    torch.set_num_threads(1)


def speak_pool(jobs: int):
    """`speak_all`'s process pool: `jobs` spawned workers, torch on one thread each."""
    from multiprocessing import get_context

    # Spawned, not forked: flite's resampling runs torch in the workers, and a fork of a process whose
    # torch thread pool has run can hang there.
    return get_context("spawn").Pool(jobs, initializer=one_torch_thread)


def speak_all(rows: list[dict], jobs: int) -> list[torch.Tensor]:
    """The teacher's audio (float16 `[samples]`) of every utterance row (`corpus.speak`), in order."""
    from corpus import speak

    audio, t0 = [], time.time()
    with speak_pool(jobs) as pool:
        for a in pool.imap(speak, rows, chunksize=16):  # in order, as map; the log shows progress
            audio.append(torch.from_numpy(a).to(torch.float16))
            if len(audio) % 1000 == 0:
                print(f"spoke {len(audio)} of {len(rows)} clips: {time.time() - t0:.0f} s", flush=True)
    return audio


def choose_rows(
    rows: list[dict],
    utterances: int,
    eval_clips: int,
    eval_from: int | None = None,
    trained_on: int | None = None,
) -> tuple[list[dict], list[int], list[int]]:
    """The corpus rows a run speaks, and which of them it trains on and evaluates: every held-out row,
    the first `utterances` training rows, and with `eval_from` the `eval_clips` training rows from
    training row `eval_from` on. Returns (chosen rows, training indices, evaluation indices) into the
    chosen rows: the evaluation ones are the first `eval_clips` held-out rows, or with `eval_from` the
    rows from there on (clips of every corpus speaker that a vocoder trained on at most `eval_from`
    utterances never heard; the held-out rows are fewer and of one speaker). `trained_on`: how many of
    the first training rows the evaluated vocoder trained on, when that is not `utterances` (`--eval`
    speaks none; vocoder.json records the number).

    Raises ValueError for a negative `utterances`, an `eval_clips` below 1, an `eval_from` below the
    rows trained on, or fewer than `eval_clips` training rows from `eval_from` on. (Fewer held-out rows
    than `eval_clips`, or training rows than `utterances`, give what there is.)"""
    if utterances < 0 or eval_clips < 1:
        raise ValueError(
            f"--utterances must be >= 0 and --eval-clips >= 1, not {utterances} and {eval_clips}"
        )
    seen = utterances if trained_on is None else trained_on
    if eval_from is not None and eval_from < seen:
        source = (
            f"--utterances {utterances}" if trained_on is None else f"the {trained_on} the vocoder trained on"
        )
        raise ValueError(f"--eval-from {eval_from} is below {source}: those clips are trained on")
    train = [u for u in rows if u["split"] == "train"]
    held = [u for u in rows if u["split"] == "heldout"]
    unseen = [] if eval_from is None else train[eval_from : eval_from + eval_clips]
    if eval_from is not None and len(unseen) < eval_clips:
        raise ValueError(
            f"--eval-from {eval_from} --eval-clips {eval_clips}: the corpus has {len(train)} training rows, "
            f"{len(unseen)} of them from there on"
        )
    chosen = held + train[:utterances] + unseen
    train_idx = list(range(len(held), len(held) + min(utterances, len(train))))
    if eval_from is None:
        eval_idx = list(range(min(eval_clips, len(held))))
    else:
        eval_idx = list(range(len(chosen) - len(unseen), len(chosen)))
    return chosen, train_idx, eval_idx


def load_audio(
    work: Path, chosen: list[dict], jobs: int, cache_name: str = "vocoder_audio.pt"
) -> list[torch.Tensor]:
    """The audio of the `chosen` rows of WORK/sentences.jsonl (`choose_rows`), in order; cached in
    WORK/`cache_name` (re-spoken when the cache holds other rows, or the same rows spoken otherwise:
    the key is each whole row, teacher, voice, rate and pitch included, since the espeak-ng and flite
    corpora share ids and texts)."""
    key = [json.dumps(u, sort_keys=True) for u in chosen]
    cache = work / cache_name
    if cache.is_file():
        saved = torch.load(cache)
        if saved.get("rows") == key:
            return saved["audio"]
    t0 = time.time()
    audio = speak_all(chosen, jobs)
    torch.save({"rows": key, "audio": audio}, cache)
    print(f"spoke {len(chosen)} clips in {time.time() - t0:.0f} s -> {cache}", flush=True)
    return audio


class Clips:
    """Clips prepared for training: audio padded to whole codec frames `[1024 T]` float32, the clip's
    log-mel `[4T, 80]` (the loss's target) and the vocoder's input log-mel `[4T, 80]`."""

    def __init__(self, audio: list[torch.Tensor], codec=None):
        self.logmel = LogMel()
        self.audio, self.target_mel, self.input_mel = [], [], []
        for a in audio:
            a = a.float()
            T = max(1, math.ceil(a.numel() / FRAME_LENGTH))
            a = F.pad(a, (0, T * FRAME_LENGTH - a.numel()))
            mel = self.logmel(a)
            self.audio.append(a)
            self.target_mel.append(mel)
            self.input_mel.append(
                mel if codec is None else codec.decode_logmel(codec.encode_logmel(mel)).cpu()
            )

    def batch(self, r: random.Random, size: int, frames: int, context: int) -> dict:
        """`size` random crops of `frames` mel frames, each with `context` frames of left context (silence
        before a clip's start): input mel `[B, context + frames, 80]`, the signal the crop's fully
        overlapped samples should equal `[B, 256 frames - 768]`, its log-mel `[B, frames, 80]`."""
        mels, audio, targets = [], [], []
        for _ in range(size):
            k = r.randrange(len(self.audio))
            mel, a = self.input_mel[k], self.audio[k]
            M = mel.shape[0]
            start = r.randrange(max(1, M - frames + 1))
            padded = F.pad(mel, (0, 0, context, max(0, start + frames - M)), value=math.log(LOG_FLOOR))
            mels.append(padded[start : start + context + frames])
            # STFT frame j adds into emitted samples [256 j, 256 j + 1024), i.e. signal samples from
            # 256 j - 512; four frames overlap from emitted 256 (start + 3) to 256 (start + frames).
            lo = HOP * (start + 3) - DELAY
            n = HOP * frames - TAIL
            seg = F.pad(a, (DELAY, HOP * frames + DELAY))[lo + DELAY : lo + DELAY + n]
            audio.append(seg)
            tmel = F.pad(self.target_mel[k], (0, 0, 0, max(0, start + frames - M)), value=math.log(LOG_FLOOR))
            targets.append(tmel[start : start + frames])
        return {"mel": torch.stack(mels), "audio": torch.stack(audio), "target_mel": torch.stack(targets)}


# ---- loss ------------------------------------------------------------------------------------------


def stft_mag(x: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """|STFT| `[B, frames, n_fft / 2 + 1]` of `[B, L]`, Hann window, floored at 1e-5."""
    window = torch.hann_window(n_fft, device=x.device)
    spec = torch.stft(x, n_fft, hop, window=window, center=True, return_complex=True)
    return spec.abs().clamp_min(1e-5).transpose(1, 2)


def spectral_losses(y: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(spectral convergence, log-magnitude L1 in nats), each averaged over RESOLUTIONS; y, ref `[B, L]`."""
    sc, lm = y.new_zeros(()), y.new_zeros(())
    for n_fft, hop in RESOLUTIONS:
        a, b = stft_mag(y, n_fft, hop), stft_mag(ref, n_fft, hop)
        sc = sc + torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-5)
        lm = lm + (a.log() - b.log()).abs().mean()
    return sc / len(RESOLUTIONS), lm / len(RESOLUTIONS)


def synthesize_crops(model: CausalVocoder, batch: dict) -> torch.Tensor:
    """The vocoder's audio for a batch's crops `[B, 256 frames - 768]`: the fully overlapped samples,
    aligned with `batch["audio"]`."""
    R = model.receptive_frames
    frames = model.frames(batch["mel"])[:, R:]  # [B, M, 1024]
    return overlap_add(frames)[:, TAIL : HOP * frames.shape[1]] / ENVELOPE


def compute_loss(model: CausalVocoder, batch: dict, mel_fn: LogMel) -> tuple[torch.Tensor, dict]:
    """The training loss of one batch (module docstring) and its parts."""
    return reconstruction_loss(synthesize_crops(model, batch), batch, mel_fn)


def reconstruction_loss(y: torch.Tensor, batch: dict, mel_fn: LogMel) -> tuple[torch.Tensor, dict]:
    """The reconstruction loss of the crops' audio `y` (`synthesize_crops`) and its parts."""
    sc, lm = spectral_losses(y, batch["audio"])
    # y starts at signal sample 256 (start + 1): its log-mel frame m' is the crop's mel frame m' + 3.
    y_mel = torch.stack([log_mel_frames(mel_fn, row) for row in y])  # [B, M - 6, 80]
    mel_loss = (y_mel - batch["target_mel"][:, 3 : 3 + y_mel.shape[1]]).abs().mean()
    loss = sc + lm + 0.5 * mel_loss
    return loss, {"sc": sc.detach(), "log_mag": lm.detach(), "mel": mel_loss.detach()}


def log_mel_frames(mel_fn: LogMel, y: torch.Tensor) -> torch.Tensor:
    """Log-mel frames `[L / 256 - 3, 80]` of `y` `[L]` (L a multiple of 256), frame m centred on sample
    256 m + 512 (no padding: every frame lies inside y); differentiable."""
    spec = torch.stft(
        y, 1024, HOP, window=torch.hann_window(1024, device=y.device), center=False, return_complex=True
    )
    fb = mel_fn.filterbank.to(y.device)  # [513, 80]
    return torch.log((spec.abs().T @ fb).clamp_min(LOG_FLOOR))


# ---- adversarial training (`--adversarial`) ---------------------------------------------------------

PERIODS = (2, 3, 5, 7, 11)  # HiFi-GAN's periods (primes, so that the folds overlap little)


def judge(convs: nn.ModuleList, post: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A discriminator's stack: each conv then leaky ReLU (slope 0.1), then `post` -> logits `[B, n]`
    and every layer's output (the features that feature matching compares)."""
    feats = []
    for conv in convs:
        h = F.leaky_relu(conv(h), 0.1)
        feats.append(h)
    h = post(h)
    feats.append(h)
    return h.flatten(1), feats


class PeriodDiscriminator(nn.Module):
    """HiFi-GAN's period discriminator (Kong et al., "HiFi-GAN", 2020, section 2.2): audio `[B, L]`
    folded into `[B, 1, L / p, p]` (reflection-padded to a multiple of p) and 2-D convolutions along
    time only, so that each of the p phases is judged on its own. Narrower than HiFi-GAN's (32-256
    channels, not 32-1024): espeak-ng's speech is simple, and the step must stay fast."""

    def __init__(self, period: int, channels: tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        self.period = period
        convs, c_in = [], 1
        for c in channels:
            convs.append(weight_norm(nn.Conv2d(c_in, c, (5, 1), (3, 1), padding=(2, 0))))
            c_in = c
        convs.append(weight_norm(nn.Conv2d(c_in, c_in, (5, 1), 1, padding=(2, 0))))
        self.convs = nn.ModuleList(convs)
        self.post = weight_norm(nn.Conv2d(c_in, 1, (3, 1), 1, padding=(1, 0)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Audio `[B, L]` -> logits `[B, n]` and every layer's feature map (for feature matching)."""
        B, L = x.shape
        pad = (-L) % self.period
        h = F.pad(x.unsqueeze(1), (0, pad), mode="reflect").view(B, 1, -1, self.period)
        return judge(self.convs, self.post, h)


class ResolutionDiscriminator(nn.Module):
    """A resolution discriminator after UnivNet's (Jang et al., "UnivNet", 2021, section 2.3): 2-D
    convolutions over the STFT magnitude at one (FFT, hop), here its log `[B, 1, frames, bins]` (UnivNet
    takes the linear magnitude; the log keeps quiet frames from vanishing beside loud ones)."""

    def __init__(self, n_fft: int, hop: int, channels: int = 32):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        c = channels
        self.convs = nn.ModuleList(
            [weight_norm(nn.Conv2d(1, c, (3, 9), padding=(1, 4)))]
            + [weight_norm(nn.Conv2d(c, c, (3, 9), (1, 2), padding=(1, 4))) for _ in range(3)]
            + [weight_norm(nn.Conv2d(c, c, (3, 3), padding=(1, 1)))]
        )
        self.post = weight_norm(nn.Conv2d(c, 1, (3, 3), padding=(1, 1)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Audio `[B, L]` -> logits `[B, n]` and every layer's feature map."""
        h = stft_mag(x, self.n_fft, self.hop).log().unsqueeze(1)
        return judge(self.convs, self.post, h)


class Discriminators(nn.Module):
    """The period discriminators (PERIODS) and the resolution discriminators (RESOLUTIONS) together."""

    def __init__(self):
        super().__init__()
        self.nets = nn.ModuleList(
            [PeriodDiscriminator(p) for p in PERIODS]
            + [ResolutionDiscriminator(n, h) for n, h in RESOLUTIONS]
        )

    def forward(self, x: torch.Tensor) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        return [net(x) for net in self.nets]


def adversarial_step(
    disc: Discriminators, d_opt: torch.optim.Optimizer, y: torch.Tensor, audio: torch.Tensor, generator: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step of the discriminators on real `audio` against the generator's `y` (both
    `[B, L]`), then, when `generator`, the generator's adversarial and feature-matching losses on the
    updated discriminators (real features recomputed with them, as HiFi-GAN does, so that `y` equal to
    `audio` matches exactly). Returns (adversarial, feature matching, discriminator loss), the first
    two zero without `generator`."""
    d_loss = discriminator_loss(disc(audio), disc(y.detach()))
    d_opt.zero_grad(set_to_none=True)
    d_loss.backward()
    torch.nn.utils.clip_grad_norm_(disc.parameters(), 10.0)
    d_opt.step()
    if not generator:
        zero = y.new_zeros(())
        return zero, zero, d_loss.detach()
    with torch.no_grad():
        real = disc(audio)
    adv, fm = generator_losses(real, disc(y))
    return adv, fm, d_loss.detach()


def discriminator_loss(real: list, fake: list) -> torch.Tensor:
    """Least-squares GAN loss of the discriminators (HiFi-GAN's eq. 1): real toward 1, fake toward 0,
    summed over the discriminators. `fake` from audio detached from the generator."""
    return sum(((1 - r) ** 2).mean() + (f**2).mean() for (r, _), (f, _) in zip(real, fake, strict=True))


def generator_losses(real: list, fake: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(adversarial, feature matching) losses of the generator (HiFi-GAN's eqs. 2 and 3): fake toward
    1, and the L1 distance of every discriminator layer's features of the fake to the real's (detached),
    each summed over the discriminators and their layers."""
    adv = sum(((1 - f) ** 2).mean() for f, _ in fake)
    fm = sum(
        (fr.detach() - ff).abs().mean()
        for (_, feats_r), (_, feats_f) in zip(real, fake, strict=True)
        for fr, ff in zip(feats_r, feats_f, strict=True)
    )
    return adv, fm


# ---- evaluation ------------------------------------------------------------------------------------


def mfcc_distance(y: torch.Tensor, ref: torch.Tensor, mfcc) -> float:
    """Mean over frames of the mel-cepstral distortion formula, (10 / ln 10) sqrt(2 sum_d (c_d - c'_d)^2) dB,
    over MFCCs 1..12 of natural-log mels (`mfcc`: torchaudio's MFCC with log_mels=True); silences
    included, which makes the values large: compare them with each other only."""
    d = mfcc(y)[1:] - mfcc(ref)[1:]
    return float((10 / math.log(10)) * (2 * d.pow(2).sum(0)).sqrt().mean())


@torch.no_grad()
def evaluate(model: CausalVocoder, codec, rows: list[dict], audio: list[torch.Tensor], asr: bool) -> dict:
    """Clips (the held-out ones, or `--eval-from`'s) through the codec, decoded by Griffin-Lim and by
    `model`: log-spectral distance to the clip (nats, `spectral_losses`' log-magnitude term), MFCC
    distance (dB, `mfcc_distance`), decode time per audio time on this process's threads, and, with
    `asr`, Whisper tiny.en WER of each decode and of the clip itself, overall and, when the rows have
    several corpus speakers, per speaker (`wer_per_speaker`, keyed by the speaker's index). Returns
    the means per decoder."""
    import torchaudio

    model.eval()
    mfcc = torchaudio.transforms.MFCC(
        22050, n_mfcc=13, melkwargs={"n_fft": 1024, "hop_length": HOP, "n_mels": 80}, log_mels=True
    )
    # "clip": the teacher's clip itself, its WER the ASR's floor (older eval.json files: "espeak")
    out: dict = {"clips": len(rows), "griffin_lim": {}, "vocoder": {}, "clip": {}}
    decodes: dict[str, list] = {"griffin_lim": [], "vocoder": [], "clip": []}
    seconds = {"griffin_lim": 0.0, "vocoder": 0.0}
    for a in audio:
        a = a.float()
        T = max(1, math.ceil(a.numel() / FRAME_LENGTH))
        a = F.pad(a, (0, T * FRAME_LENGTH - a.numel()))
        mel = codec.decode_logmel(codec.encode_audio(a)).cpu()
        t0 = time.perf_counter()
        decodes["griffin_lim"].append(codec.vocoder(mel).cpu())
        t1 = time.perf_counter()
        decodes["vocoder"].append(model.synthesize(mel.unsqueeze(0))[0])
        seconds["griffin_lim"] += t1 - t0
        seconds["vocoder"] += time.perf_counter() - t1
        decodes["clip"].append(F.pad(a, (DELAY, 0))[: a.numel()])  # the clip with the codec's delay
    audio_seconds = sum(y.numel() for y in decodes["clip"]) / 22050
    out["audio_seconds"] = round(audio_seconds, 1)
    for name in ("griffin_lim", "vocoder"):
        pairs = list(zip(decodes[name], decodes["clip"], strict=True))
        lsd = [float(spectral_losses(y[None], ref[None])[1]) for y, ref in pairs]
        out[name]["log_spectral_distance"] = round(sum(lsd) / len(lsd), 4)
        out[name]["mfcc_distance_db"] = round(
            sum(mfcc_distance(y, ref, mfcc) for y, ref in pairs) / len(pairs), 3
        )
        out[name]["decode_rtf"] = round(seconds[name] / audio_seconds, 4)
    if asr:
        from tts_tools.evaluate import ASR, wer, words

        recognizer = ASR(threads=torch.get_num_threads())
        refs = [words(row["text"]) for row in rows]
        speaker = [str(row.get("speaker", "?")) for row in rows]  # the corpus speaker's index
        speakers = sorted(set(speaker))
        for name, clips in decodes.items():
            hyps = [words(recognizer.transcribe(y.numpy(), 22050)) for y in clips]
            out[name]["wer"] = round(wer(refs, hyps), 4)
            if len(speakers) > 1:
                by_speaker: dict[str, tuple[list, list]] = {sp: ([], []) for sp in speakers}
                for ref, hyp, sp in zip(refs, hyps, speaker, strict=True):
                    by_speaker[sp][0].append(ref)
                    by_speaker[sp][1].append(hyp)
                out[name]["wer_per_speaker"] = {sp: round(wer(*pair), 4) for sp, pair in by_speaker.items()}
    return out


# ---- main ------------------------------------------------------------------------------------------

WARMUP_STEPS = 200


def learning_rate(step: int, seconds: float, peak: float, steps: int, span: float) -> float:
    """Linear warm-up over the first WARMUP_STEPS steps, then a cosine from `peak` to 10% of it over
    `steps` steps or `span` training seconds, whichever is further along. `step` and `seconds` count
    from the first of the resumed runs, so that they make one schedule."""
    progress = min(1.0, max(step / steps, seconds / max(1.0, span)))
    return peak * min(1.0, (step + 1) / WARMUP_STEPS) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def vocoder_entry(folder: Path) -> dict | None:
    """codec.json's `"vocoder"` entry (`tts.codec.melvq.load_vocoder` reads it) for the trained vocoder
    in `folder`: a run folder's (its vocoder.json's shape beside vocoder.safetensors) or a bundle's (its
    codec.json names it); None when `folder` holds neither."""
    if (folder / "vocoder.json").is_file():
        shape = json.loads((folder / "vocoder.json").read_text())
        return {"type": VOCODER_TYPE, **{k: shape[k] for k in ("channels", "blocks", "kernel")}}
    codec = folder / "codec.json"
    return json.loads(codec.read_text()).get("vocoder") if codec.is_file() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "training" / "work", help="corpus work folder")
    p.add_argument("--codec", type=Path, default=ROOT / "tts" / "assets" / "default", help="codec folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--utterances", type=int, default=2000, help="training clips (first of the corpus)")
    p.add_argument(
        "--input", choices=["codec", "mel"], default="codec", help="the vocoder's input (see above)"
    )
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--crop-frames", type=int, default=64, help="mel frames per crop (after the context)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument(
        "--max-seconds", type=float, default=540, help="this run stops itself after this wall time"
    )
    p.add_argument(
        "--schedule-seconds",
        type=float,
        default=None,
        help="training seconds the learning-rate schedule spans, summed over resumed runs (default: this "
        "run's --max-seconds); e.g. 1650 for three resumed 10-minute calls, so that they make one cosine",
    )
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument(
        "--jobs", type=int, default=2, help="teacher (espeak-ng or flite) processes speaking the clips"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start from the trained vocoder in this folder (a run's vocoder.safetensors and vocoder.json, "
        "or a bundle's, named by its codec.json) with a fresh optimizer and schedule: "
        "a second training stage",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from OUT/checkpoint.pt (weights, optimizer, schedule)"
    )
    p.add_argument(
        "--eval",
        action="store_true",
        help="only evaluate OUT's vocoder (checkpoint.pt, else vocoder.safetensors) on the held-out clips "
        "(or --eval-from's)",
    )
    p.add_argument(
        "--adversarial",
        action="store_true",
        help="train with the period and resolution discriminators (see above); resumable with --resume",
    )
    p.add_argument(
        "--rec-weight", type=float, default=15.0, help="(--adversarial) reconstruction loss weight"
    )
    p.add_argument(
        "--fm-weight", type=float, default=2.0, help="(--adversarial) feature-matching loss weight"
    )
    p.add_argument("--disc-lr", type=float, default=2e-4, help="(--adversarial) discriminators' peak rate")
    p.add_argument(
        "--adv-warmup",
        type=int,
        default=500,
        help="(--adversarial) steps in which fresh discriminators train and the generator has the "
        "reconstruction loss only (default 500)",
    )
    p.add_argument("--eval-clips", type=int, default=60, help="clips evaluated (held-out, or --eval-from's)")
    p.add_argument(
        "--eval-from",
        type=int,
        default=None,
        metavar="K",
        help="evaluate --eval-clips training clips from training row K on instead of the held-out ones "
        "(every corpus speaker; K at least the --utterances the vocoder trained on, and past the codec's "
        "training clips for a round trip the codec never saw)",
    )
    p.add_argument("--no-asr", action="store_true", help="evaluate without Whisper (spectral distance only)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    t_start = time.time()
    ckpt = a.out / "checkpoint.pt"
    if a.resume and not ckpt.is_file():
        p.error(f"--resume: {ckpt} does not exist")
    if a.init is not None and (a.resume or a.eval):
        p.error("--init starts a new run: not with --resume or --eval")
    init = None
    if a.init is not None:
        entry = vocoder_entry(a.init)
        if entry is None:
            p.error(f"--init: {a.init} holds neither vocoder.json nor a codec.json naming a vocoder")
        try:
            init = load_vocoder(a.init, entry)  # (float16 weights widen)
        except CodecCheckpointError as exc:
            p.error(f"--init: {exc}")
    if a.eval and not (ckpt.is_file() or (a.out / "vocoder.safetensors").is_file()):
        p.error(f"--eval: {a.out} has neither checkpoint.pt nor vocoder.safetensors")
    if a.threads:
        torch.set_num_threads(a.threads)
    from tts.checkpoints.bundle import load_codec

    codec = load_codec(a.codec)
    from corpus import read_utterances

    trained_on = None  # the training clips of the vocoder that --eval scores (vocoder.json, newer runs)
    if a.eval and (a.out / "vocoder.json").is_file():
        trained_on = json.loads((a.out / "vocoder.json").read_text()).get("utterances")
    try:  # (--eval speaks no training clips)
        rows, train_ids, held = choose_rows(
            read_utterances(a.work), 0 if a.eval else a.utterances, a.eval_clips, a.eval_from, trained_on
        )
    except ValueError as exc:
        p.error(str(exc))
    if not a.eval and len(train_ids) < a.utterances:
        print(f"the corpus has {len(train_ids)} training clips, not --utterances {a.utterances}", flush=True)
    # (an evaluation keeps its clips apart from the training cache, which a resumed run reads back)
    audio = load_audio(a.work, rows, a.jobs, "vocoder_audio_eval.pt" if a.eval else "vocoder_audio.pt")
    device = torch.device(a.device)
    shape = {"channels": a.channels, "blocks": a.blocks}
    if (a.resume or a.eval) and (a.out / "vocoder.json").is_file():
        shape = {k: v for k, v in json.loads((a.out / "vocoder.json").read_text()).items() if k in shape}
    model = (init if init is not None else CausalVocoder(**shape)).to(device)
    if init is not None:
        print(f"initialized from the vocoder in {a.init}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.8, 0.99), weight_decay=0.01)
    disc = d_opt = None
    if a.adversarial and not a.eval:
        disc = Discriminators().to(device)
        d_opt = torch.optim.AdamW(disc.parameters(), lr=a.disc_lr, betas=(0.8, 0.99), weight_decay=0.01)
    step, history, trained_seconds, adv_from = 0, [], 0.0, a.adv_warmup
    kept_discriminators: dict = {}
    if (a.resume or a.eval) and ckpt.is_file():
        ck = torch.load(ckpt, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, history, trained_seconds = ck["step"], ck["history"], ck.get("trained_seconds", 0.0)
        adv_from = step + a.adv_warmup  # (fresh discriminators, unless the checkpoint has them)
        kept_discriminators = {k: ck[k] for k in ("discriminators", "disc_optimizer", "adv_from") if k in ck}
        if disc is not None and d_opt is not None and "discriminators" in ck:
            disc.load_state_dict(ck["discriminators"])
            d_opt.load_state_dict(ck["disc_optimizer"])
            adv_from = ck["adv_from"]
        print(f"resumed at step {step} ({trained_seconds:.0f} s trained)", flush=True)
    elif a.eval:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(a.out / "vocoder.safetensors")))
    if not a.eval:
        if device.type == "cuda":  # the round trip of every clip: on the GPU, then back for the eval
            codec.to(device)
        clips = Clips([audio[i] for i in train_ids], codec if a.input == "codec" else None)
        codec.to("cpu")
        print(
            f"{len(train_ids)} clips ({sum(x.numel() for x in clips.audio) / 22050 / 3600:.2f} h), "
            f"input {a.input}; "
            f"vocoder {sum(x.numel() for x in model.parameters()) / 1e6:.2f} M parameters, "
            f"receptive field {model.receptive_frames} mel frames",
            flush=True,
        )
        mel_fn = LogMel()
        r = random.Random(a.seed * 7919 + step)
        model.train()
        t_train = time.time()
        budget = a.max_seconds - (t_train - t_start) - 30
        # One warm-up and one cosine over all runs: by steps (of --steps) or by training seconds (of
        # --schedule-seconds, summed over the resumed runs), whichever is further.
        span = a.schedule_seconds or budget
        first = step
        while step < a.steps and time.time() - t_train < budget:
            lr = learning_rate(step, trained_seconds + time.time() - t_train, a.lr, a.steps, span)
            for g in opt.param_groups:
                g["lr"] = lr
            b = {
                k: v.to(device)
                for k, v in clips.batch(r, a.batch, a.crop_frames, model.receptive_frames).items()
            }
            y = synthesize_crops(model, b)
            loss, info = reconstruction_loss(y, b, mel_fn)
            if disc is not None and d_opt is not None:
                for g in d_opt.param_groups:
                    g["lr"] = lr * a.disc_lr / a.lr
                adv, fm, info["disc"] = adversarial_step(disc, d_opt, y, b["audio"], step >= adv_from)
                # (the reconstruction term is weighted from the first step, so that the loss keeps one
                # scale when the adversarial terms join; Adam's steps do not depend on that scale)
                loss = a.rec_weight * loss + adv + a.fm_weight * fm
                info["adv"], info["fm"] = adv.detach(), fm.detach()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % a.log_every == 0 or step == first + 1:
                rec = {
                    "step": step,
                    "seconds": round(time.time() - t_train, 1),
                    "lr": lr,
                    "loss": round(loss.item(), 5),
                    **{k: round(float(v), 5) for k, v in info.items()},
                    "grad_norm": round(float(gn), 4),
                }
                history.append(rec)
                print(json.dumps(rec), flush=True)
        trained_seconds += time.time() - t_train
        a.out.mkdir(parents=True, exist_ok=True)
        save(model, a.out, a.input, len(train_ids))
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history}
        if disc is not None and d_opt is not None:
            state.update(
                discriminators=disc.state_dict(), disc_optimizer=d_opt.state_dict(), adv_from=adv_from
            )
        else:  # (a resumed adversarial run continued without --adversarial keeps its discriminators)
            state.update(kept_discriminators)
        torch.save({**state, "trained_seconds": trained_seconds}, ckpt)
        with open(a.out / "loss.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for rec in history for k in rec)))
            w.writeheader()
            w.writerows(history)
        print(f"trained to step {step}; wrote {a.out}", flush=True)
    model.cpu()
    result = evaluate(model, codec, [rows[i] for i in held], [audio[i] for i in held], asr=not a.no_asr)
    result["step"] = step
    print(json.dumps(result), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "eval.json").write_text(json.dumps(result, indent=1))


def save(model: CausalVocoder, out: Path, input_kind: str, utterances: int) -> None:
    """vocoder.safetensors (float32) and vocoder.json (shape, receptive field, input kind, and the
    number of training clips, the first of the corpus: `--eval --eval-from` must start past them)."""
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        str(out / "vocoder.safetensors"),
    )
    info = {
        **model.shape,
        "receptive_frames": model.receptive_frames,
        "input": input_kind,
        "frames_per_codec_frame": SUBFRAMES,
        "utterances": utterances,
    }
    (out / "vocoder.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
