"""Text: normalization, per-model text policies, Markdown/SSML, phonemes, tokenizers and prompt building."""
