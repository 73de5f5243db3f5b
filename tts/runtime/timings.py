"""Word timings of a spoken text chunk, on its session's clock.

Two ways, one contract (`WordTiming`: words in text order, start <= end, starts and ends never going
back, all inside the audio sent):

* **measured**, for a model whose bundle names aligner heads and whose engine runs the loop guard
  (`tts.engine.aligner`): every frame comes with the aligner's text position, a token index into the
  chunk's text span. A word begins at the span token where its model text begins (phonemes for the
  default model, characters for Fish models; `word_first_tokens`, else its share of the span). It starts
  in the first frame whose position (the running maximum: the aligner may glance back) reaches that
  token: at the middle of that frame (its onset lies somewhere in it), on the audio's clock (the codec's
  audio lags its frames by `Codec.delay` samples); the first word of a chunk starts with the chunk's
  audio. A word ends where the next word starts (the last word: at the chunk's end), and is final, and
  sent, as soon as the audio sent reaches the next word's start. Words the aligner never reached (a
  chunk cut by its budget, say) share the rest of the chunk by their model text and are marked
  `estimated`;
* **estimated**, without aligner positions: at the chunk's end, whose audio length is then exact, each
  word gets its share of the chunk's audio in proportion to its share of the chunk's model text.
"""

from __future__ import annotations

import bisect
import itertools
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class WordTiming:
    """One word of a chunk and when it is heard, on the session's clock (the session's audio sample
    count since it opened, at `sample_rate`): `start` / `end` in seconds, `start_sample` / `end_sample`
    in samples (`end_sample` exclusive). estimated: placed by its share of the chunk's text, not measured
    by the aligner. chunk: the session's chunk number."""

    text: str
    start: float
    end: float
    start_sample: int
    end_sample: int
    estimated: bool
    chunk: int


def _letters(text: str) -> int:
    """Characters of `text` that are neither white space nor punctuation (what a word's length is
    counted in when words are matched to the pieces of a model text)."""
    return sum(1 for ch in text if not ch.isspace() and not unicodedata.category(ch).startswith("P"))


def _model_words(words: list[str], model_text: Callable[[str], str]) -> list[str]:
    """What the model reads for each word alone; a frontend that fails gives the word itself."""
    out = []
    for word in words:
        try:
            out.append(model_text(word).strip())
        except Exception:  # noqa: BLE001 - a frontend that cannot run: characters
            out.append(word)
    return out


def word_weights(words: list[str], model_text: Callable[[str], str]) -> list[int]:
    """Each word's weight: the length of what the model reads for it (phonemes or characters), >= 1.
    A frontend that fails falls back to the word's characters."""
    return [max(len(m), 1) for m in _model_words(words, model_text)]


MAX_JOINED = 4  # words one piece of a chunk's model text may hold (espeak joins short ones: "of the")
JOIN_BAND = 12  # how far the words joined so far may stray from an even spread of all the chunk's joins


