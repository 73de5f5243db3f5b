import argparse
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
from helpers import sysfs_mounted

from tts.cli.main import main, summarize_finish_reasons

ROOT = Path(__file__).resolve().parents[1]


def test_cli_writes_wav_whose_duration_is_frames_times_frame_length(tmp_path, capsys):
    out = tmp_path / "out.wav"
    rc = main(
        [
            "synthesize",
            "Hello there, world.",
            "-o",
            str(out),
            "--model",
            "tiny",
            "--seed",
            "1",
            "--max-new-frames",
            "30",
            "-q",
        ]
    )
    assert rc == 0
    line = capsys.readouterr().out
    frames = int(line.split(": ")[1].split(" frames")[0])
    info = sf.info(str(out))
    assert info.channels == 1 and info.samplerate == 16000 and info.subtype == "PCM_16"
    assert info.frames == frames * 640
    assert "RTF" in line and "wall" in line
    assert [p.name for p in tmp_path.iterdir()] == ["out.wav"]  # no temp file left behind


def test_cli_text_file_and_voice(tmp_path):
    text = tmp_path / "in.txt"
    text.write_text("Read from a file. " * 5)
    out = tmp_path / "f.wav"
    assert (
        main(
            [
                "synthesize",
                "--text-file",
                str(text),
                "-o",
                str(out),
                "--model",
                "tiny",
                "--voice",
                "beta",
                "--max-new-frames",
                "8",
                "--seed",
                "5",
                "-q",
            ]
        )
        == 0
    )
    assert sf.info(str(out)).frames > 0


BAD = [
    (["synthesize", "", "-o", "{d}/a.wav"], "nothing to speak"),
    (["synthesize", "   ", "-o", "{d}/a.wav"], "nothing to speak"),
    (["synthesize", "?!...", "-o", "{d}/a.wav"], "nothing to speak"),
    (["synthesize", "word " * 3000, "-o", "{d}/a.wav", "--max-new-frames", "900"], "context"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--temperature", "-0.1"],
     "--temperature must be >= 0, got -0.1"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--top-p", "1.01"], "--top-p must be in (0, 1], got 1.01"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--top-k", "-1"], "--top-k must be in [0, 2**31)"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--max-new-frames", "0"], "--max-new-frames must be > 0, got 0"),
    (["synthesize", "hi", "-o", "{d}/missing/a.wav"], "does not exist"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--reference-audio", "{d}/empty.wav", "--reference-text", "x"],
     "empty"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--reference-audio", "{d}/junk.wav", "--reference-text", "x"],
     "cannot read"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--reference-audio", "{d}/nofile.wav", "--reference-text", "x"],
     "reference audio file not found: {d}/nofile.wav"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--reference-audio", "{d}/junk.wav", "--reference-text", "x"],
     "cannot read reference audio file {d}/junk.wav: Format not recognised (expected WAV, FLAC, MP3 or Ogg)"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--reference-audio", "{d}", "--reference-text", "x"],
     "reference audio path {d} is a directory, not a file"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--reference-audio", "{d}/empty.wav", "--reference-text", "x"],
     "reference audio file {d}/empty.wav is empty"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--threads", "0"], "--threads must be >= 1, got 0"),
    (["synthesize", "--text-file", "{d}/none.txt", "-o", "{d}/a.wav"], "text file not found: {d}/none.txt"),
    (["synthesize", "--text-file", "{d}/latin1.txt", "-o", "{d}/a.wav"],
     "text file {d}/latin1.txt is not UTF-8 (byte 5 is 0xe9)"),
    (["synthesize", "Hello <|im_end|> there", "-o", "{d}/a.wav"], "reserved tag '<|im_end|>'"),
    (["synthesize", "hi \udcff", "-o", "{d}/a.wav"], "not valid UTF-8"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--voice", "nobody"], "unknown voice"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--voice", "beta", "--reference-audio", "{d}/junk.wav",
      "--reference-text", "x"], "not both"),
    (["synthesize", "hi", "-o", "{d}/a.wav", "--model", "{d}"], "config.json"),
]  # fmt: skip


