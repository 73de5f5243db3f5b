"""Text policies: what a model does to the text it is given, before it is split into chunks.

Text handling belongs to the model. Every prompt format names its policy (`text_policy`), and the
planner applies it to every request (`plan_text`):

| policy | models | with `normalize` on (the default) | with `normalize` off |
|---|---|---|---|
| `english` | the default model, `tiny`, our own checkpoints | markup read as rendered (`tts.text.markup`), then the English normalizer (`tts.text.normalize.normalize_text`: numbers, dates, units, ... as words) | the text as given |
| `fish-s2` | Fish Audio S2-Pro | markup read as rendered; nothing else (fish-speech main passes text to the model as it is) | the text as given |
| `fish-s1` | OpenAudio S1 | markup read as rendered; nothing else (fish-speech d3df505 does no cleaning at inference) | the text as given |
| `fish-1.5` | fish-speech 1.5 | markup read as rendered, then fish-speech 1.5's `clean_text` (curly quotes to ASCII, emoji dropped, ",,," to ",") | `clean_text` only (the prompt format always applies it, as fish-speech 1.5 does) |

Fish models read digits, other languages and scripts themselves: their text is never verbalized in
English (nor in any other language). All policies remove control characters (C0/C1; the English one
also invisible format characters), refuse lone surrogates and reserved `<|...|>` tags, and refuse text
with nothing to speak.

The English policy keeps only what its voice can say: runs of letters of other scripts (Chinese,
Japanese, Korean, Cyrillic, Arabic, ...; a single Greek letter such as π is kept, espeak-ng names it)
are left out with a warning that names the scripts, and text with no English left is refused
(TextError), rather than spelling each character ("Chinese letter, Chinese letter, ..."). This holds
with `normalize` off too: it is what the voice can say, not a normalization. With `normalize` on, emoji
are dropped as well (espeak-ng would read their names, "grinning face").
"""  # noqa: E501 (a Markdown table; its rows cannot wrap)

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, lru_cache

import regex

from tts.text.budget import charge
from tts.text.markup import render_markup
from tts.text.normalize import (
    NOTHING_TO_SPEAK,
    TAG,
    TextError,
    check_user_tags,
    has_speaker_tags,
    normalize_text,
    remove_control_characters,
    speakable,
    split_speaker_turns,
    split_text,
)


@dataclass
class PreparedText:
    """The text a model reads (before splitting) and what was changed or left out, one line each."""

    text: str
    warnings: list[str] = field(default_factory=list)


@dataclass
class TextPlan:
    """A request's text as generation chunks, with the warnings for the client."""

    chunks: list[str]
    warnings: list[str] = field(default_factory=list)


def _check_speakable(text: str) -> None:
    charge(len(text))
    if not speakable(TAG.sub("", text)):
        raise TextError(NOTHING_TO_SPEAK)


@contextmanager
def _naming_markup(markup_warnings: list[str]) -> Iterator[None]:
    """Around a check of text whose Markdown was read: its "nothing to speak" error says what reading the
    Markdown left out (a file of code blocks only is not "empty"); any other TextError passes as it is."""
    try:
        yield
    except TextError as exc:
        if markup_warnings and str(exc) == NOTHING_TO_SPEAK:
            raise TextError(
                f"text has nothing to speak once its Markdown is read: {'; '.join(markup_warnings)}"
            ) from exc
        raise


def check_speakable(text: str) -> None:
    """The checks every policy makes, without a model: raises TextError for text with nothing to speak
    (empty, whitespace, punctuation or control characters only) or a lone surrogate."""
    _check_speakable(remove_control_characters(text))


class EnglishPolicy:
    """The English voice's text handling (see the module docstring)."""

    name = "english"
    summary = "Markdown read as rendered, numbers and symbols as English words, other scripts left out"

    def prepare(
        self, text: str, allowed_tags: re.Pattern | None, normalize: bool = True, markup: bool = True
    ) -> PreparedText:
        """User text -> the text the model reads. Raises TextError (nothing to speak, no English, a lone
        surrogate) or InvalidRequest (a reserved tag)."""
        text = remove_control_characters(text)
        check_user_tags(text, allowed_tags)
        warnings: list[str] = []
        if normalize and markup:
            rendered = render_markup(text)
            text, warnings = rendered.text, rendered.warnings
        markup_warnings = list(warnings)
        text, dropped = drop_other_scripts(text)
        if dropped:
            _check_english_left(text, dropped)
            warnings.append(_dropped_warning(dropped))
        if normalize:
            text = _EMOJI.sub(" ", text)  # espeak-ng would name them ("grinning face")
            with _naming_markup(markup_warnings):
                text = normalize_text(text)  # ("&" alone is read: "and")
            check_user_tags(text, allowed_tags)  # NFKC made <| |> of their full-width forms
        else:
            text = text.strip()
            _check_speakable(text)
        return PreparedText(text, warnings)


