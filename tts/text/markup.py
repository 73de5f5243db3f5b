"""Markup in text to speak: what a person reads aloud from rendered Markdown, SSML and links.

Text from language models is usually Markdown, and a TTS server gets it as it comes. `render_markup`
turns it into the plain text a person would read from the rendered page (markdown-it-py parses it, as
CommonMark plus tables and strikethrough):

* headings, paragraphs, list items, block quotes and table rows each become a line of their own, and
  each line that does not end in punctuation gets a full stop (`。` after Chinese or Japanese), so the
  model pauses there as a reader would;
* emphasis, strong, strikethrough and inline-code markers go, their text stays; a link is read by its
  text, an image by its alt text; an ordered list keeps its numbers ("1. First"), bullets go;
* fenced code blocks are skipped (one warning says how many); HTML tags (of HTML's own elements) are
  removed, their text kept, with a warning; other `<name>` tags stay text (a model's tokenizer may
  reserve one, and the prompt builder refuses it); indented code blocks are not recognized (text
  indented by four spaces is read);
* text that has no Markdown structure (only paragraphs of plain text) comes back unchanged.

SSML is not interpreted. Text with SSML tags (`<speak>`, `<break>`, `<prosody>`, `<say-as>`, `<sub>`,
...) is read as its text content, and its Markdown as above: `<sub alias="X">` reads X, `<break>` becomes
a space (no pause is inserted), `<speak>`, `<p>` and `<s>` end a line, every other SSML tag is removed,
and a warning says so. Tags that are not SSML are left to the Markdown reading (HTML tags removed, other
`<name>` tags kept as text).

URLs anywhere in the text are read as their host ("https://www.example.com/a?b=1" -> "example.com").
`<|...|>` control tags and bracketed cues such as `[laugh]` pass through as text.

Every step is linear in the text's length (markdown-it-py's parser included) and reports its work to
`tts.text.budget.charge`.
"""

from __future__ import annotations

import html
import re
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

from tts.text.budget import charge

# SSML is recognized by a <speak> root or by a tag only SSML has (p, s and w are HTML tags too).
_SSML = re.compile(
    r"<speak\b[^<>]*>|<(?:break|prosody|say-as|sub|phoneme|audio|mark|lang|voice)\b[^<>]*/?>"
    r"|<(?:amazon|mstts|google):[\w-]+\b[^<>]*/?>",
    re.IGNORECASE,
)
# `<sub alias="X">...</sub>` reads X. Found by a scan (`_read_sub_aliases`), not by one regex: a regex that
# finds each open tag's alias and then its close tag rescans the rest of the text for every open tag.
_SUB_OPEN = re.compile(r"<sub\b[^<>]*>", re.IGNORECASE)
_SUB_CLOSE = re.compile(r"</sub\s*>", re.IGNORECASE)
_ALIAS = re.compile(r"\balias\s*=\s*(?:'([^']*)'|\"([^\"]*)\")", re.IGNORECASE)
# Every SSML element's tag, opening or closing: group 1 a block (a paragraph or sentence of its own),
# group 2 a break; the others (prosody, emphasis, say-as, ...) are inline and leave their text in place.
_SSML_TAG = re.compile(
    r"</?(?:(speak|p|s|paragraph|sentence)|(break)|prosody|say-as|sub|phoneme|audio|mark|lang|voice|emphasis"
    r"|w|token|desc|lexicon|meta|metadata|par|seq|media|(?:amazon|mstts|google):[\w-]+)\b[^<>]*>",
    re.IGNORECASE,
)
_ANY_TAG = re.compile(r"</?[A-Za-z][\w:.-]*(?:\s[^<>]*)?/?>")
_URL = re.compile(r"\b(?:https?://|www\.)[^\s<>\"'`]+", re.IGNORECASE)
_URL_TRAILING = ".,;:!?)]}"
SSML_WARNING = (
    "SSML is not interpreted: its tags were removed and the text inside them is read "
    "(<break> adds no pause, <sub alias> reads the alias)"
)
HTML_WARNING = "HTML tags were removed from the text (their text is read)"
# Tags removed as HTML; any other `<name>` stays text (a tokenizer may reserve it, e.g. Qwen's <think>,
# and the prompt builder then refuses it rather than this module hiding it).
HTML_TAG_NAMES = frozenset(
    "a abbr address article aside b bdi bdo big blockquote br caption center cite code col colgroup dd del "
    "details dfn div dl dt em figcaption figure font footer h1 h2 h3 h4 h5 h6 header hr i img ins kbd li "
    "main mark nav ol p pre q s samp section small span strike strong sub summary sup table tbody td tfoot "
    "th thead time tr tt u ul var wbr".split()
)
_TAG_NAME = re.compile(r"</?([A-Za-z][\w:.-]*)")


