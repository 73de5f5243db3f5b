"""What each model does to text (tts.text.policy): one table of inputs and outputs per text policy."""

import pytest

from tts.text.normalize import SPEAKER_TAG, TextError
from tts.text.policy import get_text_policy, plan_text

SAME = object()  # the output is the input, as the model's reference code leaves it
HAN = "this model reads English only: {} characters of Han text were left out"

# input, then what each policy makes of it: english (the default voice), fish-s2 / fish-s1 (fish-speech
# main and d3df505 pass text as it is), fish-1.5 (fish-speech 1.5's clean_text)
REFUSED = object()  # the English voice refuses the text (TextError)

CASES = [
    # the cases
    ("1951年，我们的村子只有一条泥路。", REFUSED, SAME, SAME),
    ("25 Euro am 3. Mai", "twenty-five Euro am three. Mai", SAME, SAME),
    ("$5.3 billion", "five point three billion dollars", SAME, SAME),
    ("221B", "two hundred and twenty-one B", SAME, SAME),
    ("2.0.1", "two point zero point one", SAME, SAME),
    ("3:30 p.m.", "three thirty p m.", SAME, SAME),
    ("10 a.m.", "ten a m.", SAME, SAME),
    ("-5 kg", "minus five kilograms", SAME, SAME),
    ("10:30-11:30 tomorrow", "ten thirty to eleven thirty tomorrow", SAME, SAME),
    ("3.14e10", "three point one four times ten to the power of ten", SAME, SAME),
    ("$5-10", "five to ten dollars", SAME, SAME),
    # other languages: Fish models get them as their reference code leaves them; the English voice reads
    # Latin-script text with English rules and leaves other scripts out
    ("Der Preis beträgt 25 € pro Person.", "Der Preis beträgt twenty-five € pro Person.", SAME, SAME),
    (
        "Il est 15h30, le 14 juillet 2024.",
        "Il est fifteen h thirty, le fourteen juillet two thousand and twenty-four.",
        SAME,
        SAME,
    ),
    ("¿Cuánto cuesta? ¡Sólo 3 pesos!", "¿Cuánto cuesta? ¡Sólo three pesos!", SAME, SAME),
    # ... and text whose only "English" would be the numbers written in it is refused, not read as a
    # salad of numbers out of their sentences
    ("今日は2024年5月3日です。", REFUSED, SAME, SAME),
    ("안녕하세요, 3명입니다.", REFUSED, SAME, SAME),
    ("مرحبا، عندي 3 قطط.", REFUSED, SAME, SAME),
    ("Привет, мир! Hello world.", "Hello world.", SAME, SAME),
    # quotes and emoji: fish-speech 1.5 cleans them, S2 and S1 keep them
    ("It\u2019s great \U0001f600,,, really", "It's great,,, really", SAME, "It's great , really"),
    # markup is read as rendered by every model; S2's inline tags and cues pass through
    ("# Hi\n\n**3** cats", "Hi. three cats.", "Hi.\n3 cats.", "Hi.\n3 cats."),
    (
        "See https://www.example.com/a?b=1 now.",
        "See example dot com now.",
        "See example.com now.",
        "See example.com now.",
    ),
    (
        '<speak>I have <break time="1s"/> 3 cats.</speak>',
        "I have three cats.",
        "I have 3 cats.",
        "I have 3 cats.",
    ),
    ("<|speaker:0|>[laugh] I have 3 cats.", "<|speaker:0|>[laugh] I have three cats.", SAME, None),
    ("<|speaker:1|>(sighs) 好的。", "<|speaker:1|>(sighs)", SAME, None),
]


@pytest.mark.parametrize("raw, english, fish, fish15", CASES, ids=[c[0][:24] for c in CASES])
def test_what_each_model_reads(raw, english, fish, fish15):
    tags = SPEAKER_TAG if raw.startswith("<|") else None
    if english is REFUSED:
        with pytest.raises(TextError, match="reads English only, and the text is .* with nothing English"):
            get_text_policy("english").prepare(raw, SPEAKER_TAG)
    else:
        assert get_text_policy("english").prepare(raw, SPEAKER_TAG).text == english
    expected = raw if fish is SAME else fish
    assert get_text_policy("fish-s2").prepare(raw, SPEAKER_TAG).text == expected
    if tags is None:  # S1 and 1.5 take no speaker tags
        assert get_text_policy("fish-s1").prepare(raw, None).text == expected
        assert get_text_policy("fish-1.5").prepare(raw, None).text == (raw if fish15 is SAME else fish15)