# fish-speech 1.5's clean_text (v1.5.1 fish_speech/text/clean.py): strip, curly single quotes to ASCII,
# emoji dropped, runs of commas to one.
_CURLY_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'"})
_EMOJI = re.compile("[\U0001f600-\U0001f64f\U0001f300-\U0001f5ff\U0001f680-\U0001f6ff\U0001f1e0-\U0001f1ff]+")
_COMMAS = re.compile(r",{2,}")


def clean_text_15(text: str) -> str:
    """The text cleaning fish-speech 1.5 applies to target and reference texts before tokenizing."""
    text = text.strip().translate(_CURLY_QUOTES)
    return _COMMAS.sub(",", _EMOJI.sub("", text))


class FishPolicy:
    """A Fish family's text handling: its reference code's cleaning, nothing more (module docstring)."""

    def __init__(self, version: str):
        if version not in ("s2", "s1", "1.5"):
            raise ValueError(f"unknown Fish version {version!r}")
        self.version = version
        self.name = f"fish-{version}"
        cleaning = ", fish-speech 1.5's clean_text" if version == "1.5" else ""
        self.summary = f"Markdown read as rendered{cleaning}; digits and every language left to the model"

    def prepare(
        self, text: str, allowed_tags: re.Pattern | None, normalize: bool = True, markup: bool = True
    ) -> PreparedText:
        """User text -> the text the model reads (see `EnglishPolicy.prepare`)."""
        text = remove_control_characters(text, keep_joiners=True)
        check_user_tags(text, allowed_tags)
        warnings: list[str] = []
        if normalize and markup:
            rendered = render_markup(text)
            text, warnings = rendered.text, rendered.warnings
        text = clean_text_15(text) if self.version == "1.5" else text.strip()
        with _naming_markup(warnings):
            _check_speakable(text)
        return PreparedText(text, warnings)


TextPolicy = EnglishPolicy | FishPolicy
POLICY_NAMES = ("english", "fish-s2", "fish-s1", "fish-1.5")


@cache
def get_text_policy(name: str) -> TextPolicy:
    """The policy a prompt format names: "english", "fish-s2", "fish-s1" or "fish-1.5"."""
    if name == "english":
        return EnglishPolicy()
    if name.startswith("fish-"):
        try:
            return FishPolicy(name.removeprefix("fish-"))
        except ValueError:
            pass
    raise ValueError(f"unknown text policy {name!r} (expected one of {', '.join(POLICY_NAMES)})")


def plan_text(
    text: str, policy: TextPolicy, allowed_tags: re.Pattern | None, chunk_length: int, normalize: bool = True
) -> TextPlan:
    """Prepare `text` with `policy`, then split it into generation chunks of at most `chunk_length`
    UTF-8 bytes (0: one chunk). Text with `<|speaker:N|>` tags is split into speaker turns, grouped up to
    5 turns and `chunk_length` bytes per chunk (docs/fish_dual_ar.md §3.2); other text at sentence ends
    (`tts.text.normalize.split_text`)."""
    prepared = policy.prepare(text, allowed_tags, normalize)
    if chunk_length <= 0:
        chunks = [prepared.text]
    elif has_speaker_tags(prepared.text):
        chunks = split_speaker_turns(prepared.text, chunk_length)
    else:
        chunks = split_text(prepared.text, chunk_length)
    return TextPlan(chunks, prepared.warnings)


# ---- scripts the English voice cannot read ------------------------------------------------------------

