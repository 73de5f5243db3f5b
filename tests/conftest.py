import pytest
import torch

from tts.checkpoints.bundle import build_tiny_bundle


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def standin_graphs(monkeypatch):
    """Every engine this test builds on a CPU runs its "lazy" / "startup" graphs (`EngineConfig.graphs`,
    `prefill_graphs`) as stand-ins (`graphs.runner.StandInGraph`: a replay runs the step again on the
    same buffers) instead of none, so that bucket choice, padding, capture and replay run without CUDA.
    (On a CUDA device engines have real graphs anyway.)"""
    from tts.engine.engine import Engine

    monkeypatch.setattr(Engine, "graphs_supported", lambda self: True)


@pytest.fixture(scope="session")
def tiny_bundle():
    """The tiny random-weight model in fp32 on CPU (shared; tests must not modify it)."""
    return build_tiny_bundle()


@pytest.fixture(scope="session")
def tiny_model(tiny_bundle):
    return tiny_bundle.model


@pytest.fixture(scope="session")
def fish_checkpoints(tmp_path_factory):
    """Tiny random Fish checkpoints in the real formats, as the parity goldens were made from them."""
    from fish_golden import CASES

    from tts.checkpoints.fish.writer import write_checkpoint

    root = tmp_path_factory.mktemp("fish")
    out = {}
    for fam, spec in CASES["families"].items():
        out[fam] = root / spec["shape"]
        write_checkpoint(spec["shape"], out[fam], seed=spec["seed"])
    return out
