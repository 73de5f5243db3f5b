"""The job pipeline: text chunks -> engine requests -> codes -> codec stage -> audio events.

One `JobPipeline` runs every synthesis job of one engine, whoever asked for it: the Python API
(`tts.api.TTS` drives it on the caller's thread) and the service (`tts.runtime.engine_thread.EngineThread`
drives it on the engine thread). It is single-threaded: one thread calls `submit`, `cancel`, `resume` and
`step`. The codec stage's worker (tts.runtime.codec_stage) decodes beside it.

A job (`tts.runtime.planner.SynthesisJob`) runs like this:

1. a codec stream slot is opened; a reference clip, if the job has one, is encoded on the codec stage
   (through the reference cache: a clip seen before is not encoded again) while other jobs run on;
2. `Started` is delivered and text chunk 0 is submitted as an engine request: its prompt carries the
   voice references and the previous chunk (text and codes) as context, seed `seed + i`, and the
   chunk's frame budget (the job's budget, cut to what is left of the request's audio limit);
3. every frame the engine emits goes to the job's pending codes (as the model family's reference
   returns frames, `tts.params.FrameConvention`: fish-speech 1.5 drops each text chunk's first frame
   and keeps its end-token frame); when `chunk_size` frames are pending (`first_chunk_frames` for the
   first two chunks, then twice the last size up to `chunk_frames`) and at the end, the pending codes
   go to the codec stage as one piece; the decoded audio comes back in order and is delivered as
   `Audio` (sequence 0, 1, 2, ... without gaps, frame ranges contiguous);
4. when a chunk ends its finish reason is kept (`short` if the end token came with implausibly little
   audio for its text, with a warning), then the next chunk is submitted; after the last one and its
   audio, `Finished` (or `Failed` at any point, and nothing after it).

Back-pressure: when `max_queued_chunks` audio chunks of a job wait unread or on the codec stage, the job's
engine request is paused (its row and blocks stay reserved, the batch runs on) and its next text chunk
is not started; the consumer's `resume` undoes it. A job paused longer than `pause_timeout` seconds
while others wait for a row (or were just refused admission) is ended with `Preempted`: it frees its
row and blocks so that no client can starve the others by not reading.

Failures: an engine step that raises fails every job in flight (EngineFailed) and the engine serves on
(its requests were all freed); a codec call that raises fails the jobs whose audio it held and the
stage checks itself (`tts.runtime.codec_stage`). What cannot recover takes the whole runner out of
service (`failure` says why, `on_failure` is called once): the codec stage dead (its probe failed), or
MAX_CONSECUTIVE_STEP_FAILURES engine steps in a row that raised (a broken device fails every step).
Every job in flight then fails with EngineFailed naming the cause; the owner stops admitting work.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

import numpy as np
import torch
from torch import Tensor

from tts.engine.engine import Engine
from tts.engine.realtime import Playback
from tts.engine.request import FinishReason, InvalidRequest, Request, StepOutput
from tts.params import FrameConvention, chunk_size
from tts.runtime.codec_stage import MAX_PIECE_FRAMES, CodecStage, DecodeResult
from tts.runtime.codec_stage import MAX_ROWS as CODEC_MAX_ROWS
from tts.runtime.codec_stage import MIN_ROWS as CODEC_MIN_ROWS
from tts.runtime.planner import Planner, PreparedReference, SynthesisJob
from tts.runtime.voices import ReferenceCache
from tts.text.prompt import Turn, VoiceReference

log = logging.getLogger(__name__)


# Engine steps that raise in a row (no step in between succeeded) before the runner is out of service.
MAX_CONSECUTIVE_STEP_FAILURES = 3

# The parts of a job's time to first audio (`JobPipeline.first_audio_seconds`), in order.
FIRST_AUDIO_PHASES = ("encode", "first_frame", "frames", "codec")


def ramp_sizes(first: int, later: int) -> tuple[int, ...]:
    """The distinct sizes `chunk_size` gives a job's chunks, ascending (4, 8, 16 by default, from
    chunks of 4, 4, 8, 16, 16, ...): what a start-up capture of the codec stage's graphs must cover."""
    # Chunk k >= 1 has first << (k - 1) frames until it reaches `later`: from first = 1 the largest
    # piece (MAX_PIECE_FRAMES, a power of two) is chunk MAX_PIECE_FRAMES.bit_length(), the last k here.
    return tuple(sorted({chunk_size(first, later, k) for k in range(MAX_PIECE_FRAMES.bit_length() + 1)}))


class Cancelled(RuntimeError):
    """The job was cancelled (by its consumer or at shutdown). Maps to CANCELLED."""


class EngineFailed(RuntimeError):
    """The engine or the codec stage failed while running the job. Maps to INTERNAL."""


class Preempted(RuntimeError):
    """The job's consumer did not read for `pause_timeout` seconds while others waited: ended to free
    its row. Maps to RESOURCE_EXHAUSTED."""


class LoopClosed(RuntimeError):
    """The runner is not accepting work (warming up, shutting down or stopped). Maps to UNAVAILABLE."""


