"""Engine: requests, scheduler, model runner (the frame step) and the iteration loop."""

from .engine import Engine, EngineConfig, for_bundle
from .request import FinishReason, InvalidRequest, Request, SamplingParams, StepOutput
from .scheduler import QueueFull

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
