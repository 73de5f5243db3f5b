"""Tokenizers of Fish checkpoints (docs/fish_dual_ar.md §3.1).

* S2-Pro ships a Hugging Face `tokenizer.json` (Qwen3 BPE plus added tokens):
  `tts.text.tokenizer.TextTokenizer` reads it, exactly as fish-speech's `AutoTokenizer` does for encoding
  purposes.
* OpenAudio S1 and fish-speech 1.5 ship `tokenizer.tiktoken` (base64 byte sequences with their BPE
  ranks) and, for S1, `special_tokens.json`; `TiktokenTokenizer` reads them with the `tiktoken` library
  and fish-speech's pre-tokenization regex. Special tokens take the ids right after the mergeable ranks,
  in list order (the S1 list or the 1.5 list below, or the key order of `special_tokens.json`).

Either way text is encoded with every special token recognized inline and nothing added around it.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from pathlib import Path

import tiktoken

from tts.text.tokenizer import END_TOKEN, TokenizerError

log = logging.getLogger(__name__)

# fish-speech's tiktoken pre-tokenization pattern (a GPT-4o variant that splits punctuation); it is part
# of the tokenizer's definition, so it must be exactly this string.
FISH_TIKTOKEN_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"\p{P}",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(\?!\S)",
        r"\s+",
    ]
)
MAX_ENCODE_CHARS = 400_000  # fish-speech encodes longer text in pieces of this many characters

# Special tokens in id order after the mergeable ranks (docs/fish_dual_ar.md §3.1).
S1_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", END_TOKEN, "<|phoneme_start|>",
    "<|phoneme_end|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|text|>", "<|voice|>", "<|interleave|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio|>",
] + [f"<|semantic:{i}|>" for i in range(4096)]  # fmt: skip
FISH15_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", END_TOKEN,
    "<|placeholder:0|>", "<|placeholder:1|>", "<|placeholder:2|>", "<|placeholder:3|>",
    "<|text|>", "<|voice|>", "<|interleave|>",
] + [f"<|semantic:{i}|>" for i in range(1024)]  # fmt: skip

_SEMANTIC = re.compile(r"^<\|semantic:(\d+)\|>$")


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a `tokenizer.tiktoken` file: one `base64 rank` pair per line; `=` stands for the empty
    token and is skipped, as fish-speech does. Raises TokenizerError for a malformed file."""
    ranks: dict[bytes, int] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}:{n}: expected 'base64 rank', got {line[:40]!r}")
        token, rank = parts
        if token == "=":
            continue
        try:
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise TokenizerError(f"{path}:{n}: {exc}") from exc
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens")
    return ranks


def write_tiktoken_ranks(path: str | Path, ranks: dict[bytes, int]) -> None:
    """Write ranks in the `tokenizer.tiktoken` format (empty token written as `=`)."""
    lines = [f"{base64.b64encode(tok).decode() or '='} {rank}" for tok, rank in ranks.items()]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