# ---- events --------------------------------------------------------------------------------------------


@dataclass
class Started:
    """The job's first engine request is queued (its inputs passed every check, its clip is encoded)."""

    request_id: str
    seed: int
    text_chunks: int


@dataclass
class Audio:
    """Audio chunk `sequence`: float32 mono `samples [S]` for frames `[frame_start, frame_end)` and the
    codes `[N, frame_end - frame_start]` int64 they were decoded from."""

    sequence: int
    samples: np.ndarray
    frame_start: int
    frame_end: int
    codes: Tensor
    # The aligner's text position (a token of the current text chunk's span) of each of these frames,
    # None where it read none (unguarded requests, end frames): `[frame_end - frame_start]`, or None
    # when no frame has one. Word timings (tts.runtime.timings) read it.
    positions: list[int | None] | None = None


@dataclass
class Finished:
    """The job ended normally: `frames` generated in all, one finish reason per text chunk (a chunk
    not started because the request's audio limit was reached counts as `length`), warnings for the
    client, and the monotonic times the job was submitted and its first audio chunk was delivered."""

    frames: int
    finish_reasons: list[FinishReason]
    submitted_at: float
    first_audio_at: float | None
    warnings: list[str] = field(default_factory=list)
    # The context the next text would continue (the turns, in order: a session's job adds its chunks to
    # the turns it began with; another job keeps its last chunk), and per text chunk the prompt
    # positions prefilled and those found already in the session's kept KV (tts.engine.sequences).
    history: list[Turn] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)


@dataclass
class Failed:
    """The job ended with `error` (InvalidRequest, AudioError, Cancelled, Preempted, EngineFailed,
    LoopClosed)."""

    error: Exception


Event = Started | Audio | Finished | Failed


class JobSink(Protocol):
    """Where a job's events go. `deliver` returns False once nobody will read them (the job is then
    cancelled); `pause_if_full(cap)` marks the consumer paused and returns True if `cap` audio chunks
    wait unread (atomically with the consumer's reads)."""

    def deliver(self, event: Event) -> bool: ...

    def pause_if_full(self, cap: int) -> bool: ...


class ListSink:
    """A sink that keeps every event (the Python API's): never paused."""

    def __init__(self, progress: Callable[[int, int, int], None] | None = None):
        self.events: deque[Event] = deque()
        self.progress = progress

    def deliver(self, event: Event) -> bool:
        self.events.append(event)
        return True

    def pause_if_full(self, cap: int) -> bool:
        return False


# ---- one job ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    job_id: str
    spec: SynthesisJob
    sink: JobSink
    submitted_at: float
    slot: int = -1
    own_slot: bool = (
        True  # the job opened its codec stream (and closes it); False: the caller's (a session's)
    )
    references: list[VoiceReference] = field(default_factory=list)
    encoding: Future[VoiceReference] | None = None  # the reference clip, while it encodes
    index: int = 0  # current text chunk
    engine_id: str | None = None  # the engine request of the current text chunk, while it runs
    budget: int = 0  # the current chunk's frame budget
    deferred: bool = False  # the next text chunk waits for the consumer (back-pressure)
    history: list[Turn] = field(default_factory=list)
    generated: list[Tensor] = field(default_factory=list)  # [1, N] codes of the current text chunk
    pending: list[Tensor] = field(default_factory=list)  # [1, N] codes not yet sent to the codec
    # The newest frames of `pending` that the engine's loop guard may still take back (not sent to the
    # codec until a later frame's hold, or the chunk's end, lets them go).
    held: int = 0
    # the aligner's position of each audio frame so far (None: none read), for word timings
    frame_positions: list[int | None] = field(default_factory=list)
    request: Request | None = None  # the engine request of the current text chunk
    # Its audio's playback clock, which the engine keeps for real-time admission (tts.engine.realtime):
    # one for all its text chunks, so that a later chunk's request knows how far ahead the job is.
    playback: Playback | None = None
    # The audio frames sent on the playback clock before this job (a session's earlier jobs on the same
    # clock; not the clock's `released`, which also counts their frames that are no audio): where the
    # job's audio starts on it (`_deadline`).
    playback_start: int = 0
    prefill_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    # (sequence, frame_start, codes) being decoded
    inflight: deque[tuple[int, int, Tensor]] = field(default_factory=deque)
    frames: int = 0  # generated
    frames_queued: int = 0  # sent to the codec stage
    sequence: int = 0  # next audio chunk number to queue
    reasons: list[FinishReason] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Where the time to first audio went (time.monotonic()): the first engine request queued, its
    # first frame out, the first audio chunk queued on the codec stage, its audio back.
    first_request_at: float | None = None
    first_frame_at: float | None = None
    first_chunk_at: float | None = None
    first_audio_at: float | None = None
    paused_at: float | None = None
    generation_done: bool = False
    cancelled: bool = False

    @property
    def paused_since(self) -> float:
        """`paused_at` of a job known to be paused."""
        assert self.paused_at is not None, f"{self.job_id} is not paused"
        return self.paused_at


