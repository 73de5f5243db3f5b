"""Fish Audio checkpoints: S2-Pro, OpenAudio S1(-mini) and fish-speech 1.5 (docs/fish_dual_ar.md).

`load_fish_bundle` is what `tts.checkpoints.bundle.load_bundle` calls for a checkpoint directory without our
"tts_runtime" config key; `load_fish_model` loads just the language model (any family); `write_checkpoint`
writes random-weight checkpoints in the real on-disk formats (`tts write-checkpoint`). Submodules load on
first use, so `tts --help` stays fast.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FAMILIES": "loader",
    "load_fish_bundle": "loader",
    "load_fish_model": "loader",
    "SHAPES": "checkpoint",
    "write_checkpoint": "checkpoint",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
