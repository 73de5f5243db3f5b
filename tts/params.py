"""What a caller asks of one generation: sampling parameters, how a generation ends, bad-input errors.

A leaf module (no engine, no model): the request planner, the bundle and the engine all use it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# The most frames one audio chunk may hold (first_chunk_frames, chunk_frames): the codec stage decodes
# a chunk in one call (tts.runtime.codec_stage).
MAX_CHUNK_FRAMES = 256
# An audio stream's chunks: the first two of DEFAULT_FIRST_CHUNK_FRAMES frames (first audio early),
# then doubling up to DEFAULT_CHUNK_FRAMES (`chunk_size` says why).
DEFAULT_FIRST_CHUNK_FRAMES = 4
DEFAULT_CHUNK_FRAMES = 16


def chunk_size(first: int, later: int, sequence: int) -> int:
    """Frames in audio chunk `sequence` (0, 1, 2, ...) of a job: `first` twice, then doubling up to
    `later` (4, 4, 8, 16, 16, ... by default), at most MAX_CHUNK_FRAMES. The job runner releases a
    job's audio in these chunks (tts.runtime.jobs); the engine's real-time admission predicts the
    releases from them (tts.engine.realtime).

    Why a ramp: a player starts on chunk 0 and must have chunk k before the audio of chunks 0..k-1
    has played, so a job must generate at sum(sizes 1..k) / sum(sizes 0..k-1) times real time.
    Jumping from 4 frames to 16 needs 4x; doubling from the first chunk (4, 8, 16) 2x; repeating the
    first size once (4, 4, 8, 16) 1.75x, the tightest chunk being chunk 3 (16 frames: 28 frames
    generated while the 16 of chunks 0-2 play). Measured on a 2-core CPU, default voice, 4 clients at
    about 2.4x real time each (four runs each way): with 4 then 16, every request had a late chunk,
    272-278 ms late at worst; with doubling from the first chunk 3 to 12 of 12 requests did, 4-36 ms
    late at worst, at the same frames/s (docs/benchmarks.md). A `later` below `first` gives `later`
    from the second chunk on, without doubling.
    """
    size = first if sequence == 0 else min(later, first << min(sequence - 1, 16))
    return min(max(size, 1), MAX_CHUNK_FRAMES)


# Admission (tts.engine.scheduler, tts.engine.realtime; `tts serve`'s defaults): prompt tokens prefilled per
# engine iteration at most; the seconds of audio a playing stream keeps ahead of its player when a request
# is admitted, and the longest a request waits for that before it is admitted anyway; the prompt tokens of a
# prefill pass up to which a waiting request rides along with a pass that runs anyway (tts.engine.realtime).
DEFAULT_MAX_PREFILL_TOKENS = 2048
DEFAULT_REALTIME_MARGIN = 0.05
DEFAULT_REALTIME_MAX_WAIT = 0.15
RIDE_ALONG_TOKENS = 256

# The KV block pool on CUDA: this share of the free device memory at start-up (`--kv-memory-fraction`); and
# `--max-batch auto` sizes the batch for streams of AUTO_STREAM_TOKENS context tokens each.
DEFAULT_KV_MEMORY_FRACTION = 0.5
AUTO_STREAM_TOKENS = 2048

# Sampling constants shared by the torch sampler and its Triton kernel (tts.model.sampling,
# tts.model.kernels.sampling): a temperature below MIN_TEMPERATURE samples greedily; repetition-aware
# sampling resamples a repeated token at RAS_HIGH_TEMPERATURE / RAS_HIGH_TOP_P.
RAS_HIGH_TEMPERATURE = 1.0
RAS_HIGH_TOP_P = 0.9
MIN_TEMPERATURE = 1e-5


class InvalidRequest(ValueError):
    """A request that can never run (bad parameter, too long for the context). Maps to INVALID_ARGUMENT.
    `parameter`: the SamplingParams field at fault where one is (`SamplingParams.validate`), else None."""

    def __init__(self, message: str = "", *, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


class FinishReason(str, enum.Enum):
    STOP = "stop"  # the model emitted the end token (<|im_end|>)
    LENGTH = "length"  # the request hit its frame budget (max_new_frames, the runaway guard, a limit)
    SHORT = "short"  # ended by the end token with implausibly little audio for its text
    LOOP = "loop"  # kept a repetition loop that the loop guard could not mend (tts.engine.aligner)
    CANCELLED = "cancelled"
    ERROR = "error"
    # Ended by the engine to free its KV blocks: the pool ran out mid-stream and no running request
    # could decode (tts.engine.scheduler). Maps to RESOURCE_EXHAUSTED.
    PREEMPTED = "preempted"


# The most a repetition penalty may be (fish-speech asserts 0 < penalty < 2).
MAX_REPETITION_PENALTY = 2.0


@dataclass(frozen=True)
class FrameConvention:
    """Which generated frames of a text chunk become audio, as the family's reference code returns them.

    Every family generates frames until the end token (`<|im_end|>`) or the frame budget. fish-speech
    main (S2) and the S1-era code return every frame except the end-token frame; fish-speech 1.5
    returns `y[1:, prompt_length + 1:]`: it drops the first generated frame and keeps the end-token
    frame (its codes: c_0 = 0, the residual codes sampled as in any frame). drop_first: the chunk's
    first frame is not audio; keep_end: the end-token frame is (unless it is the first frame).
    The engine emits every frame but the end-token one and hands that one over separately
    (`StepOutput.end_codes`); the job runner applies this convention.
    """

    drop_first: bool = False
    keep_end: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (docs/fish_dual_ar.md §4).

    temperature >= 0 (0 = greedy); top_p in (0, 1]; top_k >= 0 (0 = no limit); max_new_frames > 0
    frames; min_new_frames in [0, max_new_frames]: the end token is not sampled before that many frames
    (vLLM's `min_tokens`; a stream of known length for tests and benchmarks); seed: any int, or None for
    a random one chosen at submission; ras_window in [0, 10] main tokens (0 disables repetition-aware
    sampling); repetition_penalty in (0, 2) (1 = off): fish-speech 1.5's and S1's penalty on the
    tokens of the last 16 frames (a positive logit divided by it, a negative one multiplied), applied
    where the model family's reference applies it and ignored by the others (S2, the default model).
    """

    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    max_new_frames: int = 1024
    seed: int | None = None
    ras_window: int = 10
    min_new_frames: int = 0
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad field."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}", parameter="temperature")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", parameter="top_p")
        if not 0 <= self.top_k < 2**31:
            raise InvalidRequest(
                f"top_k must be in [0, 2**31) (0 = no limit), got {self.top_k}", parameter="top_k"
            )
        if self.max_new_frames <= 0:
            raise InvalidRequest(
                f"max_new_frames must be > 0, got {self.max_new_frames}", parameter="max_new_frames"
            )
        if not 0 <= self.min_new_frames <= self.max_new_frames:
            raise InvalidRequest(
                f"min_new_frames must be in [0, max_new_frames = {self.max_new_frames}], got "
                f"{self.min_new_frames}",
                parameter="min_new_frames",
            )
        if not (
            math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty < MAX_REPETITION_PENALTY
        ):
            raise InvalidRequest(
                f"repetition_penalty must be in (0, 2) (1 = off), got {self.repetition_penalty}",
                parameter="repetition_penalty",
            )
        if not 0 <= self.ras_window <= 10:
            raise InvalidRequest(
                f"ras_window must be in [0, 10], got {self.ras_window}", parameter="ras_window"
            )
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest("seed must fit in a signed 64-bit integer", parameter="seed")
