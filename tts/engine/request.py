"""Requests, their sampling parameters and how they end."""

from __future__ import annotations

import enum
import math
import secrets
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor


class InvalidRequest(ValueError):
    """A request that can never run (bad parameter, too long for the context). Maps to INVALID_ARGUMENT."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # the model emitted the end token (<|im_end|>)
    LENGTH = "length"  # the request hit max_new_frames
    CANCELLED = "cancelled"
    ERROR = "error"


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (Fish spec section 4).

    temperature >= 0 (0 = greedy); top_p in (0, 1]; top_k >= 0 (0 = no limit); max_new_frames > 0
    frames; min_new_frames in [0, max_new_frames]: the end token is not sampled before that many frames
    (vLLM's `min_tokens`; a stream of known length for tests and benchmarks); seed: any int, or None for
    a random one chosen at submission; ras_window in [0, 10] main tokens (0 disables repetition-aware
    sampling).
    """

    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    max_new_frames: int = 1024
    seed: int | None = None
    ras_window: int = 10
    min_new_frames: int = 0

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise InvalidRequest(f"top_k must be in [0, 2**31) (0 = no limit), got {self.top_k}")
        if self.max_new_frames <= 0:
            raise InvalidRequest(f"max_new_frames must be > 0, got {self.max_new_frames}")
        if not 0 <= self.min_new_frames <= self.max_new_frames:
            raise InvalidRequest(
                f"min_new_frames must be in [0, max_new_frames = {self.max_new_frames}], got {self.min_new_frames}"
            )
        if not 0 <= self.ras_window <= 10:
            raise InvalidRequest(f"ras_window must be in [0, 10], got {self.ras_window}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest("seed must fit in a signed 64-bit integer")


@dataclass(eq=False)
class Request:
    """One synthesis request inside the engine.

    prompt: `[T, 1 + N]` int64 frame columns (spec 1.1) on the CPU; generation continues after its last
    column. `seed` is resolved at creation so that a request is reproducible even without a user seed.
    """

    request_id: str
    prompt: Tensor
    params: SamplingParams
    seed: int = 0
    state: RequestState = RequestState.WAITING
    blocks: list[int] = field(default_factory=list)
    num_generated: int = 0
    paused: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.seed = self.params.seed
        else:
            self.seed = secrets.randbits(63)
        self.prompt = torch.as_tensor(self.prompt, dtype=torch.int64)

    @property
    def prompt_len(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def max_tokens(self) -> int:
        """Context slots this request may ever use: prompt + every frame it may generate."""
        return self.prompt_len + self.params.max_new_frames


@dataclass
class StepOutput:
    """What one engine iteration produced for one request.

    codes: `[n, N]` int64 codebook codes of the new frames (n is 0 or 1; the end-token frame is
    dropped, spec 1.4 step 8); finished with its reason when the request ended in this iteration.
    """

    request_id: str
    codes: Tensor
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