@pytest.mark.parametrize("argv, message", BAD, ids=[m + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_input_one_line_error_nonzero_exit_no_file(tmp_path, capsys, argv, message):
    sf.write(str(tmp_path / "empty.wav"), [], 16000)
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wav file")
    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 au lait".encode("latin-1")[:3] + b"xx\xe9")
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    message = message.replace("{d}", str(tmp_path))
    if "--model" not in argv:
        argv += ["--model", "tiny"]
    before = sorted(p.name for p in tmp_path.iterdir())
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert message in err and err.startswith("tts: error:") and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """`python -m tts.cli.main ARGS` as a user runs it (this checkout first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "tts.cli", *args], capture_output=True, text=True, env=env, cwd=cwd or ROOT
    )


def one_error_line(stderr: str) -> str:
    """The single `tts: error: ...` line of stderr (asserting there is exactly one and no traceback)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("tts: error: "), stderr
    return errors[0]


def _unwritable_dirs():
    cases = []
    if os.geteuid() != 0:  # root ignores permission bits
        cases.append(pytest.param("chmod", id="directory-without-write-permission"))
    if sysfs_mounted():  # refuses new files even for root
        cases.append(pytest.param("/sys", id="sysfs"))
    return cases


@pytest.mark.parametrize("where", _unwritable_dirs())
def test_unwritable_output_directory_is_one_line_naming_the_path_and_reason(tmp_path, where):
    directory = tmp_path / "ro" if where == "chmod" else Path(where)
    if where == "chmod":
        directory.mkdir()
        directory.chmod(0o555)
    before = sorted(p.name for p in directory.iterdir())
    try:
        out = directory / "x.wav"
        r = run_cli("synthesize", "Hello there.", "-o", str(out), "--model", "tiny", "--max-new-frames", "3")
        assert r.returncode == 2, r.stderr
        assert one_error_line(r.stderr) == f"tts: error: cannot write {out}: permission denied"
        assert ".tmp" not in r.stderr and "model:" not in r.stderr  # found before the model was loaded
        assert sorted(p.name for p in directory.iterdir()) == before  # nothing left behind
    finally:
        if where == "chmod":
            directory.chmod(0o755)


def test_an_immutable_output_file_is_refused_before_the_model_loads(tmp_path):
    """chattr +i makes a file that even root cannot replace: the error comes before any work, and the
    file is left as it was."""
    out = tmp_path / "keep.wav"
    out.write_bytes(b"original")
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a file system that supports it)")
    try:
        r = run_cli("synthesize", "Hello there.", "-o", str(out), "--model", "tiny", "--max-new-frames", "3")
        assert r.returncode == 2, r.stderr
        assert one_error_line(r.stderr) == f"tts: error: cannot write {out}: operation not permitted"
        assert "model:" not in r.stderr  # found before the model was loaded
        assert out.read_bytes() == b"original" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.wav"]
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=False)


def test_an_append_only_output_directory_is_refused_and_nothing_is_left_in_it(tmp_path):
    """chattr +a on the directory lets files be created in it but never renamed or removed (even by
    root): the final rename would fail, and a probe file made there could not be removed. One line before
    the model loads, and the directory stays empty."""
    directory = tmp_path / "append-only"
    directory.mkdir()
    if subprocess.run(["chattr", "+a", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("chattr +a is not available here (needs root and a file system that supports it)")
    try:
        out = directory / "x.wav"
        r = run_cli("synthesize", "Hello there.", "-o", str(out), "--model", "tiny", "--max-new-frames", "3")
        assert r.returncode == 2, r.stderr
        assert one_error_line(r.stderr) == (
            f"tts: error: cannot write {out}: directory {directory} is append-only (chattr +a), "
            "so the output cannot be renamed into place"
        )
        assert "model:" not in r.stderr  # found before the model was loaded
        assert list(directory.iterdir()) == []  # nothing left behind
    finally:
        subprocess.run(["chattr", "-a", str(directory)], check=False)


@pytest.mark.parametrize("o_tmpfile", [True, False], ids=["O_TMPFILE", "without-O_TMPFILE"])
def test_the_write_probe_leaves_no_file_even_where_files_cannot_be_removed(tmp_path, monkeypatch, o_tmpfile):
    """The directory probe makes a file with no name (O_TMPFILE): nothing is left even where a named file
    could not be removed (here: every unlink refused). Without O_TMPFILE (not Linux, or a file system
    without it) a named file is made and removed."""
    import errno

    from tts.cli.main import check_output_path

    out = tmp_path / "x.wav"
    if o_tmpfile:
        if not hasattr(os, "O_TMPFILE"):
            pytest.skip("no O_TMPFILE here")
        try:  # (a file system without it, e.g. an older overlayfs: the named probe is the other case)
            os.close(os.open(tmp_path, os.O_TMPFILE | os.O_WRONLY, 0o600))
        except OSError as exc:
            pytest.skip(f"this file system has no O_TMPFILE ({exc.strerror})")

        def refuse_unlink(path, *args, **kwargs):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))

        monkeypatch.setattr(os, "unlink", refuse_unlink)
        monkeypatch.setattr(os, "remove", refuse_unlink)
    else:
        monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    assert check_output_path(str(out)) == out
    assert list(tmp_path.iterdir()) == []


def test_an_unexpected_o_tmpfile_refusal_falls_back_to_a_named_probe(tmp_path, monkeypatch):
    """A file system that answers O_TMPFILE with an errno Linux does not document for it (EINVAL from a
    FUSE or 9p server) is not taken for an unwritable directory: the named probe decides."""
    import errno

    from tts.cli.main import check_output_path

    if not hasattr(os, "O_TMPFILE"):
        pytest.skip("no O_TMPFILE here")
    real_open = os.open

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    out = tmp_path / "x.wav"
    assert check_output_path(str(out)) == out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("errno_name, refused", [("EPERM", True), ("EACCES", False), ("ETXTBSY", False)])
