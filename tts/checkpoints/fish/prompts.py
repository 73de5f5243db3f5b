"""Prompt layouts of the Fish model families (docs/fish_dual_ar.md §3.2).

Every format returns the `[T, 1 + N]` frame matrix of `tts.text.prompt.PromptAssembler`: each text part is
tokenized on its own (BPE merges never cross a part boundary) and a reference's codes contribute one
column per frame. `|` below marks a part boundary and `[VQ]` a span of reference (or earlier) codes.

* S2-Pro (fish-speech main): `tts.text.prompt.S2PromptFormat`, re-exported here.
* OpenAudio S1 (fish-speech d3df505, `ContentSequence(modality="interleave")`), no chat framing:
  `<|interleave|>` then per reference `<|speaker:0|> | TEXT | [VQ] | <|im_end|>`, then
  `<|speaker:0|> | TARGET`. fish-speech generates S1 text in one piece; when this runtime splits long
  text, earlier chunks are added like references, after them.
* fish-speech 1.5 (v1.5.1, `Conversation`): a system message `Speak out the provided text.`, per
  reference a user message with its (cleaned) text and an assistant message `<|voice|> | [VQ]`, then the
  target user message and `<|im_start|>assistant\\n | <|voice|>`. Messages are framed by a part
  `<|im_start|>ROLE\\n` and a part `<|im_end|>` (no newline in 1.5). Earlier chunks become user /
  assistant pairs after the references, as fish-speech 1.5 keeps earlier segments.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from tts.text.policy import clean_text_15
from tts.text.prompt import PromptAssembler, S2PromptFormat, Turn, VoiceReference
from tts.text.tokenizer import TokenizerLike

__all__ = ["S2PromptFormat", "S1PromptFormat", "Fish15PromptFormat", "clean_text_15"]


class S1PromptFormat:
    """OpenAudio S1's interleaved prompt (see the module docstring)."""

    name = "s1-interleave"
    user_tags = None  # no speaker turns: the format puts `<|speaker:0|>` before every text itself
    text_policy = "fish-s1"

    def __init__(self, tokenizer: TokenizerLike, num_codebooks: int):
        self.tokenizer = tokenizer
        self.num_codebooks = num_codebooks

    def model_text(self, text: str) -> str:
        """S1 reads the text as it is."""
        return text

    def build(
        self, text: str, references: Sequence[VoiceReference] = (), history: Sequence[Turn] = ()
    ) -> Tensor:
        p = PromptAssembler(self.tokenizer, self.num_codebooks)
        p.text("<|interleave|>")
        items: list[VoiceReference | Turn] = [*references, *history]
        for item in items:
            p.text("<|speaker:0|>").user_text(item.text, None).codes(item.codes).text("<|im_end|>")
        p.text("<|speaker:0|>").user_text(text, None)
        return p.build()


class Fish15PromptFormat:
    """fish-speech 1.5's conversation prompt (see the module docstring)."""

    name = "fish-1.5"
    user_tags = None
    text_policy = "fish-1.5"
    SYSTEM = "Speak out the provided text."

    def __init__(self, tokenizer: TokenizerLike, num_codebooks: int):
        self.tokenizer = tokenizer
        self.num_codebooks = num_codebooks

    def model_text(self, text: str) -> str:
        """fish-speech 1.5 reads its `clean_text` of the text."""
        return clean_text_15(text)

    def build(
        self, text: str, references: Sequence[VoiceReference] = (), history: Sequence[Turn] = ()
    ) -> Tensor:
        p = PromptAssembler(self.tokenizer, self.num_codebooks)
        p.text("<|im_start|>system\n").text(self.SYSTEM).text("<|im_end|>")
        items: list[VoiceReference | Turn] = [*references, *history]
        for item in items:
            p.text("<|im_start|>user\n").user_text(clean_text_15(item.text), None).text("<|im_end|>")
            p.text("<|im_start|>assistant\n").text("<|voice|>").codes(item.codes).text("<|im_end|>")
        p.text("<|im_start|>user\n").user_text(clean_text_15(text), None).text("<|im_end|>")
        p.text("<|im_start|>assistant\n").text("<|voice|>")
        return p.build()
