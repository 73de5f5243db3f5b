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


def test_glue_words_between_content_words():
    """`--glue`: short unstressed words between content words in many constructions (articles after
    "and" / "or" / prepositions, numbers and pronouns after "and"), in sentences of 6-25 words with
    words after them; never a held-out text; grammatical articles ("an" before a vowel sound)."""
    glue = corpus.glue_texts(3000, 13)
    assert len(glue) == len(set(glue)) == 3000
    norms = [normalize_text(t).lower() for t in glue]
    held = {_words(t) for t in HELDOUT}
    assert not held & {_words(n) for n in norms}
    assert all(6 <= len(n.split()) <= 25 and len(n.encode()) <= 200 for n in norms)
    constructions = {
        "and an": r"\band an \w+ \w",
        "and a": r"\band a \w+ \w",
        "or an": r"\bor an \w",
        "in/at/near an": r"\b(in|at|near|from|for) an \w",
        "of the": r"\bof the \w",
        "and + number": r"\band (two|three|four|five|six|seven|eight|nine|ten|eleven|twelve) [a-z]+s\b",
        "and + pronoun": r"\band (i|it|he|she|we) \w",
    }
    for name, pattern in constructions.items():
        assert sum(bool(re.search(pattern, n)) for n in norms) > 30, name
    assert not any(re.search(r"\ban [bcdfgjklmnpqrstvwxyz]", n) for n in norms)  # "an" + consonant
    assert not any(re.search(r"\ba (a|e|i|o|u)", n) for n in norms)  # "a" + vowel
    assert not any(
        re.search(r"\b(a|an|the) (is|will|should|helps|and)\b", n) for n in norms
    )  # no bare article
    assert corpus.glue_texts(40, 13) == glue[:40]  # seeded


def test_merge_codes_folders(tmp_path, monkeypatch):
    """`corpus.py merge`: every folder's utterances once (a replayed one is dropped), only the first
    folder's held-out rows, no training row with a held-out or everyday text's phonemes, new shards of
    SHARD_SIZE; different tokenizers are refused."""
    import torch

    from tts.text.tokenizer import build_byte_tokenizer

    tokenizer = build_byte_tokenizer(1024)
    frontend = PhonemeFrontend()
    held_ph = frontend.sentences([HELDOUT[0]])[0]  # "Hello there, this is a test of the default voice."

    def item(uid: int, phonemes: str, split: str = "train", first: int = 0) -> dict:
        return {
            "id": uid,
            "speaker": 0,
            "split": split,
            "seconds": 0.25,
            "tokens": torch.tensor(tokenizer.encode(phonemes), dtype=torch.int16),
            "codes": torch.full((4, 5), first, dtype=torch.int16),
        }

    def folder(name: str, shards: list[list[dict]]) -> Path:
        d = tmp_path / name
        d.mkdir()
        tokenizer.save(d / "tokenizer.json")
        for k, items in enumerate(shards):
            torch.save(items, d / f"codes-{k:04d}.pt")
        return d

    a = folder("a", [[item(0, "hˈɛloʊ.", "heldout"), item(1, "wˈʌn."), item(2, "tˈuː.")]])
    b = folder(
        "b",
        [
            [item(0, "ʌðɚ hˈɛld.", "heldout"), item(1, "wˈʌn."), item(2, "wˈʌn.", first=7)],
            [item(3, held_ph.replace("ˈ", "")), item(4, "θɹˈiː.")],
        ],
    )
    monkeypatch.setattr(corpus, "SHARD_SIZE", 2)
    corpus.merge([a, b], tmp_path / "out")
    shards = sorted((tmp_path / "out").glob("codes-*.pt"))
    assert [p.name for p in shards] == ["codes-0000.pt", "codes-0001.pt", "codes-0002.pt"]
    assert [len(torch.load(p)) for p in shards] == [2, 2, 1]  # (full shards across the folders' seam)
    items = [u for p in shards for u in torch.load(p)]
    assert [u["id"] for u in items] == [0, 1, 2, 3, 4]
    got = [(tokenizer.decode(u["tokens"].long().tolist()), u["split"], int(u["codes"][0, 0])) for u in items]
    assert got == [
        ("hˈɛloʊ.", "heldout", 0),  # the first folder's held-out row
        ("wˈʌn.", "train", 0),
        ("tˈuː.", "train", 0),
        ("wˈʌn.", "train", 7),  # the same text spoken otherwise stays; b's replay of a's row does not
        ("θɹˈiː.", "train", 0),
    ]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    with pytest.raises(SystemExit, match="already holds codes shards"):
        corpus.merge([a, b], tmp_path / "out")  # (a second merge would leave the first's extra shards)
    with pytest.raises(SystemExit, match="is a source"):
        corpus.merge([a, b], b)
    (b / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit, match="different tokenizers"):
        corpus.merge([a, b], tmp_path / "out2")


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
