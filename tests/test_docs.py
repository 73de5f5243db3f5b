"""Citations of the project's documents resolve, and no file points outside the repository.

Comments, docstrings and Markdown cite the Fish model spec as `docs/fish_dual_ar.md §1.4` (a section
heading of that file; optionally `§1.4 step 8`, `§1.4 steps 4-6` or `§7 item 1` for a numbered item of
the section; several as `§2.2, §2.5` or `§3 and §4`, on the same line as the file name) and the design's
invariants as `docs/DESIGN.md invariant 7` (`invariants 1, 4, 5, 6`, `invariants 1-4`). Every cited
section, item and invariant must exist. The older forms (the word spec and a section number, a document's
name without its folder, an invariant number without the file) are refused: a reader cannot tell which
file they mean. This file's own example strings are not citations and are not scanned.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = "docs/fish_dual_ar.md"
DESIGN = "docs/DESIGN.md"
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "node_modules", ".pytest_cache", ".ruff_cache", "build"}
BINARY = {".safetensors", ".pth", ".pt", ".bin", ".npz", ".npy", ".wav", ".flac", ".png", ".gz"}

REF = r"§(\d+(?:\.\d+)?)(?: (steps?|items?) (\d+)(?:-(\d+))?)?"
SPEC_CITE = re.compile(re.escape(SPEC) + r"(?:(?:,| and|, and| or| /)? " + REF + r")+")
SECTION_REF = re.compile(REF)
DESIGN_CITE = re.compile(re.escape(DESIGN) + r" invariants? (\d+(?:-\d+)?(?:(?:,|, and| and) \d+(?:-\d+)?)*)")
BARE_INVARIANT = re.compile(r"\binvariants? \d")
OLD_FORMS = re.compile(
    r"\b[Ss]pec,? (?:sections? )?\d+(?:\.\d+)?"  # the word spec, then a section number
    r"|\bFish spec\b"
    r"|(?<![\w/.-])(?:DESIGN|fish_dual_ar)\.md"  # the file without its folder
)
# Paths outside the repository: the sibling shared folder, or an absolute path into a work tree
# (the patterns are spelled so that this file does not match them itself).
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.~-])/work(?=/)|(?<![\w/.-])shared/(?:reference|DESIGN)")


def files() -> list[str]:
    """Repository-relative paths of the files a commit would hold (tracked or not ignored)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = sorted(set(p for p in out.split("\0") if p))
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        paths = []
        for top, dirs, names in os.walk(ROOT):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            paths += [Path(top, n).relative_to(ROOT).as_posix() for n in sorted(names)]
    return [p for p in paths if (ROOT / p).is_file()]


def text_files() -> dict[str, str]:
    out = {}
    for p in files():
        if Path(p).suffix.lower() in BINARY:
            continue
        data = (ROOT / p).read_bytes()
        if b"\0" in data[:8192]:
            continue
        out[p] = data.decode("utf-8", errors="replace")
    return out


def is_cited_source(path: str) -> bool:
    """The .py and .md files whose comments and docstrings cite the documents (not generated code)."""
    return path.endswith((".py", ".pyi", ".md")) and "_pb2" not in path and path != THIS


def is_run_record(path: str) -> bool:
    """Recorded results (JSON, logs) keep the machine path a run was made from; they point no reader
    anywhere, so the outside-path rule does not apply to them."""
    return path.split("/")[0] == "benchmarks" and path.endswith((".json", ".log", ".txt", ".csv"))


