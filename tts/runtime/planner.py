"""The request planner: everything about a synthesis that is checked and decided before device work.

`Planner.job(text, voice=..., ...)` turns a caller's request into a `SynthesisJob`: sampling values
(the bundle's defaults, overridden), the voice (a preset or registered voice by name, reference
objects, or a prepared clip still to be encoded), the text prepared by the model's text policy
(`tts.text.policy`: markup, the English normalizer for English models, the reference cleaning for Fish
models; `normalize=False` skips markup and normalization) and split into generation chunks at sentence
ends (reserved control tags refused), the warnings for the client (text left out or markup ignored),
each chunk's frame budget (the caller's `max_new_frames`, capped by a
runaway guard in proportion to the chunk's text), and the proof that every chunk's prompt plus its
budget fits the engine. The Python API (`tts.api.TTS`) and both service fronts call it, so a request is
validated one way whatever way it arrives. The planner never touches the device: encoding a clip and
generating are the job runner's (`tts.runtime.jobs`).

Prompts for text chunk i carry the voice references and the previous chunk (its text and generated codes) as
context, as fish-speech does for long text (docs/fish_dual_ar.md §3.2); `prompt()` builds them as the runner
reaches each chunk.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import Tensor

from tts.checkpoints.bundle import ModelBundle
from tts.codec.base import AudioError, prepare_audio
from tts.params import DEFAULT_CHUNK_FRAMES, DEFAULT_FIRST_CHUNK_FRAMES, InvalidRequest, SamplingParams
from tts.runtime.request_errors import InvalidField, field_of, with_field
from tts.runtime.voices import VoiceNotFound, VoiceRegistry, codec_fingerprint
from tts.text.budget import charge
from tts.text.normalize import TextError
from tts.text.policy import NOTHING_TO_SPEAK, TextPlan, get_text_policy, plan_text
from tts.text.prompt import Turn, VoiceReference

log = logging.getLogger(__name__)

MAX_REFERENCE_SECONDS = 30.0
MIN_REFERENCE_SECONDS = 0.5
SILENCE_PEAK = 1e-4
# Runaway guard: a text chunk of b UTF-8 bytes gets at most GUARD_SECONDS + b * GUARD_SECONDS_PER_BYTE
# seconds of audio (its frame budget is capped there; the chunk then ends with finish reason `length`).
# English speech runs about 15 characters a second, so a chunk needs about b / 15 s: the guard allows
# 3-4x that for long chunks and more for short ones; a 200-byte chunk may run 53 s.
GUARD_SECONDS = 3.0
GUARD_SECONDS_PER_BYTE = 0.25
# A chunk that the end token ends with fewer frames than `frame_rate * bytes / SHORT_BYTES_PER_SECOND`
# (at least 2 frames) is implausibly short: no one speaks 40 bytes of text a second.
SHORT_BYTES_PER_SECOND = 40.0
# Models that read phonemes and follow their text with aligner heads (the default voice): a chunk of T
# text tokens (phonemes, punctuation and spaces) is expected to take PACE_FRAMES + PACE_FRAMES_PER_TOKEN * T
# frames (its 8 preset voices on three sentences of 11-175 tokens: 0.9-1.35x of that). Its runaway budget
# is PACE_BUDGET times that (a text of one or two words cannot babble on for seconds), and its end token
# is refused before PACE_END_FLOOR times that (tts.engine.Engine._refuse_end).
PACE_FRAMES = 8.0
PACE_FRAMES_PER_TOKEN = 0.8
PACE_BUDGET = 2.0
PACE_END_FLOOR = 0.4

CheckFn = Callable[[Tensor, SamplingParams], None]


@dataclass
class PreparedReference:
    """A checked reference clip before codec encoding: mono float32 `samples [S]` at the codec's rate
    and its normalized transcript; `key` is its reference-cache key (None: not cached)."""

    samples: Tensor
    text: str
    key: str | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class SynthesisJob:
    """One planned synthesis, as the job runner runs it.

    chunks: normalized text chunks, generated in order, each with the previous one as context.
    params: sampling values with a resolved `seed` (text chunk i uses `seed + i`).
    budgets: frames per text chunk (`params.max_new_frames` capped by the runaway guard).
    references: resolved voice references; reference: a clip still to be encoded (cache key inside).
    first_chunk_frames / chunk_frames: the first audio chunk's frames, and the size later chunks double
    up to (`tts.params.chunk_size`; >= 1).
    max_frames: the request's total audio limit in frames (None: none).
    voice_kind: which voice, for logs: "none", "default:NAME" (the bundle's default preset, no voice
    named), "preset:NAME", "registered:NAME", "reference" (a clip in the request) or "objects".
    warnings: for the client, about the text (left out, markup ignored); the runner passes them on.
    """

    chunks: list[str]
    params: SamplingParams
    budgets: list[int] = field(default_factory=list)
    references: list[VoiceReference] = field(default_factory=list)
    reference: PreparedReference | None = None
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    request_id: str | None = None
    max_frames: int | None = None
    voice_kind: str = "none"
    text_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    # A session's chunk (tts.runtime.sessions): the earlier turns its prompt carries (as many as fit,
    # `Planner.session_prompt`), and the engine's kept sequence it extends (tts.engine.sequences).
    history: list[Turn] = field(default_factory=list)
    sequence: str | None = None

    def __post_init__(self) -> None:
        if not self.budgets:
            self.budgets = [self.params.max_new_frames] * len(self.chunks)


class Planner:
    """The input side of synthesis for one bundle (see the module docstring).

    max_context: the engine's context size in tokens. check: `(prompt, params)` -> None, raising
    InvalidRequest if an engine request could never run (the engine's static check; None: only the
    context size is checked). voices: the registry that names resolve in (default: the bundle's presets).
    """

    def __init__(
        self,
        bundle: ModelBundle,
        max_context: int,
        check: CheckFn | None = None,
        voices: VoiceRegistry | None = None,
    ):
        self.bundle = bundle
        self.max_context = max_context
        self._check = check
        self.voices = voices or VoiceRegistry(bundle.voices, None, codec_fingerprint(bundle.codec))
        self.text_policy = get_text_policy(getattr(bundle.prompt_format, "text_policy", "english"))

    @property
    def sample_rate(self) -> int:
        return self.bundle.codec.sample_rate

    @property
    def frame_rate(self) -> float:
        return self.bundle.codec.frame_rate

    def warmup_job(self) -> SynthesisJob:
        """A short greedy job (4 frames in 2-frame audio chunks, no voice) that runs every part of the
        pipeline once: start-up runs it so that no user request pays the one-time set-up."""
        params = replace(self.bundle.sampling, temperature=0.0, max_new_frames=4, seed=0)
        return SynthesisJob(["Warm up."], params, first_chunk_frames=2, chunk_frames=2, request_id="warmup")

    # ---- inputs --------------------------------------------------------------------------------------

    def sampling_params(self, **overrides) -> SamplingParams:
        """The bundle's defaults with the given non-None fields replaced; raises InvalidRequest."""
        params = replace(self.bundle.sampling, **{k: v for k, v in overrides.items() if v is not None})
        params.validate()
        return params

    def voice(self, voice: str | VoiceReference | list[VoiceReference] | None) -> list[VoiceReference]:
        """Resolve a voice name (preset or registered; raises VoiceNotFound) or pass one or more
        references through (all go into the prompt, docs/fish_dual_ar.md §3.2). No voice means the bundle's
        `default_voice` preset when it has one, else no reference."""
        return self._voice(voice)[0]

    def _voice(self, voice) -> tuple[list[VoiceReference], str]:
        if voice is None:
            name = self.bundle.default_voice
            return ([self.voices.get(name)], f"default:{name}") if name else ([], "none")
        if isinstance(voice, VoiceReference):
            return [voice], "objects"
        if isinstance(voice, list | tuple):
            if not all(isinstance(v, VoiceReference) for v in voice):
                raise InvalidRequest("a list of voices must hold VoiceReference objects")
            return list(voice), "objects"
        if not isinstance(voice, str):
            raise InvalidRequest(
                f"voice must be a name or VoiceReference objects, not {type(voice).__name__}"
            )
        return [self.voices.get(voice)], f"{self.voices.kind(voice)}:{voice}"

    @property
    def max_reference_seconds(self) -> float:
        """Longest reference clip accepted: 30 s, or the audio that fills a quarter of the context."""
        budget = (self.max_context // 4) / self.frame_rate
        return min(MAX_REFERENCE_SECONDS, budget)

    def prepare_reference(
        self, audio, sample_rate: int, text: str, key: str | None = None
    ) -> PreparedReference:
        """Check a reference clip on the host (no codec work): transcript present, mono, resampled to
        the codec's rate, at least 0.5 s, not silent, at most `max_reference_seconds`. A longer clip is
        refused (cutting the audio would separate it from its transcript). Raises AudioError or
        InvalidRequest with a one-line reason."""
        if not text or not text.strip():
            raise InvalidRequest("a reference clip needs its transcript")
        x = prepare_audio(audio, sample_rate, self.sample_rate)
        seconds = x.numel() / self.sample_rate
        if seconds < MIN_REFERENCE_SECONDS:
            raise AudioError(
                f"reference audio is {seconds:.2f} s long; at least {MIN_REFERENCE_SECONDS} s needed"
            )
        limit = self.max_reference_seconds
        if seconds > limit:
            raise AudioError(
                f"reference audio is {seconds:.1f} s long; this model takes at most {limit:.1f} s: "
                "give a shorter clip and the transcript of just that part"
            )
        if float(x.abs().max()) < SILENCE_PEAK:
            raise AudioError("reference audio is silent")
        # A transcript is read as plain text (no markup), normalized as the model's text policy says.
        prepared = self.text_policy.prepare(text, self.bundle.prompt_format.user_tags, markup=False)
        warnings = [f"reference transcript: {w}" for w in prepared.warnings]
        return PreparedReference(x, prepared.text, key, warnings)

    def plan(self, text: str, chunk_length: int | None = None, normalize: bool = True) -> list[str]:
        """The generation chunks of `text` (see `text_plan`)."""
        return self.text_plan(text, chunk_length, normalize).chunks

    def text_plan(self, text: str, chunk_length: int | None = None, normalize: bool = True) -> TextPlan:
        """Prepare text with the model's text policy (`tts.text.policy`; normalize=False: as given) and split
        it into generation chunks of at most chunk_length UTF-8 bytes (None: the model's; 0 = one chunk) at
        sentence ends of any script. Text with `<|speaker:N|>` tags is split into speaker turns, grouped up to
        5 turns and chunk_length bytes per chunk (docs/fish_dual_ar.md §3.2). Returns the chunks and the
        warnings for the client. Raises TextError when nothing is left to speak, InvalidRequest for a
        `<|...|>` tag the model's prompt format does not take from users."""
        limit = self.bundle.chunk_length if chunk_length is None else chunk_length
        return plan_text(text, self.text_policy, self.bundle.prompt_format.user_tags, limit, normalize)

    def guard_frames(self, chunk_text: str) -> int:
        """The runaway guard's frame budget for a text chunk (see GUARD_SECONDS)."""
        nbytes = len(chunk_text.encode("utf-8"))
        return math.ceil(self.frame_rate * (GUARD_SECONDS + GUARD_SECONDS_PER_BYTE * nbytes))

    def paced(self) -> bool:
        """Whether chunk budgets and end floors follow the text's tokens (`PACE_FRAMES`): models with
        aligner heads, whose text tokens are what is spoken (the default voice's phonemes)."""
        return getattr(self.bundle, "aligner", None) is not None

    def expected_frames(self, text_tokens: int) -> float:
        """Frames a chunk of `text_tokens` text tokens is expected to take (a paced model's)."""
        return PACE_FRAMES + PACE_FRAMES_PER_TOKEN * text_tokens

    def paced_budget(self, text_tokens: int) -> int:
        """A paced model's runaway budget for a chunk of `text_tokens` tokens, in frames."""
        return math.floor(PACE_BUDGET * self.expected_frames(text_tokens))  # (never over PACE_BUDGET x)

    def chunk_budget(self, budget: int, text_tokens: int | None, min_new_frames: int) -> int:
        """A chunk's frame budget: `budget` (the request's and the runaway guard's), for a paced model
        cut to `paced_budget` of its `text_tokens` (None: not known), never below `min_new_frames` (as
        many as the request asked for)."""
        if text_tokens is None or not self.paced():
            return budget
        return min(budget, max(self.paced_budget(text_tokens), min_new_frames))

    def end_floor(self, span: tuple[int, int] | None) -> int:
        """Frames before which a paced model's end token is refused for a chunk whose text is the
        prompt's `span` (0: no floor)."""
        if span is None or not self.paced():
            return 0
        return math.floor(PACE_END_FLOOR * self.expected_frames(span[1] - span[0]))

    def short_frames(self, chunk_text: str) -> int:
        """Fewer frames than this, ended by the end token, is implausibly little audio for the text."""
        nbytes = len(chunk_text.encode("utf-8"))
        return max(2, math.ceil(self.frame_rate * nbytes / SHORT_BYTES_PER_SECOND))

    @staticmethod
    def check_chunk_seeds(seed: int, n_chunks: int) -> None:
        """Text chunk i is generated with seed + i: raise InvalidRequest if that leaves int64."""
        if not -(2**63) <= seed + n_chunks - 1 < 2**63:
            raise InvalidRequest(
                f"seed must be below 2**63 - {n_chunks - 1} ({n_chunks} text chunks use seed + i), got {seed}"
            )

    def prompt(self, text: str, references, history, params: SamplingParams) -> Tensor:
        """The chunk's prompt `[T, 1 + N]`; drops the previous-chunk context if it would not fit the
        context size with `params.max_new_frames`."""
        return self.prompt_with_span(text, references, history, params)[0]

    def prompt_with_span(
        self, text: str, references, history, params: SamplingParams
    ) -> tuple[Tensor, tuple[int, int] | None]:
        """`prompt`, and the positions `[start, end)` of the chunk's text in it, which the engine's loop
        guard follows (None where the prompt format does not say)."""
        fmt = self.bundle.prompt_format
        build = getattr(fmt, "build_with_span", None) or (lambda *parts: (fmt.build(*parts), None))
        prompt, span = build(text, references, history)
        if history and prompt.shape[0] + params.max_new_frames > self.max_context:
            prompt, span = build(text, references, [])
        return prompt, span

    def session_prompt(
        self, text: str, references, history, params: SamplingParams
    ) -> tuple[Tensor, tuple[int, int] | None]:
        """A session chunk's prompt and text span (as `prompt_with_span`) with as many of the session's
        earlier turns as fit the context with `params.max_new_frames`: the oldest are dropped first (the
        engine then prefills the rest again, and counts it). Raises InvalidRequest when the chunk does
        not fit even alone."""
        fmt = self.bundle.prompt_format
        build = getattr(fmt, "build_with_span", None) or (lambda *parts: (fmt.build(*parts), None))
        turns = list(history)
        while True:
            prompt, span = build(text, references, turns)
            if prompt.shape[0] + params.max_new_frames <= self.max_context:
                return prompt, span
            if not turns:
                raise InvalidRequest(
                    f"prompt ({prompt.shape[0]} tokens) + max_new_frames ({params.max_new_frames}) exceeds "
                    f"the context size {self.max_context}"
                )
            turns = turns[1:]

    def check(self, prompt: Tensor, params: SamplingParams) -> None:
        """Raise InvalidRequest if an engine request with this prompt and params could never run."""
        if self._check is not None:
            self._check(prompt, params)
        elif prompt.shape[0] + params.max_new_frames > self.max_context:
            raise InvalidRequest(
                f"prompt ({prompt.shape[0]} tokens) + max_new_frames ({params.max_new_frames}) "
                f"= {prompt.shape[0] + params.max_new_frames} exceeds the context size {self.max_context}"
            )

    # ---- the whole request ---------------------------------------------------------------------------

    def job(
        self,
        text: str,
        *,
        voice: str | VoiceReference | list[VoiceReference] | None = None,
        reference: PreparedReference | None = None,
        chunk_length: int | None = None,
        first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        max_audio_seconds: float | None = None,
        request_id: str | None = None,
        normalize: bool = True,
        **sampling,
    ) -> SynthesisJob:
        """Plan and validate a synthesis (see the module docstring); `sampling`: temperature, top_p,
        top_k, max_new_frames (per text chunk), min_new_frames, seed, ras_window, repetition_penalty. A
        random seed is chosen when none is given. normalize=False: the text is read as given (no markup
        reading, no normalization; see `tts.text.policy`). Raises TextError, InvalidRequest, VoiceNotFound
        or AudioError before any work, each a `tts.runtime.request_errors.RequestError` naming the
        request field at fault; a `reference` clip is checked for size here (its codes come later, from
        the codec stage). The request's own rules (one voice source, audio chunk sizes, limits) are
        `tts.runtime.request.SpeechRequest`'s, which calls this: callers go through it."""
        try:
            params = self.sampling_params(**sampling)
        except InvalidRequest as exc:
            raise with_field(exc, field_of(exc) or "sampling") from exc
        # An explicit budget that no prompt could fit is an error; the model's default budget is only a
        # ceiling (the runaway guard and the fit check below cut it to what the chunk and context allow).
        if sampling.get("max_new_frames") is not None and params.max_new_frames >= self.max_context:
            raise InvalidField(
                "sampling.max_new_frames",
                f"max_new_frames ({params.max_new_frames}) exceeds the context size {self.max_context}",
            )
        try:
            references, kind = self._voice(voice) if reference is None else ([], "reference")
        except (VoiceNotFound, InvalidRequest) as exc:
            raise with_field(exc, "voice") from exc
        try:
            text_plan = self.text_plan(text, chunk_length, normalize)
        except (TextError, InvalidRequest) as exc:
            raise with_field(exc, "text") from exc
        chunks = text_plan.chunks
        warnings = list(text_plan.warnings) + (list(reference.warnings) if reference is not None else [])
        if params.repetition_penalty != 1.0 and getattr(self.bundle, "repetition", None) is None:
            warnings.append(
                f"repetition_penalty {params.repetition_penalty:g} is ignored: this model samples without a "
                "repetition penalty (as its reference code does)"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        params = replace(params, seed=seed)
        budgets = [min(params.max_new_frames, self.guard_frames(c)) for c in chunks]
        # Every chunk's prompt + budget must fit before any work. A clip not encoded yet has a known
        # frame count (ceil(samples / frame_length), Codec.encode): stand-in codes of that length.
        check_refs = list(references)
        if reference is not None:
            codec = self.bundle.codec
            frames = max(1, math.ceil(reference.samples.numel() / codec.frame_length))
            check_refs.append(VoiceReference(_zero_codes(codec.num_codebooks, frames), reference.text))
        kept = self._chunk_prompts(chunks, budgets, check_refs, params.min_new_frames, warnings)
        if not kept:
            raise with_field(TextError(NOTHING_TO_SPEAK), "text")
        chunks, budgets = [c for c, _, _ in kept], [b for _, b, _ in kept]
        try:
            self.check_chunk_seeds(seed, len(chunks))
        except InvalidRequest as exc:
            raise with_field(exc, "sampling.seed") from exc
        for i, (_, budget, prompt) in enumerate(kept):
            try:
                self.check(prompt, replace(params, seed=seed + i, max_new_frames=budget, min_new_frames=0))
            except InvalidRequest as exc:
                # (the text, with the voice and the budget, is too long for the context)
                prefix = f"text chunk {i + 1} of {len(chunks)}: " if len(chunks) > 1 else ""
                raise InvalidField("text", f"{prefix}{exc}") from exc
        max_frames = None
        if max_audio_seconds is not None:
            max_frames = max(1, math.floor(max_audio_seconds * self.frame_rate))
        return SynthesisJob(
            chunks,
            params,
            budgets,
            references,
            reference,
            first_chunk_frames,
            chunk_frames,
            request_id,
            max_frames,
            kind,
            len(text.encode("utf-8", "replace")),
            warnings,
        )

    def _chunk_prompts(
        self, chunks: list[str], budgets: list[int], references, min_new_frames: int, warnings: list[str]
    ) -> list[tuple[str, int, Tensor]]:
        """Each chunk's prompt for the fit check, with its budget (a paced model's cut to its text's
        tokens, never below `min_new_frames`): `(chunk, budget, prompt)`. A chunk the model reads as
        nothing (its frontend's output is empty, e.g. "- - -" has no phonemes) is left out, with a
        warning appended to `warnings`, as a session leaves such text out."""
        fmt = self.bundle.prompt_format
        with_span = getattr(fmt, "build_with_span", None)  # (formats that say where the text is)
        kept: list[tuple[str, int, Tensor]] = []
        for chunk_text, budget in zip(chunks, budgets, strict=True):
            charge(len(chunk_text))  # (and the deadline is checked before each chunk's prompt)
            if with_span is not None:
                prompt, (start, end) = with_span(chunk_text, references, [])
                if end <= start:
                    warnings.append(left_out(chunk_text))
                    continue
                budget = self.chunk_budget(budget, end - start, min_new_frames)
            else:
                prompt = fmt.build(chunk_text, references, [])
            kept.append((chunk_text, budget, prompt))
        return kept


def left_out(text: str) -> str:
    """The warning for text the model reads as nothing (a request's chunk, a session's piece), which is
    left out rather than spoken: the text shown up to 60 characters."""
    shown = text if len(text) <= 60 else text[:57] + "..."
    return f"nothing to speak in {shown!r}: left out"


def _zero_codes(n: int, frames: int) -> Tensor:
    import torch

    return torch.zeros(n, frames, dtype=torch.int64)


__all__ = [
    "Planner",
    "PreparedReference",
    "SynthesisJob",
    "Turn",
    "TextError",
    "AudioError",
    "InvalidRequest",
    "VoiceNotFound",
]