def _group(own: list[int], size: list[int]) -> list[int] | None:
    """How many consecutive words each piece holds: the grouping of words (lengths `own`) into pieces
    (lengths `size`, in order; each holds 1 to `MAX_JOINED` words) with the least total difference
    between a piece's length and its words' (on a tie, the later piece holds fewer words). None where
    the words cannot be grouped so (too many or too few).

    A grouping is a path of states d: the words joined to the pieces before (piece j's words start at
    word j + d). Only d within `JOIN_BAND` of an even spread of the chunk's n - k joins are tried (all
    of them when n - k <= `JOIN_BAND`; the even spread itself is always a grouping), so the work is
    O(k * JOIN_BAND * MAX_JOINED), linear in the words."""
    n, k = len(own), len(size)
    joins = n - k
    if not 0 <= joins <= k * (MAX_JOINED - 1):
        return None
    pre = [0]
    for w in own:
        pre.append(pre[-1] + w)
    inf = float("inf")
    lo, cost = 0, [0.0]  # the states before piece j: d in [lo, lo + len(cost)), their best fits
    runs: list[tuple[int, list[int]]] = []  # per piece: its states' lo and each state's words
    for j in range(1, k + 1):
        centre = (2 * j * joins + k) // (2 * k)  # round(j * joins / k)
        new_lo = max(0, joins - (MAX_JOINED - 1) * (k - j), centre - JOIN_BAND)
        new_hi = min(joins, (MAX_JOINED - 1) * j, centre + JOIN_BAND)
        fit, run = [inf] * (new_hi - new_lo + 1), [0] * (new_hi - new_lo + 1)
        piece = size[j - 1]
        for d in range(new_lo, new_hi + 1):
            i = j + d  # words through piece j
            best, best_g = inf, 0
            for g in range(1, MAX_JOINED + 1):
                p = d - g + 1 - lo  # the state before: d - (g - 1), in the last piece's list
                if p < 0:
                    break
                if p >= len(cost) or cost[p] == inf:
                    continue
                c = cost[p] + abs(piece - (pre[i] - pre[i - g]))
                if c < best:
                    best, best_g = c, g
            fit[d - new_lo], run[d - new_lo] = best, best_g
        runs.append((new_lo, run))
        lo, cost = new_lo, fit
    if lo != joins or cost[0] == inf:
        return None
    groups, d = [0] * k, joins
    for j in range(k, 0, -1):
        run_lo, run = runs[j - 1]
        groups[j - 1] = run[d - run_lo]
        d -= groups[j - 1] - 1
    return groups


def word_first_tokens(
    words: list[str],
    model_text: Callable[[str], str],
    chunk_text: str,
    token_ends: Callable[[str], list[int]],
    span_tokens: int,
) -> list[int] | None:
    """Each word's first token in the chunk's text span: the token of `chunk_text` (what the model reads
    for the whole chunk, the span's text) that holds the word's first character. token_ends: the
    tokenizer's `token_ends` (each token's end, in characters of its text), so a token that carries the
    space before a word (" do" of BPE vocabularies) is that word's first token, and a byte tokenizer's
    space token is not.

    A frontend reads a chunk as a whole and may join words ("of the" -> "ʌvðə"); it never splits one.
    So the whitespace-separated pieces of `chunk_text` are matched to runs of consecutive words (at most
    `MAX_JOINED` a piece), the grouping whose pieces' lengths best fit their words' own lengths
    (`model_text` of each word alone, letters only; least total difference; `_group`), and words that
    share a piece split it by those lengths. None (the caller falls back to shares of the span) when
    `chunk_text` has more pieces than there are words, none, too few for the words, or is not
    `span_tokens` tokens long (then it is not the span's text)."""
    pieces = [(m.start(), m.end()) for m in re.finditer(r"\S+", chunk_text)]
    n, k = len(words), len(pieces)
    if not 0 < k <= n:
        return None
    # (running maximum: a tokenizer that trims a space token's offsets may end it before the last)
    ends = list(itertools.accumulate(token_ends(chunk_text), max))
    if len(ends) != span_tokens:
        return None
    own = [max(_letters(m), 1) for m in _model_words(words, model_text)]
    size = [max(_letters(chunk_text[a:b]), 1) for a, b in pieces]
    groups = _group(own, size)
    if groups is None:
        return None
    starts, w = [], 0
    for (a, b), g in zip(pieces, groups, strict=True):
        total, acc = sum(own[w : w + g]), 0
        for x in range(w, w + g):
            starts.append(a + round((b - a) * acc / total))
            acc += own[x]
        w += g
    # the token holding each word's first character: the first whose end lies past it
    return [bisect.bisect_right(ends, c) for c in starts]


