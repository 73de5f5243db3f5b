"""Regenerate the Python modules of the service API from `proto/tts/v1/tts.proto` (grpcio-tools).

    python -m service.gen_proto            # rewrite service/grpc_gen/v1/: tts_pb2.py, .pyi, tts_pb2_grpc.py
    python -m service.gen_proto --out DIR  # write them under DIR/service/grpc_gen/v1/ instead (tests compare)

The .proto is compiled with the repository root as the include path, so its descriptor keeps the file
name `proto/tts/v1/tts.proto` (the API's protobuf package stays `tts.v1`), and protoc names the modules
`proto.tts.v1.*`. They are then moved into the package `service.grpc_gen.v1` (a top-level `proto` package
would clash with the `proto-plus` distribution's), with their own module path rewritten to match: the
`tts_pb2` module name the messages are registered under, and `tts_pb2_grpc`'s import of `tts_pb2`. The
generated modules are committed; `tests/test_proto.py` checks that they match the .proto.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = "proto/tts/v1/tts.proto"
PACKAGE = "service/grpc_gen/v1"  # where the generated modules live (the Python package service.grpc_gen.v1)
GENERATED = ("tts_pb2.py", "tts_pb2.pyi", "tts_pb2_grpc.py")

# What protoc writes for PROTO_FILE -> what the modules say in PACKAGE; every pair must occur.
_RENAMES = {
    "tts_pb2.py": [("'proto.tts.v1.tts_pb2'", "'service.grpc_gen.v1.tts_pb2'")],
    "tts_pb2_grpc.py": [
        ("from proto.tts.v1 import tts_pb2 as", "from service.grpc_gen.v1 import tts_pb2 as"),
        (
            "generated code in proto/tts/v1/tts_pb2_grpc.py",
            "generated code in service/grpc_gen/v1/tts_pb2_grpc.py",
        ),
    ],
}


def generate(out_root: Path = ROOT) -> list[Path]:
    """Compile the .proto into `out_root/service/grpc_gen/v1/`; returns the generated files.

    Raises RuntimeError if protoc fails (its message is on stderr) or its output no longer has the module
    paths this rewrites, and ImportError without grpcio-tools.
    """
    from importlib.resources import files

    from grpc_tools import protoc

    well_known = str(files("grpc_tools") / "_proto")
    out_dir = Path(out_root) / PACKAGE
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE}")
        for name in GENERATED:
            text = (Path(tmp) / Path(PROTO_FILE).parent / name).read_text()
            for old, new in _RENAMES.get(name, []):
                if old not in text:
                    raise RuntimeError(f"protoc's {name} has no {old!r}: update service/gen_proto.py")
                text = text.replace(old, new)
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.gen_proto", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
