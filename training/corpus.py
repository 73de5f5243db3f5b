"""Build the default voice's training corpus: text -> teacher speech -> log-mel -> codec codes.

The teacher is espeak-ng (the shipped model's) or, with `text --teacher flite`, flite: the same texts
and speakers, spoken by CMU's voices.

Stages (each resumable; outputs under --work, default `training/work/`, git-ignored):

  text     sentences.jsonl: every utterance (id, raw text, normalized text, phonemes, speaker, rate,
           pitch, split); with --paragraphs N also N utterances of 2-4 training sentences each. Sources, both
           reproducible and legally clean:
           * the example sentences in WordNet 3.0's glosses (Debian package `wordnet-base`,
             /usr/share/wordnet/data.*; WordNet 3.0 license: use, copy, modify and distribute for any
             purpose with the copyright notice kept; see training/README.md);
           * sentences generated here from templates with numbers, dates, times, currency, percentages,
             ordinals, years and abbreviations (seeded, so always the same).
           All text goes through the runtime's normalizer `tts.text.normalize.normalize_text`, then through
           the runtime's phoneme frontend (`tts.text.phonemes`), exactly as at inference.
  synth    shards/mel-XXXX.pt: the teacher (Debian package `espeak-ng` or `flite`) speaks every
           utterance with its speaker's voice, rate and pitch at 22050 Hz; each clip becomes a log-mel
           `[4T, 80]` float16 (`tts.codec.melrvq.LogMel`). Audio itself is never stored.
  codec    codec/: fits the residual-VQ codebooks by k-means on a sample of training frames
           (`tts.codec.melrvq.fit_rvq`) and writes codec.json + codec.safetensors.
  encode   codes/: per shard, codes `[N, T]` int16 and token ids, the training input of train.py
           (which needs neither espeak-ng, phonemizer nor soundfile).

Run everything:  python training/corpus.py all --work training/work --jobs 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_tools.evaluate import FLITE_SPEAKERS as FLITE_VOICES  # noqa: E402
from tts_tools.evaluate import espeak_audio, flite_audio  # noqa: E402

WORDNET_DIR = Path("/usr/share/wordnet")
SHARD_SIZE = 1000

# Speakers: espeak-ng en-us with different voice variants, a base pitch (0-99) and rate (words/min).
# Speaker 0 is the default voice (the model's voice when no reference is given).
SPEAKERS = [
    {"name": "ava", "voice": "en-us+f3", "pitch": 55, "rate": 165},
    {"name": "ben", "voice": "en-us+m3", "pitch": 40, "rate": 170},
    {"name": "cora", "voice": "en-us+f1", "pitch": 68, "rate": 160},
    {"name": "dave", "voice": "en-us+m1", "pitch": 32, "rate": 175},
    {"name": "emma", "voice": "en-us+f4", "pitch": 50, "rate": 180},
    {"name": "finn", "voice": "en-us+m7", "pitch": 48, "rate": 160},
    {"name": "gwen", "voice": "en-us+f2", "pitch": 60, "rate": 170},
    {"name": "hank", "voice": "en-us+klatt2", "pitch": 42, "rate": 165},
]
# The same eight speakers spoken by flite (Debian package `flite` 2.2, Carnegie Mellon University's
# synthesizer and its CMU ARCTIC voices, under a free license: training/README.md), the teacher of
# `--teacher flite`: a voice, a duration stretch (1.0 = the voice's own rate; larger is slower) and a
# mean F0 target in Hz (0 = the voice's own; flite's slt and kal16 follow it, its rms and awb do not).
# Defined once, in `tts_tools.evaluate` (its voice check speaks with them too).
FLITE_SPEAKERS = [
    {"name": name, "voice": voice, "stretch": stretch, "f0": f0}
    for name, (voice, stretch, f0) in FLITE_VOICES.items()
]
TEACHERS = ("espeak", "flite")
DEFAULT_SPEAKER_SHARE = 0.3
SECOND_READING_SHARE = 0.05  # share of training sentences read a second time by another speaker
HELDOUT = 60


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- text ------------------------------------------------------------------------------------------


def wordnet_sentences() -> list[str]:
    """The quoted example sentences of WordNet 3.0's glosses, deduplicated, in sorted order."""
    if not WORDNET_DIR.is_dir():
        raise SystemExit("WordNet data not found: apt-get install -y wordnet-base")
    found = set()
    for name in ("data.noun", "data.verb", "data.adj", "data.adv"):
        for line in (WORDNET_DIR / name).read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            for s in re.findall(r'"([^"]+)"', line.split("|", 1)[1]):
                s = s.strip().strip(";").strip()
                if 4 <= len(s.split()) <= 28 and re.fullmatch(r"[A-Za-z0-9 ,.;:'!?$%&/\-]+", s):
                    found.add(s)
    out = []
    for s in sorted(found):
        s = s[0].upper() + s[1:]
        if s[-1] not in ".!?":
            s += "."
        out.append(s)
    return out


