"""Text tokenizers behind one small interface.

`TextTokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (a `tokenizer.json`): S2-Pro ships one, and
our own models ship a byte-level one built by `build_byte_tokenizer`. Special tokens written inline
(`<|im_start|>`, `<|speaker:0|>`, ...) encode as single tokens; text is encoded without adding any
special tokens (docs/fish_dual_ar.md §3.1). The semantic id range is read from the vocabulary's
`<|semantic:i|>` tokens and must be contiguous (docs/fish_dual_ar.md §2.1).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", END_TOKEN, "<|pad|>", "<|phoneme_start|>", "<|phoneme_end|>",
    "<|text|>", "<|voice|>", "<|interleave|>", "<|audio_start|>", "<|audio_end|>",
] + [f"<|speaker:{i}|>" for i in range(8)]  # fmt: skip
_SEMANTIC = re.compile(r"^<\|semantic:(\d+)\|>$")


class TokenizerError(ValueError):
    """A tokenizer file that lacks what a dual-AR model needs."""


@runtime_checkable
class TokenizerLike(Protocol):
    """What prompts, bundles and the engine need from a tokenizer: `encode` text without adding any
    special tokens (inline special tokens such as `<|im_start|>` encode as single ids), the contiguous
    `<|semantic:i|>` id range, the `<|im_end|>` id, and `special_tokens`: every id that `encode` makes of
    such an inline token (prompts use it to keep user text from producing them). `TextTokenizer` (Hugging
    Face tokenizer.json) and `tts.checkpoints.fish.tokenizer.TiktokenTokenizer` (fish-speech's tiktoken files)
    implement it. `token_ends`: for each token of `encode(text)`, the character offset in `text` where it
    ends; a token that ends inside a character (byte-level tokens may split one) ends after it, so the
    token holding a character's first byte is the first whose end passes that character's offset."""

    semantic_begin_id: int
    semantic_end_id: int
    eos_id: int
    special_tokens: dict[int, str]  # id -> text of every token `encode` recognizes inline

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_ends(self, text: str) -> list[int]: ...

    def token_id(self, token: str) -> int: ...


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        semantic = sorted((int(m.group(1)), i) for tok, i in vocab.items() if (m := _SEMANTIC.match(tok)))
        if not semantic:
            raise TokenizerError("tokenizer has no <|semantic:i|> tokens")
        codes, ids = zip(*semantic, strict=True)
        if list(codes) != list(range(len(codes))) or list(ids) != list(range(ids[0], ids[0] + len(ids))):
            raise TokenizerError("<|semantic:i|> tokens must have contiguous ids in code order")
        self.semantic_begin_id, self.semantic_end_id = ids[0], ids[-1]
        self.eos_id = self.token_id(END_TOKEN)
        # Added tokens, special or not (Qwen's `<think>` is not special), all match inline.
        self.special_tokens = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:
            if isinstance(exc, TokenizerError):
                raise
            raise TokenizerError(f"cannot read tokenizer {path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_ends(self, text: str) -> list[int]:
        """For each token of `encode(text)`, the character offset in `text` where it ends (the
        tokenizer's own offsets: every token of a character split into several ends after it)."""
        return [end for _, end in self.tokenizer.encode(text, add_special_tokens=False).offsets]

    def token_id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary")
        return i


def build_byte_tokenizer(num_semantic: int) -> TextTokenizer:
    """A byte-level tokenizer: 256 byte tokens (no merges), the special tokens above, then
    `<|semantic:0..num_semantic-1|>`. Any UTF-8 text encodes losslessly."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS + [f"<|semantic:{i}|>" for i in range(num_semantic)])
    return TextTokenizer(tok)
