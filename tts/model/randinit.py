"""Deterministic random weights for random-weight checkpoints, identical on every machine.

Values come from the counter-based integer hash of `tts.model.sampling.hash32` keyed by (seed, tensor name,
element index), so a checkpoint written from a seed is bit-identical on any platform, torch version or thread
count (torch's own generators make no such promise). The tests rely on this: they regenerate tiny checkpoints
from a seed and compare them with golden outputs computed once from the same weights.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_CHUNK = 1 << 22


def name_key(seed: int, name: str) -> int:
    """A 32-bit key for (seed, tensor name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _hash32(x: np.ndarray) -> np.ndarray:
    # tts.model.sampling.hash32 on uint32 (numpy wraps multiplication modulo 2**32, so no masking is needed).
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x21F0AAAD)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x735A2D97)
    return x ^ (x >> np.uint32(15))


def hashed_uniform(shape, seed: int, name: str, low: float = -1.0, high: float = 1.0) -> Tensor:
    """float32 `shape` tensor of uniform values in (low, high), a pure function of (seed, name, index).

    Element i is `low + (high - low) * u` with `u = ((h >> 8) + 0.5) / 2**24` (exact in float32) and
    `h = hash32((i * 0x9E3779B1 + key + (i >> 32)) mod 2**32)`, key = name_key(seed, name).
    """
    n = math.prod(shape)
    out = np.empty(n, dtype=np.float32)
    key = np.uint32(name_key(seed, name))
    for start in range(0, n, _CHUNK):
        idx = np.arange(start, min(n, start + _CHUNK), dtype=np.uint64)
        x = ((idx * np.uint64(0x9E3779B1)) + np.uint64(key) + (idx >> np.uint64(32))) & np.uint64(_MASK32)
        h = _hash32(x.astype(np.uint32))
        u = ((h >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24))
        out[start : start + idx.size] = np.float32(low) + np.float32(high - low) * u
    return torch.from_numpy(out).view(*shape)


# Above this many elements a torch generator is used (several times faster); such tensors only occur in
# full-size checkpoints (benchmarks), which do not need cross-machine bit reproducibility.
HASHED_MAX_ELEMENTS = 1 << 22


def random_like_init(shape, seed: int, name: str, std: float, mean: float = 0.0) -> Tensor:
    """float32 uniform values with the given mean and standard deviation (half-width std * sqrt(3)).

    Tensors up to HASHED_MAX_ELEMENTS come from `hashed_uniform` (identical everywhere); larger ones from
    a torch CPU generator seeded from (seed, name), which is fast and deterministic for a given torch
    build but not guaranteed across torch versions.
    """
    half = std * math.sqrt(3.0)
    if math.prod(shape) <= HASHED_MAX_ELEMENTS:
        return hashed_uniform(shape, seed, name, mean - half, mean + half)
    gen = torch.Generator().manual_seed(name_key(seed, name))
    out = torch.empty(*shape, dtype=torch.float32)
    return out.uniform_(mean - half, mean + half, generator=gen)


def random_weight_norm(key: str, shape, seed: int, storage: str) -> dict[str, Tensor]:
    """A random weight-normalized conv weight `key` (`base.weight`) as a checkpoint stores it: the
    direction v (unit variance) and the magnitude g (about 0.8 per output channel, so each channel's
    weight norm stays near 1 and random codecs give finite, non-saturated audio), under the keys of
    `storage`: "parametrization" (`base.parametrizations.weight.original0/1`), "old"
    (`base.weight_g/weight_v`) or "fused" (`base.weight = torch._weight_norm(v, g, 0)`)."""
    base = key.rpartition(".")[0]
    v = random_like_init(shape, seed, key + ".v", std=1.0)
    g = random_like_init((shape[0], 1, 1), seed, key + ".g", std=0.15, mean=0.8)
    if storage == "fused":
        return {key: torch._weight_norm(v, g, 0)}
    if storage == "parametrization":
        return {
            f"{base}.parametrizations.weight.original0": g,
            f"{base}.parametrizations.weight.original1": v,
        }
    return {f"{base}.weight_g": g, f"{base}.weight_v": v}


def hashed_randint(shape, seed: int, name: str, high: int) -> Tensor:
    """int64 `shape` tensor of integers in [0, high), a pure function of (seed, name, index)."""
    u = hashed_uniform(shape, seed, name, 0.0, 1.0).double()
    return torch.clamp((u * high).floor(), 0, high - 1).to(torch.int64)
