"""Prompt building: text parts and reference codes -> the `[T, 1 + N]` frame matrix
(docs/fish_dual_ar.md §3.2).

A prompt is a list of parts. Each text part is tokenized on its own, so BPE merges never cross a part
boundary; a VQ part contributes one column per frame (`row0 = semantic_begin + c_0`, rows 1..N the codes,
docs/fish_dual_ar.md §1.1). `S2PromptFormat` follows fish-speech main for S2-Pro; our own models use it too.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from tts.text.normalize import SPEAKER_TAG, reserved_tag_error
from tts.text.phonemes import Frontend, apply_frontend, identity
from tts.text.tokenizer import TokenizerLike


@dataclass
class VoiceReference:
    """Reference audio as codes `[N, T]` int64, with its transcript."""

    codes: Tensor
    text: str


@dataclass
class Turn:
    """An earlier chunk of the same request: its text and the codes generated for it `[N, T]`."""

    text: str
    codes: Tensor


class PromptFormat(Protocol):
    """A model family's prompt layout: `build` returns the `[T, 1 + N]` int64 frame matrix for a target
    text, its voice references and the earlier chunks of the same request; `name` identifies it;
    `user_tags` matches the `<|...|>` tags the format documents for user text (None: no tag), and `build`
    raises InvalidRequest when user text would tokenize to any other special token. `text_policy` names
    what the planner does to user text for this model (`tts.text.policy`); `model_text(text)` is what the
    model reads for a planned chunk (its phonemes, or the reference code's cleaning of it)."""

    name: str
    user_tags: re.Pattern | None
    text_policy: str

    def model_text(self, text: str) -> str: ...

    def build(
        self, text: str, references: Sequence[VoiceReference] = (), history: Sequence[Turn] = ()
    ) -> Tensor: ...


# Token ids of short text parts, per tokenizer: above all the formats' own strings (`<|im_start|>user\n`,
# ...), of which every prompt (one per text chunk, built on the engine thread) tokenizes about ten. Short
# reference transcripts pass through `text` too; the first _CACHED_TEXTS short strings stay (a bound).
_TEXT_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHED_TEXT_CHARS = 64
_CACHED_TEXTS = 1024


def _text_ids(tokenizer: TokenizerLike, s: str) -> Sequence[int]:
    """`tokenizer.encode(s)`, remembered for short `s`."""
    if len(s) > _CACHED_TEXT_CHARS:
        return tokenizer.encode(s)
    try:
        cache = _TEXT_IDS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: not remembered
        return tokenizer.encode(s)
    ids = cache.get(s)
    if ids is None:
        ids = tuple(tokenizer.encode(s))
        if len(cache) < _CACHED_TEXTS:
            cache[s] = ids
    return ids


class PromptAssembler:
    """Concatenates text and VQ parts into frame columns."""

    def __init__(self, tokenizer: TokenizerLike, num_codebooks: int):
        self.tokenizer = tokenizer
        self.num_codebooks = num_codebooks
        self.columns: list[Tensor] = []
        self._text: list[int] = []  # ids of the text parts since the last column

    def text(self, s: str) -> PromptAssembler:
        """A text part of the format's own (its special tokens are meant)."""
        return self._ids(_text_ids(self.tokenizer, s))

    def user_text(self, s: str, allowed: re.Pattern | None) -> PromptAssembler:
        """A text part that came from a user. Raises InvalidRequest if it tokenizes to a special token
        (`<|im_end|>`, `<|semantic:N|>`, ...) that `allowed` does not match (None: any special token)."""
        return self._ids(self.check_user_text(s, allowed))

    def check_user_text(self, s: str, allowed: re.Pattern | None) -> list[int]:
        """The ids of user text `s`; raises InvalidRequest as `user_text` does."""
        ids = self.tokenizer.encode(s)
        special = self.tokenizer.special_tokens
        for i in ids:
            token = special.get(i)
            if token is not None and (allowed is None or not allowed.fullmatch(token)):
                raise reserved_tag_error(token, allowed)
        return ids

    @property
    def length(self) -> int:
        """Prompt positions so far (text and code columns)."""
        return sum(c.shape[0] for c in self.columns) + len(self._text)

    def _ids(self, ids: Sequence[int]) -> PromptAssembler:
        self._text.extend(ids)  # one column for consecutive text parts
        return self

    def _end_text(self) -> None:
        if self._text:
            col = torch.zeros(len(self._text), 1 + self.num_codebooks, dtype=torch.int64)
            col[:, 0] = torch.tensor(self._text)
            self.columns.append(col)
            self._text = []

    def codes(self, codes: Tensor) -> PromptAssembler:
        self._end_text()
        codes = torch.as_tensor(codes, dtype=torch.int64)
        if codes.dim() != 2 or codes.shape[0] != self.num_codebooks:
            raise ValueError(f"reference codes must be [{self.num_codebooks}, T], got {tuple(codes.shape)}")
        col = torch.empty(codes.shape[1], 1 + self.num_codebooks, dtype=torch.int64)
        col[:, 0] = codes[0] + self.tokenizer.semantic_begin_id
        col[:, 1:] = codes.T
        self.columns.append(col)
        return self

    def build(self) -> Tensor:
        self._end_text()
        return torch.cat(self.columns, dim=0)


class S2PromptFormat:
    """fish-speech main's S2-Pro prompt (docs/fish_dual_ar.md §3.2): system message (with references if any),
    then one user / assistant exchange per earlier chunk, then the target text and `assistant\\n<|voice|>`."""

    name = "s2"
    # speaker turns, `<|speaker:0|>Hi. <|speaker:1|>Hello.` (docs/fish_dual_ar.md §3.2)
    user_tags: re.Pattern | None = SPEAKER_TAG
    SYSTEM = "convert the provided text to speech"
    SYSTEM_WITH_REFERENCE = "convert the provided text to speech reference to the following:\n\nText:\n"

    def __init__(
        self,
        tokenizer: TokenizerLike,
        num_codebooks: int,
        frontend: Frontend = identity,
        text_policy: str = "fish-s2",
    ):
        """`frontend` maps every text the prompt carries (target, reference transcripts, earlier turns)
        to what the model reads, e.g. phonemes for the default model (`tts.text.phonemes`); special tokens
        such as `<|speaker:1|>` pass through untouched. `text_policy`: S2-Pro's own ("fish-s2") unless
        the model says otherwise (our English models: "english")."""
        self.tokenizer = tokenizer
        self.num_codebooks = num_codebooks
        self.frontend = frontend
        self.text_policy = text_policy

    def model_text(self, text: str) -> str:
        """What the model reads for `text`: its frontend's output (phonemes), else the text."""
        return apply_frontend(self.frontend, text)

    def build(
        self, text: str, references: Sequence[VoiceReference] = (), history: Sequence[Turn] = ()
    ) -> Tensor:
        return self.build_with_span(text, references, history)[0]

    def build_with_span(
        self, text: str, references: Sequence[VoiceReference] = (), history: Sequence[Turn] = ()
    ) -> tuple[Tensor, tuple[int, int]]:
        """`build`'s prompt and the positions `[start, end)` of the target text's tokens in it (what
        the loop guard follows, `tts.engine.aligner`)."""
        p = PromptAssembler(self.tokenizer, self.num_codebooks)
        f = self.frontend
        if f is not identity:
            text = apply_frontend(f, text)
            references = [VoiceReference(r.codes, apply_frontend(f, r.text)) for r in references]
            history = [Turn(apply_frontend(f, t.text), t.codes) for t in history]
        p.text("<|im_start|>system\n")
        if references:
            p.text(self.SYSTEM_WITH_REFERENCE)
            for r in references:
                p.check_user_text(r.text, self.user_tags)
            p.text("\n".join(_with_speaker(r.text, i) for i, r in enumerate(references)))
            p.text("\n\nSpeech:\n")
            p.codes(torch.cat([torch.as_tensor(r.codes) for r in references], dim=1))
        else:
            p.text(self.SYSTEM)
        p.text("<|im_end|>\n")
        for turn in history:
            p.text("<|im_start|>user\n").user_text(turn.text, self.user_tags).text("<|im_end|>\n")
            p.text("<|im_start|>assistant\n<|voice|>").codes(turn.codes).text("<|im_end|>\n")
        p.text("<|im_start|>user\n")
        start = p.length
        p.user_text(text, self.user_tags)
        span = (start, p.length)
        p.text("<|im_end|>\n<|im_start|>assistant\n<|voice|>")
        return p.build(), span


def _with_speaker(text: str, i: int) -> str:
    """fish-speech main tags the i-th reference text `<|speaker:i|>` unless it has a tag anywhere."""
    return text if SPEAKER_TAG.search(text) else f"<|speaker:{i}|>{text}"