def test_the_english_voice_warns_about_text_it_leaves_out():
    out = get_text_policy("english").prepare("In 1951年，我们的村子只有一条泥路。", None)
    assert out.text == "In" and out.warnings == [
        HAN.format(12).replace(" text were", " text, with the 4 digits written in it, were")
        + " (a multilingual model such as Fish Audio S2-Pro reads them)"
    ]
    spaced = get_text_policy("english").prepare("Room 12 東京 tour", None)  # (a number apart stays)
    assert spaced.text == "Room twelve tour"
    mixed = get_text_policy("english").prepare("Tokyo 東京 and Seoul 서울.", None)
    assert mixed.text == "Tokyo and Seoul." and "4 characters of Han and Hangul" in mixed.warnings[0]
    assert get_text_policy("english").prepare("π is 3.14", None).warnings == []  # a Greek letter is kept


def test_text_with_no_english_is_refused_by_the_english_voice():
    with pytest.raises(TextError, match="reads English only, and the text is Han text"):
        get_text_policy("english").prepare("我们的村子只有一条泥路。", None)
    # ... and taken by a Fish model
    assert get_text_policy("fish-s2").prepare("我们的村子只有一条泥路。", None).warnings == []


@pytest.mark.parametrize("policy", ["english", "fish-s2", "fish-s1", "fish-1.5"])
def test_normalize_off_reads_the_text_as_given(policy):
    raw = "# Intro\n\nWe sold **5** units for $3."
    out = get_text_policy(policy).prepare(raw, None, normalize=False)
    assert out.text == raw and out.warnings == []
    on = get_text_policy(policy).prepare(raw, None)
    assert on.text.startswith("Intro.\n" if policy != "english" else "Intro. We sold five units")


def test_normalize_off_still_leaves_out_what_the_english_voice_cannot_say():
    out = get_text_policy("english").prepare("Hello 世界 $5", None, normalize=False)
    assert out.text == "Hello $5" and "Han" in out.warnings[0]


def test_markup_warnings_come_with_the_text():
    raw = "Run:\n\n```sh\nmake\n```\n\n<speak>Done</speak>"
    out = get_text_policy("fish-s2").prepare(raw, None)
    assert out.text == "Run:\nDone." and "SSML" in out.warnings[0]  # SSML and Markdown both read
    assert out.warnings[1:] == ["1 code block was not read"]
    code = get_text_policy("fish-s2").prepare("Run:\n\n```sh\nmake\n```\n\nDone.", None)
    assert code.text == "Run:\nDone." and code.warnings == ["1 code block was not read"]


def test_plan_text_splits_chinese_for_fish_at_sentence_ends():
    from test_text import ZH_PARAGRAPH

    plan = plan_text(ZH_PARAGRAPH, get_text_policy("fish-s2"), SPEAKER_TAG, 200)
    assert "".join(plan.chunks) == ZH_PARAGRAPH and all(c.endswith(("。", "！", "；")) for c in plan.chunks)
    assert plan.chunks[0].startswith("1951年") and plan.warnings == []


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown text policy 'klingon'"):
        get_text_policy("klingon")


@pytest.mark.parametrize(
    "policy, spoken",
    [("english", "Title. Hello world. one. two."), ("fish-s2", "Title.\nHello world.\none.\ntwo.")],
)
def test_ssml_tags_do_not_turn_off_markdown(policy, spoken):
    raw = '# Title\n\n<speak>Hello <break time="1s"/> **world**</speak>\n\n```\ncode\n```\n\n- one\n- two'
    out = get_text_policy(policy).prepare(raw, None)
    assert out.text == spoken
    assert "number" not in out.text and "asterisk" not in out.text and "code" not in out.text
    assert "SSML" in out.warnings[0] and "1 code block was not read" in out.warnings


@pytest.mark.parametrize("policy", ["english", "fish-s2", "fish-1.5"])
@pytest.mark.parametrize("raw, english", [("2024.", "two thousand and twenty-four."), ("1.", "one.")])
def test_a_number_alone_is_spoken(policy, raw, english):
    assert get_text_policy(policy).prepare(raw, None).text == (english if policy == "english" else raw)


@pytest.mark.parametrize("policy", ["english", "fish-s2"])
def test_lone_tag_brackets_around_words_are_text_and_real_tags_are_refused(policy):
    from tts.engine import InvalidRequest

    text = get_text_policy(policy).prepare("a lone <| and |> is ok", None).text
    assert text == "a lone <| and |> is ok"
    with pytest.raises(InvalidRequest, match=r"reserved tag '<\|im_end\|>'"):
        get_text_policy(policy).prepare("a lone <| and <|im_end|> is not", None)


def test_words_between_lone_tag_brackets_reach_the_phonemizer():
    from tts.text.phonemes import apply_frontend

    out = apply_frontend(str.upper, "a lone <| and |> is ok <|speaker:0|>x")
    assert out == "A LONE <| AND |> IS OK <|speaker:0|>X"
