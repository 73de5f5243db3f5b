import pytest


@pytest.fixture(scope="session")
def fish_checkpoints(tmp_path_factory):
    """Tiny random Fish checkpoints in the real formats, as the parity goldens were made from them."""
    from fish_golden import CASES

    from tts.fish.checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("fish")
    out = {}
    for fam, spec in CASES["families"].items():
        out[fam] = root / spec["shape"]
        write_checkpoint(spec["shape"], out[fam], seed=spec["seed"])
    return out
