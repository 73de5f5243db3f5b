"""The Python API shared by the CLI and users' programs.

    from tts import TTS
    tts = TTS.load("default")                       # or "tiny", or a checkpoint directory
    result = tts.synthesize("Hello there.", seed=1)  # float32 audio, sample rate, codes, timings
    for chunk in tts.stream("A longer text."):       # audio chunks as frames are generated
        play(chunk.samples, chunk.sample_rate)

A synthesis is planned by `tts.runtime.planner.Planner` (text normalized and split into chunks of at most
`chunk_length` UTF-8 bytes, the voice resolved, every chunk's prompt checked against the context) and run by
the same job pipeline the service uses (`tts.runtime.jobs.JobPipeline`, driven here on the caller's thread):
each chunk is one engine request whose prompt carries the voice reference and the previous chunk (text and
generated codes) as context, as fish-speech does for long text (docs/fish_dual_ar.md §3.2), and the codes flow
through one streaming codec decode per synthesis on the codec stage's thread, so chunk boundaries are seamless
and decoding overlaps generation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from tts.checkpoints.bundle import ModelBundle
from tts.checkpoints.load import load_bundle
from tts.codec.base import AudioError
from tts.engine import Engine, EngineConfig, FinishReason, InvalidRequest, for_bundle
from tts.params import DEFAULT_CHUNK_FRAMES, DEFAULT_FIRST_CHUNK_FRAMES
from tts.runtime.jobs import Audio, Failed, Finished, JobPipeline, ListSink, ramp_sizes
from tts.runtime.planner import Planner, PreparedReference, SynthesisJob
from tts.runtime.request import RequestLimits, Sampling, SpeechRequest
from tts.runtime.sessions import Session, SessionEvent, SessionManager, SessionOptions
from tts.runtime.voices import VoiceEntry, VoiceExists, VoiceNotFound, VoiceRegistry, codec_fingerprint
from tts.text.normalize import TextError
from tts.text.prompt import VoiceReference

log = logging.getLogger(__name__)
# The attribute marking the log records of a synthesis's warnings (also in `Synthesis.warnings`), so that
# a front end that shows those warnings itself can filter the records out.
SYNTHESIS_WARNING = "synthesis_warning"
# The Python API's request limits: none on the text or a clip's size (the caller owns the process).
API_LIMITS = RequestLimits()


@dataclass
class AudioChunk:
    """Audio for frames `[frame_start, frame_end)` of one synthesis: float32 mono samples in [-1, 1]
    at `sample_rate` Hz, and the codes `[N, frames]` they were decoded from."""

    samples: np.ndarray
    sample_rate: int
    frame_start: int
    frame_end: int
    codes: Tensor


@dataclass
class Synthesis:
    """A finished synthesis: `audio` float32 `[samples]` at `sample_rate`, `codes [N, frames]`, the
    finish reason of each text chunk, warnings (e.g. a chunk that ended implausibly short), and the
    wall time spent (seconds)."""

    audio: np.ndarray
    sample_rate: int
    codes: Tensor
    finish_reasons: list[FinishReason] = field(default_factory=list)
    wall_seconds: float = 0.0
    first_audio_seconds: float | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def frames(self) -> int:
        return int(self.codes.shape[1])

    @property
    def audio_seconds(self) -> float:
        return len(self.audio) / self.sample_rate

    @property
    def rtf(self) -> float:
        """Real-time factor: compute seconds per second of audio (< 1 is faster than real time)."""
        return self.wall_seconds / self.audio_seconds if self.audio_seconds else float("inf")


ProgressFn = Callable[[int, int, int], None]  # (frames so far, chunk index, number of chunks)


class TTS:
    """Text to speech with one model bundle and its own engine, driven on the caller's thread.

    One thread at a time may use a TTS object (several `stream` generators of one thread may be
    interleaved). `voices_dir`: where registered voices are kept (None: the model's presets only, and
    voices added with `add_voice` live in memory). With `graphs="startup"` on CUDA, construction also
    captures the codec stage's graphs and runs one short warm-up synthesis (a few tenths of a second),
    so that the first real synthesis runs as fast as later ones.
    """

    def __init__(self, bundle: ModelBundle, engine_config: EngineConfig | None = None, *, voices_dir=None):
        self.bundle = bundle
        self.engine = Engine(bundle.model, for_bundle(engine_config or EngineConfig(max_batch=4), bundle))
        codec = bundle.codec
        self.voice_registry = VoiceRegistry(
            bundle.voices, voices_dir, codec_fingerprint(codec), (codec.num_codebooks, codec.codebook_size)
        )
        self.planner = Planner(bundle, self.engine.max_context, self.engine.check, self.voice_registry)
        self._wake = threading.Event()
        self.last_finish_reasons: list[FinishReason] = []
        self.last_warnings: list[str] = []
        self._sessions: SessionManager | None = None  # made by the first `session()`
        # Codec streams: one per job (max_batch + 4) and one per open session (`sessions`: as many again).
        self.runner = JobPipeline(
            self.engine,
            self.planner,
            max_streams=2 * (self.engine.config.max_batch + 4),
            notify=self._wake.set,
        )
        if self.engine.config.graphs == "startup" and self.engine.graphs.enabled:
            # the codec's graphs too, for the default chunk sizes (`stream`'s first chunk growing)
            self.runner.stage.capture(ramp_sizes(DEFAULT_FIRST_CHUNK_FRAMES, DEFAULT_CHUNK_FRAMES)).result()
            # ... and one short synthesis for the one-time set-up (first launches, kernel compiles),
            # so that the first real one runs at the speed of later ones: on an H200 the default voice's
            # first `synthesize` of a process took 0.32 s against 0.04-0.06 s for the next ones.
            sink = ListSink()
            self._run_until_ended(self.runner.submit(self.planner.warmup_job(), sink))
            for event in sink.events:
                if isinstance(event, Failed):
                    log.warning("the warm-up synthesis failed: %s", event.error)

    @classmethod
    def load(
        cls, model: str = "default", device: str = "cpu", dtype=None, voices_dir=None, **engine_options
    ) -> TTS:
        """Load a preset or checkpoint directory; `engine_options` are EngineConfig fields."""
        return cls(
            load_bundle(model, device=device, dtype=dtype),
            EngineConfig(**engine_options),
            voices_dir=voices_dir,
        )

    def close(self) -> None:
        """Stop the codec stage's thread (the object is unusable afterwards)."""
        self.runner.stage.stop()

    # ---- inputs ----------------------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.bundle.codec.sample_rate

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def plan(self, text: str, chunk_length: int | None = None, normalize: bool = True) -> list[str]:
        """The text's generation chunks, as the model reads them (see `Planner.text_plan`)."""
        return self.planner.plan(text, chunk_length, normalize)

    def voice(self, voice) -> list[VoiceReference]:
        """Resolve a voice name or reference objects (see `Planner.voice`)."""
        return self.planner.voice(voice)

    def reference_from_audio(self, audio, sample_rate: int, text: str) -> VoiceReference:
        """Encode reference audio (any channel count and rate) with its transcript. Raises AudioError
        (silent, too short, longer than the model takes: `planner.max_reference_seconds`) or
        InvalidRequest (no transcript)."""
        prepared = self.planner.prepare_reference(audio, sample_rate, text)
        return VoiceReference(codes=self.runner.stage.encode(prepared.samples).result(), text=prepared.text)

    def voices(self) -> list[VoiceEntry]:
        """Preset and registered voices."""
        return self.voice_registry.list()

    def add_voice(self, name: str, audio, sample_rate: int, text: str, replace: bool = False) -> VoiceEntry:
        """Register a voice from a clip and its transcript (persisted when the TTS has a voices_dir);
        afterwards `voice=name` uses it. Raises InvalidRequest (bad name, a preset's name), VoiceExists,
        AudioError."""
        self.voice_registry.check_new(name, replace)
        return self.voice_registry.add(name, self.reference_from_audio(audio, sample_rate, text), replace)

    def delete_voice(self, name: str) -> None:
        """Remove a registered voice (raises VoiceNotFound, or InvalidRequest for a preset)."""
        self.voice_registry.delete(name)

    # ---- synthesis -----------------------------------------------------------------------------------

    def prepare(
        self,
        text: str,
        *,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        chunk_length: int | None = None,
        first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        normalize: bool = True,
        **sampling,
    ) -> SynthesisJob:
        """Validate everything about a synthesis before any work (see `Planner.job`): text, sampling
        values, voice, and that every chunk's prompt plus its budget fits the context. normalize=False
        reads the text as given (no markup reading or normalization, `tts.text.policy`). The job's
        `warnings` say what was left out of the text. Raises TextError, InvalidRequest, VoiceNotFound, each
        naming the request field at fault (`tts.runtime.request`: the rules every front shares)."""
        request = SpeechRequest(
            text,
            voice=voice,
            sampling=Sampling(**sampling),
            first_chunk_frames=first_chunk_frames,
            chunk_frames=chunk_frames,
            normalize=normalize,
            chunk_length=chunk_length,
        )
        return request.plan(self.planner, API_LIMITS)

    def stream(
        self,
        text: str | SynthesisJob,
        *,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        chunk_length: int | None = None,
        progress: ProgressFn | None = None,
        normalize: bool = True,
        **sampling,
    ) -> Iterator[AudioChunk]:
        """Yield audio chunks as frames are generated: the first two of `first_chunk_frames` frames,
        then chunks doubling in size up to `chunk_frames` (4, 4, 8, 16, 16, ... by default; decoded on
        the codec stage's thread while the engine runs on).
        `sampling`: temperature, top_p, top_k, max_new_frames (per text chunk), min_new_frames,
        repetition_penalty, seed, ras_window. normalize=False reads the text as given (see `prepare`).
        `text` may be a SynthesisJob from `prepare`. Raises TextError, InvalidRequest, VoiceNotFound
        before any work."""
        job = (
            text
            if isinstance(text, SynthesisJob)
            else self.prepare(
                text,
                voice=voice,
                chunk_length=chunk_length,
                first_chunk_frames=first_chunk_frames,
                chunk_frames=chunk_frames,
                normalize=normalize,
                **sampling,
            )
        )
        sink = ListSink(progress)
        job_id = self.runner.submit(job, sink)
        ended = False
        try:
            while True:
                while sink.events:
                    event = sink.events.popleft()
                    if isinstance(event, Audio):
                        yield AudioChunk(
                            event.samples, self.sample_rate, event.frame_start, event.frame_end, event.codes
                        )
                    elif isinstance(event, Finished):
                        ended = True
                        self.last_finish_reasons = list(event.finish_reasons)
                        self.last_warnings = list(event.warnings)
                        for warning in event.warnings:  # (marked: the CLI prints them itself)
                            log.warning("%s", warning, extra={SYNTHESIS_WARNING: True})
                        return
                    elif isinstance(event, Failed):
                        ended = True
                        raise event.error
                self._wake.clear()
                stepped = self.runner.step()
                self._tick_sessions()
                if not stepped and not sink.events:
                    self._wake.wait(0.1)  # the codec stage sets it when audio is decoded
        finally:
            if not ended:  # the caller stopped iterating: free the job's blocks, row and codec slot now
                self.runner.cancel(job_id)
                self._run_until_ended(job_id)

    def _run_until_ended(self, job_id: str) -> None:
        """Step the runner until job `job_id` has ended (sleeping while the codec stage works)."""
        while job_id in self.runner.jobs:
            self._wake.clear()
            stepped = self.runner.step()
            self._tick_sessions()
            if not stepped:
                self._wake.wait(0.1)

    # ---- sessions (text streamed in) -----------------------------------------------------------------

    @property
    def sessions(self) -> SessionManager:
        """The session manager (`tts.runtime.sessions`) of this TTS: at most max_batch + 4 sessions."""
        if self._sessions is None:
            self._sessions = SessionManager(self.runner, max_sessions=self.engine.config.max_batch + 4)
        return self._sessions

    def _tick_sessions(self) -> float | None:
        return self._sessions.tick() if self._sessions is not None else None

    def session(
        self,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        *,
        reference: PreparedReference | None = None,
        normalize: bool = True,
        options: SessionOptions | None = None,
        session_id: str | None = None,
        **sampling,
    ) -> SpeechSession:
        """Open a streaming session: text sent in pieces, audio and word timings out (see
        `SpeechSession`, `tts.runtime.sessions`). voice: a voice name or VoiceReference objects (None: the
        model's default voice); or reference: a clip from `planner.prepare_reference(audio, rate, text)`,
        encoded once as the session opens (not both); sampling: temperature, top_p, top_k, max_new_frames
        (per chunk), min_new_frames, seed (chunk i uses seed + i), ras_window, repetition_penalty; options:
        bounds and chunking (`SessionOptions`). Raises SessionLimit, InvalidRequest, VoiceNotFound.

            s = tts.session(voice="ava")
            s.send("Hello there, how are")
            s.send(" you today? I'm fine.")
            s.close()                       # speak the rest, then end
            for event in s:                 # SessionAudio, WordTimings, ChunkEnded, ..., SessionEnded
                ...
        """
        core = self.sessions.open(
            voice,
            reference=reference,
            session_id=session_id,
            normalize=normalize,
            options=options,
            **sampling,
        )
        return SpeechSession(self, core)

    def synthesize(self, text: str | SynthesisJob, **options) -> Synthesis:
        """Synthesize all of `text` (or a SynthesisJob); options as for `stream`."""
        t0 = time.perf_counter()
        first = None
        chunks = []
        for chunk in self.stream(text, **options):
            first = first if first is not None else time.perf_counter() - t0
            chunks.append(chunk)
        return self._synthesis(
            [c.samples for c in chunks],
            [c.codes for c in chunks],
            self.last_finish_reasons,
            self.last_warnings,
            time.perf_counter() - t0,
            first,
        )

    def synthesize_many(self, jobs: Sequence[SynthesisJob]) -> list[Synthesis]:
        """Synthesize several jobs (from `prepare`) at once: they run concurrently in the engine's batch,
        at most min(max_batch, max_waiting) in flight (the next starts as one ends). Returns one Synthesis
        per job, in the order given; each one's `wall_seconds` runs from this call to that job's end and
        its `first_audio_seconds` from this call to its first audio. A seeded job gets the codes it has
        alone through `synthesize` up to float rounding: a lone row's matrix products can round otherwise
        than a batch's (on a CPU, a matrix-vector product; on a GPU, see docs/usage.md on packed prefill),
        which flips a near-tie token now and then (the default voice on a CPU: 1 sample in 42 at batch 8,
        from its 88th frame); its audio may also differ by the float rounding of the codec's batched
        decode (float32 within 1e-5). Raises the error of the first job that fails (InvalidRequest,
        AudioError, ...), once the others are cancelled and freed.
        """
        t0, t0_monotonic = time.perf_counter(), time.monotonic()
        config = self.engine.config
        width = max(1, min(config.max_batch, config.max_waiting))
        sinks = [ListSink() for _ in jobs]
        running: dict[int, str] = {}  # job index -> job id
        ended: dict[int, float] = {}  # job index -> seconds from t0 to its end
        started = 0
        try:
            while len(ended) < len(jobs):
                while started < len(jobs) and len(running) < width:
                    running[started] = self.runner.submit(jobs[started], sinks[started])
                    started += 1
                self._wake.clear()
                stepped = self.runner.step()
                self._tick_sessions()
                now = time.perf_counter() - t0
                for k in [k for k, job_id in running.items() if job_id not in self.runner.jobs]:
                    del running[k]
                    ended[k] = now
                    failed = [e for e in sinks[k].events if isinstance(e, Failed)]
                    if failed:
                        raise failed[0].error
                if not stepped:
                    self._wake.wait(0.1)  # the codec stage sets it when audio is decoded
        finally:  # (a failure or an interrupt: the jobs still running free their rows, blocks and slots)
            for job_id in running.values():
                try:
                    self.runner.cancel(job_id)
                    self._run_until_ended(job_id)
                except Exception:  # (logged: the error that brought us here is the one to raise)
                    log.exception("freeing job %s after a failure failed", job_id)
        results = []
        for k, sink in enumerate(sinks):
            audio = [e for e in sink.events if isinstance(e, Audio)]
            (finished,) = [e for e in sink.events if isinstance(e, Finished)]
            for warning in finished.warnings:  # (marked: the CLI prints them itself)
                log.warning("%s", warning, extra={SYNTHESIS_WARNING: True})
            first = finished.first_audio_at
            results.append(
                self._synthesis(
                    [e.samples for e in audio],
                    [e.codes for e in audio],
                    finished.finish_reasons,
                    finished.warnings,
                    ended[k],
                    None if first is None else first - t0_monotonic,
                )
            )
        return results

    def _synthesis(self, samples, codes, finish_reasons, warnings, wall_seconds, first) -> Synthesis:
        """A Synthesis from a job's audio chunks (float32 `[S]` each) and their codes (`[N, frames]`)."""
        N = self.bundle.codec.num_codebooks
        return Synthesis(
            audio=np.concatenate(samples) if samples else np.zeros(0, np.float32),
            sample_rate=self.sample_rate,
            codes=torch.cat(codes, dim=1) if codes else torch.zeros(N, 0, dtype=torch.int64),
            finish_reasons=list(finish_reasons),
            wall_seconds=wall_seconds,
            first_audio_seconds=first,
            warnings=list(warnings),
        )


