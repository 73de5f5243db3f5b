"""`tts synthesize` output formats and pipes: the extension (or --format) picks the encoder, `-o -` writes
the audio alone to stdout, `--text-file -` reads stdin, files are complete or absent."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tts.cli.main import main

av = pytest.importorskip("av")
ROOT = Path(__file__).resolve().parent.parent
FRAME = 640  # samples per frame of the tiny model's codec (16 kHz)
ARGS = ["--model", "tiny", "--seed", "1", "--max-new-frames", "12", "-q"]


def frames_of(summary: str) -> int:
    """The frame count of a `wrote ...: N frames, ...` summary line."""
    return int(summary.split("): ")[1].split(" frames")[0])


def decoded_samples(data: bytes) -> tuple[int, int]:
    container = av.open(io.BytesIO(data))
    frames = list(container.decode(audio=0))
    return sum(f.samples for f in frames), frames[0].sample_rate


@pytest.mark.parametrize(
    "name, fmt",
    [("out.mp3", "mp3"), ("out.ogg", "opus"), ("out.opus", "opus"), ("out.aac", "aac"), ("out.FLAC", "flac")],
)
def test_extension_picks_the_format(tmp_path, capsys, name, fmt):
    out = tmp_path / name
    assert main(["synthesize", "Hello there.", "-o", str(out), *ARGS]) == 0
    summary = capsys.readouterr().out
    assert f"({fmt})" in summary
    frames = frames_of(summary)
    samples, rate = decoded_samples(out.read_bytes())
    expected = frames * FRAME * rate // 16000
    if fmt == "aac":  # ADTS keeps the encoder's priming (up to 2 x 1024 samples)
        assert expected <= samples <= expected + 2048
    else:  # whole files carry their length (MP3: the LAME gapless header; Ogg: granule positions)
        assert samples == expected
    assert rate == (48000 if fmt == "opus" else 16000)
    assert f"audio at {rate} Hz" in summary  # the summary line gives the file's rate
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary file left behind


def test_format_option_overrides_the_extension(tmp_path, capsys):
    out = tmp_path / "audio.bin"
    assert main(["synthesize", "Hello.", "-o", str(out), "--format", "flac", *ARGS]) == 0
    frames = frames_of(capsys.readouterr().out)
    assert sf.info(str(out)).format == "FLAC" and sf.info(str(out)).frames == frames * FRAME
    assert "warning: writing" not in capsys.readouterr().err  # (.bin names no format: nothing to warn of)


def test_a_format_the_extension_contradicts_is_written_with_a_warning(tmp_path, capsys):
    out = tmp_path / "audio.wav"
    assert main(["synthesize", "Hello.", "-o", str(out), "--format", "flac", *ARGS]) == 0
    # (the first line: the random model may also reach its 12 frames, which is warned of after it)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"warning: writing flac into {out}, whose extension says wav"
    assert not any("writing" in line for line in err[1:])
    assert sf.info(str(out)).format == "FLAC"


@pytest.mark.parametrize("name", ["out.m4a", "out", "out.txt"])
def test_unknown_extension_is_a_one_line_error_before_any_work(tmp_path, capsys, name):
    rc = main(["synthesize", "Hello.", "-o", str(tmp_path / name), *ARGS])
    err = capsys.readouterr().err.strip()
    assert (
        rc == 2 and err.startswith("tts: error: cannot tell the audio format") and len(err.splitlines()) == 1
    )
    assert "--format" in err and list(tmp_path.iterdir()) == []


def run_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "tts.cli", *args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_stdout_gets_only_the_audio_and_stdin_gives_the_text(tmp_path):
    """`--text-file - -o -`: text from a pipe, audio to a pipe; the summary goes to stderr."""
    r = run_cli("synthesize", "--text-file", "-", "-o", "-", *ARGS, stdin=b"Hello from a pipe.")
    assert r.returncode == 0, r.stderr.decode()
    summary = r.stderr.decode().strip().splitlines()[-1]
    assert summary.startswith("wrote stdout (wav): ")
    audio, rate = sf.read(io.BytesIO(r.stdout), dtype="float32")  # stdout is exactly one WAV file
    assert rate == 16000 and len(audio) == frames_of(summary) * FRAME
    # The same text given as an argument gives the same audio (seeded).
    same = tmp_path / "same.wav"
    assert main(["synthesize", "Hello from a pipe.", "-o", str(same), *ARGS]) == 0
    np.testing.assert_array_equal(sf.read(str(same), dtype="float32")[0], audio)
    # --format with stdout.
    r = run_cli("synthesize", "Hi.", "-o", "-", "--format", "mp3", *ARGS)
    assert r.returncode == 0 and decoded_samples(r.stdout)[0] > 0
    assert not (ROOT / "-").exists()
