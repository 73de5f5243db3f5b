"""Text preparation is bounded: hostile texts cost work linear in their length, long numbers read (no
overflow), and a preparation past its deadline stops at its next step. Work is counted, not timed: every
preparation step charges the characters it scans to the text budget (`tts.text.budget`)."""

from __future__ import annotations

import itertools

import pytest

from tts.text.budget import PreparationTimeout, TextBudget, text_budget
from tts.text.normalize import SPEAKER_TAG, TextError, normalize_text
from tts.text.policy import get_text_policy, plan_text

MAX_TEXT = 20_000  # the service's default text limit (bytes)
# Characters of work per byte of text: about 60 passes over the text (the normalizer's rules), over text
# that reading makes longer ("1.1" -> "one point one", "½E" (3 bytes) -> "one half E"); these texts
# measure 380 at most. A step that rescans the rest of a 20 KB text per match or per tag costs thousands.
WORK_PER_BYTE = 1000


def _fill(unit: str, head: str = "", tail: str = "") -> str:
    """`unit` repeated to fill MAX_TEXT characters between `head` and `tail`."""
    return head + unit * ((MAX_TEXT - len(head) - len(tail)) // len(unit)) + tail


HOSTILE = {
    "sub tags, none closed": "<sub alias='x'>" * 1250,  # the 68.8 s one
    "sub tags, all closed": _fill("<sub alias='x'>y</sub>"),
    "sub tags, one close at the end": _fill("<sub alias='x'>", tail="</sub>"),
    "sub aliases never quoted to the end": _fill("<sub alias='", head="<speak>"),
    "digits": "1" * MAX_TEXT,
    "long decimal": _fill("1", head="0."),
    "digits and commas": "1," * (MAX_TEXT // 2),
    "thousands groups": _fill(",000", head="1"),
    "digits and hyphens": "1-" * (MAX_TEXT // 2),
    "percent after a digit run": _fill("1", tail="%"),
    "currency": _fill("9", head="$"),
    "version": _fill("1.", tail="1"),
    "ordinal": _fill("1", tail="th"),
    "times": _fill("10:30 a.m. "),
    "streets": _fill("Main St. "),
    "hyphenated host names": _fill("a-", tail="b.com"),
    "HTML tags": _fill("<b>"),
    "unclosed tags": _fill("<a "),
    "nested SSML": "<speak>" + "<prosody>" * 900 + "hi" + "</prosody>" * 900 + "</speak>",
    "long word": "a" * MAX_TEXT,
    "exclamation marks": "!" * MAX_TEXT,
    "exclamation marks between words": _fill("!", head="a", tail="b"),
    "commas between words": _fill(",", head="a", tail="b"),
    "closing quotes between words": _fill('!"', head="a", tail="b"),
    "dots": "." * MAX_TEXT,
    "image openers": _fill("!["),
    "link openers": _fill("[a]("),
    "emphasis": _fill("*a "),
    "emphasis marks": _fill("*_"),
    "table": "|a" * 3000 + "\n" + "|-" * 3000 + "\n" + "|a" * 3000,
    "list items": _fill("- a\n"),
    "backticks": _fill("`a"),
    "entities": _fill("&amp"),
    "URL with trailing dots": _fill(".", head="www.a"),
    "mixed scripts": "a中b Ω 😀 " * (MAX_TEXT // 14),
    "vulgar fractions": "½E" * (MAX_TEXT // 3),
    "NFKC expansions": "\ufdfa\u337b\ufb04" * (MAX_TEXT // 9),
    "speaker tags": _fill("<|speaker:1|>x"),
}
POLICIES = ("english", "fish-s2", "fish-1.5")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_text_is_prepared_with_work_linear_in_its_length(name, policy):
    text = HOSTILE[name]
    assert len(text.encode()) <= MAX_TEXT + 40
    with text_budget() as budget:
        try:
            plan = plan_text(text, get_text_policy(policy), SPEAKER_TAG, chunk_length=200)
            assert plan.chunks
        except TextError:
            pass  # (nothing to speak: refused, which is the right answer for some of them)
    assert 0 < budget.work <= WORK_PER_BYTE * len(text.encode()), f"{name}: {budget.work} characters of work"


def test_the_reported_texts_read_as_a_user_expects():
    policy = get_text_policy("english")
    with pytest.raises(TextError, match="nothing to speak"):  # SSML tags only, none closed
        policy.prepare("<sub alias='x'>" * 1250, None)
    closed = policy.prepare("<speak>" + "<sub alias='ex'>x</sub> " * 1000 + "</speak>", None).text
    assert closed == " ".join(["ex"] * 1000)
    assert policy.prepare("1," * 10000, None).text == ",".join(["one"] * 10000) + ","


@pytest.mark.parametrize(
    "raw, spoken",
    [
        # up to 15 digits: words, as before
        ("123456789012345", "one hundred and twenty-three trillion, four hundred and fifty-six billion, "
         "seven hundred and eighty-nine million, twelve thousand, three hundred and forty-five"),
        ("000000000000000000007 items", "seven items"),
        # longer: digit by digit, in groups of four, or in the number's own comma groups
        ("Card 4111111111111111.",
         "Card four one one one, one one one one, one one one one, one one one one."),
        ("1,000,000,000,000,000,000", "one, zero zero zero, zero zero zero, zero zero zero, zero zero zero, "
         "zero zero zero, zero zero zero"),
        ("$12345678901234567", "one two three four, five six seven eight, nine zero one two, three four five "
         "six, seven dollars"),
        ("12345678901234567%", "one two three four, five six seven eight, nine zero one two, three four five "
         "six, seven percent"),
        ("the 12345678901234567th", "the one two three four, five six seven eight, nine zero one two, three "
         "four five six, seventh"),
        ("v1.2.12345678901234567",
         "v one point two point one two three four, five six seven eight, nine zero "
         "one two, three four five six, seven"),
        ("1.25 and 0.12345678901234567890", "one point two five and zero point one two three four five six "
         "seven eight nine zero one two three four five six seven eight nine zero"),
    ],
)  # fmt: skip
def test_long_numbers_are_read_digit_by_digit(raw, spoken):
    assert normalize_text(raw) == spoken


@pytest.mark.parametrize("digits", [16, 306, 307, 400, 4301, 20_000])
def test_a_digit_run_of_any_length_reads(digits):
    """num2words overflows at 307 digits and int() refuses 4301: neither may reach a user as an error."""
    for text in (
        "1" * digits,
        f"${'9' * digits}",
        f"{'1' * digits}%",
        f"{'2' * digits}th",
        f"0.{'3' * digits}",
    ):
        assert len(normalize_text(text).split()) >= digits  # a word a digit


def test_a_cancelled_budget_stops_preparation_at_once():
    budget = TextBudget()
    budget.cancel()
    with text_budget(budget=budget), pytest.raises(PreparationTimeout):
        get_text_policy("english").prepare("Hello there.", None)
    assert budget.work > 0  # the first step charged, then stopped


def test_preparation_stops_at_the_first_step_past_its_deadline(monkeypatch):
    """A clock that passes the deadline after k checks: the next step raises, no step runs after it."""
    import tts.text.budget as textbudget

    text = "On 2024-03-10 we paid $12.50 for 3 kg. " * 50
    with text_budget() as full:
        get_text_policy("english").prepare(text, None)
    for k in (1, 5, 20):
        clock = itertools.count()
        monkeypatch.setattr(textbudget, "_now", lambda clock=clock: next(clock))
        with text_budget(deadline=k - 0.5) as budget, pytest.raises(PreparationTimeout):
            get_text_policy("english").prepare(text, None)
        assert next(clock) == k + 1  # checks 0..k ran; the check at time k raised; nothing checked since
        assert budget.work < full.work
