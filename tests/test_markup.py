"""Markdown, SSML and URLs in text to speak (tts.text.markup): read as a person reads the rendered text."""

import pytest

from tts.text.markup import HTML_WARNING, SSML_WARNING, render_markup


@pytest.mark.parametrize(
    "raw, spoken",
    [
        # headings, emphasis and paragraphs: lines of their own, each ending in punctuation
        (
            "# Results\n\nThe test **passed** and *nothing* broke.",
            "Results.\nThe test passed and nothing broke.",
        ),
        ("## Summary\nAll good", "Summary.\nAll good."),
        ("Title\n=====\n\nBody text.", "Title.\nBody text."),
        # lists: bullets go, numbers stay
        ("Steps:\n\n- open the box\n- take it out", "Steps:\nopen the box.\ntake it out."),
        ("1. First\n2. Second", "1. First.\n2. Second."),
        ("* a\n  * nested b", "a.\nnested b."),
        # links by their text, images by their alt text, inline code by its content
        ("See [the docs](https://example.com/docs) for more.", "See the docs for more."),
        ("![a red cat](cat.png)\n\nNice.", "a red cat.\nNice."),
        ("Call `foo()` **now**.", "Call foo() now."),
        ("~~old~~ new *price*", "old new price"),
        # block quotes and tables
        ("> To be or not to be.\n\nHamlet said.", "To be or not to be.\nHamlet said."),
        ("| Name | Age |\n|---|---|\n| Ann | 31 |\n| Bob | 42 |", "Name, Age.\nAnn, 31.\nBob, 42."),
        # escapes and entities
        ("5 \\* 3 is **15**", "5 * 3 is 15"),
        ("AT&amp;T *rocks*", "AT&T rocks"),
        # CJK lines get 。
        ("# 标题\n\n正文很短。\n\n- 第一项\n- 第二项", "标题。\n正文很短。\n第一项。\n第二项。"),
        ("## 見出し\n\n本文です", "見出し。\n本文です。"),
        # speaker tags and bracketed cues survive
        ("<|speaker:0|>**Hi** there [laugh]", "<|speaker:0|>Hi there [laugh]"),
        ("# Scene\n\n[whisper]: come closer", "Scene.\n[whisper]: come closer."),
    ],
)
def test_markdown_reads_as_the_rendered_text(raw, spoken):
    out = render_markup(raw)
    assert out.text == spoken and out.warnings == []


@pytest.mark.parametrize(
    "plain",
    [
        "Hello world.",
        "5 * 3 = 15, and 2 * 4 = 8.",
        "snake_case_names and a*b stay",
        "Line one\nline two\n\nA new paragraph",
        "    indented text is read, not skipped",
        "#hashtag is not a heading",
        "<|speaker:0|>Hi.\n<|speaker:1|>Hello! [laugh]",
        "我们今天去公园。你呢？",
        "a < b and c > d, I <3 you",
    ],
)
def test_plain_text_comes_back_unchanged(plain):
    out = render_markup(plain)
    assert out.text == plain and out.warnings == []


def test_code_blocks_are_skipped_with_a_warning():
    out = render_markup("Run this:\n\n```python\nprint(1)\n```\n\nThen this:\n\n```\nls\n```\n\nDone.")
    assert out.text == "Run this:\nThen this:\nDone."
    assert out.warnings == ["2 code blocks were not read"]


def test_html_tags_are_removed_with_a_warning():
    out = render_markup("Some <b>bold</b> text.\n\n<div>A block</div>")
    assert out.text == "Some bold text.\nA block."
    assert out.warnings == [HTML_WARNING]


def test_tags_that_are_not_html_stay_text():
    # Qwen's tokenizer reserves <think>: it must reach the prompt builder, which refuses it.
    out = render_markup("Let me <think> about **it**.")
    assert out.text == "Let me <think> about it." and out.warnings == []


