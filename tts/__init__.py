"""Inference runtime for dual-autoregressive TTS models (Fish Audio family and our own).

Start with `tts.api.TTS`; the map of the code is in docs/DESIGN.md ("How to read the code").
"""

from tts.api import TTS, AudioChunk, Synthesis, VoiceNotFound
from tts.checkpoints.bundle import ModelBundle
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig, FinishReason, InvalidRequest, SamplingParams
from tts.text.prompt import VoiceReference

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
