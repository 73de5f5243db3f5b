import pytest

from tts.text import TextError, normalize_text, split_text


@pytest.mark.parametrize(
    "raw, spoken",
    [
        ("It costs $12.50.", "It costs twelve dollars and fifty cents."),
        ("On 2024-03-10 we met.", "On March tenth, twenty twenty-four we met."),
        ("Meet at 10:30.", "Meet at ten thirty."),
        (
            "About 50% of 1,234 people.",
            "About fifty percent of one thousand, two hundred and thirty-four people.",
        ),
        ("The 21st time, in 1999.", "The twenty-first time, in nineteen ninety-nine."),
        ("Dr. Smith \u2014 hello\u2026", "Doctor Smith, hello..."),
        ("pi is 3.14", "pi is three point one four"),
    ],
)
def test_normalize(raw, spoken):
    assert normalize_text(raw) == spoken


@pytest.mark.parametrize("bad", ["", "   \n\t", "...!?", "\u2014 \u2026"])
def test_nothing_to_speak(bad):
    with pytest.raises(TextError):
        normalize_text(bad)


def test_split_text_respects_limit_and_keeps_words():
    text = normalize_text("This is a sentence, with a clause. " * 20 + "Supercalifragilistic" * 3)
    chunks = split_text(text, 60)
    assert all(len(c.encode()) <= 60 for c in chunks)
    assert "".join(chunks).replace(" ", "") == text.replace(" ", "")
    assert split_text("short", 60) == ["short"]


def test_split_text_terminates_when_the_limit_is_below_one_character():
    chunks = split_text("\u4f60\u597d\u4e16\u754c", 2)  # 3 bytes per character
    assert "".join(chunks) == "\u4f60\u597d\u4e16\u754c" and len(chunks) == 4
