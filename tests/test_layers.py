"""The house's layers: imports run downhill, and no import circle joins two product files.

Layers, from the bottom: `tts.params` (the request vocabulary) and `graphs` (CUDA-graph machinery, no TTS);
`tts.model` and `tts.text`; `tts.codec` (its DAC uses the model's layers and kernels); `tts.engine`,
`tts.checkpoints` and `tts.audio`; `tts.runtime`; the Python API (`tts`, `tts.api`); the fronts
(`service`); the command line (`tts.cli`); the tools (`tts_tools`). A module may import its own package
and any package on a lower floor, never one on its floor or above. Lazy imports inside functions count;
imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> floor; the longest matching prefix names a module's package.
FLOORS = {
    "tts.params": 0,
    "tts.environment": 0,
    "graphs": 0,
    "tts.model": 1,
    "tts.text": 1,
    "tts.codec": 2,
    "tts.engine": 3,
    "tts.checkpoints": 3,
    "tts.audio": 3,
    "tts.runtime": 4,
    "tts": 5,  # the package itself and the Python API (tts.api)
    "service": 6,
    "tts.cli": 7,
    "tts_tools": 8,
}
SOURCES = {
    "tts": ROOT / "tts",
    "graphs": ROOT / "graphs",
    "service": ROOT / "service",
    "tts_tools": ROOT / "tools" / "tts_tools",
}
GENERATED = "service.grpc_gen"  # protoc's output: it imports only itself


def module_files() -> dict[str, Path]:
    out = {}
    for top, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([top, *parts])
            if not name.startswith(GENERATED):
                out[name] = path
    return out


def package_of(module: str) -> str:
    best = ""
    for pkg in FLOORS:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for inner in ast.walk(sub):
                    if hasattr(inner, "lineno"):
                        lines.add(inner.lineno)
    return lines


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that module `name` (file `path`) imports, at any depth of its code,
    `if TYPE_CHECKING:` blocks aside; `known` is every module name of ours."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def test_imports_run_downhill():
    upward = []
    for module, targets in import_graph().items():
        pkg = package_of(module)
        for target in targets:
            tpkg = package_of(target)
            if tpkg != pkg and FLOORS[tpkg] >= FLOORS[pkg]:
                upward.append(
                    f"{module} ({pkg}, floor {FLOORS[pkg]}) imports {target} ({tpkg}, floor {FLOORS[tpkg]})"
                )
    assert not upward, "imports that run sideways or up:\n" + "\n".join(sorted(upward))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_between_product_files():
    graph = {m: t for m, t in import_graph().items() if not m.startswith("tts_tools")}
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from tts.engine import engine\n")
    found = imports_of("tts.model.m", path, {"tts.engine.engine", "tts.engine", "tts.model.m"})
    assert found == {"tts.engine.engine"}
    assert FLOORS[package_of("tts.engine.engine")] > FLOORS[package_of("tts.model.m")]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