class TiktokenTokenizer:
    """fish-speech's tiktoken tokenizer (S1 and 1.5). Implements `tts.text.tokenizer.TokenizerLike`.

    ranks: mergeable byte sequences -> rank; special_tokens: names in id order, ids starting at
    `len(ranks)`. Raises TokenizerError when the `<|semantic:i|>` tokens are missing or not contiguous in
    code order, or `<|im_end|>` is missing.
    """

    def __init__(self, ranks: dict[bytes, int], special_tokens: list[str], name: str = "fish"):
        self.ranks = ranks
        begin = len(ranks)
        self.special_ids = {tok: begin + i for i, tok in enumerate(special_tokens)}
        if len(self.special_ids) != len(special_tokens):
            raise TokenizerError("special token list has duplicates")
        semantic = sorted(
            (int(m.group(1)), i) for tok, i in self.special_ids.items() if (m := _SEMANTIC.match(tok))
        )
        if not semantic:
            raise TokenizerError("tokenizer has no <|semantic:i|> tokens")
        codes, ids = zip(*semantic, strict=True)
        if list(codes) != list(range(len(codes))) or list(ids) != list(range(ids[0], ids[0] + len(ids))):
            raise TokenizerError("<|semantic:i|> tokens must have contiguous ids in code order")
        self.semantic_begin_id, self.semantic_end_id = ids[0], ids[-1]
        if END_TOKEN not in self.special_ids:
            raise TokenizerError(f"tokenizer has no {END_TOKEN} token")
        self.eos_id = self.special_ids[END_TOKEN]
        try:
            self._enc = tiktoken.Encoding(
                name=name,
                pat_str=FISH_TIKTOKEN_PATTERN,
                mergeable_ranks=ranks,
                special_tokens=self.special_ids,
            )
        except Exception as exc:  # tiktoken rejects inconsistent ranks
            raise TokenizerError(f"invalid tiktoken ranks: {exc}") from exc
        self.special_tokens = {i: tok for tok, i in self.special_ids.items()}  # id -> token, all inline

    @classmethod
    def from_dir(cls, directory: str | Path, default_special_tokens: list[str]) -> TiktokenTokenizer:
        """Read `tokenizer.tiktoken` and, if present, `special_tokens.json` from a checkpoint directory.

        As in fish-speech, `special_tokens.json` supplies the special tokens' *order* (its keys); ids are
        assigned by position after the mergeable ranks, and ids written in the file that disagree are
        ignored with a warning. Without it `default_special_tokens` is used (`S1_SPECIAL_TOKENS` or
        `FISH15_SPECIAL_TOKENS`). Raises TokenizerError for missing or malformed files.
        """
        directory = Path(directory)
        path = directory / "tokenizer.tiktoken"
        if not path.is_file():
            raise TokenizerError(f"{directory} has no tokenizer.tiktoken")
        ranks = read_tiktoken_ranks(path)
        special_tokens = list(default_special_tokens)
        special_path = directory / "special_tokens.json"
        if special_path.is_file():
            try:
                written = json.loads(special_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise TokenizerError(f"cannot read {special_path}: {exc}") from exc
            if not isinstance(written, dict):
                raise TokenizerError(f"{special_path} must map token names to ids")
            special_tokens = list(written)
            positional = {tok: len(ranks) + i for i, tok in enumerate(special_tokens)}
            wrong = [tok for tok, i in written.items() if i != positional[tok]]
            if wrong:
                log.warning(
                    "%s: %d special token ids disagree with their position (e.g. %s); using positions, "
                    "as fish-speech does",
                    special_path,
                    len(wrong),
                    wrong[0],
                )
        return cls(ranks, special_tokens, name=directory.name)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.tiktoken` and `special_tokens.json` (token -> id) into `directory`."""
        directory = Path(directory)
        write_tiktoken_ranks(directory / "tokenizer.tiktoken", self.ranks)
        (directory / "special_tokens.json").write_text(
            json.dumps(self.special_ids, indent=2), encoding="utf-8"
        )

    @property
    def vocab_size(self) -> int:
        """Mergeable ranks plus special tokens (the model's embedding may have more rows)."""
        return len(self.ranks) + len(self.special_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens recognized inline, nothing added."""
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            ids += self._enc.encode(
                text[start : start + MAX_ENCODE_CHARS], allowed_special="all", disallowed_special=()
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def token_ends(self, text: str) -> list[int]:
        """For each token of `encode(text)`, the character offset in `text` where it ends: the characters
        whose first byte lies in it or before it (a token of a character's later bytes only ends after
        that character too)."""
        ends, chars = [], 0
        for piece in self._enc.decode_tokens_bytes(self.encode(text)):
            chars += sum(1 for b in piece if not 0x80 <= b < 0xC0)  # (not a UTF-8 continuation byte)
            ends.append(chars)
        return ends

    def token_id(self, token: str) -> int:
        """The id of a special token, or of text that encodes to exactly one token."""
        if token in self.special_ids:
            return self.special_ids[token]
        ids = self._enc.encode(token, allowed_special=set(), disallowed_special=())
        if len(ids) != 1:
            raise TokenizerError(f"token {token!r} is not in the vocabulary")
        return ids[0]
