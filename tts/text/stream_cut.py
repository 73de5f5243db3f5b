"""Where streamed text is cut into chunks to speak (the session planner's rule, `tts.runtime.sessions`).

A voice agent sends its reply as it is written, a few characters at a time. `TextBuffer` collects the
pieces and hands out a chunk as soon as one is complete:

* the first chunk of a turn ends at the first clause end (`,` `;` `:` a dash, and their CJK forms) or
  sentence end, once it has at least `first_words` words: audio starts after a few words instead of a
  whole sentence;
* later chunks end at sentence ends (`.` `!` `?` `…` and CJK `。！？`), closing quotes and brackets
  included;
* `flush()` hands out whatever is left;
* a chunk never exceeds `max_bytes` UTF-8 bytes: text that reaches the bound without a boundary is cut
  at its last space before the bound (or at the bound, for text without spaces).

A Latin terminator only counts when whitespace follows it: streamed text may still continue the token
(`3.` + `5 apples`, `example.` + `com`). CJK terminators count at once. Everything here works on
characters; nothing normalizes (the planner's text policy does that per chunk).
"""

from __future__ import annotations

import re

# A sentence end: terminators, then closing quotes/brackets, then whitespace (Latin) or nothing (CJK).
_SENTENCE_END = re.compile(r"(?:[.!?…]+[\"'”’)\]]*\s)|(?:[。！？]+[」』”’）]*)")
_CLAUSE_END = re.compile(r"(?:[,;:]+[\"'”’)\]]*\s)|(?:\s[—–-]{1,2}\s)|(?:[—]\s?)|(?:[、，；：]+)")


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


class TextBuffer:
    """Streamed text waiting to be cut into chunks (see the module docstring).

    max_bytes: the length bound of a chunk, UTF-8 bytes (>= 16). first_words: words the first chunk of a
    turn needs before a clause end may cut it. `first` is True while the next chunk is a turn's first
    (`new_turn()` sets it again: after a barge-in or when the session went quiet).
    """

    def __init__(self, max_bytes: int = 300, first_words: int = 3):
        if max_bytes < 16:
            raise ValueError("max_bytes must be >= 16")
        self.max_bytes = max_bytes
        self.first_words = first_words
        self.text = ""
        self.first = True

    def __len__(self) -> int:
        """UTF-8 bytes waiting."""
        return utf8_len(self.text)

    def new_turn(self) -> None:
        self.first = True

    def clear(self) -> None:
        """Forget the waiting text (barge-in); the next chunk is a turn's first."""
        self.text = ""
        self.first = True

    def push(self, piece: str) -> list[str]:
        """Add `piece`; returns the chunks now complete (stripped, non-empty), in order."""
        self.text += piece
        return self._cut(flush=False)

    def flush(self) -> list[str]:
        """Every chunk left, the last one whatever its end (the buffer is then empty)."""
        return self._cut(flush=True)

    def _cut(self, flush: bool) -> list[str]:
        out: list[str] = []
        while True:
            end = self._boundary()
            if end is None and utf8_len(self.text) > self.max_bytes:
                end = self._bound_cut()
            if end is None:
                break
            chunk, self.text = self.text[:end].strip(), self.text[end:].lstrip()
            if chunk:
                out.append(chunk)
                self.first = False
        if flush:
            rest, self.text = self.text.strip(), ""
            while rest:  # (a flushed rest longer than the bound is cut at the bound too)
                self.text = rest
                end = self._bound_cut() if utf8_len(rest) > self.max_bytes else len(rest)
                out.append(rest[:end].strip())
                rest = rest[end:].strip()
                self.text = ""
            self.first = self.first and not out
        return [c for c in out if c]

    def _boundary(self) -> int | None:
        """End index of the next complete chunk within the bound, or None."""
        text = self.text
        ends = []
        m = _SENTENCE_END.search(text)
        if m is not None:
            ends.append(m.end())
        if self.first and self.first_words > 0:
            for c in _CLAUSE_END.finditer(text):
                if len(text[: c.start()].split()) >= self.first_words:
                    ends.append(c.end())
                    break
        if not ends:
            return None
        end = min(ends)
        return end if utf8_len(text[:end]) <= self.max_bytes else None

    def _bound_cut(self) -> int:
        """Where text over the bound is cut: its last whitespace within max_bytes, else the bound."""
        text, limit = self.text, 0
        size = 0
        for i, ch in enumerate(text):
            size += utf8_len(ch)
            if size > self.max_bytes:
                limit = i
                break
        space = text.rfind(" ", 0, limit + 1)
        return space + 1 if space > 0 else max(limit, 1)
