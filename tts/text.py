"""English text normalization: the text every model here (and the default model's corpus) sees.

Numbers, dates, times, currency, percentages, ordinals and common abbreviations become words
(num2words does the number reading); typographic punctuation becomes ASCII; whitespace collapses.
`split_text` cuts long text into chunks at sentence, then clause, then word boundaries.
"""

from __future__ import annotations

import re
import unicodedata

from num2words import num2words


class TextError(ValueError):
    """Text with nothing to speak (empty, whitespace or punctuation only)."""


_MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
]  # fmt: skip
_ABBREVIATIONS = {
    "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Dr.": "Doctor", "Prof.": "Professor",
    "St.": "Saint", "Jr.": "Junior", "Sr.": "Senior", "vs.": "versus", "etc.": "et cetera",
    "e.g.": "for example", "i.e.": "that is", "approx.": "approximately", "No.": "number",
}  # fmt: skip
_SYMBOLS = {"&": " and ", "+": " plus ", "@": " at ", "=": " equals ", "#": " number "}
_TRANSLATE = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": ", ",
        "\u2026": "...",
        "\u00a0": " ",
    }  # fmt: skip
)
_CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
               "€": ("euro", "euros", "cent", "cents")}  # fmt: skip


def _int_words(s: str) -> str:
    return num2words(int(s.replace(",", "")))


def _number_words(s: str) -> str:
    s = s.replace(",", "")
    if "." in s:
        whole, frac = s.split(".", 1)
        digits = " ".join(num2words(int(d)) for d in frac)
        return f"{num2words(int(whole or '0'))} point {digits}"
    return num2words(int(s))


def _year_words(y: int) -> str:
    return num2words(y, to="year") if 1100 <= y <= 2099 else num2words(y)


def _currency(m: re.Match) -> str:
    one, many, cent, cents = _CURRENCIES[m.group(1)]
    amount = m.group(2).replace(",", "")
    whole, _, frac = amount.partition(".")
    words = f"{num2words(int(whole))} {one if int(whole) == 1 else many}"
    if frac and int(frac[:2].ljust(2, "0")):
        c = int(frac[:2].ljust(2, "0"))
        words += f" and {num2words(c)} {cent if c == 1 else cents}"
    return words


def _date_iso(m: re.Match) -> str:
    y, mo, d = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return m.group(0)
    return f"{_MONTHS[mo - 1]} {num2words(d, to='ordinal')}, {_year_words(y)}"


def _date_us(m: re.Match) -> str:
    mo, d, y = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return m.group(0)
    return f"{_MONTHS[mo - 1]} {num2words(d, to='ordinal')}, {_year_words(y)}"


def _time(m: re.Match) -> str:
    h, mi = int(m.group(1)), int(m.group(2))
    suffix = f" {m.group(3).replace('.', '').lower()}" if m.group(3) else ""
    suffix = " ".join(suffix).replace("  ", " ") if suffix else ""
    if mi == 0:
        return f"{num2words(h)} o'clock{suffix}" if not suffix else f"{num2words(h)}{suffix}"
    minutes = f"oh {num2words(mi)}" if mi < 10 else num2words(mi)
    return f"{num2words(h)} {minutes}{suffix}"


_RULES: list[tuple[re.Pattern, object]] = [
    (re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b"), _date_iso),
    (re.compile(r"\b(\d{1,2})/(\d{1,2})/(\d{4})\b"), _date_us),
    (re.compile(r"\b(\d{1,2}):(\d{2})\s*([AaPp]\.?[Mm]\.?)?"), _time),
    (re.compile(r"([$£€])\s?(\d[\d,]*(?:\.\d+)?)"), _currency),
    (re.compile(r"(\d[\d,]*(?:\.\d+)?)\s?%"), lambda m: f"{_number_words(m.group(1))} percent"),
    (re.compile(r"\b(\d+)(st|nd|rd|th)\b", re.I), lambda m: num2words(int(m.group(1)), to="ordinal")),
    (
        re.compile(r"\b(?:in|since|by|of|from|until|year)\s+(1[1-9]\d\d|20\d\d)\b", re.I),
        lambda m: m.group(0)[:-4] + _year_words(int(m.group(1))),
    ),  # fmt: skip
    (re.compile(r"\b(\d+)s\b"), lambda m: _plural_number(m.group(1))),
    (
        re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\d])"),
        lambda m: _number_words(m.group(0)),
    ),  # fmt: skip
]


def _plural_number(s: str) -> str:
    n = int(s)
    words = _year_words(n) if 1100 <= n <= 2099 else num2words(n)
    if words.endswith("y"):
        return words[:-1] + "ies"
    return words + ("es" if words.endswith("x") else "s")


