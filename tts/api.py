"""The Python API shared by the CLI, the service and users' programs.

    from tts import TTS
    tts = TTS.load("default")                       # or "tiny", or a checkpoint directory
    result = tts.synthesize("Hello there.", seed=1)  # float32 audio, sample rate, codes, timings
    for chunk in tts.stream("A longer text."):       # audio chunks as frames are generated
        play(chunk.samples, chunk.sample_rate)

Text is normalized, split into chunks of at most `chunk_length` UTF-8 bytes, and each chunk is one
engine request whose prompt carries the voice reference and the previous chunk (text and generated
codes) as context, as fish-speech does for long text (spec 3.2). Codes flow through one streaming codec
decoder, so chunk boundaries are seamless.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from .bundle import ModelBundle, load_bundle
from .codec.base import AudioError, prepare_audio
from .engine import Engine, EngineConfig, FinishReason, InvalidRequest, SamplingParams
from .prompt import Turn, VoiceReference
from .text import TextError, has_speaker_tags, normalize_user_text, shorten, split_speaker_turns, split_text

log = logging.getLogger(__name__)

MAX_REFERENCE_SECONDS = 30.0
MIN_REFERENCE_SECONDS = 0.5
SILENCE_PEAK = 1e-4


class VoiceNotFound(KeyError):
    """An unknown preset voice name. Maps to NOT_FOUND."""

    def __str__(self) -> str:
        return str(self.args[0])


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
    finish reason of each text chunk, and the wall time spent (seconds)."""

    audio: np.ndarray
    sample_rate: int
    codes: Tensor
    finish_reasons: list[FinishReason] = field(default_factory=list)
    wall_seconds: float = 0.0
    first_audio_seconds: float | None = None

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


@dataclass
class Plan:
    """A validated synthesis: normalized text chunks, voice references and sampling parameters."""

    chunks: list[str]
    references: list[VoiceReference]
    params: SamplingParams


@dataclass
class PreparedReference:
    """A checked reference clip before codec encoding: mono float32 `samples [S]` at the codec's rate
    (at most 30 s) and its normalized transcript."""

    samples: Tensor
    text: str


ProgressFn = Callable[[int, int, int], None]  # (frames so far, chunk index, number of chunks)