def test_only_an_immutable_file_is_refused_by_the_write_probe(tmp_path, monkeypatch, errno_name, refused):
    """The probe opens an existing output for writing: EPERM (immutable or append-only) is refused;
    mode bits (EACCES) or a running program (ETXTBSY) are not, since the final rename may still replace
    the file; a symlink is not probed (the rename replaces the link)."""
    import builtins
    import errno

    from tts.cli.main import UserError, check_output_path

    out = tmp_path / "x.wav"
    out.write_bytes(b"old")
    link = tmp_path / "link.wav"
    link.symlink_to(out)
    real_open = builtins.open

    def refusing_open(path, mode="r", *args, **kwargs):
        if Path(path) == out and "+" in mode:
            raise OSError(getattr(errno, errno_name), os.strerror(getattr(errno, errno_name)), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    if refused:
        with pytest.raises(UserError, match=f"^cannot write {re.escape(str(out))}: operation not permitted$"):
            check_output_path(str(out))
    else:
        assert check_output_path(str(out)) == out
    assert check_output_path(str(link)) == link and out.read_bytes() == b"old"


def test_each_warning_is_printed_once(tmp_path):
    """The CLI prints a synthesis's warnings itself; the API's log records of them are not printed too."""
    text = tmp_path / "t.md"
    text.write_text("Hello there.\n\n```\nsome code\n```\n")
    # (a fixed seed: the same frames every run, not a `short` ending by chance)
    frames = ["--seed", "1", "--max-new-frames", "3"]
    out = str(tmp_path / "x.wav")
    r = run_cli("synthesize", "--text-file", str(text), "-o", out, "--model", "tiny", *frames)
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "code block" in line] == [
        "warning: 1 code block was not read"
    ]


def test_a_write_that_fails_at_the_end_names_the_output_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The directory was writable when checked but the final rename fails (the file system went
    read-only): one line naming the output, not the temporary file, and no file left."""
    import errno

    import tts.audio.files

    def read_only(src, dst):
        raise OSError(errno.EROFS, "Read-only file system", str(src))

    monkeypatch.setattr(tts.audio.files.os, "replace", read_only)
    out = tmp_path / "x.wav"
    # (a fixed seed: the random weights could end the speech short, exit 3 before any write)
    frames = ["--seed", "1", "--max-new-frames", "3"]
    rc = main(["synthesize", "Hello there.", "-o", str(out), "--model", "tiny", *frames, "-q"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"tts: error: cannot write {out}: read-only file system"
    assert list(tmp_path.iterdir()) == []


def test_console_script_help_and_exit_code():
    r = subprocess.run(
        [sys.executable, "-m", "tts.cli", "synthesize", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--max-new-frames" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "tts.cli", "synthesize", "", "-o", "x.wav", "--model", "tiny"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "nothing to speak" in r.stderr


def test_argument_errors_are_one_line_and_version_prints(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["synthesize", "hi", "-o", "x.wav", "--seed", "abc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tts synthesize: error: argument --seed")
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("tts ")


LONG_TEXT = " ".join(f"This is sentence number {i} of a long text read in chunks." for i in range(1, 25))


def test_progress_on_a_non_terminal_stderr_is_a_few_plain_lines(tmp_path, capsys):
    out = tmp_path / "long.wav"
    rc = main(
        ["synthesize", LONG_TEXT, "-o", str(out), "--model", "tiny", "--seed", "1", "--max-new-frames", "3"]
    )
    assert rc == 0
    captured = capsys.readouterr()  # capsys's stderr is not a TTY, like a CI log or a pipe
    assert "\r" not in captured.err and "\x1b" not in captured.err
    lines = captured.err.splitlines()
    assert lines[0].startswith("model: ")
    # (the chunks that the 3-frame budget cut are each named in a warning after the progress)
    progress = [line for line in lines[1:] if not line.startswith("warning: ")]
    assert 1 <= len(progress) <= 3 and all(line.startswith("synthesizing: ") for line in progress), lines
    assert len(captured.out.splitlines()) == 1


def test_summary_line_counts_finish_reasons_instead_of_listing_each_chunk(tmp_path, capsys):
    out = tmp_path / "long.wav"
    assert (
        main(
            [
                "synthesize",
                LONG_TEXT,
                "-o",
                str(out),
                "--model",
                "tiny",
                "--seed",
                "1",
                "--max-new-frames",
                "2",
                "-q",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip()
    assert line.endswith("seed 1, finish length"), line  # every chunk hit its 2-frame budget


@pytest.mark.parametrize(
    "reasons, summary",
    [
        (["stop"], "stop"),
        (["stop"] * 7, "stop"),
        (["stop"] * 5 + ["length"], "stop x5, length x1"),
        (["length", "stop", "length"], "length x2, stop x1"),
        ([], "none"),
    ],
)
def test_summarize_finish_reasons(reasons, summary):
    from tts.engine import FinishReason

    assert summarize_finish_reasons(reasons) == summary
    assert summarize_finish_reasons([FinishReason(r) for r in reasons]) == summary


def test_synthesize_warns_once_about_text_the_model_leaves_out_and_takes_no_normalize(tmp_path, capsys):
    out = tmp_path / "a.wav"
    argv = [
        "synthesize",
        "Hello 你好 world.",
        "-o",
        str(out),
        "--model",
        "tiny",
        "--seed",
        "1",
        "--max-new-frames",
        "3",
    ]
    assert main([*argv, "-q"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: this model reads English only: 2 characters of Han text were left out") == 1
    assert (
        main(
            [
                "synthesize",
                "**5** items",
                "-o",
                str(out),
                "--model",
                "tiny",
                "--seed",  # (a random seed could draw the end token at once: a short reading, exit 3)
                "1",
                "--max-new-frames",
                "3",
                "--no-normalize",
                "-q",
            ]
        )
        == 0
    )
    assert main(["synthesize", "你好。", "-o", str(out), "--model", "tiny"]) == 2
    assert "reads English only" in capsys.readouterr().err


SUBCOMMAND_SOURCE = """
def add_parser(subparsers):
    subparsers.add_parser("{name}", help="a test subcommand").set_defaults(func=lambda args: 0)
