"""`tts eval --timings`: the word timings a session reports, held against the local ASR's word timestamps.

    tts eval --timings --seeds 0 --limit 30 --out timings.json

Each text (the held-out sentences by default; `--everyday`, `--long` or `--sentences` as for `tts eval`)
is spoken by one session (`tts.runtime.sessions`, the path every front's word timings come from: the
text sent, the session closed, its events read), with the session seed `seed * 1000 + index`. The
session's audio goes to the local ASR (faster-whisper, Whisper tiny.en, greedy) with
`word_timestamps=True`, and the two word lists are matched:

* both sides as `tts_tools.evaluate.words` gives them (normalized, lower case, no punctuation), one
  token list each, aligned by `difflib.SequenceMatcher`;
* a reported word and an ASR word are a pair when all the tokens of each are aligned, in order, to all
  the tokens of the other (the same word, heard as it was written). Words the ASR missed, misheard or cut
  differently ("$42.99" heard as "42.99") have no pair and are left out; the report counts them.

For every pair, the reported start (and end) minus the ASR's, in ms. Reported (JSON; a short table on
stderr): the absolute differences' mean, median and 90th percentile and the mean signed difference
(positive: the runtime places words later than the ASR hears them) for starts and for ends, over the
measured words and over all matched words; the words reported, measured, heard and matched. A measured
word is one whose start the aligner found: not `estimated`, and not the first word of a text chunk, which
starts where the chunk's audio does (the silence before the speech is its own; the ASR, too, tends to
start the first word it hears at the audio's start, so these pairs agree by convention, not by
measurement). An end is where the next word starts (a pause belongs to the word before it), while the
ASR ends a word where its sound ends, so the ends differ more than the starts by nature.

Gate (`timing_start`): the mean absolute start difference of the measured words is at most
`START_GATE_MS` (the target of the default voice on a CPU). The ASR's word timestamps are not ground
truth either (Whisper's come from its cross-attention, in 20 ms steps): the differences are the sum of
both errors. So, for a model trained on flite's speech (the default voice) speaking as one of flite's
speakers, and when the `flite` binary is installed (`--no-espeak` skips it), `asr_reference` measures
the ASR alone on the same texts: flite speaks each, its own segment times (`-psdur`) say where every
word begins, and the ASR's starts are compared with those (row `asr-flite start`; positive: the ASR
hears words later than they begin).
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from tts_tools.evaluate import (
    ASR,
    FLITE_SPEAKERS,
    eval_log,
    eval_texts,
    flite_run,
    load_for_eval,
    parse_seeds,
    sampling_options,
    voice_teacher,
    words,
)

if TYPE_CHECKING:
    import numpy as np

START_GATE_MS = 100.0  # the gate on the mean absolute start difference of measured words


@dataclass(frozen=True)
class TimedWord:
    """A word and when it is heard: start / end in seconds on the audio's clock; estimated: placed by its
    share of the text, not measured (the runtime's `WordTiming.estimated`; False for the ASR's words);
    chunk_start: the first word of its text chunk, which starts where the chunk's audio does (the silence
    before the speech is its), not where the aligner found it."""

    text: str
    start: float
    end: float
    estimated: bool = False
    chunk_start: bool = False

    @property
    def measured(self) -> bool:
        """Whether the aligner measured this word's start (not estimated, not its chunk's first)."""
        return not self.estimated and not self.chunk_start


def match_words(
    reported: Sequence[TimedWord], heard: Sequence[TimedWord], tokens=None
) -> list[tuple[int, int]]:
    """The pairs `(i, j)` of `reported[i]` and `heard[j]` that are the same word (module docstring), in
    order. tokens: word -> its tokens (default: `words(text).split()`); a word without tokens never pairs."""
    tokens = tokens or (lambda text: words(text).split())
    a_tok, a_own, b_tok, b_own = [], [], [], []
    for i, w in enumerate(reported):
        t = tokens(w.text)
        a_tok += t
        a_own += [i] * len(t)
    for j, w in enumerate(heard):
        t = tokens(w.text)
        b_tok += t
        b_own += [j] * len(t)
    aligned: dict[int, int] = {}  # reported token -> heard token
    for block in difflib.SequenceMatcher(None, a_tok, b_tok, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            aligned[block.a + k] = block.b + k
    a_span = _spans(a_own)
    b_span = _spans(b_own)
    pairs = []
    for i, (p, q) in sorted(a_span.items()):
        if not all(k in aligned for k in range(p, q)):
            continue
        r = aligned[p]
        j = b_own[r]
        if b_span[j] != (r, r + q - p) or any(aligned[p + k] != r + k for k in range(q - p)):
            continue
        pairs.append((i, j))
    return pairs


def _spans(owners: list[int]) -> dict[int, tuple[int, int]]:
    """Owner -> `[first, last + 1)` of its tokens (consecutive by construction)."""
    spans: dict[int, tuple[int, int]] = {}
    for k, o in enumerate(owners):
        first = spans.get(o, (k, k))[0]
        spans[o] = (first, k + 1)
    return spans


def difference_stats(diffs_ms: Sequence[float]) -> dict:
    """Statistics of signed differences (ms): n, mean / median / p90 of the absolute values, the mean
    signed value (None for each when there are none)."""
    import numpy as np

    if not diffs_ms:
        return {
            "n": 0,
            "mean_abs_ms": None,
            "median_abs_ms": None,
            "p90_abs_ms": None,
            "mean_signed_ms": None,
        }
    d = np.asarray(diffs_ms, dtype=np.float64)
    a = np.abs(d)
    return {
        "n": int(d.size),
        "mean_abs_ms": round(float(a.mean()), 1),
        "median_abs_ms": round(float(np.median(a)), 1),
        "p90_abs_ms": round(float(np.percentile(a, 90)), 1),
        "mean_signed_ms": round(float(d.mean()), 1),
    }


@dataclass
class TimingSample:
    """One text spoken by one session: its words as reported and as heard, and the pairs."""

    text: str
    seed: int
    request_seed: int
    audio_seconds: float
    finish: str
    reported: list[TimedWord] = field(default_factory=list)
    heard: list[TimedWord] = field(default_factory=list)
    pairs: list[tuple[int, int]] = field(default_factory=list)


def summarize(samples: Sequence[TimingSample]) -> dict:
    """The report's statistics over `samples` (module docstring): `words` (reported, matched, measured,
    measured_matched, heard) and `start` / `end` (each `difference_stats`) for `measured` and `all`
    matched words."""
    diffs: dict[str, dict[str, list[float]]] = {k: {"start": [], "end": []} for k in ("measured", "all")}
    counts = {"reported": 0, "heard": 0, "matched": 0, "measured": 0, "measured_matched": 0}
    for s in samples:
        counts["reported"] += len(s.reported)
        counts["heard"] += len(s.heard)
        counts["measured"] += sum(w.measured for w in s.reported)
        for i, j in s.pairs:
            r, h = s.reported[i], s.heard[j]
            kinds = ("all", "measured") if r.measured else ("all",)
            for kind in kinds:
                diffs[kind]["start"].append(1000 * (r.start - h.start))
                diffs[kind]["end"].append(1000 * (r.end - h.end))
            counts["matched"] += 1
            counts["measured_matched"] += r.measured
    return {
        "words": counts,
        **{kind: {edge: difference_stats(d[edge]) for edge in ("start", "end")} for kind, d in diffs.items()},
    }


def table(summary: dict) -> str:
    """The short table of `summarize`'s result (ms)."""
    cols = ("n", "mean_abs_ms", "median_abs_ms", "p90_abs_ms", "mean_signed_ms")
    lines = [f"{'words':<16}" + "".join(f"{c.replace('_ms', ''):>14}" for c in cols)]
    rows = [
        (f"{kind} {edge}", summary[kind][edge]) for kind in ("measured", "all") for edge in ("start", "end")
    ]
    if summary.get("asr_reference"):
        rows.append(("asr-flite start", summary["asr_reference"]["start"]))
    for name, row in rows:
        lines.append(f"{name:<16}" + "".join(f"{'-' if row[c] is None else row[c]:>14}" for c in cols))
    w = summary["words"]
    lines.append(
        f"words reported {w['reported']} (measured {w['measured']}), heard {w['heard']}, "
        f"matched {w['matched']} (measured {w['measured_matched']})"
    )
    return "\n".join(lines)