@pytest.mark.parametrize(
    "ssml, spoken",
    [
        ('<speak>Hello <break time="500ms"/> world.</speak>', "Hello world."),
        ('<speak><sub alias="World Wide Web">WWW</sub> is big.</speak>', "World Wide Web is big."),
        ("<speak><p>One.</p><p>Two &amp; three.</p></speak>", "One.\nTwo & three."),
        ('Say <say-as interpret-as="characters">abc</say-as> now', "Say abc now"),
        ('<speak><prosody rate="slow">Slowly</prosody> <emphasis>now</emphasis></speak>', "Slowly now"),
    ],
)
def test_ssml_tags_are_removed_with_a_warning(ssml, spoken):
    out = render_markup(ssml)
    assert out.text == spoken and out.warnings == [SSML_WARNING]


@pytest.mark.parametrize(
    "raw, spoken",
    [
        ("Visit https://www.example.com/path?x=1 today.", "Visit example.com today."),
        ("See http://docs.python.org/3/.", "See docs.python.org."),
        ("Go to www.wikipedia.org, then search.", "Go to wikipedia.org, then search."),
        ("(https://example.org/a)", "(example.org)"),
        ("Auto <https://fish.audio/docs> link", "Auto fish.audio link"),
    ],
)
def test_urls_are_read_as_their_host(raw, spoken):
    assert render_markup(raw).text == spoken


@pytest.mark.parametrize("policy", ["english", "fish-s2", "fish-1.5"])
def test_text_of_code_blocks_only_is_refused_naming_what_was_left_out(policy):
    """Not "empty, whitespace or punctuation only": the user gave text, and the error says why none of
    it is spoken."""
    from tts.text.normalize import TextError
    from tts.text.policy import get_text_policy

    code = "```python\nprint('hello world')\n```\n\n```\nmore code\n```\n"
    with pytest.raises(TextError) as err:
        get_text_policy(policy).prepare(code, None)
    assert (
        str(err.value) == "text has nothing to speak once its Markdown is read: 2 code blocks were not read"
    )
    # with markup off (the service's and API's normalize=false), the text is read as given
    assert "print" in get_text_policy(policy).prepare(code, None, normalize=False).text


def test_a_symbol_the_english_voice_reads_after_a_code_block_is_still_read():
    from tts.text.policy import get_text_policy

    prepared = get_text_policy("english").prepare("```\ncode\n```\n\n&", None)
    assert (prepared.text, prepared.warnings) == ("and", ["1 code block was not read"])


@pytest.mark.parametrize(
    "raw, spoken",
    [
        # Markdown around SSML: the heading, emphasis and code block are read as rendered
        ("# Title\n\n<speak>Hello **world**</speak>", "Title.\nHello world."),
        (
            'Intro <break time="1s"/> text.\n\n```\nprint(1)\n```\n\n- one\n- <sub alias="two">2</sub>',
            "Intro text.\none.\ntwo.",
        ),
        ("<speak><p>## Part *one*</p><p>Tom &amp; Jerry</p></speak>", "Part one.\nTom & Jerry."),
    ],
)
def test_ssml_and_markdown_are_read_together(raw, spoken):
    out = render_markup(raw)
    assert out.text == spoken
    assert out.warnings[0] == SSML_WARNING
    assert ("1 code block was not read" in out.warnings) == ("```" in raw)


def test_a_tag_that_is_neither_ssml_nor_html_stays_text_beside_ssml():
    out = render_markup('Let me <think> <break time="1s"/> about it.')
    assert out.text == "Let me <think> about it." and out.warnings == [SSML_WARNING]


@pytest.mark.parametrize("raw", ["2024.", "1.", " 7) "])
def test_a_number_alone_is_read_not_taken_for_an_empty_list_item(raw):
    assert render_markup(raw).text == raw.strip()


def test_empty_bullets_are_still_left_out():
    assert render_markup("- one\n-\n- two").text == "one.\ntwo."
