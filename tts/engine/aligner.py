"""The text aligner and the loop guard: where in its text a request's speech is, frame by frame, and a
rewind when the speech goes back over text it has already said.

Some attention heads of a text-to-speech decoder read their text in order: at each frame most of their
attention sits on the text token being spoken, and it moves forward through the text as the frames go
(the alignment that Tacotron-style models learn explicitly). In the default model two heads of its last
slow layer do this (layer 3, heads 0 and 2: about 0.9 of their attention on the chunk's text, its
median moving forward through it; found by `training/aligner_probe.py`, training/RESULTS.md "The loop
guard"). A model names such heads in its config (`tts_runtime.aligner`); others have none,
and nothing here runs for them.

* `text_alignment` runs inside the frame step (graph-capturable: fixed shapes, no host reads). For each
  row it takes the aligner heads' queries against the keys of the row's own text span in the paged KV
  cache, softmaxes over that span, averages the heads and returns the median token of the distribution:
  the row's position in its text. (The median, not the mean: a little attention far ahead or behind
  moves the mean by tens of tokens and the median not at all.)
* `LoopGuard` runs on the host, one per request, fed that position every frame. A repeat ("where he
  where he was") shows as the position falling back by several tokens from where it had stayed, then
  climbing through the same tokens again. The guard then names the frames that say them again; the
  engine (`Engine._guard`) takes them back and samples again from a little before them, hotter for a
  few frames, or, when the fall came after the text's last token (the model read on instead of
  stopping), ends the request there. The repeated audio is never heard: with each frame the engine
  says how many of the newest frames it may still take back (`LoopGuard.retractable`: 3, more while a
  suspected repeat is under way, never more than `RETRACT_MAX_FRAMES`), and the job pipeline keeps
  those from the codec (`tts.runtime.jobs`).

Glances are not loops: the position may jump ahead for a frame or two (at a comma, say) and come back;
the guard only trusts positions reached by small steps and held for `HOLD_FRAMES` frames, and a glance
ahead during a suspected repeat neither ends it nor counts as reading on. The end of a chunk is not a
loop either: after the last word the heads drift back and jump to the end again in one frame; the guard
wants a gradual climb, small steps forward over `CLIMB_FRAMES` frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tts.model.kv_cache import paged_slots

# Tokens of a text span the step reads at most (a longer span gets no alignment: no guard). The default
# model's 200-byte chunks are 200-300 tokens of phonemes.
ALIGN_MAX_TOKENS = 512

# The loop guard's thresholds, chosen on 111 unguarded readings of the held-out passages (seeds 2-38;
# training/RESULTS.md):
FALL_TOKENS = 6  # a fall of at least this many tokens below the trusted position starts a suspected repeat
HOLD_FRAMES = 3  # a position is trusted once held (as the minimum) over this many frames (push: 3) ...
TRUST_STEP = 8  # ... each reached by a step forward of at most this many tokens (else: a glance ahead)
CLIMB_FRAMES = 3  # a repeat: after the fall, this many frames in a row step forward by 0 to ...
CLIMB_STEP = 4  # ... this many tokens (reading again; the drift after a chunk's end jumps instead) ...
CLIMB_TOKENS = 3  # ... and climb at least this many tokens above the lowest position since the fall
BACK_FRAMES = 4  # a suspected repeat ends if the position is back at the trusted one for this many frames
# (glances ahead lasted up to 3)
# The most frames a rewind takes back (replayed over the 111 readings, the guard would take back 7-14
# frames, a median of 7); the job pipeline holds back at most this many.
RETRACT_MAX_FRAMES = 16
# A rewind goes this many frames further back than the repeat's first frame: that frame's position is
# already decided by the frames before it (the step attends from the previous frame), so sampling again
# from there would fall back the same way.
REWIND_EXTRA_FRAMES = 3
START_FRAME = 2  # no position is trusted before this frame (the heads settle on the text)
# A repeat is after the text's end, and an end token is not early, when a trusted position had reached
# one of the text's last END_TOKENS tokens. The default voice's tokens are the bytes of its IPA, and its
# heads hold on a final two-byte phoneme and pass what follows within a frame ("things." is ŋ, two bytes,
# then z and "."), so the furthest trusted position of a complete reading is often the third token from
# the end. A whole final word is at least four tokens with its punctuation ("it." is ɪ, two bytes, t and
# "."), so three still refuses an end that leaves a word unsaid. Trusted, not any: a glance to the end
# followed by a repeat mid-text would otherwise end the request with its last words unsaid.
END_TOKENS = 3
assert HOLD_FRAMES == 3  # (LoopGuard.push compares the last three steps directly)
# The end token sampled while the furthest trusted position is short of the text's end (its last
# END_TOKENS tokens) is refused: the frame is taken back and that step sampled again without it, at most
# this many times per request; past that the request ends there, with finish reason "short".
MAX_END_REFUSALS = 24
# ... and no more once this many refusals in a row found the trusted position no further than at the
# refusal before (the speech is not going on through the text: what follows would be babble).
MAX_STALLED_REFUSALS = 2
MAX_REWINDS = 4  # rewinds per request; a repeat after that stays, and the request ends with reason "loop"
# After a rewind the row samples this many frames at a higher temperature and top-p (at least its own):
# at the default model's temperature 0.1 the same state would draw the same repeat again.
RETRY_FRAMES = 8
RETRY_TEMPERATURE = 0.7
RETRY_TOP_P = 0.9


@dataclass(frozen=True)
class Repeat:
    """A repeat found by `LoopGuard.push`: frames `first` .. the newest say text again; `at_end`: it
    began after a trusted position had reached the text's end (its last END_TOKENS tokens: the model
    read on instead of stopping)."""

    first: int
    at_end: bool


def text_alignment(
    q: Tensor,
    k_cache: Tensor,
    block_tables: Tensor,
    start: Tensor,
    length: Tensor,
    heads: Tensor,
    kv_heads: Tensor,
    scale: float,
    tokens: int = ALIGN_MAX_TOKENS,
) -> Tensor:
    """Each row's position in its text span: `[b]` int64, the median token (0 .. length - 1) of the
    aligner heads' attention over the span, -1 for rows with no span (`length` 0).

    q `[b, H, D]`: this step's (rotated) queries of the aligner's layer; k_cache `[blocks, block_size,
    Hkv, D]`: that layer's paged keys; block_tables `[b, W]` int32; start, length `[b]` int64: each row's
    span, positions `start .. start + length - 1` of its context (all written by its prefill); heads
    `[h]` int64: the aligner's query heads, kv_heads `[h]`: their KV heads (grouped-query attention);
    tokens: span positions read (at least the longest length; the rest are masked). Attention
    renormalized over the span only: the positions outside it are not text."""
    b, block_size = q.shape[0], k_cache.shape[1]
    t = torch.arange(tokens, device=q.device)
    last = (length - 1).clamp(min=0).unsqueeze(1)
    pos = start.unsqueeze(1) + torch.minimum(t.unsqueeze(0), last)  # [b, T], inside the span
    slots = paged_slots(block_tables, pos, block_size).view(-1)
    k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots)  # [b * T, Hkv, D]
    k = k.view(b, tokens, *k_cache.shape[2:]).index_select(2, kv_heads).float()  # [b, T, h, D]
    scores = torch.einsum("bhd,bthd->bht", q.index_select(1, heads).float(), k) * scale
    scores = scores.masked_fill((t.unsqueeze(0) >= length.unsqueeze(1)).unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).mean(dim=1)  # [b, T]; NaN rows (no span) are replaced below
    return torch.where(length > 0, median_token(probs), -1)


def median_token(probs: Tensor) -> Tensor:
    """The median token of attention distributions `probs [..., T]` (each summing to 1): the first
    token whose cumulative attention reaches 0.5, `[...]` int64."""
    return (probs.cumsum(dim=-1) < 0.5).sum(dim=-1)


class LoopGuard:
    """One request's loop detector over its per-frame text positions (see the module docstring).

    `push(position)` takes frame i's position (frames counted from 0, as generated and kept) and returns
    None, or the `Repeat` seen at this frame: frames `first .. i` go over text already said. `rewind(first)`
    forgets frames `first` onwards (the engine took them back). `repeats` counts the repeats found.
    text_tokens: the length of the text span (its last token is `text_tokens - 1`); tokens: its token ids,
    when known: a climb over tokens that the text also has where the speech is (the text repeats
    itself: "three, five, three") is the heads taking one for the other, not a repeat."""

    def __init__(self, text_tokens: int, tokens: list[int] | None = None) -> None:
        self.text_tokens = text_tokens
        self.tokens = tokens
        self.positions: list[int] = []
        self.trusted: list[int] = []  # the trusted position after each frame (-1: none yet)
        self.fall: int | None = None  # the frame where a suspected repeat began
        self.last = 0  # since the fall: the newest position that was not a glance ahead
        self.bottom = 0  # ... the lowest position
        self.climb = 0  # ... frames in a row stepping forward a little
        self.back = 0  # ... frames in a row at or past the trusted position again
        self.repeats = 0

    def push(self, position: int) -> Repeat | None:
        p, i = self.positions, len(self.positions)
        p.append(position)
        trusted = self.trusted[-1] if self.trusted else -1
        self.trusted.append(trusted)
        if self.fall is None:
            # a new trusted position: held over HOLD_FRAMES frames, each reached by a small step (this
            # runs for every frame of every guarded row: plain comparisons, HOLD_FRAMES = 3)
            if i >= max(START_FRAME, HOLD_FRAMES):
                a, b, c = p[i - 3], p[i - 2], p[i - 1]
                if b - a <= TRUST_STEP and c - b <= TRUST_STEP and position - c <= TRUST_STEP:
                    self.trusted[-1] = trusted = max(trusted, min(b, c, position))
            if trusted >= 0 and position <= trusted - FALL_TOKENS:
                self.fall, self.last, self.bottom, self.climb, self.back = i, position, position, 0, 0
            return None
        if i - self.fall >= RETRACT_MAX_FRAMES - REWIND_EXTRA_FRAMES - 1:
            # too long ago to take back: start over from here (trust a position held from now on)
            self.fall, self.trusted[-1] = None, -1
            return None
        if position >= trusted:  # back where it was, if it stays (a glance ahead does not)
            self.back += 1
            if self.back >= BACK_FRAMES:
                self.fall = None
            return None
        self.back = 0
        step = position - self.last
        if step > TRUST_STEP:
            return None  # a glance ahead: not part of the climb
        self.last = position
        if position < self.bottom:
            self.bottom, self.climb = position, 0
        elif 0 <= step <= CLIMB_STEP:
            self.climb += 1
            if self.climb >= CLIMB_FRAMES and position - self.bottom >= CLIMB_TOKENS:
                first, self.fall = self.fall, None
                if self._in_text_ahead(self.bottom, position, trusted):
                    return None
                self.repeats += 1
                return Repeat(first, max(self.trusted[:first]) >= self.text_tokens - END_TOKENS)
        else:
            self.climb = 0
        return None

    def _in_text_ahead(self, bottom: int, top: int, trusted: int) -> bool:
        """Whether the tokens `bottom .. top` climbed over after a fall (their first CLIMB_TOKENS + 1) are
        also in the text where the speech is (from a little before the trusted position to as far past it as
        the climb is long, and a trusted step more): then the text itself repeats them, and the heads looked
        at the earlier copy."""
        if self.tokens is None:
            return False
        # (the climb's first tokens: the heads' median may run a token or two past the copy's end)
        climbed = self.tokens[bottom : min(top + 1, bottom + CLIMB_TOKENS + 1)]
        n = len(climbed)
        lo, hi = max(top + 1, trusted - n), min(len(self.tokens), trusted + 2 * n + TRUST_STEP)
        return any(self.tokens[i : i + n] == climbed for i in range(lo, hi - n + 1))

    def reached(self) -> int:
        """The furthest trusted position of the frames kept (-1: none yet)."""
        return max(self.trusted, default=-1)

    def said_all(self) -> bool:
        """Whether a trusted position reached the text's end (one of its last END_TOKENS tokens): the
        end token before that leaves words unsaid."""
        return self.reached() >= self.text_tokens - END_TOKENS

    def retractable(self) -> int:
        """How many of the newest frames (the last one pushed included) a later repeat could take back:
        the REWIND_EXTRA_FRAMES before a fall that may start at the next frame, or, while a suspected
        repeat is under way, every frame since REWIND_EXTRA_FRAMES before its fall. Never more than
        RETRACT_MAX_FRAMES (a suspected repeat is dropped sooner)."""
        if self.fall is None:
            return REWIND_EXTRA_FRAMES
        return len(self.positions) - self.fall + REWIND_EXTRA_FRAMES

    def rewind(self, first: int) -> None:
        """Forget frames `first` onwards."""
        del self.positions[first:], self.trusted[first:]
        self.fall = None