@dataclass
class Rendered:
    """Plain text to speak and what was dropped or ignored on the way (one line each)."""

    text: str
    warnings: list[str] = field(default_factory=list)


def render_markup(text: str) -> Rendered:
    """What a person reads from `text` rendered (see the module docstring)."""
    charge(len(text))
    ssml = _SSML.search(text) is not None
    out = _render_markdown(_strip_ssml(text) if ssml else text)
    if ssml:
        lines = (re.sub(r"[ \t\f\v]+", " ", line).strip() for line in out.text.splitlines())
        out.text = "\n".join(line for line in lines if line)
        out.warnings.insert(0, SSML_WARNING)
    out.text = read_urls(out.text)
    return out


def read_urls(text: str) -> str:
    """Every URL in `text` replaced by its host without `www.` (trailing punctuation stays text)."""

    def host(m: re.Match) -> str:
        url = m.group(0).rstrip(_URL_TRAILING)
        tail = m.group(0)[len(url) :]
        try:
            name = urlsplit(url if "://" in url else f"http://{url}").hostname or url
        except ValueError:
            name = url
        return name.removeprefix("www.") + tail

    charge(len(text))
    return _URL.sub(host, text)


def _read_sub_aliases(text: str) -> str:
    """`text` with every `<sub alias="X">...</sub>` (the open tag, what follows up to the next close tag,
    and that tag) replaced by X. An open tag without an alias or without a close tag after it stays."""
    closes = [m.span() for m in _SUB_CLOSE.finditer(text)]
    out: list[str] = []
    pos = 0  # text before pos is done
    next_close = 0  # the first close tag that may still end a <sub>
    for m in _SUB_OPEN.finditer(text):
        if m.start() < pos:
            continue  # inside a <sub> already read
        alias = _ALIAS.search(m.group(0))
        if alias is None:
            continue
        while next_close < len(closes) and closes[next_close][0] < m.end():
            next_close += 1
        if next_close == len(closes):
            break  # no close tag after this one, nor after any later one
        out += [text[pos : m.start()], alias.group(1) if alias.group(1) is not None else alias.group(2)]
        pos = closes[next_close][1]
        next_close += 1
    out.append(text[pos:])
    return "".join(out)


def _strip_ssml(text: str) -> str:
    """`text` without its SSML tags, its Markdown left as it was for `_render_markdown`: a block's tags
    become a blank line (a paragraph break), a break a space, other SSML tags nothing (entities are
    decoded by the Markdown reading)."""
    charge(len(text))
    text = _read_sub_aliases(text)
    return _SSML_TAG.sub(lambda m: "\n\n" if m.group(1) else " " if m.group(2) else "", text)


@lru_cache(maxsize=1)
def _parser():
    from markdown_it import MarkdownIt

    # Indented code is off: text indented by four spaces is text to read, not code. Link reference
    # definitions are off: a line such as "[whisper]: ok" is an S2 cue and its text, not a definition.
    # text_join is off so escapes and entities stay separate tokens (they mark the text as Markdown).
    md = MarkdownIt("commonmark").enable(["table", "strikethrough"])
    return md.disable(["code", "reference", "text_join"])


_PLAIN_INLINE = {"text", "softbreak", "hardbreak"}
_STRUCTURE = {
    "heading_open",
    "bullet_list_open",
    "ordered_list_open",
    "blockquote_open",
    "table_open",
    "fence",
    "html_block",
    "hr",
}