_NAMES = (
    "Alice Bob Carla David Elena Frank Grace Henry Irene Jack Karen Leo Maria Nick Olga Peter Rosa Sam Tina "
    "Victor"
).split()
_CITIES = "Boston Denver Chicago Seattle Houston Portland Dallas Atlanta Miami Phoenix Austin Detroit".split()
_THINGS = "tickets chairs books apples boxes bottles lamps pencils shirts plates cups bikes".split()
_MONTHS = "January February March April May June July August September October November December".split()
_TITLES = ["Dr.", "Mr.", "Mrs.", "Ms.", "Prof."]
_SURNAMES = "Smith Jones Brown Miller Davis Wilson Moore Taylor Clark Lewis Walker Hall".split()


def template_sentences(n: int, seed: int = 0) -> list[str]:
    """`n` distinct sentences with numbers, dates, times, money, percentages, ordinals, years and
    abbreviations, drawn from fixed templates with a seeded generator."""
    r = random.Random(seed)

    def num():
        return r.choice(
            [str(r.randint(2, 99)), str(r.randint(100, 999)), f"{r.randint(1, 99)},{r.randint(0, 999):03d}"]
        )

    def date():
        y, m, d = r.randint(1950, 2035), r.randint(1, 12), r.randint(1, 28)
        return r.choice([f"{y}-{m:02d}-{d:02d}", f"{m}/{d}/{y}", f"{_MONTHS[m - 1]} {d}, {y}"])

    def time_():
        h, mi = r.randint(1, 12), r.choice([0, 5, 10, 15, 20, 30, 45, r.randint(1, 59)])
        return f"{h}:{mi:02d}" + r.choice(["", " a.m.", " p.m.", " AM", " PM"])

    def money():
        cur = r.choice(["$", "$", "£", "€"])
        return cur + r.choice(
            [
                str(r.randint(1, 999)),
                f"{r.randint(1, 99)}.{r.randint(1, 99):02d}",
                f"{r.randint(1, 9)},{r.randint(0, 999):03d}",
            ]
        )

    def pct():
        return r.choice([f"{r.randint(1, 99)}%", f"{r.randint(1, 20)}.{r.randint(1, 9)}%"])

    def ordinal():
        d = r.randint(1, 31)
        suf = "th" if 10 <= d % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(d % 10, "th")
        return f"{d}{suf}"

    def person():
        return r.choice([r.choice(_NAMES), f"{r.choice(_TITLES)} {r.choice(_SURNAMES)}"])

    templates = [
        lambda: f"The meeting with {person()} is on {date()} at {time_()}.",
        lambda: f"{r.choice(_NAMES)} bought {num()} {r.choice(_THINGS)} for {money()}.",
        lambda: f"Prices in {r.choice(_CITIES)} rose by {pct()} last year.",
        lambda: f"Please call {person()} before {time_()} tomorrow.",
        lambda: f"The train to {r.choice(_CITIES)} leaves at {time_()} from platform {r.randint(1, 12)}.",
        lambda: f"Our office opened in {r.randint(1890, 2020)} and moved on {date()}.",
        lambda: f"Is the report due on the {ordinal()} of {r.choice(_MONTHS)}?",
        lambda: f"The total came to {money()}, which is {pct()} more than we planned.",
        lambda: f"We sold {num()} {r.choice(_THINGS)} in the {r.randint(196, 201)}0s!",
        lambda: f"{person()} was born on {date()} in {r.choice(_CITIES)}.",
        lambda: f"Room {r.randint(100, 999)} is on the {ordinal()} floor; take the stairs.",
        lambda: f"About {pct()} of the {num()} voters said yes.",
        lambda: (
            f"The package weighs {r.randint(2, 80)}.{r.randint(1, 9)} pounds and costs {money()} to ship."
        ),
        lambda: (
            f"Wait, did {r.choice(_NAMES)} really pay {money()} for {r.randint(2, 9)} {r.choice(_THINGS)}?"
        ),
        lambda: f"Store hours: {time_()} to {time_()}, except on the {ordinal()}.",
        lambda: f"In {r.randint(1900, 2030)}, the town had {num()} people and {r.randint(2, 40)} schools.",
        lambda: f"Flight {r.randint(10, 999)} to {r.choice(_CITIES)} is delayed until {time_()}.",
        lambda: (
            f"{person()} scored {r.randint(50, 100)}% on the test, and {r.choice(_NAMES)} scored "
            f"{r.randint(40, 100)}%."
        ),
        lambda: f"Your appointment is {date()} at {time_()}; please arrive early.",
        lambda: f"The bill was {money()} plus a tip of {money()}.",
    ]
    out: set[str] = set()
    while len(out) < n:
        out.add(r.choice(templates)())
    return sorted(out)


