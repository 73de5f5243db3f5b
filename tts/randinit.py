"""Deterministic random weights for random-weight checkpoints, identical on every machine.

Values come from the counter-based integer hash in `tts.sampling` keyed by (seed, tensor name, element
index), so a checkpoint written from a seed is bit-identical on any platform, torch version or thread
count (torch's own generators make no such promise). The tests rely on this: they regenerate tiny
checkpoints from a seed and compare them with golden outputs computed once from the same weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import Tensor

from .sampling import hash32

_MASK32 = 0xFFFFFFFF
_CHUNK = 1 << 22


def name_key(seed: int, name: str) -> int:
    """A 32-bit key for (seed, tensor name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def hashed_uniform(shape, seed: int, name: str, low: float = -1.0, high: float = 1.0) -> Tensor:
    """float32 `shape` tensor of uniform values in (low, high), a pure function of (seed, name, index).

    Uniforms have 24-bit resolution: `((h >> 8) + 0.5) / 2**24`, exact in float32.
    """
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float32)
    key = name_key(seed, name)
    for start in range(0, n, _CHUNK):
        idx = torch.arange(start, min(n, start + _CHUNK), dtype=torch.int64)
        h = hash32((idx * 0x9E3779B1 + key) & _MASK32)
        h = hash32(h ^ ((idx >> 32) & _MASK32) ^ 0x85EBCA6B)
        u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        out[start : start + idx.numel()] = low + (high - low) * u
    return out.view(*shape)


def random_like_init(shape, seed: int, name: str, std: float, mean: float = 0.0) -> Tensor:
    """Uniform values with the given mean and standard deviation (half-width std * sqrt(3))."""
    half = std * math.sqrt(3.0)
    return hashed_uniform(shape, seed, name, mean - half, mean + half)
