"""The user documentation (README.md, docs/*.md) points at what exists.

* Every relative Markdown link resolves to a file of the repository, and a `#anchor` to a heading of
  that file (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens).
* Every `tts SUBCOMMAND ... --flag` in a fenced code block names a flag that subcommand accepts, and so
  does every option in the server-options table of docs/operations.md: the help of the installed `tts`
  entry point (`tts.cli:main`) is the reference.
* The README stays a short page, and its CPU-only recipe takes torch and torchaudio from one index
  (a torchaudio from the default index is a CUDA build that fails to load beside a CPU torch).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs/fish_dual_ar.md"  # the model spec: its code blocks are fish-speech's, not ours
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted(
    p for p in (ROOT / "docs").glob("*.md") if p != SPEC
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading's text."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(anchor(line.lstrip("#")))
    return out


def code_lines(text: str) -> list[str]:
    """The lines of the fenced shell code blocks (no language, bash or sh), continuation lines (`\\`)
    joined."""
    lines, fenced, shell, joined = [], False, False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            shell = line[3:].strip() in ("", "bash", "sh", "shell")
            continue
        if fenced and shell:
            joined += line.rstrip("\\").strip() + " "
            if not line.endswith("\\"):
                lines.append(joined.strip())
                joined = ""
    return lines


def test_relative_links_resolve():
    errors = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                errors.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                errors.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert not errors, "\n".join(errors)


def test_the_checks_catch_what_they_should():
    assert anchor("Text handling: what each model reads") == "text-handling-what-each-model-reads"
    assert anchor("Scaling out: replicas") == "scaling-out-replicas"
    assert anchor("One host: `tts serve --devices`") == "one-host-tts-serve---devices"
    assert code_lines("```bash\ntts serve --a \\\n    --b\necho x\n```") == ["tts serve --a --b", "echo x"]
    assert code_lines("```python\ntts = TTS.load()\n```") == []
    assert FLAG.findall("tts bench --model x -o y --max-new-frames 3") == ["--model", "--max-new-frames"]


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """`tts SUBCOMMAND --help` of every subcommand, from one process."""
    script = """
import contextlib, io, json, sys
from tts.cli.main import main
out = {}
for cmd in sys.argv[1:]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main(cmd.split() + ["--help"])
    out[cmd] = buf.getvalue()
print(json.dumps(out))
"""
    commands = [
        "synthesize", "serve", "client", "bench", "bench-server", "eval", "text", "info", "voices",
        "voices add", "write-checkpoint",
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", script, *commands], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_documented_commands_use_flags_that_exist(helps):
    errors, checked = [], 0
    for page in PAGES:
        for line in code_lines(page.read_text()):
            for command in re.split(r"\s*(?:\||&&|;)\s*", line.split("  #")[0]):
                words = command.split()
                if len(words) < 2 or words[0] != "tts":
                    continue
                sub = " ".join(words[1:3]) if " ".join(words[1:3]) in helps else words[1]
                assert sub in helps, f"{page.name}: unknown subcommand in {command!r}"
                for flag in FLAG.findall(command):
                    checked += 1
                    if flag not in helps[sub]:
                        errors.append(f"{page.relative_to(ROOT)}: `tts {sub}` has no {flag} ({command})")
    assert not errors, "\n".join(errors)
    assert checked > 40  # the documented commands are found


def test_the_server_options_table_matches_tts_serve(helps):
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text.split("Server options", 1)[1].split("\n\n", 2)[1]
    flags = {f for row in table.splitlines() for f in FLAG.findall(row.split(" | ")[0])}
    assert len(flags) > 25
    missing = sorted(f for f in flags if f not in helps["serve"] and f != "--capture")  # (deprecated alias)
    assert not missing, missing
    options = set(re.findall(r"^ {2}(?:-\w, )?(--[a-z0-9-]+)", helps["serve"], re.M))
    assert "--max-connection-age-grace" in options and "--loop-guard" in options
    undocumented = sorted(options - flags - {"--help"})
    assert not undocumented, f"tts serve options missing from docs/operations.md: {undocumented}"


def test_the_readme_is_short_and_its_cpu_recipe_takes_one_index():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    installs = [line for line in code_lines(text) if "download.pytorch.org/whl/cpu" in line]
    assert installs and all(re.search(r"pip install torch torchaudio --index-url", i) for i in installs)
