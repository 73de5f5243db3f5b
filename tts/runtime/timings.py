"""Word timings of a spoken text chunk, on its session's clock.

Two ways, one contract (`WordTiming`: words in text order, start <= end, starts and ends never going
back, all inside the audio sent):

* **measured**, for a model whose bundle names aligner heads and whose engine runs the loop guard
  (`tts.engine.aligner`): every frame comes with the aligner's text position, a token index into the
  chunk's text span. A word owns a share of the span's tokens (its share of the chunk's model text:
  phonemes for the default model, characters for Fish models); it starts at the first frame whose
  position (the running maximum: the aligner may glance back) reaches its first token, and ends where the
  next word starts (the last word: at the chunk's end). A word is final, and sent, as soon as the next
  word's start frame has been heard. Words the aligner never reached (a chunk cut by its budget, say)
  share the rest of the chunk by their model text and are marked `estimated`;
* **estimated**, without aligner positions: at the chunk's end, whose audio length is then exact, each
  word gets its share of the chunk's audio in proportion to its share of the chunk's model text.
"""

from __future__ import annotations

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


def word_weights(words: list[str], model_text: Callable[[str], str]) -> list[int]:
    """Each word's weight: the length of what the model reads for it (phonemes or characters), >= 1.
    A frontend that fails falls back to the word's characters."""
    weights = []
    for word in words:
        try:
            n = len(model_text(word).strip())
        except Exception:  # noqa: BLE001 - a frontend that cannot run: characters
            n = len(word)
        weights.append(max(n, 1))
    return weights


class ChunkTimer:
    """Word timings of one text chunk as its audio arrives (see the module docstring).

    words: the chunk's words (its normalized text split at whitespace); weights: `word_weights`;
    span_tokens: the text span's tokens the aligner positions index (None: no measured timings);
    start_sample: the session clock where the chunk's audio begins; frame_length: samples per frame;
    sample_rate: Hz; chunk: the chunk's number.
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
        self.first_token = [(span_tokens or 0) * c // total for c in cum[:-1]]
        self.span_tokens = span_tokens
        self.starts: list[int] = [0] if words else []  # start frame of each word reached so far
        self.reach = -1  # the running maximum of the aligner's positions
        self.frames = 0  # frames heard so far
        self.samples = 0  # samples of the chunk sent so far
        self.sent = 0  # words handed out
        self.measured = False

    def _timing(self, k: int, start_frame: float, end_frame: float, estimated: bool) -> WordTiming:
        end_cap = self.start_sample + self.samples
        a = min(self.start_sample + round(start_frame * self.frame_length), end_cap)
        b = min(max(self.start_sample + round(end_frame * self.frame_length), a), end_cap)
        return WordTiming(self.words[k], a / self.rate, b / self.rate, a, b, estimated, self.chunk)

    def audio(self, frames: int, samples: int, positions: list[int | None] | None) -> list[WordTiming]:
        """The chunk's next `frames` audio frames (`samples` samples) were sent, with the aligner's
        position of each (None: none). Returns the words that became final, in order."""
        if positions is not None and self.span_tokens:
            self.measured = True
            for i, p in enumerate(positions):
                if p is None:
                    continue
                self.reach = max(self.reach, p)
                while len(self.starts) < len(self.words) and self.reach >= self.first_token[len(self.starts)]:
                    self.starts.append(self.frames + i)
        self.frames += frames
        self.samples += samples
        out = []
        if self.measured:
            while self.sent + 1 < len(self.starts):
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
        if self.sent <= last and last < n:
            # word `last` and those never reached share [its start, the end] by their weights
            a = self.starts[last]
            span = self.frames - a
            w = self.cum[n] - self.cum[last]
            for k in range(max(self.sent, last), n):
                s = a + span * (self.cum[k] - self.cum[last]) / (w or 1)
                e = a + span * (self.cum[k + 1] - self.cum[last]) / (w or 1)
                estimated = not self.measured or last < n - 1  # (word `last` then ends by its share)
                out.append(self._timing(k, s, e, estimated))
        self.sent = n
        return out