def _render_markdown(text: str) -> Rendered:
    charge(len(text))
    tokens = _parser().parse(text)
    plain = all(
        t.type in ("paragraph_open", "paragraph_close")
        or (t.type == "inline" and all(c.type in _PLAIN_INLINE for c in t.children or []))
        for t in tokens
    )
    if plain:
        return Rendered(text)
    walk = _MarkdownWalk()
    for t in tokens:
        walk.feed(t)
    warnings: list[str] = []
    if walk.code_blocks:
        n = walk.code_blocks
        warnings.append(f"{n} code block{'s were' if n > 1 else ' was'} not read")
    if walk.html_seen:
        warnings.append(HTML_WARNING)
    lines = walk.lines
    structured = any(t.type in _STRUCTURE for t in tokens)
    if len(lines) > 1 or structured:
        lines = [_with_stop(line) for line in lines]
    return Rendered("\n".join(lines), warnings)


class _MarkdownWalk:
    """The lines read from a Markdown token stream (`feed` each token in order), the code blocks left
    out and whether HTML tags were seen."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.code_blocks = 0
        self.html_seen = False
        self.item_prefix: list[str] = []  # the number of each open list item ("" for a bullet)
        self.prefix_pending = False
        self.row: list[str] | None = None

    def feed(self, t) -> None:
        kind = t.type
        if kind == "list_item_open":
            self.item_prefix.append(f"{t.info}{t.markup} " if t.info else "")
            self.prefix_pending = True
        elif kind == "list_item_close":
            self._close_item()
        elif kind == "tr_open":
            self.row = []
        elif kind == "tr_close":
            cells = [c for c in (self.row or []) if c]
            if cells:
                self.lines.append(", ".join(cells))
            self.row = None
        elif kind == "inline":
            self._inline(t)
        elif kind == "fence":
            self.code_blocks += 1
        elif kind == "html_block":
            self._html_block(t)

    def _close_item(self) -> None:
        # An item with no text: a number alone ("2024.", "1.") is read as it is; a bullet is nothing.
        if self.prefix_pending and self.item_prefix[-1] and self.row is None:
            self.lines.append(self.item_prefix[-1].strip())
        self.item_prefix.pop()
        self.prefix_pending = False

    def _inline(self, t) -> None:
        charge(len(t.content))
        content, saw_html = _inline_text(t.children or [])
        self.html_seen |= saw_html
        if self.row is not None:
            self.row.append(content.strip())
            return
        if self.prefix_pending:
            content = self.item_prefix[-1] + content
            self.prefix_pending = False
        if content.strip():
            self.lines.append(content.strip())

    def _html_block(self, t) -> None:
        inner = _ANY_TAG.sub(lambda m: " " if _is_html_tag(m.group(0)) else m.group(0), t.content)
        self.html_seen |= inner != t.content
        inner = html.unescape(inner).strip()
        if inner:
            self.lines.append(re.sub(r"\s+", " ", inner))


def _inline_text(children) -> tuple[str, bool]:
    """The text of an inline token's children, and whether it held HTML tags."""
    parts: list[str] = []
    saw_html = False
    for c in children:
        if c.type in ("text", "text_special", "code_inline"):
            parts.append(c.content)
        elif c.type == "softbreak":
            parts.append(" ")
        elif c.type == "hardbreak":
            parts.append("\n")
        elif c.type == "image":
            parts.append(c.content)
        elif c.type == "html_inline" and _is_html_tag(c.content):
            saw_html = True
            parts.append(" " if re.match(r"<br\b", c.content, re.IGNORECASE) else "")
        elif c.type == "html_inline":
            parts.append(c.content)  # not an HTML tag: text
    return "".join(parts), saw_html


def _is_html_tag(tag: str) -> bool:
    m = _TAG_NAME.match(tag)
    return m is not None and m.group(1).lower() in HTML_TAG_NAMES


def _is_cjk(ch: str) -> bool:
    name = unicodedata.name(ch, "")
    return name.startswith(("CJK UNIFIED", "CJK COMPATIBILITY IDEOGRAPH", "HIRAGANA", "KATAKANA"))


def _with_stop(line: str) -> str:
    """`line` ending in punctuation: a full stop is added after a letter or digit (`。` after CJK)."""
    last = line[-1]
    if unicodedata.category(last).startswith("P"):
        return line
    return line + ("\u3002" if _is_cjk(last) else ".")