class JobPipeline:
    """The job pipeline of one engine (see the module docstring).

    planner: plans prompts (and holds the voices). max_streams: jobs in flight at most (codec slots).
    max_queued_chunks: back-pressure cap of unread audio chunks per job. pause_timeout: seconds a paused
    job may hold its row while others wait (None: forever). notify: called from the codec stage's
    thread when results are ready (wakes the driving thread). reference_cache: encoded clips by content
    (None: no cache). codec_graphs: let the codec stage capture CUDA graphs. codec_gather: seconds a
    later audio chunk may wait in the codec stage for more work to share its decode call (0: none); less
    where its player would run dry first (the runner passes each chunk's deadline, `_deadline`, where
    real-time admission keeps the job's playback clock). codec_sms: SMs the codec's kernels may use
    (CUDA; 0: all, `codec_stage.codec_stream`).
    """

    def __init__(
        self,
        engine: Engine,
        planner: Planner,
        *,
        max_streams: int,
        max_queued_chunks: int = 8,
        pause_timeout: float | None = None,
        notify: Callable[[], None] = lambda: None,
        reference_cache: ReferenceCache | None = None,
        codec_graphs: bool = True,
        codec_gather: float = 0.0,
        codec_sms: int = 0,
    ):
        if max_queued_chunks < 1:
            raise ValueError("max_queued_chunks must be >= 1")
        self.engine = engine
        self.planner = planner
        self.bundle = planner.bundle
        self.frames = getattr(self.bundle, "frames", None) or FrameConvention()
        self.max_queued_chunks = max_queued_chunks
        self.pause_timeout = pause_timeout
        self.cache = reference_cache
        # Why the runner is out of service (None while it serves), and who to tell (any thread may set it:
        # the codec stage's worker does when the stage dies).
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.consecutive_step_failures = 0
        self.stage = CodecStage(
            self.bundle.codec,
            max_streams,
            notify,
            # A call's rows are the engine's rows plus the last pieces of streams that just ended (a
            # batch turning over): more rows would only cost graphs and memory never used, which at a
            # small max batch is most of the codec's memory (a decode graph's size grows with rows). At
            # least CODEC_MIN_ROWS, so that a codec that fell behind (a slow call, a long encode)
            # drains the streams that ended meanwhile in few calls.
            max_rows=min(CODEC_MAX_ROWS, max(CODEC_MIN_ROWS, 2 * engine.config.max_batch)),
            graphs=codec_graphs,
            on_dead=self._stage_dead,
            gather=codec_gather,
            sms=codec_sms,
        )
        self.jobs: dict[str, _Job] = {}
        self._by_engine_id: dict[str, _Job] = {}
        self._ids = itertools.count()
        self._refused_at = -1e9
        # (job id, final event or None where the consumer had gone), just before that event is delivered
        self.on_end: Callable[[str, Event | None], None] | None = None
        # Called before each engine step (admission, prefill, frame step): the engine loop hands the
        # events delivered so far over to its consumers there, so that they are handled while the
        # step's prefill and frame run on the device.
        self.before_engine_step: Callable[[], None] | None = None
        self.frame_step_seconds = 0.0
        self.step_failures = 0
        # Host seconds spent handing decoded audio to the consumers and routing the engine's outputs.
        self.phase_seconds = {"audio": 0.0, "route": 0.0}
        # The time to first audio of the jobs that had audio, split and summed (seconds; / jobs: the
        # mean): `encode` (submitted -> first engine request queued: the reference clip's encode),
        # `first_frame` (-> its first frame out: waiting for a row, prefill, the first frame step),
        # `frames` (-> the first chunk's frames generated and queued on the codec stage), `codec` (->
        # its audio back from the codec stage).
        self.first_audio_seconds = dict.fromkeys(FIRST_AUDIO_PHASES, 0.0)
        self.first_audio_jobs = 0
        # Audio frames the jobs sent to the codec stage per playback clock (a session's turn: its chunks'
        # jobs share one): where the next job's audio starts on it (`_Job.playback_start`).
        self._sent: weakref.WeakKeyDictionary[Playback, int] = weakref.WeakKeyDictionary()

    # ---- commands (the driving thread) -------------------------------------------------------------

    def new_job_id(self, prefix: str | None = None) -> str:
        return f"{prefix or 'job'}-{next(self._ids)}"

    def submit(
        self,
        spec: SynthesisJob,
        sink: JobSink,
        job_id: str | None = None,
        *,
        slot: int | None = None,
        playback: Playback | None = None,
    ) -> str:
        """Start a job; its events go to `sink`. Returns its id. Input errors found now (a clip that
        does not encode, a prompt that does not fit) arrive as Failed, never as exceptions.

        slot: a codec stream the caller opened (`stage.open()`) and keeps: the job's audio continues that
        stream's decoder state and the job leaves it open when it ends (a session's chunks, one stream
        for the whole session). None: the job opens its own stream and closes it at its end.
        playback: the playback clock of a stream whose audio the job continues (a session's turn: the
        clock its earlier chunks' jobs had; for real-time admission, tts.engine.realtime). None: a new
        stream (with real-time admission on, the job gets its own)."""
        job = _Job(job_id or self.new_job_id(spec.request_id), spec, sink, time.monotonic())
        job.history = list(spec.history)  # (a session's earlier turns; empty for other jobs)
        job.warnings = list(spec.warnings)  # the planner's (text left out, markup ignored) come first
        if playback is not None:
            playback.next_job(self.engine.clock())
        elif self.engine.realtime is not None:
            playback = Playback(self.planner.frame_rate, spec.first_chunk_frames, spec.chunk_frames)
        job.playback = playback
        job.playback_start = self._sent.get(playback, 0) if playback is not None else 0
        self.jobs[job.job_id] = job
        if slot is not None:
            job.slot, job.own_slot = slot, False
        else:
            try:
                job.slot = self.stage.open()
            except RuntimeError as exc:
                self._end(job, Failed(EngineFailed(str(exc))))
                return job.job_id
        job.references = list(spec.references)
        if spec.reference is not None:
            job.encoding = self.encode_reference(spec.reference)
        else:
            self._start(job)
        return job.job_id

    def encode_reference(self, ref: PreparedReference) -> Future[VoiceReference]:
        """Encode a checked reference clip (`Planner.prepare_reference`) on the codec stage, through the
        reference cache (a clip seen before is not encoded again): a future of its VoiceReference (codes
        `[N, T]` int64 on the CPU, the normalized transcript), or of the encode's exception. Any thread."""
        encode = lambda: self.stage.encode(ref.samples)  # noqa: E731
        if self.cache is not None and ref.key is not None:
            return self.cache.get_or_encode(ref.key, lambda: _as_voice(encode(), ref.text))
        return _as_voice(encode(), ref.text)

    def cancel(self, job_id: str) -> None:
        """End the job at the next step, freeing its blocks, row and codec slot (idempotent)."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.cancelled = True
        if job.engine_id is not None:
            self.engine.cancel(job.engine_id)  # ends at the next step; routed as CANCELLED
        else:
            self._end(job, Failed(Cancelled("cancelled")))

    def resume(self, job_id: str) -> None:
        """The consumer read its queue down: resume the paused job."""
        job = self.jobs.get(job_id)
        if job is None or job.paused_at is None:
            return
        job.paused_at = None
        if job.engine_id is not None:
            self.engine.set_paused(job.engine_id, False)
        elif job.deferred:
            job.deferred = False
            self._submit_chunk(job)

    def _stage_dead(self, error: Exception) -> None:
        """(codec stage thread) The stage went out of service."""
        self.out_of_service(str(error))

    def out_of_service(self, reason: str) -> None:
        """Take the runner out of service (any thread; the first reason is kept): every job in flight fails
        at the next `step`, and `on_failure(reason)` is called once."""
        if self.failure is not None:
            return
        self.failure = reason
        log.error("the synthesis pipeline is out of service: %s", reason)
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001 - the owner's callback must not hide the failure
                log.exception("on_failure callback failed")

    def note_refusal(self) -> None:
        """A request was just refused admission: paused jobs now stand in someone's way."""
        self._refused_at = time.monotonic()

    def fail_all(self, error: Exception) -> None:
        """End every job with `error` (shutdown or an unrecoverable failure); frees everything."""
        for job in list(self.jobs.values()):
            self._end(job, Failed(error))

    # ---- state -----------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Something for `step` to do now: engine work, or codec results to take."""
        return (
            self.engine.has_work()
            or self.stage.has_results
            or self._encodes_done()
            or (self.failure is not None and bool(self.jobs))
        )

    def _encodes_done(self) -> bool:
        return any(j.encoding is not None and j.encoding.done() for j in self.jobs.values())

    def idle(self) -> bool:
        """No job, no engine request and every codec slot free (what a server returns to after load)."""
        return (
            not self.jobs
            and not self._by_engine_id
            and not self.engine.has_work()
            and self.stage.idle
            and self.stage.free_slots == self.stage.max_streams
        )

    @property
    def paused_jobs(self) -> int:
        return sum(1 for j in self.jobs.values() if j.paused_at is not None)

    # ---- one iteration -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, beside_step: Callable[[], bool] | None = None) -> bool:
        """One pass: finished encodes start their jobs, decoded audio is delivered, paused jobs past
        their timeout are preempted, then one engine step if there is work, `beside_step` run while it
        computes (`Engine.step`'s while_stepping: the caller's work, its queued commands; returns
        whether it did any). Returns whether anything happened (False: everything running is paused
        or waiting on the codec stage)."""
        progressed = False
        if self.failure is not None and self.jobs:
            progressed = True
            self.fail_all(EngineFailed(f"this replica is out of service: {self.failure}"))
        for job in [j for j in self.jobs.values() if j.encoding is not None and j.encoding.done()]:
            progressed = True
            self._encoded(job)
        t0 = time.perf_counter()
        for result in self.stage.results():
            progressed = True
            self._audio(result)
        self.phase_seconds["audio"] += time.perf_counter() - t0
        self._preempt_paused()
        if self.engine.has_work():
            if self.before_engine_step is not None:
                self.before_engine_step()
            beside = _BesideStep(beside_step) if beside_step is not None else None
            t0 = time.perf_counter()
            frames = self.engine.frames_generated
            try:
                outputs = self.engine.step(beside)
            except Exception as exc:  # noqa: BLE001 - fail the jobs, keep serving
                outputs = self._step_failed(exc)
            else:
                self.consecutive_step_failures = 0
            t1 = time.perf_counter()
            if beside is not None:
                progressed = progressed or beside.did
                t0 += beside.seconds  # (that work is counted as its own)
            self.frame_step_seconds += t1 - t0
            # A frame step that computed frames progressed even with no output: a refused end token's
            # frame is taken back, and the next step samples again (the loop must not sleep on it).
            progressed = progressed or self.engine.frames_generated != frames
            for out in outputs:
                progressed = True
                try:
                    self._route(out)
                except Exception as exc:  # noqa: BLE001 - a bug in one job must not stop the others
                    log.exception("handling the output of %s failed", out.request_id)
                    owner = self._by_engine_id.get(out.request_id)
                    if owner is not None:
                        self._end(owner, Failed(EngineFailed(f"{type(exc).__name__}: {exc}")))
            self.phase_seconds["route"] += time.perf_counter() - t1
            if beside is not None and beside.error is not None:
                raise beside.error  # (as it would have before the step: the engine loop's failure path)
        return progressed

    # ---- internals -------------------------------------------------------------------------------------

    def _step_failed(self, exc: Exception) -> list[StepOutput]:
        """The engine step raised: every request in flight fails (the outputs that say so are returned),
        and the replica goes out of service after MAX_CONSECUTIVE_STEP_FAILURES in a row."""
        log.exception("engine step failed; failing every request in flight")
        self.step_failures += 1
        self.consecutive_step_failures += 1
        outputs = self.engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
        for job in list(self.jobs.values()):
            if job.engine_id is None:
                self._end(job, Failed(EngineFailed(f"engine step failed: {exc}")))
        if self.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self.out_of_service(
                f"{self.consecutive_step_failures} engine steps in a row failed, the last with "
                f"{type(exc).__name__}: {exc}"
            )
        return outputs

    def _encoded(self, job: _Job) -> None:
        future, job.encoding = job.encoding, None
        assert future is not None  # (step calls this for a done encoding only)
        try:
            voice = future.result()
        except Exception as exc:  # noqa: BLE001 - the clip did not encode: this job fails
            error = exc if isinstance(exc, ValueError) else EngineFailed(f"reference encoding failed: {exc}")
            self._end(job, Failed(error))
            return
        job.references.append(voice)
        self._start(job)

    def _start(self, job: _Job) -> None:
        if self._submit_chunk(job):
            self._deliver(job, Started(job.job_id, _seed(job.spec), len(job.spec.chunks)))

    def _submit_chunk(self, job: _Job) -> bool:
        """Queue the engine request of text chunk `job.index`; False if the job ended instead."""
        spec, i = job.spec, job.index
        budget = spec.budgets[i]
        if spec.max_frames is not None:
            left = spec.max_frames - job.frames
            if left <= 0:
                seconds = spec.max_frames / self.planner.frame_rate
                job.warnings.append(
                    f"the request reached the server's limit of {seconds:.1f} s of audio; "
                    f"text chunks {i + 1}-{len(spec.chunks)} of {len(spec.chunks)} were not spoken"
                )
                job.reasons += [FinishReason.LENGTH] * (len(spec.chunks) - i)
                self._generation_done(job)
                return True
            budget = min(budget, left + int(self.frames.drop_first))  # (the first frame is not audio)
        params = replace(
            spec.params,
            seed=_seed(spec) + i,
            max_new_frames=budget,
            min_new_frames=min(spec.params.min_new_frames, budget),
        )
        engine_id = f"{job.job_id}/{i}"
        try:
            if spec.sequence is not None:  # a session's chunk: every turn that fits, its KV kept
                prompt, span = self.planner.session_prompt(
                    spec.chunks[i], job.references, job.history, params
                )
            else:
                prompt, span = self.planner.prompt_with_span(
                    spec.chunks[i], job.references, job.history, params
                )
            end_floor = self.planner.end_floor(span)
            job.request = self.engine.submit(
                prompt,
                params,
                request_id=engine_id,
                text_span=span,
                sequence=spec.sequence,
                end_floor=end_floor,
                playback=job.playback,
            )
        except InvalidRequest as exc:
            prefix = f"text chunk {i + 1} of {len(spec.chunks)}: " if len(spec.chunks) > 1 else ""
            self._end(job, Failed(InvalidRequest(f"{prefix}{exc}")))
            return False
        except Exception as exc:  # noqa: BLE001 - the engine's queue is sized for every job; be safe
            self._end(job, Failed(EngineFailed(f"cannot queue text chunk {i + 1}: {exc}")))
            return False
        job.engine_id = engine_id
        job.budget = budget
        if job.first_request_at is None:
            job.first_request_at = time.monotonic()
        self._by_engine_id[engine_id] = job
        job.generated = []
        return True

    def _route(self, out: StepOutput) -> None:
        job = self._by_engine_id.get(out.request_id)
        if job is None:
            return
        frames = self.frames
        if job.first_frame_at is None:
            job.first_frame_at = time.monotonic()
        if out.retract:
            self._retract(job, out.retract)
        if out.codes.numel():
            job.generated.append(out.codes)  # the next chunk's context: every generated frame
            if not (frames.drop_first and len(job.generated) == 1):
                self._audio_frame(job, out.codes, out.hold, out.align_position)
        if out.finished and frames.keep_end and out.end_codes is not None and job.generated:
            self._audio_frame(job, out.end_codes)  # (an end frame that is the first frame is dropped)
        if not out.finished:
            return
        del self._by_engine_id[out.request_id]
        job.engine_id = None
        if out.finish_reason == FinishReason.CANCELLED or job.cancelled:
            self._end(job, Failed(Cancelled("cancelled")))
        elif out.finish_reason == FinishReason.ERROR:
            self._end(job, Failed(EngineFailed(out.error or "engine error")))
        elif out.finish_reason == FinishReason.PREEMPTED:  # (the KV pool ran out mid-stream)
            self._end(job, Failed(Preempted(out.error or "preempted: the KV cache is full")))
        else:
            assert out.finish_reason is not None  # a finished output has its reason
            self._chunk_done(job, out.finish_reason)

    def _audio_frame(self, job: _Job, codes: Tensor, hold: int = 0, position: int | None = None) -> None:
        """One frame `[1, N]` of the job's audio: pending until its audio chunk is due, and while it is
        among the newest `hold` frames, which the engine's loop guard may still take back. position: the
        aligner's text position of the frame (None: none)."""
        job.pending.append(codes)
        job.frame_positions.append(position)
        job.frames += codes.shape[0]
        job.held = min(hold, len(job.pending))
        progress = getattr(job.sink, "progress", None)
        if progress is not None:
            progress(job.frames, job.index, len(job.spec.chunks))
        due = chunk_size(job.spec.first_chunk_frames, job.spec.chunk_frames, job.sequence)
        if len(job.pending) - job.held >= due:
            self._queue_audio(job)

    def _retract(self, job: _Job, frames: int) -> None:
        """The engine took back the chunk's newest `frames` frames (a repeat): forget them. They are
        among the frames held back (`_audio_frame`), never sent to the codec."""
        assert 0 < frames <= min(job.held, len(job.pending), len(job.generated)), (frames, job.held)
        del job.generated[-frames:], job.pending[-frames:], job.frame_positions[-frames:]
        job.held -= frames
        job.frames -= frames

    def _chunk_done(self, job: _Job, reason: FinishReason) -> None:
        job.held = 0  # the chunk's frames are final
        spec, i = job.spec, job.index
        n = len(spec.chunks)
        frames = len(job.generated)
        where = f"text chunk {i + 1} of {n}" if n > 1 else "the text"
        nbytes = len(spec.chunks[i].encode("utf-8"))
        if reason == FinishReason.SHORT:  # the engine's: the end token came before the text was said
            job.warnings.append(
                f"{where} ended after {frames} frame{'s' if frames != 1 else ''} "
                f"({frames / self.planner.frame_rate:.2f} s) before its text was said: "
                "its last words are missing"
            )
        elif reason == FinishReason.STOP and frames < self.planner.short_frames(spec.chunks[i]):
            reason = FinishReason.SHORT
            job.warnings.append(
                f"{where} ended after {frames} frame{'s' if frames != 1 else ''} "
                f"({frames / self.planner.frame_rate:.2f} s) for {nbytes} bytes of text: words may be missing"
            )
        elif reason == FinishReason.LENGTH and job.budget < spec.params.max_new_frames:
            seconds = job.budget / self.planner.frame_rate
            why = "the request's audio limit" if job.budget < spec.budgets[i] else "the runaway guard"
            job.warnings.append(
                f"{where} reached {why} of {job.budget} frames ({seconds:.1f} s) for {nbytes} bytes of text"
            )
        elif reason == FinishReason.LENGTH and spec.params.min_new_frames < spec.params.max_new_frames:
            # (min_new_frames = max_new_frames asks for exactly that many frames: nothing was cut)
            seconds = job.budget / self.planner.frame_rate
            job.warnings.append(
                f"{where} reached max_new_frames ({job.budget} frames, {seconds:.1f} s) for {nbytes} bytes "
                "of text: its audio may stop mid-word"
            )
        elif reason == FinishReason.LOOP:
            job.warnings.append(f"{where} repeats words: the loop guard could not mend a repetition loop")
        job.reasons.append(reason)
        if job.request is not None:
            job.prefill_tokens.append(job.request.prefill_tokens)
            job.cached_tokens.append(job.request.cached)
        if spec.sequence is not None:  # a session's job keeps every turn (its chunks extend one sequence)
            if reason != FinishReason.LOOP and job.generated:
                job.history = job.history + [Turn(spec.chunks[i], torch.cat(job.generated).T)]
        elif reason == FinishReason.LOOP:
            job.history = []  # no repeat as the next chunk's context
        elif job.generated:
            job.history = [Turn(spec.chunks[i], torch.cat(job.generated).T)]
        job.index += 1
        if job.index < n:
            if job.paused_at is not None:
                job.deferred = True  # started by the consumer's resume
            else:
                self._submit_chunk(job)
            return
        self._generation_done(job)

    def _generation_done(self, job: _Job) -> None:
        job.generation_done = True
        if job.pending:
            self._queue_audio(job)
        self._finish_if_done(job)

    def _queue_audio(self, job: _Job) -> None:
        """Send the pending frames but the held ones to the codec stage, as one audio chunk (two where
        released held frames make it longer than the codec stage takes)."""
        while len(job.pending) > job.held:
            n = min(len(job.pending) - job.held, MAX_PIECE_FRAMES)
            codes = torch.cat(job.pending[:n]).T.contiguous()  # [N, frames]
            job.pending = job.pending[n:]
            job.inflight.append((job.sequence, job.frames_queued, codes))
            # (a job's first chunk is its time to first audio: the codec stage decodes it at once)
            self.stage.decode(
                job.slot,
                (job.job_id, job.sequence),
                codes,
                first=job.first_chunk_at is None,
                deadline=self._deadline(job),
            )
            if job.first_chunk_at is None:
                job.first_chunk_at = time.monotonic()
            job.sequence += 1
            job.frames_queued += codes.shape[1]
            if job.playback is not None:
                self._sent[job.playback] = job.playback_start + job.frames_queued
        self._pause_if_full(job)

    def _deadline(self, job: _Job) -> float | None:
        """When the job's player runs dry without the piece about to be queued (when the audio before
        it has played), on the codec stage's clock; None where the job's playback clock is not kept
        (real-time admission off) or has not started.

        On the playback clock (tts.engine.realtime.Playback, the engine's clock) the player started at
        `started`, moved on by the gaps where it ran dry, and plays `rate` frames a second: the audio
        before the piece has played at `started + before / rate`, `before` being the clock's frames
        before the piece. Which of the clock's frames those are: it releases a chunk in the frame step
        that completes it, before the runner routes that step's frame, so its `released` holds this
        piece already (and for a family that drops each text chunk's first frame it released it a step
        earlier); it counts frames that are no audio (a dropped first frame, an end-token frame), so
        it runs ahead of the audio, never behind; the loop guard's held frames it leaves out, as the
        runner does. So `before` is at least this job's audio sent before the piece (`frames_queued`)
        on top of the audio sent on the clock before the job (`playback_start`: a session's earlier
        jobs' audio, never the clock's frames, which run ahead by a frame or so per text chunk), and
        that is used: a deadline a few frames early at worst, never late. The clock's `released` bounds
        it too (the clock's own dry time, should it ever have seen less than the job sent). A gap after
        the piece's start moved `started` on, but then the time computed is past already (the frames
        after the gap play from its release on, and a past deadline starts the call at once)."""
        playback = job.playback
        if self.engine.realtime is None or playback is None or playback.started is None:
            return None
        before = min(playback.released, job.playback_start + job.frames_queued)
        dry = playback.started + before / playback.rate
        return self.stage.clock() + (dry - self.engine.clock())

    def _audio(self, result: DecodeResult) -> None:
        job_id, sequence = cast("tuple[str, int]", result.tag)  # the tag _audio_frame queued
        job = self.jobs.get(job_id)
        if job is None:  # the job ended meanwhile: its late audio is dropped
            return
        if result.error is not None:
            self._end(job, Failed(EngineFailed(f"codec stage failed: {result.error}")))
            return
        seq, start, codes = job.inflight.popleft()
        assert seq == sequence, (seq, sequence)
        assert result.samples is not None  # (a result without an error has its samples)
        if job.first_audio_at is None:
            job.first_audio_at = time.monotonic()
            self._count_first_audio(job)
        positions = job.frame_positions[start : start + codes.shape[1]]
        aligned = positions if any(p is not None for p in positions) else None
        if not self._deliver(job, Audio(seq, result.samples, start, start + codes.shape[1], codes, aligned)):
            return
        self._pause_if_full(job)
        self._finish_if_done(job)

    def _count_first_audio(self, job: _Job) -> None:
        marks = (
            job.submitted_at,
            job.first_request_at,
            job.first_frame_at,
            job.first_chunk_at,
            job.first_audio_at,
        )
        if any(m is None for m in marks):  # (every mark is set on the way to a first chunk; be safe)
            return
        for phase, (a, b) in zip(FIRST_AUDIO_PHASES, itertools.pairwise(marks), strict=True):
            self.first_audio_seconds[phase] += b - a  # type: ignore[operator]  # (checked above)
        self.first_audio_jobs += 1

    def _pause_if_full(self, job: _Job) -> None:
        """Pause the job once its unread chunks plus those still on the codec stage reach the cap: a
        lagging codec stage must not let a job nobody reads run ahead (memory stays bounded)."""
        if (
            not job.generation_done
            and job.paused_at is None
            and job.sink.pause_if_full(self.max_queued_chunks - len(job.inflight))
        ):
            job.paused_at = time.monotonic()
            if job.engine_id is not None:
                self.engine.set_paused(job.engine_id, True)

    def _finish_if_done(self, job: _Job) -> None:
        if job.generation_done and not job.inflight and not job.pending and job.job_id in self.jobs:
            event = Finished(
                job.frames,
                job.reasons,
                job.submitted_at,
                job.first_audio_at,
                job.warnings,
                job.history,
                job.prefill_tokens,
                job.cached_tokens,
            )
            self._end(job, event)

    def _contention(self, now: float) -> bool:
        """Someone waits for a row (or was just refused admission)."""
        return self.engine.num_waiting > 0 or now - self._refused_at < (self.pause_timeout or 0.0)

    def _preemptible(self) -> list[_Job]:
        """Paused jobs that hold a batch row, longest paused first."""
        jobs = [
            j
            for j in self.jobs.values()
            if j.paused_at is not None and j.engine_id is not None and self.engine.is_running(j.engine_id)
        ]
        return sorted(jobs, key=lambda j: j.paused_since)

    def preempt_due(self) -> float | None:
        """Seconds until a paused job may be preempted (<= 0: now), or None while nothing can be (no
        timeout, nothing paused, or nobody waiting: a submission or refusal wakes the driver anyway)."""
        if self.pause_timeout is None or not self._contention(time.monotonic()):
            return None
        jobs = self._preemptible()
        return jobs[0].paused_since + self.pause_timeout - time.monotonic() if jobs else None

    def _preempt_paused(self) -> None:
        """End paused jobs past the timeout, longest paused first, as many as requests wait for a row
        (at least one while admission was just refused): only those in someone's way."""
        if self.pause_timeout is None:
            return
        now = time.monotonic()
        if not self._contention(now):
            return
        due = [j for j in self._preemptible() if now - j.paused_since > self.pause_timeout]
        for job in due[: max(1, self.engine.num_waiting)]:
            log.info(
                "preempting %s: not read for %.1f s while others wait", job.job_id, now - job.paused_since
            )
            message = (
                f"the stream was not read for {self.pause_timeout:g} s while other requests waited; it was "
                "ended to free its batch row (the server's --pause-timeout)"
            )
            self._end(job, Failed(Preempted(message)))

    def _deliver(self, job: _Job, event: Event) -> bool:
        if job.sink.deliver(event):
            return True
        # Nobody will read this job any more: stop it.
        if not job.cancelled:
            job.cancelled = True
            if job.engine_id is not None:
                self.engine.cancel(job.engine_id)
            else:
                self._end(job, None)
        return False

    def _end(self, job: _Job, event: Event | None) -> None:
        if self.jobs.pop(job.job_id, None) is None:
            return
        if job.engine_id is not None:  # still in the engine: free its row and blocks at the next step
            self.engine.cancel(job.engine_id)
            self._by_engine_id.pop(job.engine_id, None)
            job.engine_id = None
        if job.slot >= 0 and job.own_slot:
            self.stage.close(job.slot)
        if job.encoding is not None:
            job.encoding = None  # a shared encode goes on for the cache and its other jobs
        # Released before the final event is delivered: a client that resubmits as soon as it sees it
        # must find its own slot free (and /load must no longer count it).
        if self.on_end is not None:
            self.on_end(job.job_id, event)
        if event is not None:
            job.sink.deliver(event)


class _BesideStep:
    """The caller's work run while a frame step computes (`Engine.step`'s while_stepping), which must
    not raise there: whether it did anything, its seconds, and the exception it raised (raised again
    once the step's outputs are handled)."""

    def __init__(self, work: Callable[[], bool]):
        self.work, self.did, self.seconds = work, False, 0.0
        self.error: Exception | None = None

    def __call__(self) -> None:
        t0 = time.perf_counter()
        try:
            self.did = bool(self.work())
        except Exception as exc:  # noqa: BLE001 - raised again after the step (JobPipeline.step)
            self.error = exc
        self.seconds += time.perf_counter() - t0


def _seed(spec: SynthesisJob) -> int:
    """The job's seed (text chunk i uses seed + i): `Planner.plan` resolves it."""
    assert spec.params.seed is not None, "a SynthesisJob's params carry a resolved seed"
    return spec.params.seed


def _as_voice(codes_future: Future[Tensor], text: str) -> Future[VoiceReference]:
    """A future of a VoiceReference from a future of codes."""
    out: Future[VoiceReference] = Future()

    def done(f):
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(VoiceReference(codes=f.result(), text=text))

    codes_future.add_done_callback(done)
    return out