class ChunkTimer:
    """Word timings of one text chunk as its audio arrives (see the module docstring).

    words: the chunk's words (its normalized text split at whitespace); weights: `word_weights`;
    span_tokens: the text span's tokens the aligner positions index (None: no measured timings);
    first_tokens: each word's first span token (`word_first_tokens`; None: by its share of the span,
    from `weights`); start_sample: the session clock where the chunk's audio begins; frame_length:
    samples per frame; sample_rate: Hz; chunk: the chunk's number; delay: samples by which the codec's
    audio lags the frames it was decoded from (`Codec.delay`).
    """

    def __init__(
        self,
        words: list[str],
        weights: list[int],
        span_tokens: int | None,
        start_sample: int,
        frame_length: int,
        sample_rate: int,
        chunk: int,
        first_tokens: list[int] | None = None,
        delay: int = 0,
    ):
        self.words, self.weights = words, weights
        self.start_sample, self.frame_length, self.rate, self.chunk = (
            start_sample,
            frame_length,
            sample_rate,
            chunk,
        )
        total = sum(weights) or 1
        cum = [0]
        for w in weights:
            cum.append(cum[-1] + w)
        self.cum, self.total = cum, total
        # the first span token of each word
        if first_tokens is not None and len(first_tokens) == len(words):
            self.first_token = list(first_tokens)
        else:
            self.first_token = [(span_tokens or 0) * c // total for c in cum[:-1]]
        self.span_tokens = span_tokens
        # A word found at frame f starts in the middle of that frame's sound: the aligner says the word
        # had begun by frame f and not by frame f - 1, so its onset lies somewhere in frame f (the middle
        # is the estimate that is off by half a frame at most), and that frame's sound reaches the
        # session clock `delay` samples after the frame's own place.
        self.offset = frame_length // 2 + delay
        self.starts: list[int] = [0] if words else []  # start of each word reached so far, chunk samples
        self.reach = -1  # the running maximum of the aligner's positions
        self.frames = 0  # frames heard so far
        self.samples = 0  # samples of the chunk sent so far
        self.sent = 0  # words handed out
        self.measured = False

    def _timing(self, k: int, start: float, end: float, estimated: bool) -> WordTiming:
        """Word k from `start` to `end` (samples into the chunk), held inside the audio sent."""
        end_cap = self.start_sample + self.samples
        a = min(self.start_sample + round(start), end_cap)
        b = min(max(self.start_sample + round(end), a), end_cap)
        return WordTiming(self.words[k], a / self.rate, b / self.rate, a, b, estimated, self.chunk)

    def audio(self, frames: int, samples: int, positions: list[int | None] | None) -> list[WordTiming]:
        """The chunk's next `frames` audio frames (`samples` samples) were sent, with the aligner's
        position of each (None: none). Returns the words that became final (the next word's start lies
        in the audio sent), in order."""
        if positions is not None and self.span_tokens:
            self.measured = True
            for i, p in enumerate(positions):
                if p is None:
                    continue
                self.reach = max(self.reach, p)
                while len(self.starts) < len(self.words) and self.reach >= self.first_token[len(self.starts)]:
                    self.starts.append((self.frames + i) * self.frame_length + self.offset)
        self.frames += frames
        self.samples += samples
        out = []
        if self.measured:
            while self.sent + 1 < len(self.starts) and self.starts[self.sent + 1] <= self.samples:
                k = self.sent
                out.append(self._timing(k, self.starts[k], self.starts[k + 1], False))
                self.sent += 1
        return out

    def finish(self) -> list[WordTiming]:
        """The chunk ended after the audio sent: the words not handed out yet."""
        out = []
        n = len(self.words)
        if not self.measured:
            self.starts = [0]  # every word by its share of the whole chunk
        last = len(self.starts) - 1  # the last word whose start was measured (or 0)
        if self.sent < n:
            for k in range(self.sent, last):  # measured, but the next word's start came at the very end
                out.append(self._timing(k, self.starts[k], self.starts[k + 1], False))
            # word `last` and those never reached share [its start, the end] by their weights
            a = min(self.starts[last], self.samples)
            span = self.samples - a
            w = self.cum[n] - self.cum[last]
            for k in range(last, n):
                s = a + span * (self.cum[k] - self.cum[last]) / (w or 1)
                e = a + span * (self.cum[k + 1] - self.cum[last]) / (w or 1)
                estimated = not self.measured or last < n - 1  # (word `last` then ends by its share)
                out.append(self._timing(k, s, e, estimated))
        self.sent = n
        return out