def flite_words(text: str, speaker: tuple[str, float, int]) -> tuple[np.ndarray, int, list[TimedWord]] | None:
    """flite speaking `text` as `speaker` (a `FLITE_SPEAKERS` entry) and where each of its words lies, by
    flite's own segment times (`-psdur`: every phone's end): a word starts where its first phone starts
    and ends where its last one ends. The phones go to the words by how many each word has spoken alone;
    returns (float32 audio, its rate, the words), or None where those counts do not add up to the
    sentence's phones (flite read a word otherwise in context)."""
    audio, rate, printed = flite_run(text, *speaker, "-psdur")
    phones, previous = [], 0.0
    for name, end in _segments(printed):
        if name != "pau":
            phones.append((previous, end))
        previous = end
    counts = [
        sum(name != "pau" for name, _ in _segments(flite_run(w, *speaker, "-psdur")[2])) for w in text.split()
    ]
    if 0 in counts or sum(counts) != len(phones):
        return None
    out, k = [], 0
    for word, n in zip(text.split(), counts, strict=True):
        out.append(TimedWord(word, phones[k][0], phones[k + n - 1][1]))
        k += n
    return audio, rate, out


def _segments(printed: str) -> list[tuple[str, float]]:
    """flite's `-psdur` output, `pau:0.161 hh:0.250 ...` -> [(phone, end in seconds)]."""
    out = []
    for item in printed.split():
        name, _, end = item.rpartition(":")
        out.append((name, float(end)))
    return out