# Inline control tags (`<|speaker:0|>` and the like) pass through normalization untouched.
_TAG = re.compile(r"<\|[^|<>\s]{1,64}\|>")
_SPEAKER_TAG = re.compile(r"(<\|speaker:\d+\|>)")


def normalize_text(text: str) -> str:
    """Spoken form of `text` (see the module docstring); inline tags such as `<|speaker:1|>` are kept
    as they are. Raises TextError if nothing speakable remains."""
    tags = _TAG.findall(text)
    if not tags:
        return _normalize_plain(text)
    pieces = [_normalize_plain(p, allow_empty=True) for p in _TAG.split(text)]
    out = pieces[0]
    for tag, piece in zip(tags, pieces[1:], strict=True):
        out = f"{out} {tag}{piece}" if out else f"{tag}{piece}"
    if not any(ch.isalnum() for p in pieces for ch in p):
        raise TextError("text has nothing to speak (empty, whitespace or punctuation only)")
    return out


def split_speaker_turns(text: str, max_bytes: int, max_speakers: int = 5) -> list[str]:
    """Split text with `<|speaker:N|>` tags into turns and group consecutive turns into chunks of at most
    `max_speakers` turns and `max_bytes` UTF-8 bytes, joined by newlines (fish-speech main's
    `split_text_by_speaker` / `group_turns_into_batches`, Fish spec 3.2). Text before the first tag is
    kept as a turn of its own (fish-speech drops it); a turn longer than `max_bytes` is split like plain
    text, each piece keeping its tag."""
    parts = _SPEAKER_TAG.split(text)
    turns = [parts[0].strip()] if parts[0].strip() else []
    for tag, body in zip(parts[1::2], parts[2::2], strict=True):
        body = body.strip()
        if len(f"{tag}{body}".encode()) <= max_bytes or not body:
            turns.append(f"{tag}{body}")
        else:
            turns += [f"{tag}{piece}" for piece in split_text(body, max(1, max_bytes - len(tag)))]
    chunks: list[list[str]] = []
    size = 0
    for turn in turns:
        n = len(turn.encode())
        if chunks and len(chunks[-1]) < max_speakers and size + n <= max_bytes:
            chunks[-1].append(turn)
            size += n
        else:
            chunks.append([turn])
            size = n
    return ["\n".join(c) for c in chunks]


def has_speaker_tags(text: str) -> bool:
    return bool(_SPEAKER_TAG.search(text))


def _normalize_plain(text: str, allow_empty: bool = False) -> str:
    text = unicodedata.normalize("NFKC", text).translate(_TRANSLATE)
    for abbr, full in _ABBREVIATIONS.items():
        text = re.sub(rf"(?<!\w){re.escape(abbr)}", full, text)
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    for sym, word in _SYMBOLS.items():
        text = text.replace(sym, word)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([,.!?;:])", r"\1", text)
    if not allow_empty and not any(ch.isalnum() for ch in text):
        raise TextError("text has nothing to speak (empty, whitespace or punctuation only)")
    return text


def split_text(text: str, max_bytes: int) -> list[str]:
    """Split normalized text into chunks of at most `max_bytes` UTF-8 bytes, preferring sentence
    ends, then clause marks, then spaces; a single word longer than the limit is cut."""
    if len(text.encode()) <= max_bytes:
        return [text]
    chunks: list[str] = []
    for piece in _split_at(text, r"(?<=[.!?])\s+", max_bytes):
        chunks.extend(
            _split_at(piece, r"(?<=[,;:])\s+", max_bytes) if len(piece.encode()) > max_bytes else [piece]
        )
    out: list[str] = []
    for c in chunks:
        out.extend(_split_at(c, r"\s+", max_bytes) if len(c.encode()) > max_bytes else [c])
    final: list[str] = []
    for c in out:
        while len(c.encode()) > max_bytes:
            # at least one character, even when one character is longer than the limit
            cut = c.encode()[:max_bytes].decode(errors="ignore") or c[0]
            final.append(cut)
            c = c[len(cut) :]
        if c:
            final.append(c)
    return final


def _split_at(text: str, pattern: str, max_bytes: int) -> list[str]:
    """Greedily pack the pieces of `text` split at `pattern` into chunks of <= max_bytes."""
    pieces = [p for p in re.split(pattern, text) if p]
    chunks, current = [], ""
    for p in pieces:
        candidate = f"{current} {p}" if current else p
        if len(candidate.encode()) <= max_bytes or not current:
            current = candidate
        else:
            chunks.append(current)
            current = p
    if current:
        chunks.append(current)
    return chunks
