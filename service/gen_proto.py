"""Regenerate the Python modules of the service API from `proto/tts/v1/tts.proto` (grpcio-tools).

    python -m service.gen_proto            # rewrite proto/tts/v1/tts_pb2.py, tts_pb2.pyi, tts_pb2_grpc.py
    python -m service.gen_proto --out DIR  # write them under DIR/proto/tts/v1/ instead (tests compare)

The .proto is compiled with the repository root as the include path, so the generated modules import
each other as `proto.tts.v1.*` (the API's protobuf package stays `tts.v1`). The generated modules are
committed; `tests/test_proto.py` checks that they match the .proto.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = "proto/tts/v1/tts.proto"
GENERATED = ("tts_pb2.py", "tts_pb2.pyi", "tts_pb2_grpc.py")


def generate(out_root: Path = ROOT) -> list[Path]:
    """Compile the .proto into `out_root/proto/tts/v1/`; returns the generated files.

    Raises RuntimeError if protoc fails (its message is on stderr) and ImportError without grpcio-tools.
    """
    from importlib.resources import files

    from grpc_tools import protoc

    well_known = str(files("grpc_tools") / "_proto")
    out_root = Path(out_root)
    (out_root / Path(PROTO_FILE).parent).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_root}",
        f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", str(ROOT / PROTO_FILE),
    ]  # fmt: skip
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    return [out_root / Path(PROTO_FILE).parent / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.gen_proto", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