def asr_reference(asr: ASR, texts: Sequence[str], speaker: tuple[str, float, int]) -> dict:
    """How far the ASR's word starts are from known ones: flite (`flite_words`) speaks each text, the ASR
    transcribes it, and for every matched word but each text's first (the ASR tends to start that one
    at the audio's start, before flite's leading pause), the ASR's start minus flite's
    (`difference_stats`, ms; positive: the ASR hears words later than they begin). texts: normalized."""
    diffs: list[float] = []
    skipped = 0
    for text in texts:
        spoken = flite_words(text, speaker)
        if spoken is None:
            skipped += 1
            continue
        audio, rate, truth = spoken
        heard = [TimedWord(*w) for w in asr.transcribe_words(audio, rate)]
        diffs += [1000 * (heard[j].start - truth[i].start) for i, j in match_words(truth, heard) if i > 0]
    return {
        "speaker": ",".join(map(str, speaker)),
        "skipped_texts": skipped,
        "start": difference_stats(diffs),
    }


def speak(tts, text: str, seed: int, voice: str | None, sampling: dict) -> tuple:
    """One session speaking `text`: (float32 audio of the whole session, its word timings as
    `TimedWord`s, the chunks' finish reasons joined by commas)."""
    import numpy as np

    from tts.runtime.sessions import ChunkEnded, SessionAudio, WordTimings

    session = tts.session(voice=voice, seed=seed, **sampling)
    session.send(text)
    session.close()
    pieces: list = []
    reported: list[TimedWord] = []
    reasons: list[str] = []
    offset, chunks = 0, set()
    for event in session:
        if isinstance(event, SessionAudio):
            if event.sample_offset != offset:  # (a gap only follows a barge-in, which never happens here)
                raise RuntimeError(f"session audio at {event.sample_offset}, expected {offset}")
            pieces.append(event.samples)
            offset += len(event.samples)
        elif isinstance(event, WordTimings):
            for w in event.words:
                reported.append(TimedWord(w.text, w.start, w.end, w.estimated, w.chunk not in chunks))
                chunks.add(w.chunk)
        elif isinstance(event, ChunkEnded):
            reasons.append(event.reason)
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return audio, reported, ",".join(reasons)


