"""Which call imports a module: run a `tts` command and print the stack at each named module's first import.

    python tools/profile/trace_imports.py --modules torch._dynamo,sympy \\
        -- synthesize "Hello." --device cuda -o x.wav

Why: a one-shot `tts synthesize --device cuda` spent seconds importing `torch._dynamo` (and sympy), which
this project's own imports do not pull in (docs/benchmarks.md); the stack names the caller. Uses an audit hook
(`sys.addaudithook`, the "import" event), so it sees imports made anywhere, in any thread; each module's
first import is reported once, with the seconds since start, and the command's exit code is kept.
"""

import argparse
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modules", default="torch._dynamo,sympy", help="comma-separated module names")
    p.add_argument("--depth", type=int, default=40, help="stack frames printed per import")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the tts command and its arguments")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    wanted, seen, lock, t0 = set(args.modules.split(",")), set(), threading.Lock(), time.perf_counter()

    def hook(event: str, hook_args: tuple) -> None:
        if event != "import" or hook_args[0] not in wanted or hook_args[0] in sys.modules:
            return
        with lock:
            if hook_args[0] in seen:
                return
            seen.add(hook_args[0])
        print(f"== first import of {hook_args[0]} at {time.perf_counter() - t0:.2f} s:", file=sys.stderr)
        # (importlib's own frames between the callers say nothing: left out)
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<frozen")]
        print("".join(traceback.format_list(frames[-args.depth :])), end="", file=sys.stderr)

    sys.addaudithook(hook)
    from tts.cli.main import main as tts_main

    try:
        code = tts_main(command)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    print(
        f"== done in {time.perf_counter() - t0:.2f} s; not imported: {sorted(wanted - seen)}", file=sys.stderr
    )
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
