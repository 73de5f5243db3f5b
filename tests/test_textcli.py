"""`tts text`: what a model will read, per chunk, without generating."""

import json

import pytest

from tts.cli.main import main
from tts.text.tokenizer import TextTokenizer

ZH = "1951年，我们的村子只有一条泥路。每到下雨天，孩子们就只能光着脚去上学。"


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["text", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_default_model_shows_normalized_chunks_tokens_and_phonemes(capsys):
    rc, out, err = run(capsys, "# Report\n\nI paid $5.3 billion at 3:30 p.m.", "--model", "default")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("model default, text policy english (") and lines[0].endswith(
        "1 chunk of at most 200 bytes"
    )
    text = "Report. I paid five point three billion dollars at three thirty p m."
    assert lines[2] == f"  text: {text}"
    assert lines[1].startswith(f"[1/1] {len(text)} bytes, ") and " tokens (" in lines[1]
    assert lines[3].startswith("  phonemes: ɹᵻpˈɔːɹt. aɪ pˈeɪd fˈaɪv")


def test_json_output_and_the_warning_for_text_the_model_cannot_speak(capsys):
    rc, out, err = run(capsys, "Hello 你好 world. " * 20, "--model", "tiny", "--json", "--chunk-length", "60")
    assert rc == 0 and err == ""
    result = json.loads(out)
    assert result["model"] == "tiny" and result["text_policy"] == "english" and result["chunk_length"] == 60
    assert [c["text"] for c in result["chunks"]][:2] == [
        "Hello world. Hello world. Hello world. Hello world.",
        "Hello world. Hello world. Hello world. Hello world.",
    ]
    assert all(c["bytes"] <= 60 and c["tokens"] == c["bytes"] for c in result["chunks"])  # bytes tokenizer
    assert result["warnings"] == [
        "this model reads English only: 40 characters of Han text were left out "
        "(a multilingual model such as Fish Audio S2-Pro reads them)"
    ]
    rc, out, err = run(capsys, "Hello 你好 world.", "--model", "tiny")
    assert rc == 0 and err.startswith("warning: this model reads English only: 2 characters of Han")


@pytest.mark.parametrize("family", ["s2", "s1", "fish-1.5"])
def test_fish_models_keep_chinese_and_digits(capsys, fish_checkpoints, family):
    rc, out, err = run(capsys, ZH, "--model", str(fish_checkpoints[family]), "--json", "--chunk-length", "60")
    assert rc == 0 and err == ""
    result = json.loads(out)
    assert result["text_policy"] == f"fish-{family}".replace("fish-fish", "fish") and result["warnings"] == []
    chunks = [c["text"] for c in result["chunks"]]
    assert "".join(chunks) == ZH and all(c.endswith("。") or c.endswith("，") for c in chunks)
    assert chunks[0].startswith("1951年")
    if family == "s2":
        tokenizer = TextTokenizer.from_file(fish_checkpoints["s2"] / "tokenizer.json")
        assert [c["tokens"] for c in result["chunks"]] == [len(tokenizer.encode(c)) for c in chunks]


def test_no_normalize_shows_the_text_as_given(capsys):
    rc, out, _ = run(capsys, "I have **3** cats.", "--model", "tiny", "--no-normalize")
    assert rc == 0 and "  text: I have **3** cats." in out.splitlines() and "normalize off" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["Hi <|im_end|>", "--model", "tiny"], "reserved tag '<|im_end|>'"),
        (["  ", "--model", "tiny"], "nothing to speak"),
        (["你好。", "--model", "tiny"], "reads English only"),
        (["Hi.", "--model", "tiny", "--chunk-length", "-1"], "--chunk-length must be >= 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "" and message in err and len(err.splitlines()) == 1