# A run starts with a letter, mark or digit of a script other than Latin (and the shared Common and
# Inherited characters) and goes on over such characters, modifier letters and marks (the Japanese
# prolonged sound mark ー is Common), and CJK and full-width punctuation.
_OTHER = r"[^\p{Latin}\p{Common}\p{Inherited}\s]"
# Clause punctuation after a run goes with it; what is left at the start of the text is dropped too.
_AFTER_RUN = r"(?:\s*[,;:\u060c\u061b\u3001\uff0c\uff1b\uff1a])?"
_LEADING_PUNCTUATION = regex.compile(r"^[\s,;:.!?\u060c\u061f\u3001\u3002\uff0c\uff01\uff1f]+")
# Digits written inside such a run, or against it ("今天是2024年3月5日"), are part of that text (a date
# read by its language), not English: they go with the run (a number after a Latin letter stays, "A4").
_NUMBER = r"[\d\uff10-\uff19](?:[\d\uff10-\uff19]|[.,:/][\d\uff10-\uff19])*"
_OTHER_RUN = regex.compile(
    rf"(?:(?<!\p{{Latin}}){_NUMBER})?{_OTHER}"
    rf"(?:{_OTHER}|{_NUMBER}|[\p{{Lm}}\p{{M}}\u3000-\u303f\uff01-\uff0f\uff1a-\uff20\uff5b-\uff65])*"
    + _AFTER_RUN
)
_GREEK_LETTER = regex.compile(r"\p{Greek}")
_EMOJI = regex.compile(
    r"(?:(?![\u00a9\u00ae\u2122])[\p{Extended_Pictographic}\p{Emoji_Modifier}\ufe0f\u20e3])+"
)
SCRIPTS = (
    "Han", "Hiragana", "Katakana", "Hangul", "Cyrillic", "Greek", "Arabic", "Hebrew", "Devanagari",
    "Bengali", "Tamil", "Telugu", "Thai", "Georgian", "Armenian", "Ethiopic",
)  # fmt: skip
_SCRIPT_PATTERNS = [(name, regex.compile(rf"\p{{Script={name}}}")) for name in SCRIPTS]


@lru_cache(maxsize=4096)
def script_of(ch: str) -> str:
    """The Unicode script of a character, by name ("other" outside `SCRIPTS`)."""
    for name, pattern in _SCRIPT_PATTERNS:
        if pattern.match(ch):
            return name
    return "other"


def drop_other_scripts(text: str) -> tuple[str, dict[str, int]]:
    """`text` with runs of non-Latin scripts replaced by a space (a single Greek letter stays; clause
    punctuation after a run and punctuation left at the start go too), and the count of letters left
    out per script."""
    dropped: dict[str, int] = {}
    charge(len(text))

    def drop(m: regex.Match) -> str:
        run = m.group(0)
        if len(run) == 1 and _GREEK_LETTER.match(run):
            return run
        for ch in run:
            if ch.isalpha() or (ch.isalnum() and not ch.isdigit()):  # (digits: counted apart)
                script = script_of(ch)
                dropped[script] = dropped.get(script, 0) + 1
            elif ch.isdigit():
                dropped[DIGITS] = dropped.get(DIGITS, 0) + 1
        return " "

    out = _OTHER_RUN.sub(drop, text)
    if dropped:
        out = re.sub(r"[ \t]{2,}", " ", _LEADING_PUNCTUATION.sub("", out))
    return out, dropped


# The key of `drop_other_scripts`' counts for digits written inside or against a dropped run.
DIGITS = "digits"


def _script_list(dropped: dict[str, int]) -> str:
    names = sorted((s for s in dropped if s != DIGITS), key=lambda s: -dropped[s]) or ["other-script"]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _dropped_warning(dropped: dict[str, int]) -> str:
    n = sum(v for k, v in dropped.items() if k != DIGITS)
    digits = dropped.get(DIGITS, 0)
    with_digits = f", with the {digits} digit{'s' if digits != 1 else ''} written in it," if digits else ""
    return (
        f"this model reads English only: {n} character{'s' if n != 1 else ''} of {_script_list(dropped)} "
        f"text{with_digits} were left out (a multilingual model such as Fish Audio S2-Pro reads them)"
    )


def _check_english_left(text: str, dropped: dict[str, int]) -> None:
    """Refuse text whose other-script runs were dropped and that has no English word left: nothing, or
    only numbers and symbols (read alone they would be a salad of numbers out of their sentences)."""
    if not any(ch.isalpha() for ch in TAG.sub("", text)):
        raise TextError(
            f"this model reads English only, and the text is {_script_list(dropped)} text with nothing "
            "English to read; use a multilingual model such as Fish Audio S2-Pro"
        )
