"""Real-time admission: a waiting request is admitted only when no playing stream falls behind for it.

A stream is a request submitted with a `Playback`. Its consumer releases its audio in chunks
(`tts.params.chunk_size`: 4, 4, 8, 16, 16, ... frames, as tts.runtime.jobs does), and a player starts on
the first chunk and plays `rate` frames a second. So the player runs dry at
`deadline = started + released / rate` (started: when the first chunk was released, moved on by any
gap where the player ran dry and waited for a late chunk; released: the frames of the chunks released
so far), and the next chunk is released `need` frames later. At a frame step of `s` seconds the
stream's SLACK is

    slack(s) = deadline - now - need * s

the time by which its next chunk beats the player. Admitting requests stops every running row for
their prefill `p` (each admitted prompt is prefilled before the next frame step) and makes the step
slower (`s'`, the batch grows). The head of the queue is admitted in an iteration only if

1. (speed) it would keep real time itself: at `s'` each chunk of its ramp is released before the
   audio before it has played (`Playback.ramp_slack(s') >= 0`; the default ramp needs 1.75x real
   time, at its fourth chunk: a step of at most 4/7 of the frame period);
2. (slack) every playing stream keeps `slack(s') - p >= margin` -- unless the request has waited
   `max_wait` seconds (the time-to-first-audio budget), continues a stream whose player already
   runs (a job's next text chunk), or rides along: an earlier request of its kind (fresh, or
   continuing a session's kept sequence: the two go in separate passes) is prefilled in this iteration
   anyway, the engine packs them into one pass, and the pass stays within RIDE_ALONG_TOKENS prompt
   tokens (`tts.params`: up to about there a pass costs little more than its first prompt; four
   prompts of 100 tokens cost 1.4x one beside the codec, eight 2x). A rider skips the slack check
   (its prefill and the larger batch's step), not the speed rule;
3. (gathering, `gather` seconds, off by default; below `max_wait`) a fresh request that would open a
   packed prefill pass of its own (no request of its kind admitted in this iteration) while streams
   play waits until it has waited `gather`, so that requests arriving meanwhile may share its pass
   (as slack permits, or riding along). The head of the queue waiting holds up the requests behind
   it, so it gathers only while none of them must not wait (`must_not_wait`: a stream whose player
   runs, a session's continuation). A request is counted once, by the first reason it waited.

Riding along is what keeps an overloaded engine from paying one prefill pass per request: a pass
stops every stream for about the same time whether it carries one short prompt or four, while the
codec's convolutions share the GPU (S2-Pro on an H100, a graphed pass: 5.9 ms for one prompt of 60
tokens and 8.2 ms for four, alone; 43.4 and 45.5 ms beside a 48-stream codec call, whose kernels
hold the SMs that each of the pass's hundreds of kernels waits for). A request deferred now would
be forced within `max_wait` anyway, and then in a pass of its own.

With nothing running a request is always admitted (nothing to protect; its steps are measured). A
deferred request waits while the frame steps go on and the streams build slack (a stream at 2.7x real
time gains 1.7 s of slack a second); the next iteration asks again. Rule 1 never gives way to
`max_wait`: a batch too slow for one more stream takes none until a stream ends (the bounded queue
refuses the excess, RESOURCE_EXHAUSTED, so that a load balancer sends it elsewhere).

`StepTimes` gives `s'` and `p`: moving averages of the engine's own host wall times (the frame step up
to its frame on the host, the sync the engine does anyway: no new one), per rows computed (a graph's
bucket, or the batch size when eager), and of the prefill's extra time per iteration that prefilled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tts.engine.request import Request
from tts.params import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_FIRST_CHUNK_FRAMES,
    MAX_CHUNK_FRAMES,
    RIDE_ALONG_TOKENS,
    chunk_size,
)

# Weight of a new measurement in the moving averages (about the last 10 frame steps count).
STEP_EMA = 0.1
PREFILL_EMA = 0.25
DEFERRAL_REASONS = ("slack", "speed", "gather")
# Seconds after which a step time not measured again gives way to a fresher one: a batch size whose only
# sample was slow (another load on the GPU at that moment) would otherwise never be reached again to be
# measured anew, since the speed rule keeps the batch below it.
STEP_STALE = 5.0


@dataclass(eq=False)
class Playback:
    """The playback clock of one stream (a job: the requests of its text chunks share one).

    rate: audio frames per second. first, later: its chunk sizes (`tts.params.chunk_size`). The engine
    keeps the rest up to date (its own clock): base, the audio frames of the stream's finished requests;
    frames, those its consumer may release now; released and chunks, what it released (the frames of
    whole chunks, and how many); next_at, the frames at which the next chunk is due; started, when the
    first chunk was released (None: not yet), moved later by the gaps where the player ran dry (it
    plays a late chunk from its release on). A session's chunks of one turn share one clock too
    (`next_job`: each chunk's job starts the ramp again).
    The loop guard's held frames are not counted until released. A finished request counts its frames
    as the engine generated them, its end-token frame included, so a stream of several text chunks is
    counted about a frame ahead per chunk (`tts.params.FrameConvention` decides what is audio).
    """

    rate: float
    first: int = DEFAULT_FIRST_CHUNK_FRAMES
    later: int = DEFAULT_CHUNK_FRAMES
    base: int = 0
    frames: int = 0
    released: int = 0
    chunks: int = 0
    next_at: int = 0
    started: float | None = None

    def __post_init__(self) -> None:
        self.next_at = self.released + self.due()

    def due(self) -> int:
        """Frames of the next chunk."""
        return chunk_size(self.first, self.later, self.chunks)

    def advance(self, frames: int, now: float) -> None:
        """The running request has `frames` releasable audio frames at time `now`: release what its
        consumer would (a due chunk, and with it any held frames let go: pieces of MAX_CHUNK_FRAMES)."""
        self.frames = self.base + frames
        if self.frames < self.next_at:  # (every frame step, every stream: the quick way out first)
            return
        self._release(now)

    def next_job(self, now: float) -> None:
        """A job that continues this stream starts at `now` (a session's next chunk): the job before it
        released its last frames at its end, and the new job's chunks start the ramp again."""
        if self.frames > self.released:
            self._release(now)
        self.chunks = 0
        self.next_at = self.released + self.due()

    def _release(self, now: float) -> None:
        """Release every frame not released yet at `now`. A player that ran dry before (a late chunk)
        plays this audio from `now` on: the gap is heard once, not owed for the rest of the stream."""
        if self.started is None:
            self.started = now
        elif (dry := self.started + self.released / self.rate) < now:
            self.started += now - dry
        while self.frames > self.released:
            self.released += min(self.frames - self.released, MAX_CHUNK_FRAMES)
            self.chunks += 1
        self.next_at = self.released + self.due()

    def end_request(self, frames: int) -> None:
        """The stream's request ended with `frames` audio frames (all final)."""
        self.base += frames
        self.frames = self.base

    def slack(self, now: float, step: float) -> float:
        """Seconds by which its next chunk, `need` steps of `step` seconds away, beats the player at
        `now` (inf before its first chunk: nothing plays yet)."""
        if self.started is None:
            return math.inf
        need = self.next_at - self.frames
        return self.started + self.released / self.rate - now - need * step

    def ramp_slack(self, step: float) -> float:
        """A new stream's least slack over its chunks at a step of `step` seconds (clock started at its
        first chunk): chunk k + 1 is released after the frames of chunks 1..k+1 and must come before
        the audio of chunks 0..k has played. -inf when `step` is not faster than real time."""
        if step * self.rate >= 1:
            return -math.inf
        k, heard, worst = 0, 0, math.inf
        size, after = chunk_size(self.first, self.later, 0), chunk_size(self.first, self.later, 1)
        while True:
            heard += size
            worst = min(worst, heard / self.rate - (heard + after - self.first) * step)
            then = chunk_size(self.first, self.later, k + 2)
            # From chunk 1 on the sizes never fall; once two follow of one size, all after them have
            # it, and each further chunk gains (1 / rate - step) * size: the least is found. (Not
            # `after <= size`: the ramp may repeat its first size before it grows.)
            if then <= after:
                return worst
            k, size, after = k + 1, after, then


class StepTimes:
    """Moving averages of the frame step's seconds per rows computed, and of the prefill's extra
    seconds and prompt tokens per iteration that prefilled."""

    def __init__(self) -> None:
        self.step: dict[int, float] = {}
        self.measured: dict[int, float] = {}  # rows -> when the step at those rows was last measured
        self.prefill_seconds: float | None = None
        self.prefill_tokens = 0.0

    def observe_step(self, rows: int, seconds: float, now: float = 0.0) -> None:
        """A frame step at `rows` rows took `seconds`, ending at `now` (the engine's clock); a stale
        estimate (STEP_STALE) starts again from this sample."""
        old = self.step.get(rows)
        if old is None or now - self.measured[rows] > STEP_STALE:
            self.step[rows] = seconds
        else:
            self.step[rows] = old + STEP_EMA * (seconds - old)
        self.measured[rows] = now

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if self.prefill_seconds is None:
            self.prefill_seconds, self.prefill_tokens = seconds, float(tokens)
            return
        self.prefill_seconds += PREFILL_EMA * (seconds - self.prefill_seconds)
        self.prefill_tokens += PREFILL_EMA * (tokens - self.prefill_tokens)

    def step_seconds(self, rows: int, now: float | None = None) -> float | None:
        """The step at `rows` rows: measured, else the nearest measured rows below (else above); None
        before any step was measured. With `now`, estimates older than STEP_STALE seconds count only
        when there is no fresher one."""
        step = self.step
        if now is not None:
            step = {r: s for r, s in step.items() if now - self.measured[r] <= STEP_STALE} or step
        if rows in step:
            return step[rows]
        below = [r for r in step if r < rows]
        if below:
            return step[max(below)]
        return step[min(step)] if step else None

    def prefill(self, tokens: int) -> float:
        """Predicted extra seconds of prefilling `tokens` prompt tokens in one iteration: the average
        iteration's, scaled up for more tokens than it had (a short prompt costs as much: launch-bound)."""
        if self.prefill_seconds is None:
            return 0.0
        return self.prefill_seconds * max(1.0, tokens / max(self.prefill_tokens, 1.0))


@dataclass
class RealtimeAdmission:
    """The admission rules of the module docstring. margin, max_wait: seconds. Counters: `deferred`,
    requests deferred at least once, by the first reason (`DEFERRAL_REASONS`); `forced`, requests
    admitted on `max_wait` while a stream lacked slack; `rode_along`, requests admitted into a pass
    that ran anyway while a stream lacked slack (RIDE_ALONG_TOKENS; only where the engine packs the
    prompts admitted together into one pass, `packs`); `min_slack`, the least slack of
    the playing streams (before a prefill) at the last admission decision while any played (None:
    none yet). gather: seconds a fresh request that would open a pass waits for others to share it
    (rule 3; 0: never; only where the engine packs prompts)."""

    margin: float
    max_wait: float
    times: StepTimes = field(default_factory=StepTimes)
    deferred: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DEFERRAL_REASONS, 0))
    forced: int = 0
    rode_along: int = 0
    packs: bool = True
    min_slack: float | None = None
    gather: float = 0.0

    def admits(
        self,
        request: Request,
        admitted: Sequence[Request],
        running: Sequence[Request],
        rows: int,
        now: float,
        gather: bool = True,
    ) -> bool:
        """Whether `request` (the head of the queue) may join `running` now (`admitted`: those of
        `running` admitted in this iteration, not prefilled yet; `rows`: the rows the step then
        computes; `gather`: rule 3 may hold it, False while a request that must not wait is queued).
        A deferral is counted once per request."""
        if not running:
            return True
        step = self.times.step_seconds(rows, now)
        if step is None:
            return True
        playback = request.playback
        if playback is not None and playback.started is None and playback.ramp_slack(step) < 0:
            return self._defer(request, "speed")
        if playback is not None and playback.started is not None:
            return True  # its player runs: waiting only makes it later
        # (a session's continuation and a fresh prompt go in separate passes: ride with one's own kind)
        same = [r.prompt_len - r.cached for r in admitted if bool(r.cached) == bool(request.cached)]
        waited = now - request.arrival_time
        playing = self._playing(running)
        self.min_slack = min((p.slack(now, step) for p in playing), default=None)
        if (
            gather
            and self.packs
            and not same
            and not self.must_not_wait(request)
            and playing
            and waited < self.gather
        ):
            return self._defer(request, "gather")
        tokens = sum(r.prompt_len - r.cached for r in admitted) + request.prompt_len - request.cached
        cost = self.times.prefill(tokens)
        if self.min_slack is None or self.min_slack - cost >= self.margin:
            return True
        if waited >= self.max_wait:
            self.forced += 1
            return True
        if self.packs and same and sum(same) + request.prompt_len - request.cached <= RIDE_ALONG_TOKENS:
            self.rode_along += 1
            return True
        return self._defer(request, "slack")

    def after_step(self, running: Sequence[Request], now: float) -> None:
        """After a frame step that ended at `now`: the streams' chunks that came due are released."""
        for r in running:
            if r.playback is not None:
                r.playback.advance(r.released if r.guard is not None else r.num_generated, now)

    @staticmethod
    def must_not_wait(request: Request) -> bool:
        """Whether a waiting request is one that waiting only makes later: its stream's player runs
        (a job's next text chunk), or it continues a session's kept sequence."""
        playback = request.playback
        return bool(request.cached) or (playback is not None and playback.started is not None)

    @staticmethod
    def _playing(running: Sequence[Request]) -> list[Playback]:
        """The playback clocks of the streams whose player runs and whose row decodes (a paused one is
        ahead of its reader; a stalled one waits for a block, and admission waits for it anyway)."""
        return [
            r.playback
            for r in running
            if r.playback is not None and r.playback.started is not None and not (r.paused or r.stalled)
        ]

    def _defer(self, request: Request, reason: str) -> bool:
        if not request.deferred:
            request.deferred = True
            self.deferred[reason] += 1
        return False