"""


def add_subcommand_module(monkeypatch, tmp_path, module: str, body: str) -> None:
    """A subcommand module `module` on sys.path, listed after the real ones."""
    import tts.cli.main

    (tmp_path / f"{module}.py").write_text(body + SUBCOMMAND_SOURCE.format(name=module.replace("_", "-")))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(tts.cli.main, "_SUBCOMMAND_MODULES", (*tts.cli.main._SUBCOMMAND_MODULES, module))


@pytest.mark.parametrize("broken", ["own-import", "tts.cli.serve"])
def test_a_subcommand_module_that_fails_to_import_our_own_code_is_an_error_not_a_missing_command(
    broken, tmp_path, monkeypatch, capsys
):
    """An ImportError inside our own code (a bug, a broken install) must not make a subcommand vanish
    from `tts --help` in silence: every command fails with one line naming the module, and -v adds the
    traceback."""
    if broken == "own-import":
        add_subcommand_module(
            monkeypatch, tmp_path, "broken_cmd", "from tts.cli.main import no_such_helper\n"
        )
        module, reason = "broken_cmd", "cannot import name 'no_such_helper' from 'tts.cli.main'"
    else:
        monkeypatch.setitem(sys.modules, "tts.cli.serve", None)  # importing it raises ModuleNotFoundError
        module, reason = "tts.cli.serve", "import of tts.cli.serve halted"
    assert main(["info", "--model", "tiny"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"tts: error: cannot load the subcommands of {module}: ")
    assert reason in err
    assert main(["-v", "info", "--model", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("tts: error: cannot load")


def test_a_subcommand_whose_optional_extra_is_missing_is_left_out(tmp_path, monkeypatch, capsys):
    """A missing optional extra (`pip install -e '.[tools]'`) only leaves out the subcommand that needs
    it at import time; the others work."""
    from tts.cli.main import build_parser

    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # as if the tools extra were not installed
    add_subcommand_module(monkeypatch, tmp_path, "needs_extra", "import faster_whisper  # noqa\n")
    commands = build_parser()._subparsers._group_actions[0].choices
    assert "needs-extra" not in commands and {"synthesize", "serve", "eval", "text"} <= set(commands)
    assert main(["info", "--model", "tiny"]) == 0


def test_the_optional_extras_the_cli_tolerates_are_the_tools_extra_of_pyproject():
    tomllib = pytest.importorskip("tomllib")
    import tts.cli.main

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tools_extra = project["optional-dependencies"]["tools"]
    names = {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("-", "_") for req in tools_extra}
    assert set(tts.cli.main._OPTIONAL_EXTRA_MODULES) == names


GRAPH_OPTIONS = [
    ([], None, None),  # the default: synthesize lazy (one synthesis), serve startup (as benchmarked)
    (["--graphs", "off"], "off", None),
    (["--graphs", "lazy"], "lazy", None),
    (["--graphs", "startup"], "startup", None),
    # Deprecated spellings: still work, with a one-line warning.
    (["--graphs", "on"], "lazy", "--graphs on is deprecated; use --graphs lazy"),
    (["--capture", "startup"], "startup", "--capture startup is deprecated; use --graphs startup"),
    (["--capture", "lazy"], "lazy", "--capture lazy is deprecated; use --graphs lazy"),
    (["--graphs", "on", "--capture", "startup"], "startup",
     "--graphs on --capture startup is deprecated; use --graphs startup"),
    (["--capture", "startup", "--graphs", "on"], "startup",
     "--graphs on --capture startup is deprecated; use --graphs startup"),
    (["--graphs", "off", "--capture", "startup"], "off", "--capture startup is deprecated; use --graphs off"),
]  # fmt: skip


@pytest.mark.parametrize("command", ["synthesize", "serve"])
@pytest.mark.parametrize(
    "argv, graphs, warning", GRAPH_OPTIONS, ids=[" ".join(a) or "-" for a, _, _ in GRAPH_OPTIONS]
)
def test_one_graphs_option_and_its_deprecated_aliases(capsys, command, argv, graphs, warning):
    from tts.cli.main import build_parser, engine_kwargs

    words = ["synthesize", "hi", "-o", "x.wav"] if command == "synthesize" else ["serve"]
    args = build_parser().parse_args([*words, *argv])
    graphs = graphs or ("lazy" if command == "synthesize" else "startup")
    assert engine_kwargs(args)["graphs"] == graphs
    assert engine_kwargs(args)["graphs"] == graphs  # (resolved once: no second warning)
    err = capsys.readouterr().err
    assert err == (f"warning: {warning}\n" if warning else "")


@pytest.mark.parametrize("command", ["synthesize", "serve"])
def test_loop_guard_is_on_unless_turned_off(command):
    from tts.cli.main import build_parser, engine_kwargs

    words = ["synthesize", "hi", "-o", "x.wav"] if command == "synthesize" else ["serve"]
    assert engine_kwargs(build_parser().parse_args(words))["loop_guard"] is True
    assert engine_kwargs(build_parser().parse_args([*words, "--loop-guard", "off"]))["loop_guard"] is False


@pytest.mark.parametrize("command", ["synthesize", "serve"])
def test_help_shows_graphs_off_lazy_startup_and_hides_the_deprecated_spellings(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--graphs {off,lazy,startup}" in out and "--capture" not in out and "startup,on" not in out


def test_synthesize_with_a_deprecated_graph_option_warns_once_and_runs(tmp_path, capsys):
    out = tmp_path / "out.wav"
    rc = main(
        [
            "synthesize",
            "Hello.",
            "-o",
            str(out),
            "--model",
            "tiny",
            "--seed",
            "1",
            "--max-new-frames",
            "3",
            "-q",
            "--graphs",
            "on",
            "--capture",
            "startup",
        ]
    )
    assert rc == 0 and out.exists()
    lines = [x for x in capsys.readouterr().err.splitlines() if "deprecated" in x]
    assert lines == ["warning: --graphs on --capture startup is deprecated; use --graphs startup"]


def test_serve_passes_max_prepare_seconds_to_the_server(monkeypatch):
    """`tts serve --max-prepare-seconds S` is the server's preparation deadline
    (`ServiceLimits.max_prepare_seconds`); without it, the default 10 s."""
    from tts.cli import serve as service_cli

    seen = []

    async def fake_serve(args, bundle, engine_config, limits, access, started=None):
        seen.append(limits.max_prepare_seconds)
        return 0

    monkeypatch.setattr(service_cli, "_serve", fake_serve)
    base = ["serve", "--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    assert main([*base, "--max-prepare-seconds", "2.5"]) == 0
    assert main(base) == 0
    assert seen == [2.5, 10.0]


def test_serve_admission_options_reach_the_engine(monkeypatch, capsys):
    """`tts serve`'s admission options are the engine's: real-time admission auto (off on a CPU) or on,
    its margin and wait, the prefill budget; a negative margin exits 2 naming the option."""
    from tts.cli import serve as service_cli

    seen = []

    async def fake_serve(args, bundle, engine_config, limits, access, started=None):
        c = engine_config
        seen.append(
            (
                c.realtime_admission,
                c.realtime_margin,
                c.realtime_max_wait,
                c.max_prefill_tokens,
                c.prefill_gather,
            )
        )
        return 0

    monkeypatch.setattr(service_cli, "_serve", fake_serve)
    base = ["serve", "--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    assert main(base) == 0
    on = ["--realtime-admission", "on", "--realtime-margin", "0.02", "--realtime-max-wait", "0.3"]
    assert main([*base, *on, "--max-prefill-tokens", "512"]) == 0
    assert seen == [(False, 0.05, 0.15, 2048, 0.0), (True, 0.02, 0.3, 512, 0.0)]
    # (the option's value on CUDA, where the devices are checked before any model loads)
    args = service_cli._SERVE_PARSER.parse_args([*base[1:], "--prefill-gather-ms", "40"])
    assert service_cli.engine_admission_kwargs(args, "cuda")["prefill_gather"] == 0.04
    assert service_cli.realtime_admission(argparse.Namespace(realtime_admission="auto"), "cuda")
    capsys.readouterr()
    assert main([*base, "--realtime-margin", "-1"]) == 2
    error = "tts: error: --realtime-margin must be a number of seconds >= 0, got -1\n"
    assert capsys.readouterr().err == error
    for bad in ("-1", "1001", "nan"):
        assert main([*base, *on, "--prefill-gather-ms", bad]) == 2
        assert capsys.readouterr().err == f"tts: error: --prefill-gather-ms must be in 0..1000, got {bad}\n"
    # (a CPU prefills each prompt alone: nothing to share, whether admission is on or auto)
    cuda = (
        "tts: error: --prefill-gather-ms needs CUDA (where prompts share a prefill pass; a CPU prefills each "
        "alone)\n"
    )
    admission = (
        "tts: error: --prefill-gather-ms needs real-time admission (--realtime-admission auto or on)\n"
    )
    for extra, error in (
        ([], cuda),
        (on, cuda),
        (["--devices", "cpu,cpu"], cuda),
        (["--device", "cuda", "--realtime-admission", "off"], admission),
    ):
        assert main([*base, *extra, "--prefill-gather-ms", "40"]) == 2
        assert capsys.readouterr().err == error
    assert main([*base, "--device", "cuda", "--prefill-gather-ms", "150"]) == 2
    assert capsys.readouterr().err == (
        "tts: error: --prefill-gather-ms must be below --realtime-max-wait (150 ms), got 150\n"
    )
    assert len(seen) == 2


def test_serve_codec_gather_ms_reaches_the_server(monkeypatch, capsys):
    """`tts serve --codec-gather-ms MS` is the server's codec_gather in seconds (default 0: off); a
    negative or huge value exits 2 naming the option."""
    import service.server

    seen = []

    class Recorded(RuntimeError):
        pass

    class FakeServer:
        def __init__(self, *args, **kwargs):
            seen.append(kwargs["codec_gather"])

        async def start(self, host, port):
            raise Recorded("recorded")  # (a start that fails: _serve stops the server, exits 2)

        async def stop(self, grace):
            return None

    monkeypatch.setattr(service.server, "TTSServer", FakeServer)
    base = ["serve", "--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    assert main([*base, "--codec-gather-ms", "30"]) == 2
    assert main(base) == 2
    assert seen == [0.03, 0.0]
    capsys.readouterr()
    for bad in ("-1", "1001", "nan"):
        assert main([*base, "--codec-gather-ms", bad]) == 2
        assert capsys.readouterr().err == (f"tts: error: --codec-gather-ms must be in 0..1000, got {bad}\n")


def test_serve_codec_sms_needs_cuda_and_a_count(capsys):
    """`tts serve --codec-sms N` limits the codec stage to N SMs on CUDA; on a CPU, or negative, it exits 2
    in one line before any model loads."""
    base = ["serve", "--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    for extra, error in (
        (["--codec-sms", "40"], "--codec-sms needs CUDA"),
        (["--devices", "cpu,cpu", "--codec-sms", "40"], "--codec-sms needs CUDA"),
        (["--device", "cuda", "--codec-sms", "-1"], "--codec-sms must be >= 0, got -1"),
        (
            ["--device", "cuda", "--codec-sms", "40", "--codec-graphs", "on"],
            "--codec-sms launches the codec's kernels one by one: it cannot be had with --codec-graphs on",
        ),
    ):
        assert main([*base, *extra]) == 2
        assert capsys.readouterr().err == f"tts: error: {error}\n"


def test_serve_codec_sms_the_gpu_cannot_give_exits_2_before_the_model_loads(monkeypatch, capsys):
    """Where the device has no green contexts (or not that many SMs), `tts serve --codec-sms N` says so
    in one line naming the option, before any model loads."""
    import tts.checkpoints.load
    import tts.cli.serve
    import tts.runtime.codec_stage

    asked = []

    def no_green_context(device, sms):
        asked.append((str(device), sms))
        raise RuntimeError("no green contexts on cuda:1")

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(tts.cli.serve, "check_device", lambda device: None)
    monkeypatch.setattr(tts.runtime.codec_stage, "codec_stream", no_green_context)
    monkeypatch.setattr(tts.checkpoints.load, "load_bundle", no_load)
    base = ["serve", "--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    assert main([*base, "--device", "cuda:1", "--codec-sms", "40"]) == 2
    assert asked == [("cuda:1", 40)]
    assert capsys.readouterr().err == "tts: error: --codec-sms 40: no green contexts on cuda:1\n"


def test_replicas_get_the_resolved_graphs_option(monkeypatch, capsys):
    """`tts serve --devices` forwards `--graphs lazy`, not the deprecated spelling it was given."""
    import service.cluster
    from tts.cli import serve as service_cli

    forwarded = []
    monkeypatch.setattr(
        service.cluster,
        "run_cluster",
        lambda args, parser, devices: forwarded.append(service.cluster.forwarded_options(args, parser)) or 0,
    )
    argv = ["serve", "--devices", "cpu,cpu", "--model", "tiny", "--capture", "lazy"]
    # any free ports: the test must not depend on the default ports being free on this machine
    assert main([*argv, "--port", "0", "--http-port", "0", "--metrics-port", "0"]) == 0
    assert forwarded == [["--model", "tiny", "--graphs", "lazy"]]
    assert service_cli._SERVE_PARSER is not None
    assert "deprecated" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "default", "voices"], "--model goes after the command: tts voices --model default ..."),
        (["-v", "-q", "voices", "list"], "-q goes after the command: tts -v voices -q ..."),
        (["--seed=3", "synthesize", "hi"], "--seed=3 goes after the command: tts synthesize --seed=3 ..."),
    ],
)
def test_a_command_option_before_the_command_is_named(capsys, argv, message):
    """argparse would call the option's value an unknown command ('invalid choice: default')."""
    assert main(argv) == 2
    assert capsys.readouterr().err == f"tts: error: {message}\n"


