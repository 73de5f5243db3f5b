"""Engine requests: a prompt, its sampling parameters (`tts.params`), its state, blocks and outputs."""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tts.engine.aligner import LoopGuard
from tts.params import FinishReason, InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from tts.engine.realtime import Playback

__all__ = ["FinishReason", "InvalidRequest", "Request", "RequestState", "SamplingParams", "StepOutput"]


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One synthesis request inside the engine.

    prompt: `[T, 1 + N]` int64 frame columns (docs/fish_dual_ar.md §1.1) on the CPU; generation continues
    after its last column. `seed` is resolved at creation so that a request is reproducible even without a
    user seed. text_span: the prompt positions `[start, end)` of the text being spoken, which the loop
    guard follows (None: no guard); guard: its `LoopGuard` while running, and columns: the frame columns
    `[token, c_0 .. c_N-1]` kept so far (for a rewind), when guarded.
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
    arrival_time: float = field(default_factory=time.monotonic)  # (`Engine.submit`: the engine's clock)
    text_span: tuple[int, int] | None = None
    guard: LoopGuard | None = None
    columns: list[list[int]] = field(default_factory=list)
    looped: bool = False  # a repeat stayed in its frames (past the rewinds allowed): it ends with LOOP
    # Frames (counted from its first) that its consumer may have let be heard: never taken back.
    released: int = 0
    retry_until: int = 0  # after a rewind: frames generated when its sampling returns to its own (0: is)
    # A session's request (`Engine.submit(sequence=...)`, tts.engine.sequences): the kept sequence it
    # continues; cached: its leading prompt positions whose K/V the sequence already held (not
    # prefilled again); prefill_tokens: the positions it prefilled (set at admission). Its `columns`
    # record every kept frame, guarded or not (what goes back to the sequence when it ends).
    sequence: str | None = None
    cached: int = 0
    prefill_tokens: int = 0
    # Waiting for a KV block (the pool ran out): its row is inactive until one is free (tts.engine.scheduler).
    stalled: bool = False
    admission: int = 0  # order of admission among requests (1, 2, ...; 0: not admitted)
    sampled: int = 0  # frames sampled, taken back or not (the frame step's step counter)
    # An end token before this many frames kept is refused (`Engine._refuse_end`): far fewer frames than
    # its text's length predicts (0: no such floor).
    end_floor: int = 0
    end_refusals: int = 0  # end tokens refused so far
    end_reached: int = -1  # the guard's furthest trusted position at the last refusal
    end_stalls: int = 0  # refusals in a row that found it no further on
    end_masked: bool = False  # the next step samples without the end token (a refusal)
    # A stream's playback clock (tts.engine.realtime; shared by a job's requests), None: not a stream;
    # deferred: real-time admission kept it waiting at least once.
    playback: Playback | None = None
    deferred: bool = False

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

    codes: `[n, N]` int64 codebook codes of the new frames (n is 0 or 1; the end-token frame is dropped,
    docs/fish_dual_ar.md §1.4 step 8); finished with its reason when the request ended in this iteration;
    end_codes: `[1, N]` int64 codes of that end-token frame when the end token ended it (c_0 = 0), for
    families whose reference code keeps it (`tts.params.FrameConvention`), else None.
    retract: how many of the request's newest frames, handed out in earlier outputs, are taken back (the
    loop guard's rewind: they repeated text already said and will be generated again); never more than
    the previous output's `hold` allowed. hold: of a guarded request's frames handed out so far, this
    one included, how many the engine may still take back (`tts.engine.aligner.LoopGuard.retractable`):
    a consumer keeps that many newest frames unheard; 0 for unguarded requests.
    """

    request_id: str
    codes: Tensor
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    end_codes: Tensor | None = None
    retract: int = 0
    hold: int = 0
    # The text position the aligner read for this frame (`tts.engine.aligner.text_alignment`: a token
    # index into the request's text span) when the request is guarded, else None: word timings use it.
    align_position: int | None = None
