"""Engine: requests, scheduler, model runner (the frame step) and the iteration loop."""

from tts.engine.engine import Engine, EngineConfig, for_bundle
from tts.engine.request import FinishReason, InvalidRequest, Request, SamplingParams, StepOutput
from tts.engine.scheduler import QueueFull

__all__ = [
    "Engine",
    "EngineConfig",
    "FinishReason",
    "InvalidRequest",
    "QueueFull",
    "Request",
    "SamplingParams",
    "StepOutput",
    "for_bundle",
]