def paragraphs(rows: list[dict], n: int, max_bytes: int, seed: int) -> list[dict]:
    """Up to `n` distinct multi-sentence rows (source "paragraph"): 2-4 of `rows` (each at most once per
    paragraph, in drawn order) joined by spaces, raw and normalized text alike, at most `max_bytes`
    UTF-8 bytes of normalized text: the chunks `tts synthesize` feeds the model (up to the bundle's
    `chunk_length`, 200 bytes), where training had single sentences. Drawn with their own seeded
    generator, so that the single-sentence corpus is the same with or without them."""
    r = random.Random(seed)
    out: dict[str, dict] = {}
    for _ in range(50 * n):
        if len(out) >= n or len(rows) < 2:
            break
        picked = r.sample(rows, r.randint(2, min(4, len(rows))))
        while len(picked) > 2 and len(" ".join(p["text"] for p in picked).encode()) > max_bytes:
            picked.pop()
        text = " ".join(p["text"] for p in picked)
        if len(text.encode()) <= max_bytes and text not in out:
            out[text] = {"source": "paragraph", "raw": " ".join(p["raw"] for p in picked), "text": text}
    return [out[t] for t in sorted(out)]


def build_text(
    work: Path,
    n_templates: int,
    seed: int,
    n_paragraphs: int = 0,
    max_bytes: int = 200,
    teacher: str = "espeak",
) -> None:
    from tts.text.normalize import TextError, normalize_text
    from tts.text.phonemes import PhonemeFrontend

    frontend = PhonemeFrontend()
    raw = [("wordnet", s) for s in wordnet_sentences()] + [
        ("template", s) for s in template_sentences(n_templates, seed)
    ]
    rows, seen = [], set()
    for source, s in raw:
        try:
            norm = normalize_text(s)
        except TextError:
            continue
        if norm in seen or not re.fullmatch(r"[A-Za-z0-9 ,.;:'!?\-]+", norm):
            continue
        seen.add(norm)
        rows.append({"source": source, "raw": s, "text": norm})
    log(f"{len(rows)} distinct sentences ({sum(r['source'] == 'template' for r in rows)} from templates)")
    r = random.Random(seed)
    r.shuffle(rows)
    # Held-out evaluation sentences: 6+ words, never used for training (48 WordNet + 12 template).
    held, train = [], []
    want = {"wordnet": HELDOUT * 4 // 5, "template": HELDOUT - HELDOUT * 4 // 5}
    for row in rows:
        if want.get(row["source"], 0) > 0 and len(row["text"].split()) >= 6:
            want[row["source"]] -= 1
            held.append(row)
        else:
            train.append(row)
    multi = paragraphs(train, n_paragraphs, max_bytes, seed + 1)  # (training sentences only)
    if multi:
        log(f"{len(multi)} paragraphs of 2-4 training sentences, at most {max_bytes} bytes")
    phonemes = frontend.phonemize_batch([row["text"] for row in held + train + multi])
    utts = []
    for i, row in enumerate(held + train + multi):
        row["phonemes"] = phonemes[i]
        row["split"] = "heldout" if i < len(held) else "train"
    for row in held:  # held-out sentences are spoken by the default speaker (the espeak reference)
        utts.append(_utterance(row, 0, r, teacher, jitter=False))
    for row in train:
        spk = 0 if r.random() < DEFAULT_SPEAKER_SHARE else r.randrange(1, len(SPEAKERS))
        utts.append(_utterance(row, spk, r, teacher))
        if r.random() < SECOND_READING_SHARE:
            other = r.choice([s for s in range(len(SPEAKERS)) if s != spk])
            utts.append(_utterance(row, other, r, teacher))
    rp = random.Random(seed + 2)  # (paragraph speakers: the single-sentence utterances stay as they were)
    for row in multi:
        utts.append(
            _utterance(
                row, 0 if rp.random() < DEFAULT_SPEAKER_SHARE else rp.randrange(1, len(SPEAKERS)), rp, teacher
            )
        )
    for i, u in enumerate(utts):
        u["id"] = i
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "sentences.jsonl", "w") as f:
        for u in utts:
            f.write(json.dumps(u) + "\n")
    log(f"wrote {len(utts)} utterances ({len(held)} held out) to {work / 'sentences.jsonl'}")


