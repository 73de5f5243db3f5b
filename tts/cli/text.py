"""`tts text`: what a model will read, without generating anything.

    tts text "I paid $5.3 billion on 3/4." --model default
    tts text --text-file article.md --model /models/s2-pro --json

Prints the text of each generation chunk as the model's text policy prepares and splits it
(`tts.text.policy`), its UTF-8 byte length and token count (of what the model reads: the default model's
phonemes, fish-speech 1.5's cleaned text), the phonemes where the model reads phonemes, and every warning
(text left out, markup ignored). Only the tokenizer and config are read: no weights, no codec, no engine.
"""

from __future__ import annotations

import argparse
import json
import sys

from tts.cli.main import add_normalize_arg, read_text_arg, require


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "text",
        help="show what a model will read: normalized chunks, bytes, tokens, warnings",
        description="Plan TEXT as a synthesis would (the model's text policy, then splitting at sentence "
        "ends) and print each chunk the model will read, its UTF-8 bytes and tokens, and any warning. "
        "Loads only the model's tokenizer and config; nothing is generated.",
    )
    p.add_argument(
        "text",
        nargs="?",
        help="text to plan; - (or no TEXT with text piped in) reads stdin; or use --text-file",
    )
    p.add_argument("--text-file", help="read the text from this UTF-8 file (- = stdin)")
    p.add_argument("--model", default="default", help="'default', 'tiny' or a checkpoint directory")
    p.add_argument(
        "--chunk-length",
        type=int,
        default=None,
        help="UTF-8 bytes per chunk (default: the model's; 0 = one chunk)",
    )
    add_normalize_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_text)


def describe_text(model, text: str, normalize: bool = True, chunk_length: int | None = None) -> dict:
    """The plan of `text` for `model` (a `tts.checkpoints.bundle.TextModel`) as a JSON-ready dict: model, text
    policy, chunk length, chunks (text, bytes, tokens of what the model reads, prompt tokens without a voice,
    phonemes for a phoneme model) and warnings. Raises TextError / InvalidRequest as a synthesis would."""
    from tts.text.phonemes import identity
    from tts.text.policy import get_text_policy, plan_text

    fmt = model.prompt_format
    policy = get_text_policy(fmt.text_policy)
    limit = model.chunk_length if chunk_length is None else chunk_length
    plan = plan_text(text, policy, fmt.user_tags, limit, normalize)
    phonemes = getattr(fmt, "frontend", identity) is not identity
    chunks = []
    for chunk in plan.chunks:
        read = fmt.model_text(chunk)
        entry = {
            "text": chunk,
            "bytes": len(chunk.encode("utf-8")),
            "tokens": len(model.tokenizer.encode(read)),
            "prompt_tokens": int(fmt.build(chunk).shape[0]),
        }
        if phonemes:
            entry["phonemes"] = read
        chunks.append(entry)
    return {
        "model": model.name,
        "family": model.family,
        "text_policy": policy.name,
        "normalize": normalize,
        "chunk_length": limit,
        "chunks": chunks,
        "warnings": plan.warnings,
    }


def cmd_text(args: argparse.Namespace) -> int:
    from tts.checkpoints.load import load_text_model
    from tts.text.policy import check_speakable, get_text_policy

    text = read_text_arg(args)
    check_speakable(text)
    require(args.chunk_length is None or args.chunk_length >= 0, "--chunk-length must be >= 0")
    model = load_text_model(args.model)
    result = describe_text(model, text, args.normalize, args.chunk_length)
    if args.json:
        print(json.dumps(result, ensure_ascii=False, indent=2))
    else:
        policy = get_text_policy(result["text_policy"])
        n = len(result["chunks"])
        limit = result["chunk_length"]
        print(
            f"model {model.name}, text policy {policy.name} ({policy.summary}"
            f"{'' if args.normalize else '; normalize off: the text as given'}): "
            f"{n} chunk{'s' if n != 1 else ''}" + (f" of at most {limit} bytes" if limit > 0 else "")
        )
        for i, c in enumerate(result["chunks"], 1):
            print(
                f"[{i}/{n}] {c['bytes']} bytes, {c['tokens']} tokens ({c['prompt_tokens']} with the prompt)"
            )
            print(f"  text: {c['text']}")
            if "phonemes" in c:
                print(f"  phonemes: {c['phonemes']}")
        for warning in result["warnings"]:
            print(f"warning: {warning}", file=sys.stderr)
    return 0
