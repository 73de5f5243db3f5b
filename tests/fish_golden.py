"""Shared inputs of the Fish parity tests and their goldens (see tests/golden/README.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tts.model.randinit import hashed_randint, hashed_uniform
from tts.text.prompt import Turn, VoiceReference

GOLDEN = Path(__file__).parent / "golden"
CASES = json.loads((GOLDEN / "fish_cases.json").read_text())


def golden(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(GOLDEN / f"{name}.safetensors"))


def codes_for(item: dict, num_codebooks: int, semantic_high: int, residual_high: int) -> torch.Tensor:
    """Deterministic codes `[num_codebooks, frames]` for a reference / history item of the cases file."""
    shape = (num_codebooks, item["frames"])
    sem = hashed_randint(shape, item["seed"], "codes", semantic_high)
    res = hashed_randint(shape, item["seed"], "codes", residual_high)
    return torch.cat([sem[:1], res[1:]])


def prompt_inputs(case: dict, num_codebooks: int, semantic_high: int, residual_high: int):
    """(text, references, history) of one prompt case."""
    refs = [
        VoiceReference(codes_for(r, num_codebooks, semantic_high, residual_high), r["text"])
        for r in case["references"]
    ]
    hist = [
        Turn(h["text"], codes_for(h, num_codebooks, semantic_high, residual_high)) for h in case["history"]
    ]
    return case["text"], refs, hist


def encode_signal(seconds: float, sample_rate: int = 44100) -> torch.Tensor:
    """A reproducible test clip (two tones, a tremolo, hashed noise) rounded to 16-bit PCM values, so
    every platform feeds the encoder bit-identical float32 samples."""
    n = int(seconds * sample_rate)
    t = np.arange(n) / sample_rate
    x = 9000 * np.sin(2 * math.pi * 220 * t)
    x += 4000 * np.sin(2 * math.pi * 523.25 * t + 0.3) * (0.5 + 0.5 * np.sin(2 * math.pi * 2 * t))
    x += 2000 * hashed_uniform((n,), 7, "noise").double().numpy()
    pcm = np.round(x).astype(np.int16)
    return torch.from_numpy(pcm.astype(np.float32) / 32768.0)
