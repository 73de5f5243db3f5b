"""Inference runtime for dual-autoregressive TTS models (Fish Audio family and our own).

Start with `tts.api.TTS`; the map of the code is in docs/DESIGN.md ("How to read the code").

The names below are imported on first use (PEP 562), so that importing a light module of the package
(`tts.cli.main` for `tts --help`, `tts.runtime.errors`) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tts.api import TTS, AudioChunk, Synthesis, VoiceNotFound
    from tts.checkpoints.bundle import ModelBundle
    from tts.checkpoints.load import load_bundle
    from tts.engine import EngineConfig, FinishReason, InvalidRequest, SamplingParams
    from tts.text.prompt import VoiceReference

# name -> the module that defines it
_EXPORTS = {
    "TTS": "tts.api",
    "AudioChunk": "tts.api",
    "Synthesis": "tts.api",
    "VoiceNotFound": "tts.api",
    "ModelBundle": "tts.checkpoints.bundle",
    "load_bundle": "tts.checkpoints.load",
    "EngineConfig": "tts.engine",
    "FinishReason": "tts.engine",
    "InvalidRequest": "tts.engine",
    "SamplingParams": "tts.engine",
    "VoiceReference": "tts.text.prompt",
}

__all__ = [
    "TTS",
    "AudioChunk",
    "EngineConfig",
    "FinishReason",
    "InvalidRequest",
    "ModelBundle",
    "SamplingParams",
    "Synthesis",
    "VoiceNotFound",
    "VoiceReference",
    "load_bundle",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tts' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (once: later lookups find it directly)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