class SpeechSession:
    """A streaming session of a `TTS`, driven on the caller's thread (the TTS's one thread).

    Commands (each returns at once; the work happens while events are read):
    `send(text)` adds text; `flush()` speaks the buffered text without waiting for a sentence end;
    `cancel()` (barge-in) drops the text not yet spoken and ends the chunk in flight within one frame
    step, the session staying open; `close()` speaks the rest, then ends; `abort()` ends now.
    Reading: `poll()` runs one step and returns the events ready; iterating yields events until the
    session has nothing left to speak (then `send` more and iterate again) or has ended
    (`SessionEnded`, the last event). Events are `tts.runtime.sessions` types: `ChunkStarted`,
    `SessionAudio` (float32 samples, `sample_offset` in samples on the session clock), `WordTimings`
    (seconds and samples on the session clock), `ChunkEnded`, `SessionWarning`, `SessionEnded`.
    Leaving a `with` block aborts a session that has not ended.
    """

    def __init__(self, tts: TTS, session: Session):
        self._tts = tts
        self.core = session

    @property
    def id(self) -> str:
        return self.core.id

    @property
    def ended(self) -> bool:
        return self.core.ended and not self.core.events

    def send(self, text: str) -> None:
        """Add text (raises SessionClosed after close/abort, InvalidRequest for oversize text)."""
        self.core.send(text)

    def flush(self) -> None:
        self.core.flush()

    def cancel(self) -> None:
        self.core.cancel()

    def close(self) -> None:
        self.core.close()

    def abort(self) -> None:
        """End now; returns once the chunk in flight has freed its row and blocks (one engine step)."""
        job_id = self.core.current.job_id if self.core.current is not None else None
        self.core.abort()
        if job_id is not None:
            self._tts._run_until_ended(job_id)

    def poll(self) -> list[SessionEvent]:
        """One pass of the pipeline (engine step, decoded audio, timeouts); the events ready, in order."""
        if not self.core.events and not self.core.ended:
            self._tts.runner.step()
            self._tts._tick_sessions()
        return self.core.take_events()

    def __iter__(self):
        tts, core = self._tts, self.core
        while True:
            while core.events:
                yield core.events.popleft()
            core.resume()  # (everything read: a chunk paused for back-pressure goes on)
            if core.ended or not (core.busy or core.id in tts.sessions._due):
                return
            tts._wake.clear()
            stepped = tts.runner.step()
            tts._tick_sessions()
            if not stepped and not core.events:
                tts._wake.wait(0.1)  # the codec stage sets it when audio is decoded

    def __enter__(self) -> SpeechSession:
        return self

    def __exit__(self, *exc) -> None:
        if not self.core.ended:
            self.abort()


__all__ = [
    "TTS",
    "SpeechSession",
    "AudioChunk",
    "Synthesis",
    "SynthesisJob",
    "Planner",
    "PreparedReference",
    "VoiceNotFound",
    "VoiceExists",
    "TextError",
    "AudioError",
    "InvalidRequest",
]
