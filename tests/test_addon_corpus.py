"""`corpus.py addon`: the fine-tuning corpus of the shipped default voice (short utterances, everyday
sentences, a replay of the base corpus) never holds a text of the held-out evaluation."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import corpus  # noqa: E402

from tts.text.normalize import normalize_text  # noqa: E402
from tts.text.phonemes import PhonemeFrontend  # noqa: E402

pytest.importorskip("phonemizer")


def _eval_lines(name: str) -> list[str]:
    lines = (ROOT / "samples" / "eval" / name).read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


HELDOUT = [normalize_text(t) for t in _eval_lines("everyday.txt") + _eval_lines("heldout.txt")]


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9']+", " ", text.lower()).split())


@pytest.fixture(scope="module")
def texts() -> tuple[list[str], list[str]]:
    # The lists `corpus.py addon` builds with its defaults (--seed 0: short seed 10, everyday seed 11).
    return corpus.short_texts(4500, 10), corpus.everyday_texts(4500, 11)


def test_no_heldout_text_whatever_its_punctuation(texts):
    short, everyday = texts
    held = {_words(t) for t in HELDOUT}
    assert len(HELDOUT) == 81 and "hi" in held and "ok" in held
    for t in short + everyday:
        norm = normalize_text(t)
        assert norm not in HELDOUT and _words(norm) not in held, t
    # ... and the filter is what keeps them out: a held-out text in other punctuation is refused.
    keys = corpus.heldout_keys()
    assert not corpus._short_ok("Hi!", keys) and not corpus._short_ok("ok", keys)
    assert corpus._short_ok("Hey!", keys) and corpus._short_ok("hey", keys)


def test_short_utterances_as_typed(texts):
    short, _ = texts
    assert len(short) == len(set(short)) == 4500
    assert all(1 <= len(normalize_text(t).split()) <= 4 for t in short)
    bare = [t for t in short if t[-1] not in ".!?"]
    assert 0.25 * len(short) < len(bare) < 0.45 * len(short)  # with and without terminal punctuation
    assert sum(len(normalize_text(t).split()) == 1 for t in short) > 500  # single words
    # The runtime's phonemes: a full stop where the text has none, as PhonemeFrontend.__call__ gives.
    f = PhonemeFrontend()
    sample = bare[:200]
    phonemes = f.sentences([normalize_text(t) for t in sample])
    assert phonemes == [f(normalize_text(t)) for t in sample[:5]] + phonemes[5:]
    assert all(p.endswith(".") for p in phonemes)
    held = {corpus._phoneme_key(p) for p in f.sentences(HELDOUT)}
    assert not held & {corpus._phoneme_key(p) for p in f.sentences([normalize_text(t) for t in short])}


def test_everyday_sentences_end_variously(texts):
    _, everyday = texts
    assert len(everyday) == len(set(everyday)) == 4500
    norms = [normalize_text(t) for t in everyday]
    assert all(len(n.split()) <= 25 and len(n.encode()) <= 200 for n in norms)
    assert len({_words(n).split()[-1] for n in norms}) > 150  # the last word varies
    assert sum(" order of " in f" {n.lower()}" for n in norms) > 300
    assert sum(bool(re.search(r"\ban [aeiou]", n)) for n in norms) > 300
    assert sum("dollars" in n for n in norms) > 200
    weekday_end = re.compile(r"(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)[^ ]*( the \w+)?$")
    assert sum(bool(weekday_end.search(n.rstrip(".?"))) for n in norms) > 200
    assert corpus.everyday_texts(50, 11) == corpus.everyday_texts(50, 11)  # seeded


def test_weak_words_inside_longer_sentences():
    """`--weak`: "and an" + a vowel-initial noun and /θ/ after a weak word ("of three", "the third"),
    each with words after it; never a held-out text."""
    weak = corpus.weak_texts(1500, 12)
    assert len(weak) == len(set(weak)) == 1500
    norms = [normalize_text(t) for t in weak]
    held = {_words(t) for t in HELDOUT}
    assert not held & {_words(n) for n in norms}
    assert all(6 <= len(n.split()) <= 25 and len(n.encode()) <= 200 for n in norms)
    mid_an = re.compile(r"\b(and|with|for|sent|as|is there) an [aeiou]\w* \w")
    assert sum(bool(mid_an.search(n.lower())) for n in norms) > 500
    th_after_weak = re.compile(r"\b(of|the|for|set of|box of) th(ree|irt|ird)\w* \w")
    assert sum(bool(th_after_weak.search(n.lower())) for n in norms) > 250
    assert corpus.weak_texts(40, 12) == weak[:40]  # seeded


def test_addon_rows(tmp_path):
    """The add-on text list: heldout.txt as the held-out split, the new texts with the runtime's
    phonemes and the base's teacher, a replay of base rows as they were, minus any held-out text."""
    base = tmp_path / "base"
    base.mkdir()
    held_text = normalize_text(_eval_lines("heldout.txt")[0])
    rows: list[dict] = [
        {"source": "wordnet", "text": f"Sentence number {i} is here.", "split": "train"} for i in range(6)
    ] + [{"source": "paragraph", "text": f"First {i}. Second {i}.", "split": "train"} for i in range(4)]
    rows.append({"source": "wordnet", "text": held_text, "split": "train"})  # a base built otherwise
    for i, row in enumerate(rows):
        row.update(id=i, raw=row["text"], phonemes="x.", speaker=1, teacher="flite", voice="rms")
        row.update(stretch=1.0, f0=0)
    (base / "sentences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus.build_addon(tmp_path / "ft", base, 40, 30, 7, 2, seed=0, n_weak=20)
    out = corpus.read_utterances(tmp_path / "ft")
    held = [u for u in out if u["split"] == "heldout"]
    assert [u["text"] for u in held] == [normalize_text(t) for t in _eval_lines("heldout.txt")]
    assert all(u["speaker"] == 0 and u["stretch"] == 1.0 for u in held)
    train = [u for u in out if u["split"] == "train"]
    assert sum(u["source"] == "short" for u in train) == 40
    assert sum(u["source"] == "everyday" for u in train) == 30
    assert sum(u["source"] == "weak" for u in train) == 20
    replay = [u for u in train if "base_id" in u]
    assert sum(u["source"] == "paragraph" for u in replay) == 2
    assert held_text not in {u["text"] for u in train}
    assert all(rows[u["base_id"]]["phonemes"] == u["phonemes"] for u in replay)
    new = [u for u in train if "base_id" not in u]
    assert all(u["teacher"] == "flite" and u["phonemes"][-1] in ".!?" for u in new)
    assert [u["id"] for u in out] == list(range(len(out)))