def _utterance(row: dict, speaker: int, r: random.Random, teacher: str, jitter: bool = True) -> dict:
    """`row` spoken by `speaker` of `teacher`, with a jittered rate and pitch. Both teachers draw the
    same two numbers, so one seed gives the same texts and speakers whichever teacher speaks them."""
    d_rate = r.randint(-10, 10) if jitter else 0
    d_pitch = r.randint(-4, 4) if jitter else 0
    if teacher == "flite":
        spk = FLITE_SPEAKERS[speaker]
        return {
            **row,
            "speaker": speaker,
            "teacher": "flite",
            "voice": spk["voice"],
            "stretch": round(spk["stretch"] * (1 - d_rate / 165), 3),  # espeak's +-10 of 165 words/min
            "f0": spk["f0"] + 3 * d_pitch if spk["f0"] else 0,
        }
    spk = SPEAKERS[speaker]
    return {
        **row,
        "speaker": speaker,
        "voice": spk["voice"],
        "rate": spk["rate"] + d_rate,
        "pitch": spk["pitch"] + d_pitch,
    }


def read_utterances(work: Path) -> list[dict]:
    with open(work / "sentences.jsonl") as f:
        return [json.loads(line) for line in f]


# ---- synthesis -------------------------------------------------------------------------------------


def espeak(text: str, voice: str, rate: int, pitch: int):
    """Speak `text` with the espeak-ng binary (`tts_tools.evaluate.espeak_audio`); returns float32 mono audio
    at 22050 Hz."""
    audio, sr = espeak_audio(text, voice, rate, pitch)
    if sr != 22050:
        raise RuntimeError(f"espeak-ng wrote {sr} Hz, expected 22050")
    return audio


def flite(text: str, voice: str, stretch: float = 1.0, f0: int = 0):
    """Speak `text` with the flite binary (`tts_tools.evaluate.flite_audio`: `voice` one of `flite -lv`,
    durations scaled by `stretch`, mean pitch `f0` Hz or the voice's own), resampled by torchaudio to float32
    mono audio at 22050 Hz."""
    import torch
    import torchaudio

    audio, sr = flite_audio(text, voice, stretch, f0)
    return torchaudio.functional.resample(torch.from_numpy(audio), sr, 22050).numpy()


