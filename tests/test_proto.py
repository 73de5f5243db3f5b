"""The committed generated modules of the service API (service/grpc_gen/v1) match proto/tts/v1/tts.proto."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "service" / "grpc_gen" / "v1"


def serialized_descriptor(path: Path) -> bytes:
    """The FileDescriptorProto bytes a generated *_pb2.py registers (its AddSerializedFile argument)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise AssertionError(f"no AddSerializedFile call in {path}")


def grpc_methods(path: Path) -> set[str]:
    return set(re.findall(r"'(/tts\.v1\.TextToSpeech/\w+)'", path.read_text()))


def test_committed_modules_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    from service.gen_proto import GENERATED, generate

    fresh = {p.name: p for p in generate(tmp_path)}
    assert set(fresh) == set(GENERATED)
    # Version-independent: the same descriptor and the same RPC methods.
    assert serialized_descriptor(fresh["tts_pb2.py"]) == serialized_descriptor(COMMITTED / "tts_pb2.py"), (
        "service/grpc_gen/v1/tts_pb2.py is stale: run `python -m service.gen_proto`"
    )
    assert grpc_methods(fresh["tts_pb2_grpc.py"]) == grpc_methods(COMMITTED / "tts_pb2_grpc.py")
    # With the grpcio-tools version that generated the committed files: byte-identical files.
    committed_version = re.search(
        r"GRPC_GENERATED_VERSION = '([^']+)'", (COMMITTED / "tts_pb2_grpc.py").read_text()
    )
    if committed_version and committed_version.group(1) == importlib.metadata.version("grpcio-tools"):
        for name in GENERATED:
            assert fresh[name].read_text() == (COMMITTED / name).read_text(), f"{name} differs; regenerate"


def test_generated_modules_describe_the_api():
    from service.grpc_gen.v1 import tts_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["TextToSpeech"]
    assert service.full_name == "tts.v1.TextToSpeech"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {
        "Synthesize",
        "SynthesizeUnary",
        "ListVoices",
        "GetInfo",
        "AddVoice",
        "DeleteVoice",
        "SynthesizeSession",
    }
    assert methods["Synthesize"].server_streaming and not methods["SynthesizeUnary"].server_streaming
    session = methods["SynthesizeSession"]
    assert session.client_streaming and session.server_streaming  # bidi
    assert pb.SynthesizeRequest().sampling.HasField("seed") is False  # optional fields keep presence


def test_the_grpcio_floor_runs_the_generated_modules():
    """The committed modules refuse a grpcio older than the grpcio-tools that generated them, so the
    requirement in pyproject.toml must be at least that version (a user installing the floor gets a
    server that cannot start otherwise)."""
    import tomllib

    generated = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", (COMMITTED / "tts_pb2_grpc.py").read_text())
    assert generated
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if re.match(r"grpcio>=", d)).split(">=")[1]

    def as_tuple(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))

    assert as_tuple(floor) >= as_tuple(generated.group(1)), (floor, generated.group(1))