def spec_sections(text: str) -> dict[str, set[int]]:
    """Section number -> the numbers of the numbered items in that section's own text."""
    sections: dict[str, set[int]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("#"):
            m = re.match(r"#+ (\d+(?:\.\d+)?)\.? ", line)
            current = m.group(1) if m else None
            if current is not None:
                sections[current] = set()
        elif current is not None:
            m = re.match(r"(\d+)\. ", line)
            if m:
                sections[current].add(int(m.group(1)))
    return sections


def design_invariants(text: str) -> set[int]:
    body = text.split("\n## Invariants", 1)[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. ", body, re.M)}


def numbers(spec: str) -> list[int]:
    out = []
    for part in re.split(r",? and |, ", spec):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def check_citations(path: str, text: str, sections: dict[str, set[int]], invariants: set[int]) -> list[str]:
    """The problems with the citations in one file, as `path:line: what`."""
    errors = []

    def section_errors(m: re.Match) -> list[str]:
        sec, kind, first, last = m.groups()
        if sec not in sections:
            return [f"{SPEC} has no section {sec}"]
        if kind is None:
            return []
        wanted = range(int(first), int(last or first) + 1)
        missing = [n for n in wanted if n not in sections[sec]]
        return [f"{SPEC} §{sec} has no numbered {kind.rstrip('s')} {n}" for n in missing]

    for no, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{no}"
        if path == SPEC:  # the spec's references to its own sections
            errors += [f"{where}: {e}" for m in SECTION_REF.finditer(line) for e in section_errors(m)]
            continue
        covered = []
        for cite in SPEC_CITE.finditer(line):
            covered.append(cite.span())
            for m in SECTION_REF.finditer(cite.group(0)):
                errors += [f"{where}: {e}" for e in section_errors(m)]
        for m in re.finditer("§", line):
            if not any(a <= m.start() < b for a, b in covered):
                errors.append(f"{where}: '§' without `{SPEC} ` before it on the same line")
        designs = []
        for cite in DESIGN_CITE.finditer(line):
            designs.append(cite.span())
            missing = [n for n in numbers(cite.group(1)) if n not in invariants]
            errors += [f"{where}: {DESIGN} has no invariant {n}" for n in missing]
        for m in BARE_INVARIANT.finditer(line):
            if not any(a <= m.start() < b for a, b in designs):
                errors.append(f"{where}: cite an invariant as `{DESIGN} invariant N`")
        for m in OLD_FORMS.finditer(line):
            errors.append(f"{where}: {m.group(0)!r}: cite as `{SPEC} §X.Y` or `{DESIGN} invariant N`")
    return errors


@pytest.fixture(scope="module")
def repo() -> dict[str, str]:
    return text_files()


@pytest.fixture(scope="module")
def docs(repo):
    return spec_sections(repo[SPEC]), design_invariants(repo[DESIGN])


def test_the_cited_documents_are_in_the_repository(repo, docs):
    sections, invariants = docs
    assert {"1.4", "3.2", "4.1", "7"} <= set(sections) and {1, 8} <= sections["1.4"]
    assert invariants == set(range(1, len(invariants) + 1)) and len(invariants) >= 8


def test_every_citation_resolves(repo, docs):
    errors = []
    cited = 0
    for path, text in repo.items():
        if is_cited_source(path):
            errors += check_citations(path, text, *docs)
            cited += len(SPEC_CITE.findall(text)) + len(DESIGN_CITE.findall(text))
    assert not errors, "unresolvable citations:\n" + "\n".join(errors)
    assert cited > 40  # the code does cite them: the patterns still match what is written


def test_no_file_points_outside_the_repository(repo):
    errors = [
        f"{path}:{no}: {m.group(0)!r}"
        for path, text in repo.items()
        if not is_run_record(path)
        for no, line in enumerate(text.splitlines(), 1)
        for m in OUTSIDE.finditer(line)
    ]
    assert not errors, "paths outside the repository:\n" + "\n".join(errors)
    assert "README.md" in repo


def test_the_checker_catches_bad_citations(docs):
    sections, invariants = docs
    ok = [
        f"# {SPEC} §1.4 step 8, {DESIGN} invariant 7",
        f"({SPEC} §2.2, §2.5 and §1.4 steps 4-6; {SPEC} §7 item 1; {DESIGN} invariants 1-4, 6)",
    ]
    assert check_citations("x.py", "\n".join(ok), sections, invariants) == []
    bad = {
        f"# {SPEC} §9.9": "no section 9.9",
        f"# {SPEC} §1.4 step 99": "no numbered step 99",
        f"# {SPEC} §1.2, §8.5": "no section 8.5",
        "# the layout (§1.3)": "without",
        f"# {DESIGN} invariants 1, 99": "no invariant 99",
        "# padding is harmless (invariant 4)": "cite an invariant",
        "# sampling (spec 4.1)": "cite as",
        "# sampling (Fish spec section 4)": "cite as",
        "# see DESIGN.md": "cite as",
    }
    for line, why in bad.items():
        errors = check_citations("x.py", "\n\n" + line, sections, invariants)
        assert errors and all(e.startswith("x.py:3: ") for e in errors) and why in errors[0], (line, errors)
    assert OUTSIDE.search("see " + "../" + "shared/x") and OUTSIDE.search("at " + "/wo" + "rk/main/tts")
    assert not OUTSIDE.search("--out training/work/codec_vq3") and is_run_record("benchmarks/codec/x.json")