# ---- a light command line: help and usage errors load no heavy module -------------------------------

HEAVY_MODULES = ("torch", "torchaudio", "numpy", "soundfile", "av", "grpc", "fastapi", "transformers")
IMPORTS_PROBE = """
import sys
from tts.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
print("heavy:", " ".join(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["synthesize", "--help"],
        ["serve", "--help"],
        ["bench", "--help"],
        ["eval", "--help"],
        ["synthesize", "hi"],  # -o missing
        ["synthesize", "hi", "-o", "x.wav", "--frobnicate"],
        ["serve", "--port", "x"],
    ],
    ids=" ".join,
)
def test_help_and_usage_errors_import_no_heavy_module(argv):
    """`tts --help`, a command's help and a usage error answer at once: building the parser imports no
    torch, numpy, grpc, ... (counted in a fresh interpreter, not timed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    code = IMPORTS_PROBE.format(argv=argv, heavy=HEAVY_MODULES)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "heavy:", r.stdout[-500:]


def test_the_cli_default_buckets_are_the_graph_runners():
    import graphs.runner
    import tts.cli.main

    assert tts.cli.main.DEFAULT_BUCKETS == graphs.runner.DEFAULT_BUCKETS


@pytest.mark.parametrize(
    "argv, command",
    [
        (["synthesize", "hi", "-o", "x.wav", "--frobnicate"], "tts synthesize"),
        (["serve", "--frobnicate"], "tts serve"),
        (["voices", "add", "n", "c.wav", "--text", "t", "--frobnicate"], "tts voices add"),
        (["--frobnicate"], "tts"),
    ],
)
def test_an_unknown_option_points_at_its_commands_help(capsys, argv, command):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2
    assert err == f"{command}: error: unrecognized arguments: --frobnicate (see {command} --help)"


def test_a_bad_device_names_the_accepted_ones_in_one_line(capsys):
    assert main(["info", "--model", "tiny", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"tts: error: bad --device 'tpu': expected cpu, cuda, cuda:N( or mps)?", err), err


def command_parsers():
    from tts.cli.main import build_parser

    def walk(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in dict.fromkeys(action.choices.values()):
                    yield from walk(sub)

    return list(walk(build_parser()))


def test_every_option_with_a_default_shows_it_in_help():
    missing = []
    for parser in command_parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0:
                continue  # (a flag's default says nothing)
            if action.default in (None, argparse.SUPPRESS):
                continue
            shown = formatter._expand_help(action)
            if "default" not in shown:
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert missing == []


def test_help_shows_a_default_the_option_did_not_spell_out(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "address of the Prometheus endpoint (default: 127.0.0.1)" in help_text
    assert "unread chunks before a stream pauses (default: 8)" in help_text


# ---- text from stdin --------------------------------------------------------------------------------


class FakeStdin(io.TextIOWrapper):
    def __init__(self, data: bytes, tty: bool):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("argv", [["-"], []], ids=["dash", "piped"])
def test_text_comes_from_stdin_with_a_dash_or_a_pipe(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "stdin", FakeStdin(b"Read from a pipe.", tty=False))
    assert main(["text", *argv, "--model", "tiny", "--json"]) == 0
    assert '"text": "Read from a pipe."' in capsys.readouterr().out


def test_no_text_at_a_terminal_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", FakeStdin(b"", tty=True))
    assert main(["text", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tts: error: nothing to synthesize: give TEXT or --text-file, or pipe the text to stdin"


def test_dash_and_a_text_file_are_both_text(monkeypatch, capsys, tmp_path):
    (tmp_path / "t.txt").write_text("x")
    monkeypatch.setattr(sys, "stdin", FakeStdin(b"y", tty=False))
    assert main(["text", "-", "--text-file", str(tmp_path / "t.txt"), "--model", "tiny"]) == 2
    assert "give TEXT or --text-file, not both" in capsys.readouterr().err


def test_synthesize_dash_reads_stdin(tmp_path):
    out = tmp_path / "x.wav"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    # (a fixed seed: the same frames every run, not a `short` ending by chance)
    frames = ["--seed", "1", "--max-new-frames", "4"]
    argv = ["synthesize", "-", "-o", str(out), "--model", "tiny", *frames, "-q"]
    r = subprocess.run(
        [sys.executable, "-m", "tts.cli", *argv], input=b"Hello from stdin.", capture_output=True, env=env
    )
    assert r.returncode == 0, r.stderr
    assert sf.info(str(out)).frames > 0


# ---- a torchaudio that cannot load -------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "--model", "tiny"],
        ["synthesize", "Hi.", "-o", "x.wav", "--model", "tiny"],
        ["serve", "--model", "tiny", "--port", "0", "--http-port", "-1", "--metrics-port", "-1"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_torchaudio_that_cannot_load_is_one_line_with_the_fix(tmp_path, argv):
    """A CPU torch beside a CUDA torchaudio: `import torchaudio` fails with an OSError about
    libc10_cuda.so. Every command says so in one line, with the fix, instead of a traceback."""
    fake = tmp_path / "site" / "torchaudio"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise OSError("libc10_cuda.so: cannot open shared object file: No such file or directory")\n'
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT), str(ROOT / "tools")])
    )
    r = subprocess.run(
        [sys.executable, "-m", "tts.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(
        "tts: error: torchaudio cannot load (OSError: libc10_cuda.so: cannot open shared object file: "
        "No such file or directory; torch "
    )
    assert "): install torch and torchaudio from the same index, e.g. pip install" in r.stderr
    assert not (tmp_path / "x.wav").exists()


def test_each_request_field_has_one_option_that_a_command_takes():
    """CLI_OPTIONS maps canonical request fields (tts.runtime.request.FIELDS) to options the commands have."""
    from tts.cli.main import CLI_OPTIONS
    from tts.runtime.request import FIELDS

    options = {o for parser in command_parsers() for a in parser._actions for o in a.option_strings}
    assert set(CLI_OPTIONS) <= set(FIELDS)
    assert {field: option for field, option in CLI_OPTIONS.items() if option not in options} == {}


def test_an_error_names_the_option_of_its_field_not_of_its_words():
    """The option comes from the field the error is about, never from words of its message that look like
    a field's name."""
    from tts.cli.main import error_line
    from tts.params import InvalidRequest
    from tts.runtime.request_errors import InvalidField, Ref, TextFieldError

    # a sampling range (its `parameter`), a request error's field, a message naming fields as Refs
    assert error_line(InvalidRequest("top_k must be >= 0", parameter="top_k")) == "--top-k must be >= 0"
    budget = InvalidField("sampling.max_new_frames", "max_new_frames (5000) exceeds the context size 4096")
    assert error_line(budget) == "--max-new-frames (5000) exceeds the context size 4096"
    chunks = InvalidField("output.chunk_frames", Ref("output.chunk_frames"), " must be at most 256, got 300")
    assert error_line(chunks) == "--chunk-frames must be at most 256, got 300"
    # a message that starts with a word spelled like a field, about another field or about none: as it is
    assert error_line(TextFieldError("text", "seed words are not text")) == "seed words are not text"
    assert error_line(InvalidRequest("temperature of the room")) == "temperature of the room"
    # a field the message does not open with: the message as it is
    assert error_line(InvalidField("voice", "unknown voice 'x'")) == "unknown voice 'x'"


@pytest.mark.parametrize(("command", "default"), [("synthesize", "off"), ("serve", None)])
def test_the_prefill_is_captured_by_the_server_not_by_a_one_shot_synthesize(command, default):
    # `tts synthesize` prefills once per text chunk: capturing the prefill's graphs only costs start-up.
    from tts.cli.main import build_parser, engine_kwargs

    words = ["synthesize", "hi", "-o", "x.wav"] if command == "synthesize" else ["serve"]
    assert engine_kwargs(build_parser().parse_args(words))["prefill_graphs"] == default
    on = engine_kwargs(build_parser().parse_args([*words, "--prefill-graphs", "on"]))
    assert on["prefill_graphs"] is None  # (the engine's default: as --graphs)


class _Exited(Exception):
    pass


def test_the_console_command_exits_with_mains_code_once_everything_is_flushed(monkeypatch):
    """`tts` (the console script) leaves with main's exit code and without the interpreter's teardown
    (0.4 s of torch's module cleanup on a CPU, the CUDA context's too on a GPU), but only after the
    logs and both standard streams are flushed."""
    import logging

    import tts.cli.main as cli

    order = []

    class Stream(io.StringIO):
        def flush(self):
            order.append(("flush", self.name))

    for name in ("stdout", "stderr"):
        stream = Stream()
        stream.name = name
        monkeypatch.setattr(sys, name, stream)
    monkeypatch.setattr(logging, "shutdown", lambda: order.append("logging"))
    monkeypatch.setattr(cli, "main", lambda: 3)

    def exit_now(code):
        order.append(("_exit", code))
        raise _Exited

    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(_Exited):
        cli.console_main()
    assert order == ["logging", ("flush", "stdout"), ("flush", "stderr"), ("_exit", 3)]


def test_the_installed_tts_command_and_python_m_tts_cli_use_the_console_entry():
    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tts"] == "tts.cli.main:console_main"
    out = subprocess.run(
        [sys.executable, "-m", "tts.cli", "synthesize", "hi", "-o", "/nonexistent-dir/x.wav"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("tts: error:")


@pytest.mark.parametrize("closed", [">&-", "2>&-"])
def test_a_command_with_a_closed_standard_stream_still_succeeds(tmp_path, closed):
    """A shell that closes stdout or stderr (`>&-`) leaves Python's `sys.stdout` / `sys.stderr` None:
    the command still writes its file and exits 0. (A fixed seed: a random one can end the tiny model's
    speech at frame 0, which exits 3 whatever the streams.)"""
    out = tmp_path / "x.wav"
    r = subprocess.run(
        f"{sys.executable} -m tts.cli synthesize 'Hi.' --model tiny --max-new-frames 4 --seed 1 -q "
        f"-o {out} {closed}",
        shell=True, capture_output=closed == ">&-", cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sf.info(str(out)).frames > 0


def test_audio_to_a_closed_stdout_is_refused_before_the_model_loads(tmp_path):
    """`-o -` with stdout closed (`>&-`): one line and exit 2, not an AttributeError after the work."""
    r = subprocess.run(
        f"{sys.executable} -m tts.cli synthesize 'Hi.' --model tiny -o - >&-",
        shell=True, capture_output=False, stderr=subprocess.PIPE, cwd=ROOT, timeout=300, text=True,
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == "tts: error: standard output is closed: give -o a file path"


def test_messages_for_a_closed_stderr_stay_out_of_the_audio_on_stdout():
    """With stderr closed (`2>&-`) Python's `print(file=sys.stderr)` would write to stdout: the model
    line and warnings would go into the audio of `-o -`. Stdout holds exactly the WAV."""
    r = subprocess.run(
        f"{sys.executable} -m tts.cli synthesize 'Hi.' --model tiny --max-new-frames 4 --seed 1 -o - 2>&-",
        shell=True, stdout=subprocess.PIPE, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0
    assert r.stdout[:4] == b"RIFF"
    audio, rate = sf.read(io.BytesIO(r.stdout))
    assert len(audio) > 0 and rate > 0