def evaluate_timings(args: argparse.Namespace) -> dict:
    """Run the comparison (module docstring); returns the report, every sample under `samples`."""
    sentences = eval_texts(args)
    seeds = parse_seeds(args.seeds)
    asr = ASR(threads=args.asr_threads, beam_size=args.asr_beam_size)
    log = eval_log(args)
    tts, _ = load_for_eval(args, len(sentences), seeds, log)  # (--timings runs at --batch 1)
    bundle = tts.bundle
    sampling = {k: v for k, v in sampling_options(args).items() if v is not None}
    if args.max_new_frames:
        sampling["max_new_frames"] = args.max_new_frames
    samples: list[TimingSample] = []
    t0 = time.perf_counter()
    for seed in seeds:
        for i, text in enumerate(sentences):
            request_seed = seed * 1000 + i
            audio, reported, finish = speak(tts, text, request_seed, args.voice, sampling)
            heard = [TimedWord(*w) for w in asr.transcribe_words(audio, bundle.codec.sample_rate)]
            sample = TimingSample(
                text, seed, request_seed, len(audio) / bundle.codec.sample_rate, finish, reported, heard
            )
            sample.pairs = match_words(reported, heard)
            samples.append(sample)
            log(
                f"seed {seed} (session seed {request_seed}) [{i + 1}/{len(sentences)}] {finish}: "
                f"{len(sample.pairs)}/{len(reported)} words matched: {' '.join(w.text for w in heard)}"
            )
    summary = summarize(samples)
    measured = summary["measured"]["start"]["mean_abs_ms"]
    # The ASR's own error, on the speech the default voice was trained on (flite), where word starts are
    # known: what part of the differences above is the ASR's.
    reference: dict | None = None
    speaker = FLITE_SPEAKERS.get(args.voice or bundle.default_voice or "")
    if args.no_espeak or speaker is None or voice_teacher(args) != "flite":
        log("asr reference: none (a model trained on flite speech, and --voice one of its speakers, has one)")
    elif shutil.which("flite") is None:
        log("asr reference: no flite binary here")
    else:
        from tts.text.normalize import normalize_text

        reference = asr_reference(asr, [normalize_text(t) for t in sentences], speaker)
    return {
        "mode": "timings",
        "model": str(args.model),
        "describe": bundle.describe(),
        "sentences": len(sentences),
        "seeds": seeds,
        "session_seeds": "seed * 1000 + sentence index",
        "voice": args.voice,
        "loop_guard": tts.engine.loop_guard,
        "asr": "faster-whisper tiny.en int8, word_timestamps=True",
        "asr_beam_size": args.asr_beam_size,
        "wall_seconds": round(time.perf_counter() - t0, 1),
        **summary,
        "asr_reference": reference,
        "gates": {"timing_start": measured is not None and measured <= START_GATE_MS},
        "samples": [_sample_report(s) for s in samples],
    }


def _sample_report(s: TimingSample) -> dict:
    """One sample as the JSON report holds it: its pairs (each reported word with the ASR's), the
    reported words left unmatched, the transcript."""
    paired = {i for i, _ in s.pairs}
    return {
        **{k: v for k, v in asdict(s).items() if k not in ("reported", "heard", "pairs")},
        "words": [{**asdict(s.reported[i]), "heard": asdict(s.heard[j])} for i, j in s.pairs],
        "unmatched": [w.text for i, w in enumerate(s.reported) if i not in paired],
        "transcript": " ".join(w.text for w in s.heard),
    }