def speak(u: dict):
    """The audio (float32 at 22050 Hz) of utterance row `u` by its teacher (espeak-ng unless the row
    names flite)."""
    if u.get("teacher") == "flite":
        return flite(u["text"], u["voice"], u["stretch"], u["f0"])
    return espeak(u["text"], u["voice"], u["rate"], u["pitch"])


def _synth_shard(args: tuple[Path, int, list[dict]]) -> str:
    import torch

    torch.set_num_threads(1)
    from tts.codec.mel import LogMel

    work, shard, utts = args
    path = work / "shards" / f"mel-{shard:04d}.pt"
    if path.exists():
        return f"shard {shard} exists"
    logmel = LogMel()
    mels, ids, seconds = [], [], []
    for u in utts:
        audio = speak(u)
        mels.append(logmel(torch.from_numpy(audio)).to(torch.float16))
        ids.append(u["id"])
        seconds.append(len(audio) / 22050)
    tmp = path.with_suffix(".tmp")
    torch.save({"ids": ids, "seconds": seconds, "mels": mels}, tmp)
    os.replace(tmp, path)
    return f"shard {shard}: {len(utts)} clips, {sum(seconds) / 3600:.2f} h"


def synth(work: Path, jobs: int, max_utterances: int | None) -> None:
    from multiprocessing import Pool

    utts = read_utterances(work)[:max_utterances]
    (work / "shards").mkdir(parents=True, exist_ok=True)
    tasks = [(work, i // SHARD_SIZE, utts[i : i + SHARD_SIZE]) for i in range(0, len(utts), SHARD_SIZE)]
    t0 = time.time()
    with Pool(jobs) as pool:
        for k, msg in enumerate(pool.imap_unordered(_synth_shard, tasks), 1):
            log(f"[{k}/{len(tasks)}] {msg} ({time.time() - t0:.0f} s)")


def load_shards(work: Path, max_utterances: int | None = None):
    import torch

    n_shards = math.ceil(max_utterances / SHARD_SIZE) if max_utterances else None
    for path in sorted((work / "shards").glob("mel-*.pt"))[:n_shards]:
        yield path, torch.load(path)


# ---- codec -----------------------------------------------------------------------------------------


def fit_codec(
    work: Path,
    num_codebooks: int,
    codebook_size: int,
    sample_frames: int,
    iters: int,
    seed: int,
    max_utterances: int | None,
    device: str = "cpu",
) -> None:
    """The k-means codec (`tts.codec.melrvq`) into work/codec (the learned one: train_codec.py)."""
    import torch

    from tts.codec.mel import stack_frames
    from tts.codec.melrvq import MelRVQCodec, fit_rvq

    utts = {u["id"]: u for u in read_utterances(work)}
    vecs = []
    for _, shard in load_shards(work, max_utterances):
        for uid, mel in zip(shard["ids"], shard["mels"], strict=True):
            if utts[uid]["split"] == "train":
                vecs.append(stack_frames(mel.float()))
    allv = torch.cat(vecs)
    g = torch.Generator().manual_seed(seed)
    sample = allv[torch.randperm(allv.shape[0], generator=g)[:sample_frames]]
    mean, std = sample.mean(0), sample.std(0).clamp_min(1e-3)
    log(f"fitting {num_codebooks} x {codebook_size} RVQ on {sample.shape[0]} of {allv.shape[0]} frames")
    normed = ((sample - mean) / std).to(device)
    books = fit_rvq(normed, num_codebooks, codebook_size, iters=iters, seed=seed, log=log).cpu()
    out = work / "codec"
    out.mkdir(parents=True, exist_ok=True)
    MelRVQCodec(books, mean, std).save(out)
    log(f"wrote {out}")


# ---- encode ----------------------------------------------------------------------------------------


def encode(
    work: Path, max_utterances: int | None, codec_dir: Path, out: Path, threads: int = 1, device: str = "cpu"
) -> None:
    """Codes of every clip through the codec in `codec_dir` (any type `tts.checkpoints.bundle.load_codec`
    knows)."""
    import torch

    from tts.checkpoints.bundle import load_codec
    from tts.text.tokenizer import build_byte_tokenizer

    torch.set_num_threads(threads)  # several threads crawl on a busy 2-core machine
    codec = load_codec(codec_dir)
    if hasattr(codec, "to"):
        codec.to(device)
    tokenizer = build_byte_tokenizer(codec.codebook_size)
    utts = {u["id"]: u for u in read_utterances(work)}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / "tokenizer.json")
    total = 0.0
    for path, shard in load_shards(work, max_utterances):
        dst = out / path.name.replace("mel-", "codes-")
        if dst.exists():
            continue
        items = []
        for uid, mel, sec in zip(shard["ids"], shard["mels"], shard["seconds"], strict=True):
            u = utts[uid]
            codes = codec.encode_logmel(mel.float())
            items.append(
                {
                    "id": uid,
                    "speaker": u["speaker"],
                    "split": u["split"],
                    "seconds": sec,
                    "tokens": torch.tensor(tokenizer.encode(u["phonemes"]), dtype=torch.int16),
                    "codes": codes.to(torch.int16),
                }
            )
            total += sec
        torch.save(items, dst)
        log(f"{dst.name}: {len(items)} utterances")
    log(f"encoded {total / 3600:.2f} h")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["text", "synth", "codec", "encode", "all"])
    p.add_argument("--work", type=Path, default=ROOT / "training" / "work")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--templates", type=int, default=6000, help="number of templated sentences")
    p.add_argument(
        "--paragraphs",
        type=int,
        default=0,
        help="also this many utterances of 2-4 training sentences, up to --paragraph-bytes of text (the "
        "multi-sentence chunks long text is synthesized in; default 0, the shipped model's corpus)",
    )
    p.add_argument(
        "--teacher",
        choices=TEACHERS,
        default="espeak",
        help="the synthesizer that speaks the corpus (text stage; default espeak, the shipped model's)",
    )
    p.add_argument("--paragraph-bytes", type=int, default=200, help="(default 200, the chunk length)")
    p.add_argument("--num-codebooks", type=int, default=4)
    p.add_argument("--codebook-size", type=int, default=1024)
    p.add_argument("--sample-frames", type=int, default=60_000, help="frames used to fit the codebooks")
    p.add_argument("--kmeans-iters", type=int, default=12, help="Lloyd iterations per codebook")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec-dir", type=Path, default=None, help="codec to encode with (default: WORK/codec)")
    p.add_argument("--codes-dir", type=Path, default=None, help="where encode writes (default: WORK/codes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the codec and encode stages")
    p.add_argument("--device", default="cpu", help="torch device of the codec and encode stages")
    p.add_argument(
        "--max-utterances",
        type=int,
        default=None,
        help="use only the first utterances of sentences.jsonl (whole shards of 1000; default: all)",
    )
    a = p.parse_args()
    if a.stage in ("text", "all"):
        if (a.work / "sentences.jsonl").exists():  # (resumable: an existing text list is kept)
            log(f"{a.work / 'sentences.jsonl'} exists, kept (delete it to build the text again)")
        else:
            build_text(a.work, a.templates, a.seed, a.paragraphs, a.paragraph_bytes, a.teacher)
    if a.stage in ("synth", "all"):
        synth(a.work, a.jobs, a.max_utterances)
    if a.stage in ("codec", "all"):
        fit_codec(
            a.work,
            a.num_codebooks,
            a.codebook_size,
            a.sample_frames,
            a.kmeans_iters,
            a.seed,
            a.max_utterances,
            a.device,
        )
    if a.stage in ("encode", "all"):
        codec_dir = a.codec_dir or a.work / "codec"
        encode(a.work, a.max_utterances, codec_dir, a.codes_dir or a.work / "codes", a.threads, a.device)


if __name__ == "__main__":
    main()