class Frontend:
    """The input side of synthesis for one bundle: sampling defaults, voices, reference clips, text
    planning and prompts. `TTS` and the gRPC service share it; it never touches the engine.

    max_context: the engine's context size (tokens), used to decide whether a prompt fits.
    """

    def __init__(self, bundle: ModelBundle, max_context: int):
        self.bundle = bundle
        self.max_context = max_context

    @property
    def sample_rate(self) -> int:
        return self.bundle.codec.sample_rate

    # ---- inputs ------------------------------------------------------------------------------------

    def sampling_params(self, **overrides) -> SamplingParams:
        """The bundle's defaults with the given non-None fields replaced; raises InvalidRequest."""
        params = replace(self.bundle.sampling, **{k: v for k, v in overrides.items() if v is not None})
        params.validate()
        return params

    def voice(self, voice: str | VoiceReference | list[VoiceReference] | None) -> list[VoiceReference]:
        """Resolve a preset voice name (raises VoiceNotFound) or pass one or more references through
        (several references are all put in the prompt, Fish spec 3.2). No voice means the bundle's
        `default_voice` preset when it has one, else no reference."""
        if voice is None:
            name = self.bundle.default_voice
            return [self.bundle.voices[name]] if name else []
        if isinstance(voice, VoiceReference):
            return [voice]
        if isinstance(voice, list | tuple):
            if not all(isinstance(v, VoiceReference) for v in voice):
                raise InvalidRequest("a list of voices must hold VoiceReference objects")
            return list(voice)
        if voice not in self.bundle.voices:
            names = ", ".join(sorted(self.bundle.voices)) or "none"
            raise VoiceNotFound(f"unknown voice {shorten(voice, 60)!r} (available: {shorten(names, 160)})")
        return [self.bundle.voices[voice]]

    def reference_from_audio(self, audio, sample_rate: int, text: str) -> VoiceReference:
        """Encode reference audio (any channel count and rate) with its transcript.

        Raises AudioError for silent or too-short audio, InvalidRequest for an empty transcript; audio
        longer than `max_reference_seconds` (30 s, or less when a quarter of the model's context holds
        fewer frames) is trimmed with a warning.
        """
        return self.encode_reference(self.prepare_reference(audio, sample_rate, text))

    def prepare_reference(self, audio, sample_rate: int, text: str) -> PreparedReference:
        """The host-side half of `reference_from_audio`: checks, mono, resampling, trimming (no codec
        work). Raises as `reference_from_audio` does."""
        if not text or not text.strip():
            raise InvalidRequest("a reference clip needs its transcript")
        x = prepare_audio(audio, sample_rate, self.sample_rate)
        seconds = x.numel() / self.sample_rate
        if seconds < MIN_REFERENCE_SECONDS:
            raise AudioError(
                f"reference audio is {seconds:.2f} s long; at least {MIN_REFERENCE_SECONDS} s needed"
            )
        if float(x.abs().max()) < SILENCE_PEAK:
            raise AudioError("reference audio is silent")
        limit = self.max_reference_seconds
        if seconds > limit:
            log.warning("reference audio is %.1f s long; using its first %.1f s", seconds, limit)
            x = x[: int(limit * self.sample_rate)]
        return PreparedReference(x, normalize_user_text(text, self.bundle.prompt_format.user_tags))

    def encode_reference(self, prepared: PreparedReference) -> VoiceReference:
        """The codec half of `reference_from_audio` (device work: the engine thread runs it)."""
        return VoiceReference(codes=self.bundle.codec.encode_audio(prepared.samples), text=prepared.text)

    @property
    def max_reference_seconds(self) -> float:
        """Longest reference clip used: 30 s, or the audio that fills a quarter of the context."""
        budget = (self.max_context // 4) / self.bundle.codec.frame_rate
        return min(MAX_REFERENCE_SECONDS, budget)

    def plan(self, text: str, chunk_length: int | None = None) -> list[str]:
        """Normalize and split text into generation chunks (chunk_length 0 = one chunk). Text with
        `<|speaker:N|>` tags is split into speaker turns, grouped up to 5 turns and chunk_length bytes
        per chunk (Fish spec 3.2)."""
        normalized = normalize_user_text(text, self.bundle.prompt_format.user_tags)
        limit = self.bundle.chunk_length if chunk_length is None else chunk_length
        if limit <= 0:
            return [normalized]
        if has_speaker_tags(normalized):
            return split_speaker_turns(normalized, limit)
        return split_text(normalized, limit)

    @staticmethod
    def check_chunk_seeds(seed: int, n_chunks: int) -> None:
        """Text chunk i is generated with seed + i: raise InvalidRequest if that leaves int64."""
        if not -(2**63) <= seed + n_chunks - 1 < 2**63:
            raise InvalidRequest(
                f"seed must be below 2**63 - {n_chunks - 1} ({n_chunks} text chunks use seed + i), got {seed}"
            )

    def prompt(self, text: str, references, history, params: SamplingParams) -> Tensor:
        """The chunk's prompt `[T, 1 + N]`; drops the previous-chunk context if it would not fit the
        context size."""
        fmt = self.bundle.prompt_format
        prompt = fmt.build(text, references, history)
        if history and prompt.shape[0] + params.max_new_frames > self.max_context:
            prompt = fmt.build(text, references, [])
        return prompt


class TTS(Frontend):
    """Text to speech with one model bundle and its own engine (driven synchronously)."""

    def __init__(self, bundle: ModelBundle, engine_config: EngineConfig | None = None):
        self.engine = Engine(bundle.model, engine_config or EngineConfig(max_batch=4))
        super().__init__(bundle, self.engine.max_context)

    @classmethod
    def load(cls, model: str = "default", device: str = "cpu", dtype=None, **engine_options) -> TTS:
        """Load a preset or checkpoint directory; `engine_options` are EngineConfig fields."""
        return cls(load_bundle(model, device=device, dtype=dtype), EngineConfig(**engine_options))

    # ---- synthesis -----------------------------------------------------------------------------------

    def prepare(
        self, text: str, *, voice: str | VoiceReference | list[VoiceReference] | None = None, chunk_length: int | None = None,
        **sampling,
    ) -> Plan:  # fmt: skip
        """Validate everything about a synthesis before any work: text, sampling values, voice, and
        that every chunk's prompt plus its budget fits the context. Raises TextError, InvalidRequest,
        VoiceNotFound."""
        params = self.sampling_params(**sampling)
        references = self.voice(voice)
        chunks = self.plan(text, chunk_length)
        if params.seed is not None:
            self.check_chunk_seeds(params.seed, len(chunks))
        for chunk_text in chunks:
            self.engine.check(self.bundle.prompt_format.build(chunk_text, references, []), params)
        return Plan(chunks, references, params)

    def stream(
        self, text: str | Plan, *, voice: str | VoiceReference | list[VoiceReference] | None = None,
        first_chunk_frames: int = 4, chunk_frames: int = 16, chunk_length: int | None = None,
        progress: ProgressFn | None = None, **sampling,
    ) -> Iterator[AudioChunk]:  # fmt: skip
        """Yield audio chunks as frames are generated: the first after `first_chunk_frames` frames,
        then every `chunk_frames` (decoded on a second thread, so a chunk may follow its frames by up
        to two chunks while the engine runs ahead). `sampling`: temperature, top_p, top_k, max_new_frames (per text
        chunk), seed, ras_window. `text` may be a Plan from `prepare`. Raises TextError,
        InvalidRequest, VoiceNotFound before any work."""
        plan = (
            text
            if isinstance(text, Plan)
            else self.prepare(text, voice=voice, chunk_length=chunk_length, **sampling)
        )
        chunks, references, params = plan.chunks, plan.references, plan.params
        self.last_finish_reasons: list[FinishReason] = []
        # The codec decodes on its own thread, in order, while the engine generates the next frames
        # (torch releases the GIL inside ops, so on a CPU the two use two cores). The first chunk is
        # waited for (it sets the time to first audio); later ones are yielded as soon as they are
        # decoded (checked after every frame), with at most 2 queued behind the engine.
        codec_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="codec-decode")
        decoding: deque[Future[AudioChunk]] = deque()
        try:
            decoder = self.bundle.codec.stream()
            history: list[Turn] = []
            emitted = 0
            pending: list[Tensor] = []
            for i, chunk_text in enumerate(chunks):
                chunk_params = replace(params, seed=None if params.seed is None else params.seed + i)
                prompt = self.prompt(chunk_text, references, history, chunk_params)
                generated: list[Tensor] = []
                for codes in self._generate(prompt, chunk_params):
                    generated.append(codes)
                    pending.append(codes)
                    if progress:
                        progress(emitted + len(pending), i, len(chunks))
                    if len(pending) >= (first_chunk_frames if emitted == 0 else chunk_frames):
                        decoding.append(codec_thread.submit(self._decode, decoder, pending, emitted))
                        if emitted == 0 or len(decoding) > 2:
                            yield decoding.popleft().result()
                        emitted += len(pending)
                        pending = []
                    while decoding and decoding[0].done():
                        yield decoding.popleft().result()
                if generated:
                    history = [Turn(chunk_text, torch.cat(generated).T)]
            if pending:
                decoding.append(codec_thread.submit(self._decode, decoder, pending, emitted))
            while decoding:
                yield decoding.popleft().result()
        finally:  # closed early or failed: drop the queued decodes instead of waiting for them
            codec_thread.shutdown(wait=False, cancel_futures=True)

    def synthesize(self, text: str | Plan, **options) -> Synthesis:
        """Synthesize all of `text` (or a Plan); options as for `stream`."""
        t0 = time.perf_counter()
        first = None
        chunks = []
        for chunk in self.stream(text, **options):
            first = first if first is not None else time.perf_counter() - t0
            chunks.append(chunk)
        N = self.bundle.codec.num_codebooks
        audio = np.concatenate([c.samples for c in chunks]) if chunks else np.zeros(0, np.float32)
        codes = (
            torch.cat([c.codes for c in chunks], dim=1) if chunks else torch.zeros(N, 0, dtype=torch.int64)
        )
        return Synthesis(
            audio=audio, sample_rate=self.sample_rate, codes=codes,
            finish_reasons=list(self.last_finish_reasons), wall_seconds=time.perf_counter() - t0,
            first_audio_seconds=first,
        )  # fmt: skip

    # ---- internals -----------------------------------------------------------------------------------

    def _generate(self, prompt: Tensor, params: SamplingParams) -> Iterator[Tensor]:
        """Run one request to its end on this object's engine; yields `[1, N]` codes per frame."""
        request = self.engine.submit(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != request.request_id:
                        continue
                    if out.codes.numel():
                        yield out.codes
                    if out.finished:
                        finished = True
                        if out.finish_reason == FinishReason.ERROR:
                            raise RuntimeError(f"generation failed: {out.error}")
                        self.last_finish_reasons.append(out.finish_reason)
        finally:
            if not finished:  # the caller stopped iterating: free the request's blocks now
                self.engine.cancel(request.request_id)
                self.engine.step()

    def _decode(self, decoder, pending: list[Tensor], start: int) -> AudioChunk:
        codes = torch.cat(pending).T  # [N, frames]
        samples = decoder.push(codes).numpy().astype(np.float32, copy=False)
        return AudioChunk(samples, self.sample_rate, start, start + codes.shape[1], codes)


__all__ = [
    "TTS",
    "Plan",
    "Frontend",
    "PreparedReference",
    "AudioChunk",
    "Synthesis",
    "VoiceNotFound",
    "TextError",
    "AudioError",
    "InvalidRequest",
]
