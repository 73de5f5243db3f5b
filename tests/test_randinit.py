"""The deterministic random weights the Fish goldens depend on."""

import torch

from tts.checkpoints.fish.writer import write_checkpoint
from tts.model.randinit import hashed_randint, hashed_uniform, random_like_init


def test_hashed_values_are_pinned():
    # The parity goldens were computed from checkpoints made of these values: if this fails, the
    # generator changed and tests/golden must be regenerated (tests/golden/README.md).
    assert hashed_uniform((4,), 1, "x").tolist() == [
        0.4116246700286865,
        0.13970565795898438,
        -0.16278594732284546,
        -0.11111718416213989,
    ]
    assert hashed_randint((5,), 11, "codes", 4096).tolist() == [3223, 319, 404, 2046, 586]


def test_uniform_statistics_and_independence():
    x = random_like_init((200_000,), 3, "w", std=0.5, mean=1.0)
    assert abs(float(x.mean()) - 1.0) < 0.01 and abs(float(x.std()) - 0.5) < 0.01
    assert not torch.equal(hashed_uniform((8,), 3, "a"), hashed_uniform((8,), 3, "b"))
    assert not torch.equal(hashed_uniform((8,), 3, "a"), hashed_uniform((8,), 4, "a"))


def test_written_checkpoints_are_a_function_of_the_seed(tmp_path):
    a, b, c = (write_checkpoint("tiny-1.5", tmp_path / n, seed=s) for n, s in (("a", 2), ("b", 2), ("c", 3)))
    sa, sb, sc = (torch.load(r.path / "model.pth", weights_only=True) for r in (a, b, c))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attention.wqkv.weight"], sc["layers.0.attention.wqkv.weight"])
