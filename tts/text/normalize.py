"""English text normalization: the text every model here (and the default model's corpus) sees.

Numbers, dates, times, currency, percentages, ordinals, ranges, simple fractions, units after numbers and
common abbreviations become words (num2words does the number reading); phone numbers and other
hyphen-joined digit groups are read digit by digit, and so is a number of more than `MAX_WORD_DIGITS`
digits (in its comma groups, or in groups of four: "one two three four, five six ..."); typographic
punctuation becomes ASCII; control and invisible characters are removed; whitespace collapses.
Every step is linear in the text's length and reports its work to `tts.text.budget.charge`.
`split_text` cuts long text into chunks at sentence, then clause, then word boundaries.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

from num2words import num2words

from tts.params import InvalidRequest
from tts.text.budget import charge


class TextError(ValueError):
    """Text with nothing to speak (empty, whitespace or punctuation only)."""


NOTHING_TO_SPEAK = "text has nothing to speak (empty, whitespace or punctuation only)"


def speakable(text: str) -> bool:
    """Whether `text` holds anything to speak: a letter or a digit of any script."""
    return any(ch.isalnum() for ch in text)


_MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
]  # fmt: skip
_ABBREVIATIONS = {
    "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Dr.": "Doctor", "Prof.": "Professor",
    "St.": "Saint", "Jr.": "Junior", "Sr.": "Senior", "vs.": "versus", "etc.": "et cetera",
    "e.g.": "for example", "i.e.": "that is", "approx.": "approximately",
}  # fmt: skip
# Context-dependent abbreviations, applied before the plain ones: "St." after a capitalized name or an
# ordinal and not before another capitalized word is a street ("Main St.", "5th St."), else a saint
# ("St. Louis"); "No." is "number" only before a digit; "etc." ending a sentence keeps its period.
_STREET = re.compile(r"\b([A-Z][a-z]*|\d+(?:st|nd|rd|th))\s+St\.(?!\w|\s*[A-Z])")
_NUMBER_ABBREVIATION = re.compile(r"(?<!\w)No\.(?=\s?\d)")
_ETC_SENTENCE_END = re.compile(r"(?<!\w)etc\.(?=\s*$|\s+[A-Z])")
_MONTH_ABBREVIATIONS = {
    "Jan": 1, "Feb": 2, "Mar": 3, "Apr": 4, "Jun": 6, "Jul": 7, "Aug": 8, "Sep": 9, "Sept": 9, "Oct": 10,
    "Nov": 11, "Dec": 12,
}  # fmt: skip
_DAYS_IN_MONTH = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
_DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Denominators read as fractions (1/2 "one half", 5/8 "five eighths"); others (9/11, 10/12, 12/25:
# dates, scores) are left alone, as are improper fractions (24/7).
_FRACTION_DENOMINATORS = {2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64}
# Units read after a number: (regex of the written unit, singular, plural). Longest spellings first.
# "m" and "g" only with a space before them (5G, 5m as in millions); "in" only glued to the number
# ("6in"), since "put 6 in the box" is the word.
_UNITS = [
    (r"km/h|kph", "kilometer per hour", "kilometers per hour"),
    (r"mph", "mile per hour", "miles per hour"),
    (r"°\s?C", "degree Celsius", "degrees Celsius"),
    (r"°\s?F", "degree Fahrenheit", "degrees Fahrenheit"),
    (r"°", "degree", "degrees"),
    (r"kg", "kilogram", "kilograms"),
    (r"mg", "milligram", "milligrams"),
    (r"km", "kilometer", "kilometers"),
    (r"cm", "centimeter", "centimeters"),
    (r"mm", "millimeter", "millimeters"),
    (r"mi", "mile", "miles"),
    (r"ft", "foot", "feet"),
    (r"lbs?", "pound", "pounds"),
    (r"oz", "ounce", "ounces"),
    (r"m[lL]", "milliliter", "milliliters"),
    (r"L", "liter", "liters"),
    (r"ms", "millisecond", "milliseconds"),
    (r"kHz", "kilohertz", "kilohertz"),
    (r"Hz", "hertz", "hertz"),
    (r"KB|kB", "kilobyte", "kilobytes"),
    (r"MB", "megabyte", "megabytes"),
    (r"GB", "gigabyte", "gigabytes"),
    (r"TB", "terabyte", "terabytes"),
    (r"(?<=\s)g", "gram", "grams"),
    (r"(?<=\s)m", "meter", "meters"),
    (r"(?<=\d)in", "inch", "inches"),
]
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# No digit, letter, point, comma, slash or hyphen right before a number that a rule reads on its own,
# and none of those (a point, comma or hyphen only when a digit follows) right after it.
_START = r"(?<![\w.,/-])"
_END = r"(?![\w/]|[.,-]\d)"
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
        "\u2044": "/",
        "\u2212": "-",
    }
)
_CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "€": ("euro", "euros", "cent", "cents"),
}


# Numbers of at most this many digits (leading zeros aside) are read as words, longer ones digit by
# digit: no one reads a 16-digit card number or a 40-digit ID as "... quadrillion ...", num2words refuses
# numbers of 307 digits and more, and its time grows with the digits.
MAX_WORD_DIGITS = 15


@lru_cache(maxsize=4096)
def _words(n: int, to: str = "cardinal") -> str:
    return num2words(n, to=to)


def _small(s: str) -> int | None:
    """The value of a digit string of at most MAX_WORD_DIGITS significant digits, else None (without
    converting it: `int` refuses strings of more than 4300 digits, and is quadratic below that)."""
    significant = s.lstrip("0")
    return int(significant or "0") if len(significant) <= MAX_WORD_DIGITS else None


def _read_digits(s: str) -> str:
    """Digit by digit, a comma between groups: its comma groups ("1,234" -> "one, two three four"), or
    groups of four ("12345678" -> "one two three four, five six seven eight")."""
    charge(len(s))
    groups = [g for g in s.split(",") if g] if "," in s else [s[i : i + 4] for i in range(0, len(s), 4)]
    return ", ".join(" ".join(_DIGITS[int(d)] for d in g) for g in groups)


def _cardinal(s: str) -> str:
    """A written whole number (digits, maybe comma-grouped) in words; longer than MAX_WORD_DIGITS digits:
    digit by digit (`_read_digits`)."""
    n = _small(s.replace(",", ""))
    return _read_digits(s) if n is None else _words(n)


def _ordinal(s: str) -> str:
    """3 -> "third"; longer than MAX_WORD_DIGITS digits: digit by digit, the last one as an ordinal."""
    n = _small(s)
    if n is not None:
        return _words(n, "ordinal")
    head, _, last = _read_digits(s).rpartition(" ")
    return f"{head} {_words(_DIGITS.index(last), 'ordinal')}"


def _int_words(s: str) -> str:
    return _cardinal(s)


def _number_words(s: str) -> str:
    whole, point, frac = s.partition(".")
    if point:
        digits = " ".join(_DIGITS[int(d)] for d in frac.replace(",", ""))
        return f"{_cardinal(whole or '0')} point {digits}"
    return _cardinal(whole)


def _year_words(y: int) -> str:
    return _words(y, "year") if 1100 <= y <= 2099 else _words(y)


def _currency(m: re.Match) -> str:
    return _currency_amount(m.group(1), m.group(2))


def _currency_amount(symbol: str, amount: str) -> str:
    one, many, cent, cents = _CURRENCIES[symbol]
    whole, _, frac = amount.partition(".")
    words = f"{_cardinal(whole)} {one if _small(whole.replace(',', '')) == 1 else many}"
    if frac and int(frac[:2].ljust(2, "0")):
        c = int(frac[:2].ljust(2, "0"))
        words += f" and {_words(c)} {cent if c == 1 else cents}"
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


def _meridiem(m: re.Match, group: int) -> str:
    """The words " a m" / " p m" for the a.m./p.m. in `group` ("" when it did not match); a period that also
    ends
    the sentence (text ends, or a capital follows) is kept."""
    marker = m.group(group)
    if not marker:
        return ""
    words = " " + " ".join(marker.replace(".", "").lower())
    if marker.endswith(".") and _SENTENCE_ENDS_HERE.match(m.string, m.end()):
        words += "."
    return words


# At a position: only whitespace up to the end, or whitespace and a capital (matched in place: a copy of
# the rest of the text per match would make a text of many matches quadratic).
_SENTENCE_ENDS_HERE = re.compile(r"\s*\Z|\s+[A-Z]")
_ONLY_SPACE_LEFT = re.compile(r"\s*\Z")


def _time(m: re.Match) -> str:
    h, mi = int(m.group(1)), int(m.group(2))
    suffix = _meridiem(m, 3)
    if mi == 0:
        return f"{num2words(h)} o'clock{suffix}" if not suffix else f"{num2words(h)}{suffix}"
    minutes = f"oh {num2words(mi)}" if mi < 10 else num2words(mi)
    return f"{num2words(h)} {minutes}{suffix}"


def _time_without_colon(m: re.Match) -> str:
    """A time whose a.m./p.m. says it is one, written with a dot or nothing between hour and minutes:
    "3.30pm", "1030 a.m." (as speech recognizers and British usage write them); anything else that is
    not an hour of 1 to 12 and minutes below 60 is left to the number rules."""
    h, mi = int(m.group(1)), int(m.group(2))
    if not (1 <= h <= 12 and mi < 60):
        return m.group(0)
    return _time(m)


def _hour(m: re.Match) -> str:
    """An hour before a.m./p.m. without minutes: "10 a.m." -> "ten a m" (as the time rule reads it)."""
    h = int(m.group(1))
    if not 1 <= h <= 12:
        return m.group(0)
    return f"{num2words(h)}{_meridiem(m, 2)}"


# "$5.3 billion", "$10k", "€1.5bn": the scale is read before the currency.
_SCALES = {
    "thousand": "thousand", "k": "thousand", "K": "thousand", "million": "million", "m": "million",
    "M": "million", "mn": "million", "billion": "billion", "bn": "billion", "B": "billion",
    "trillion": "trillion", "tn": "trillion", "T": "trillion",
}  # fmt: skip


def _currency_scale(m: re.Match) -> str:
    many = _CURRENCIES[m.group(1)][1]
    return f"{_number_words(m.group(2))} {_SCALES[m.group(3)]} {many}"


def _currency_range(m: re.Match) -> str:
    """$5-10 -> "five to ten dollars"; with cents both ends are read as amounts."""
    symbol, a, b = m.group(1), m.group(2), m.group(3)
    if "." not in a + b:
        return f"{_int_words(a)} to {_int_words(b)} {_CURRENCIES[symbol][1]}"
    return f"{_currency_amount(symbol, a)} to {_currency_amount(symbol, b)}"


def _scientific(m: re.Match) -> str:
    sign = "minus " if m.group(2) in ("-", "\u2212") else ""
    return f"{_number_words(m.group(1))} times ten to the power of {sign}{_cardinal(m.group(3))}"


def _spaced(m: re.Match, words: str) -> str:
    """`words` for the match, set apart by spaces from letters glued to it ("221B" -> "... B")."""
    s, i, j = m.string, m.start(), m.end()
    before = " " if i > 0 and s[i - 1].isalpha() else ""
    after = " " if j < len(s) and s[j].isalpha() else ""
    return f"{before}{words}{after}"


def _version(m: re.Match) -> str:
    """2.0.1 -> "two point zero point one" (three or more dot-separated parts: a version)."""
    return _spaced(m, " point ".join(_cardinal(p) for p in m.group(0).split(".")))


def _month_abbreviation_date(m: re.Match) -> str:
    month, day = _MONTH_ABBREVIATIONS[m.group(1)], int(m.group(2))
    if not 1 <= day <= _DAYS_IN_MONTH[month - 1]:
        return m.group(0)
    words = f"{_MONTHS[month - 1]} {num2words(day, to='ordinal')}"
    return f"{words}, {_year_words(int(m.group(3)))}" if m.group(3) else words


def _digit_groups(m: re.Match) -> str:
    """Digit by digit, a comma between groups: 555-0199 -> five five five, zero one nine nine."""
    return ", ".join(" ".join(_DIGITS[int(d)] for d in g) for g in re.findall(r"\d+", m.group(0)))


def _is_year(s: str) -> bool:
    return len(s) == 4 and 1100 <= int(s) <= 2099


def _hyphen_pair(m: re.Match) -> str:
    """Two numbers joined by a hyphen: a local phone number (555-0199; any group with a leading zero)
    is read digit by digit, anything else is a range or a score, "A to B". The second number is left
    in digits for the later rules, so a unit or percent after it is still read."""
    a, b = m.group(1), m.group(2)
    plain = a.isdigit() and b.isdigit()
    round_numbers = plain and int(a[-2:]) == 0 and int(b[-2:]) == 0  # 200-1000 words
    leading_zero = any(len(g) > 1 and g[0] == "0" for g in (a, b))
    if plain and (((len(a), len(b)) == (3, 4) and not round_numbers) or leading_zero):
        return _digit_groups(m)
    if _is_year(a) and (_is_year(b) or (len(b) == 2 and b.isdigit())):
        return f"{_year_words(int(a))} to {_year_words(int(b)) if len(b) == 4 else num2words(int(b))}"
    return f"{_number_words(a)} to {b}"


def _fraction_name(numerator: int, denominator: int) -> str:
    if denominator == 2:
        return "half" if numerator == 1 else "halves"
    if denominator == 4:
        return "quarter" if numerator == 1 else "quarters"
    ordinal = num2words(denominator, to="ordinal")
    return ordinal if numerator == 1 else ordinal + "s"


def _fraction_words(numerator: str, denominator: str) -> str | None:
    """3/4 -> "three quarters"; None unless a simple proper fraction (1 <= n < d, d a common denominator)."""
    n, d = _small(numerator), _small(denominator)
    if n is None or d is None or d not in _FRACTION_DENOMINATORS or not 1 <= n < d:
        return None
    return f"{_words(n)} {_fraction_name(n, d)}"


def _mixed_words(whole: str, numerator: str, denominator: str) -> str | None:
    """2 1/2 -> "two and a half"; None unless the fraction is simple (see `_fraction_words`)."""
    if _fraction_words(numerator, denominator) is None:
        return None
    n, d = _small(numerator), _small(denominator)
    assert n is not None and d is not None  # `_fraction_words` took them
    name = _fraction_name(n, d)
    count = ("an" if name[0] in "aeiou" else "a") if n == 1 else _words(n)
    return f"{_cardinal(whole)} and {count} {name}"


def _unit(m: re.Match) -> str:
    sign, number = m.group(1), m.group(2)
    assert m.lastindex is not None  # groups 3.. are the units, one of them matched
    _, one, many = _UNITS[m.lastindex - 3]
    if "/" in number:  # 1/4 lb -> one quarter of a pound; 1 1/2 lb -> one and a half pounds
        whole, _, fraction = number.rpartition(" ")
        words = _mixed_words(whole, *fraction.split("/")) if whole else _fraction_words(*fraction.split("/"))
        if words is None or sign:
            return m.group(0)
        return f"{words} {many}" if whole else f"{words} of {'an' if one[0] in 'aeiou' else 'a'} {one}"
    words = f"{_number_words(number)} {one if number == '1' else many}"
    return f"minus {words}" if sign else words


_RULES: list[tuple[re.Pattern, object]] = [
    # host names (what tts.text.markup makes of a URL) and file names, not paths: "example.com" -> "example
    # dot com".
    # Labels of at most 63 characters and at most 10 dots (DNS allows 63 and 127): a match may start after
    # each hyphen, and unbounded, every one of them would scan to the end of a long hyphenated run. The
    # label quantifiers are possessive (giving back a label's character can never make a dot follow it).
    (
        re.compile(r"(?<![\w./])[a-z0-9][a-z0-9-]{0,62}+(?:\.[a-z0-9-]{1,63}+){0,9}\.[a-z]{2,}+(?!\w|\.\w)"),
        lambda m: m.group(0).replace(".", " dot "),
    ),
    (
        re.compile(
            rf"\b({'|'.join(sorted(_MONTH_ABBREVIATIONS, key=len, reverse=True))})\.?\s+(\d{{1,2}})"
            r"(?:st|nd|rd|th)?\b(?:,\s*(\d{4})\b)?"
        ),
        _month_abbreviation_date,
    ),
    (
        re.compile(rf"\b({'|'.join(sorted(_MONTH_ABBREVIATIONS, key=len, reverse=True))})\.?\s+(\d{{4}})\b"),
        lambda m: f"{_MONTHS[_MONTH_ABBREVIATIONS[m.group(1)] - 1]} {_year_words(int(m.group(2)))}",
    ),
    (re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b"), _date_iso),
    (re.compile(r"\b(\d{1,2})/(\d{1,2})/(\d{4})\b"), _date_us),
    # scientific notation: 3.14e10
    (re.compile(r"(?<![\w.,])(\d+(?:\.\d+)?)[eE]([-+]?)(\d{1,3})(?![\w]|[.,]\d)"), _scientific),
    # versions (and other numbers of three or more dot-separated parts): 2.0.1
    (re.compile(r"(?<![\d.,])\d+(?:\.\d+){2,}(?![\d]|\.\d)"), _version),
    # a range of times: 10:30-11:30
    (
        re.compile(r"\b(\d{1,2}:\d{2}(?:\s*[AaPp]\.?[Mm]\.?(?![A-Za-z]))?)\s*-\s*(?=\d{1,2}:\d{2}\b)"),
        lambda m: f"{m.group(1)} to ",
    ),
    (re.compile(r"\b(\d{1,2}):(\d{2})(?:\s*([AaPp]\.?[Mm]\.?)(?![A-Za-z]))?"), _time),
    (re.compile(r"(?<![\w.,:$£€])(\d{1,2})\.?(\d{2})\s*([AaPp]\.?[Mm]\.?)(?![A-Za-z])"), _time_without_colon),
    (re.compile(r"(?<![\w.,:])(\d{1,2})\s*([AaPp]\.?[Mm]\.?)(?![A-Za-z])"), _hour),
    # currency before a scale ($5.3 billion) and currency ranges ($5-10)
    (
        re.compile(rf"([$£€])\s?(\d[\d,]*(?:\.\d+)?)\s?({'|'.join(_SCALES)})(?![\w])"),
        _currency_scale,
    ),
    (
        re.compile(r"([$£€])\s?(\d[\d,]*(?:\.\d+)?)\s?-\s?[$£€]?\s?(\d[\d,]*(?:\.\d+)?)(?![\d])"),
        _currency_range,
    ),
    (re.compile(r"\(\d{3}\)\s?\d{3}-\d{4}" + _END), _digit_groups),  # (555) 123-4567
    # 1-800-555-0199, 123-45-6789; not a sequence with a trailing hyphen ("1-4-7-10-13- is ...")
    (re.compile(_START + r"\d+(?:-\d+){2,}(?!-)" + _END), _digit_groups),
    (re.compile(r"(?<![\w.,/$£€-])" + rf"({_NUMBER})-({_NUMBER})" + _END), _hyphen_pair),
    (
        re.compile(
            # (possessive digit runs: a digit given back is followed by a digit, which starts no unit)
            r"(?<![\w.,/-])(-?)(\d++\s\d++/\d++|\d++/\d++|(?:\d{1,3}(?:,\d{3})+|\d++)(?:\.\d++)?)\s?"
            rf"(?:{'|'.join(f'({u})' for u, _, _ in _UNITS)})(?![\w/]|[.,]\d)"
        ),
        _unit,
    ),
    (
        re.compile(_START + r"(\d+)\s(\d+)/(\d+)" + _END),
        lambda m: _mixed_words(*m.groups()) or m.group(0),
    ),
    (re.compile(_START + r"(\d+)/(\d+)" + _END), lambda m: _fraction_words(*m.groups()) or m.group(0)),
    (re.compile(r"([$£€])\s?(\d[\d,]*(?:\.\d+)?)"), _currency),
    # (from the start of a run of digits and commas, the commas before its first digit kept: a match tried
    # at every digit would scan the rest of the run each time)
    (
        re.compile(r"(?<![\d,])(,*)(\d[\d,]*(?:\.\d+)?)\s?%"),
        lambda m: f"{m.group(1)}{_number_words(m.group(2))} percent",
    ),
    (re.compile(r"\b(\d+)(st|nd|rd|th)\b", re.I), lambda m: _ordinal(m.group(1))),
    (
        re.compile(r"\b(?:in|since|by|of|from|until|year)\s+(1[1-9]\d\d|20\d\d)\b", re.I),
        lambda m: m.group(0)[:-4] + _year_words(int(m.group(1))),
    ),
    (re.compile(r"\b(\d+)s\b"), lambda m: _plural_number(m.group(1))),
    # a minus sign before a number (not a hyphen between words or numbers)
    (re.compile(r"(?<![\w.,/-])-(?=\d)"), lambda m: "minus "),
    (
        re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\d])"),
        lambda m: _spaced(m, _number_words(m.group(0))),
    ),
]


def _plural_number(s: str) -> str:
    n = _small(s)
    words = _cardinal(s) if n is None else _year_words(n) if 1100 <= n <= 2099 else _words(n)
    if words.endswith("y"):
        return words[:-1] + "ies"
    return words + ("es" if words.endswith("x") else "s")


_ABBREVIATION_PATTERNS = [(re.compile(rf"(?<!\w){re.escape(a)}"), full) for a, full in _ABBREVIATIONS.items()]
_SPACES = re.compile(r"\s+")
_SPACE_BEFORE_PUNCTUATION = re.compile(r"\s+([,.!?;:])")
_VULGAR_FRACTION = re.compile(r"(\d?)([\u00bc-\u00be\u2150-\u215e])")


def _vulgar_fraction(m: re.Match) -> str:
    """1½ -> "1 1/2" (NFKC alone would glue it into "11/2")."""
    fraction = unicodedata.normalize("NFKC", m.group(2)).replace("\u2044", "/")
    return f"{m.group(1)} {fraction}" if m.group(1) else fraction


# C0 and C1 control characters (and DEL) other than tab, newline and carriage return: each becomes a space,
# so the words on either side stay apart ("Hello\x00world" is two words; espeak-ng would stop at the NUL).
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def remove_control_characters(text: str, keep_joiners: bool = False) -> str:
    """`text` without what is never spoken: C0/C1 control characters become spaces (tab, newline and
    carriage return stay; normalization turns them into spaces), format characters (Unicode category
    Cf: zero-width space and joiners, word joiner, byte order mark, soft hyphen, direction marks) are
    dropped, except the zero-width joiner and non-joiner with `keep_joiners` (they spell Persian, Indic
    and emoji sequences, which multilingual models read). Raises TextError for a lone surrogate (what
    Python makes of bytes that are not UTF-8)."""
    if (bad := _SURROGATE.search(text)) is not None:
        raise TextError(
            f"text is not valid UTF-8 (it holds the lone surrogate U+{ord(bad.group()):04X} at character "
            f"{bad.start()})"
        )
    charge(len(text))
    text = _CONTROL.sub(" ", text)
    if text.isascii():
        return text
    keep = "\u200c\u200d" if keep_joiners else ""
    return "".join(ch for ch in text if ch in keep or unicodedata.category(ch) != "Cf")


# ---- tags in user text --------------------------------------------------------------------------------
# `<|...|>` tags are the prompt formats' control tokens (`<|im_end|>`, `<|voice|>`, `<|semantic:N|>`) and
# the tokenizers recognize them inline, so user text may hold only the tags its prompt format documents
# for users (a format's `user_tags`; S2's `<|speaker:N|>`). A tag is `<|`, then anything without `<|`,
# `|>` or white space, then `|>` (no tokenizer's special token holds white space, and the prompt builder
# checks the token ids again); a lone `<|` or `|>`, or a pair around words ("<| and |>"), is plain text.
# Inline tags pass through normalization untouched. Every module that looks for tags uses these two.
TAG = re.compile(r"<\|(?:(?!<\||\|>)\S)*\|>")
SPEAKER_TAG = re.compile(r"<\|speaker:[0-9]+\|>")
_SPEAKER_TURN = re.compile(f"({SPEAKER_TAG.pattern})")  # (split keeps the tags)
MAX_TAG_CHARS = 40  # a longer tag is cut in the middle in error messages


def shorten(s: str, limit: int) -> str:
    """`s` if it has at most `limit` characters, else its start and end around "..." (`limit` in all)."""
    if len(s) <= limit:
        return s
    tail = max(1, (limit - 3) // 3)
    return f"{s[: max(1, limit - 3 - tail)]}...{s[-tail:]}"


def reserved_tag_error(tag: str, allowed: re.Pattern | None) -> InvalidRequest:
    """The error for a tag (or special token) in user text that its prompt format does not allow."""
    if allowed is None:
        accepted = "no <|...|> tags"
    elif allowed.pattern == SPEAKER_TAG.pattern:
        accepted = "only <|speaker:N|> tags"
    else:
        accepted = f"only tags matching {allowed.pattern}"
    return InvalidRequest(
        f"text contains the reserved tag {shorten(tag, MAX_TAG_CHARS)!r} (this model accepts {accepted} in "
        "text)"
    )


def check_user_tags(text: str, allowed: re.Pattern | None) -> None:
    """Raise InvalidRequest naming the first `<|...|>` tag in `text` that `allowed` does not fully match
    (None: no tag is allowed)."""
    charge(len(text))
    for m in TAG.finditer(text):
        if allowed is None or not allowed.fullmatch(m.group()):
            raise reserved_tag_error(m.group(), allowed)


def normalize_user_text(text: str, allowed_tags: re.Pattern | None) -> str:
    """`normalize_text` for text a user sent, whose prompt format accepts the tags `allowed_tags` matches
    (None: none). Tags are checked after control and invisible characters are removed and again after
    normalization (NFKC turns fullwidth `＜｜` into `<|`). Raises InvalidRequest naming a reserved tag,
    TextError as `normalize_text` does."""
    check_user_tags(remove_control_characters(text), allowed_tags)
    normalized = normalize_text(text)
    check_user_tags(normalized, allowed_tags)
    return normalized


def normalize_text(text: str) -> str:
    """Spoken form of `text` (see the module docstring); control and invisible characters are removed
    first (`remove_control_characters`), inline tags such as `<|speaker:1|>` are kept as they are.
    Raises TextError if nothing speakable remains or the text holds a lone surrogate."""
    text = remove_control_characters(text)
    tags = TAG.findall(text)
    if not tags:
        return _normalize_plain(text)
    pieces = [_normalize_plain(p, allow_empty=True) for p in TAG.split(text)]
    out = pieces[0]
    for tag, piece in zip(tags, pieces[1:], strict=True):
        out = f"{out} {tag}{piece}" if out else f"{tag}{piece}"
    if not any(speakable(p) for p in pieces):
        raise TextError(NOTHING_TO_SPEAK)
    return out


def split_speaker_turns(text: str, max_bytes: int, max_speakers: int = 5) -> list[str]:
    """Split text with `<|speaker:N|>` tags into turns and group consecutive turns into chunks of at most
    `max_speakers` turns and `max_bytes` UTF-8 bytes, joined by newlines (fish-speech main's
    `split_text_by_speaker` / `group_turns_into_batches`, docs/fish_dual_ar.md §3.2). Text before the first
    tag is kept as a turn of its own (fish-speech drops it); a turn longer than `max_bytes` is split like
    plain text, each piece keeping its tag."""
    parts = _SPEAKER_TURN.split(text)
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
    return bool(SPEAKER_TAG.search(text))


def _sub(pattern: re.Pattern, repl, text: str) -> str:
    """`pattern.sub(repl, text)`, its scan charged to the text budget."""
    charge(len(text))
    return pattern.sub(repl, text)


def _normalize_plain(text: str, allow_empty: bool = False) -> str:
    charge(len(text))
    text = _VULGAR_FRACTION.sub(_vulgar_fraction, text)
    text = unicodedata.normalize("NFKC", text).translate(_TRANSLATE)
    charge(len(text))
    text = _STREET.sub(
        lambda m: f"{m.group(1)} Street" + ("." if _ONLY_SPACE_LEFT.match(m.string, m.end()) else ""), text
    )
    text = _sub(_NUMBER_ABBREVIATION, "number", text)
    text = _sub(_ETC_SENTENCE_END, "et cetera.", text)
    for pattern, full in _ABBREVIATION_PATTERNS:
        text = _sub(pattern, full, text)
    for pattern, repl in _RULES:
        text = _sub(pattern, repl, text)
    for sym, word in _SYMBOLS.items():
        charge(len(text))
        text = text.replace(sym, word)
    text = _sub(_SPACES, " ", text).strip()
    text = _sub(_SPACE_BEFORE_PUNCTUATION, r"\1", text)
    if not allow_empty and not speakable(text):
        raise TextError(NOTHING_TO_SPEAK)
    return text


# ---- splitting ----------------------------------------------------------------------------------------
# Boundaries, strongest first. A sentence ends at `.!?` followed by whitespace (or the end), at the sentence
# marks of other scripts with or without whitespace after them (CJK 。！？； and their full-width and
# half-width forms, Arabic ؟ and ۔, Devanagari । ॥, Ethiopic ።, Myanmar ။, Tibetan །, Armenian ։), and at a
# line break. Closing quotes and brackets stay with their sentence; a quotation followed by the Japanese
# quotative particle (「…。」と言った) does not end one. Clauses end at `,;:` followed by
# whitespace, at CJK ，、： and the Arabic comma and semicolon, at an ellipsis and at a dash.
_CLOSERS = "\"'\u201d\u2019\u300d\u300f\uff09)\\]\u3011\u300b\u3009\u203a\u00bb"
# (A run of `.!?` or `,;:` is matched from its first mark only: tried from each mark of a long run that
# no whitespace follows, the match would scan the rest of the run every time.)
_SENTENCE_END = re.compile(
    rf"(?<![.!?])[.!?]+[{_CLOSERS}]*(?:\s+|$)"
    rf"|[\u3002\uff01\uff1f\uff1b\uff0e\uff61\u061f\u06d4\u0964\u0965\u1362\u104b\u0f0d\u0589\u203c\u2047-\u2049]+"
    rf"(?:[{_CLOSERS}]+(?![\u3068\u3063])|(?![{_CLOSERS}]))\s*"
    r"|\n\s*"
)
_CLAUSE_END = re.compile(
    rf"(?<![,;:])[,;:]+[{_CLOSERS}]*(?:\s+|$)|[\uff0c\u3001\uff1a\u060c\u061b\u2026]+[{_CLOSERS}]*\s*|(?:\u2014|--)\s*"
)
_WORD_END = re.compile(r"\s+")
_LEVELS = (_SENTENCE_END, _CLAUSE_END, _WORD_END)


def split_text(text: str, max_bytes: int) -> list[str]:
    """Split text into chunks of at most `max_bytes` UTF-8 bytes, in any script: sentences are packed
    into chunks as long as they fit; only a sentence longer than the limit is split, at its clause
    marks, then between words, and a single word longer than the limit is cut between characters. A
    split sentence starts a new chunk, so no chunk ends mid-sentence while a whole sentence would fit.
    Chunks are stripped; joined in order (with a space where the text had whitespace) they give the
    text back."""
    if len(text.encode()) <= max_bytes:
        return [text]
    chunks: list[str] = []
    current = ""
    for piece, starts_new in _fitting_pieces(text, max_bytes, 0):
        candidate = current + piece
        if current.strip() and (starts_new or _nbytes(candidate.strip()) > max_bytes):
            chunks.append(current.strip())
            current = piece
        else:
            current = candidate
    if current.strip():
        chunks.append(current.strip())
    return chunks


def _nbytes(s: str) -> int:
    return len(s.encode())


def _fitting_pieces(text: str, max_bytes: int, level: int) -> list[tuple[str, bool]]:
    """Consecutive substrings of `text` (their concatenation is `text`), each ending at a boundary of
    `_LEVELS[level]` and at most `max_bytes` once stripped; a piece too long is split at the next level.
    Each comes with True where it must start a new chunk (the first piece of a split piece)."""
    charge(len(text))
    if level == len(_LEVELS):
        return [(p, i == 0) for i, p in enumerate(_cut(text, max_bytes))]
    out: list[tuple[str, bool]] = []
    start = 0
    bounds = [m.end() for m in _LEVELS[level].finditer(text) if m.end() > 0] + [len(text)]
    for end in bounds:
        if end <= start:
            continue
        piece = text[start:end]
        start = end
        if _nbytes(piece.strip()) <= max_bytes:
            out.append((piece, False))
        else:
            sub = _fitting_pieces(piece, max_bytes, level + 1)
            out.extend([(sub[0][0], True), *sub[1:]])
    return out


def _cut(text: str, max_bytes: int) -> list[str]:
    """`text` cut between characters into pieces of at most `max_bytes` (stripped), at least one
    character each; a combining mark stays with its base character unless the two exceed the limit."""
    clusters: list[str] = []
    for ch in text:
        if clusters and unicodedata.category(ch).startswith("M"):
            clusters[-1] += ch
        else:
            clusters.append(ch)
    units = [u for c in clusters for u in ([c] if _nbytes(c) <= max_bytes else list(c))]
    pieces: list[str] = []
    current = ""
    for u in units:
        if current.strip() and _nbytes((current + u).strip()) > max_bytes:
            pieces.append(current)
            current = ""
        current += u
    if current:
        pieces.append(current)
    return pieces
