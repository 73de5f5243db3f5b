"""One request to synthesize, whichever way it came (gRPC, HTTP, the Python API, the CLI), and every rule
about it, checked here once.

A front translates its wire format into a `SpeechRequest` and calls `SpeechRequest.plan(planner, limits)`,
which checks the request against its `RequestLimits` and the model and returns the `SynthesisJob` (through
`tts.runtime.planner.Planner.job`). What is wrong comes back as a `tts.runtime.request_errors.RequestError`
(a TextError, InvalidRequest, AudioError or VoiceNotFound as well) whose `field` is a canonical field name
and whose message names fields as `Ref`s: each front maps both to its own names (`FIELDS` lists the
canonical ones) and the error type to its status, and guesses nothing from the message's text.

The rules: the text's size in UTF-8 bytes (`RequestLimits.max_text_bytes`); a voice name or a reference
clip, not both (`check_voice_source`); a reference clip's size, its transcript and that it decodes (WAV,
FLAC, MP3 or Ogg), then its length and loudness (`Planner.prepare_reference`); the sampling ranges
(`tts.params.SamplingParams.validate`) and the frame budget against the context; the audio chunk sizes
(`check_chunk_frames`); the text itself (something to speak, no reserved tags) and that every text
chunk's prompt plus its budget fits the context (`Planner.job`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from tts.audio.files import read_audio
from tts.codec.base import AudioError
from tts.params import DEFAULT_CHUNK_FRAMES, DEFAULT_FIRST_CHUNK_FRAMES, MAX_CHUNK_FRAMES, InvalidRequest
from tts.runtime.planner import Planner, PreparedReference, SynthesisJob
from tts.runtime.request_errors import AudioFieldError, InvalidField, Ref, RequestError, with_field
from tts.runtime.voices import reference_key
from tts.text.prompt import VoiceReference

# The canonical field names (a front maps them to its own; `RequestError.field` is one of them).
TEXT = "text"
VOICE = "voice"
REFERENCE_AUDIO = "reference.audio"
REFERENCE_TEXT = "reference.text"
FIRST_CHUNK_FRAMES = "output.first_chunk_frames"
CHUNK_FRAMES = "output.chunk_frames"
SAMPLING = (
    "temperature", "top_p", "top_k", "seed", "max_new_frames", "min_new_frames", "repetition_penalty",
    "ras_window",
)  # fmt: skip
FIELDS = (
    TEXT, VOICE, REFERENCE_AUDIO, REFERENCE_TEXT, *(f"sampling.{n}" for n in SAMPLING), FIRST_CHUNK_FRAMES,
    CHUNK_FRAMES,
)  # fmt: skip

MiB = 1024 * 1024


def format_size(n: int) -> str:
    """Bytes as `12.3 MiB` / `64.0 KiB` / `100 bytes`."""
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask. max_text_bytes: the text's UTF-8 bytes (None: no limit); max_reference_bytes:
    a reference clip's encoded bytes (None: no limit); max_chunk_frames: the largest audio chunk (frames, at
    most `tts.params.MAX_CHUNK_FRAMES`); first_chunk_frames / chunk_frames: the audio chunk sizes a request
    that gives none gets; max_audio_seconds: audio per request before it ends with `length` (None: none)."""

    max_text_bytes: int | None = None
    max_reference_bytes: int | None = None
    max_chunk_frames: int = MAX_CHUNK_FRAMES
    first_chunk_frames: int = DEFAULT_FIRST_CHUNK_FRAMES
    chunk_frames: int = DEFAULT_CHUNK_FRAMES
    max_audio_seconds: float | None = None


@dataclass
class Sampling:
    """Sampling overrides (None: the model's default); ranges in `tts.params.SamplingParams`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    max_new_frames: int | None = None
    min_new_frames: int | None = None
    repetition_penalty: float | None = None
    ras_window: int | None = None

    def given(self) -> dict[str, float | int]:
        """The overrides that are set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class ReferenceClip:
    """A voice to clone, as sent: the clip's encoded bytes (WAV, FLAC, MP3 or Ogg) and its transcript."""

    audio: bytes
    text: str


@dataclass
class SpeechRequest:
    """One synthesis request, front-neutral.

    text: what to say. voice: a preset or registered voice's name (or, from the Python API, reference
    objects); reference: a clip with its transcript instead (one or the other, or neither: the model's
    default voice). sampling: overrides of the model's defaults. first_chunk_frames / chunk_frames: audio
    chunk sizes in frames (None: the limits' default). normalize: read markup and normalize the text as
    the model's text policy says (False: as given). chunk_length: text chunk size in UTF-8 bytes (None:
    the model's). request_id: the job's id prefix.
    """

    text: str
    voice: str | VoiceReference | list[VoiceReference] | None = None
    reference: ReferenceClip | None = None
    sampling: Sampling = field(default_factory=Sampling)
    first_chunk_frames: int | None = None
    chunk_frames: int | None = None
    normalize: bool = True
    chunk_length: int | None = None
    request_id: str | None = None

    def check(self, limits: RequestLimits) -> None:
        """The rules that need no model: text size, one voice source, the reference clip's size and
        transcript, the audio chunk sizes (the sampling ranges need the model's defaults: `plan`). Raises
        RequestError."""
        nbytes = len(self.text.encode("utf-8", "replace"))
        if limits.max_text_bytes is not None and nbytes > limits.max_text_bytes:
            raise InvalidField(TEXT, Ref(TEXT), f" is {nbytes} bytes; the limit is {limits.max_text_bytes}")
        check_voice_source(self.voice, self.reference is not None)
        if self.reference is not None:
            check_reference(self.reference, limits)
        check_chunk_frames(*self.chunk_sizes(limits), limits.max_chunk_frames)

    def chunk_sizes(self, limits: RequestLimits) -> tuple[int, int]:
        """(first_chunk_frames, chunk_frames): the request's, or the limits' defaults where None."""
        first = limits.first_chunk_frames if self.first_chunk_frames is None else self.first_chunk_frames
        chunk = limits.chunk_frames if self.chunk_frames is None else self.chunk_frames
        return first, chunk

    def plan(self, planner: Planner, limits: RequestLimits) -> SynthesisJob:
        """Check everything (`check`, then the clip's audio and the model's rules) and plan the job: host
        work only, on any thread, under the caller's text budget (`tts.text.budget`). Raises
        RequestError (TextError / InvalidRequest / AudioError: invalid; VoiceNotFound: not found),
        PreparationTimeout past the budget's deadline."""
        self.check(limits)
        reference = None if self.reference is None else prepare_reference(planner, self.reference, limits)
        first, chunk = self.chunk_sizes(limits)
        return planner.job(
            self.text,
            voice=self.voice,
            reference=reference,
            chunk_length=self.chunk_length,
            first_chunk_frames=first,
            chunk_frames=chunk,
            max_audio_seconds=limits.max_audio_seconds,
            request_id=self.request_id,
            normalize=self.normalize,
            **self.sampling.given(),
        )


def plan_job(planner: Planner, request: SpeechRequest, limits: RequestLimits) -> SynthesisJob:
    """`request.plan(planner, limits)`: what every front runs (on a worker thread) to turn its request into a
    job; one name, so that a test can hold every front's preparation at one place."""
    return request.plan(planner, limits)


# ---- the rules a front may also check early (the CLI, before it loads a model) ------------------------


def check_voice_source(voice: object, has_reference: bool, has_transcript: bool | None = None) -> None:
    """A request names a voice or gives a reference clip, not both; a transcript goes with a clip
    (`has_transcript`: None when the front carries the transcript inside the clip). Raises InvalidField."""
    if voice is not None and voice != "" and has_reference:
        raise InvalidField(VOICE, "give ", Ref(VOICE), " or ", Ref(REFERENCE_AUDIO), ", not both")
    if has_transcript and not has_reference:
        raise InvalidField(REFERENCE_TEXT, Ref(REFERENCE_TEXT), " goes with ", Ref(REFERENCE_AUDIO))


def check_chunk_frames(first_chunk_frames: int, chunk_frames: int, limit: int = MAX_CHUNK_FRAMES) -> None:
    """Audio chunk sizes are 1 to `limit` frames (at most MAX_CHUNK_FRAMES, what the codec stage decodes in
    one call). Raises InvalidField naming the size at fault."""
    limit = min(limit, MAX_CHUNK_FRAMES)
    for name, value in ((FIRST_CHUNK_FRAMES, first_chunk_frames), (CHUNK_FRAMES, chunk_frames)):
        if value < 1:
            raise InvalidField(name, Ref(name), f" must be at least 1, got {value}")
        if value > limit:
            raise InvalidField(name, Ref(name), f" must be at most {limit}, got {value}")


def check_reference(clip: ReferenceClip, limits: RequestLimits) -> None:
    """A clip's size (at most `limits.max_reference_bytes`, not empty) and its transcript. Raises
    InvalidField / AudioFieldError."""
    size = len(clip.audio)
    if limits.max_reference_bytes is not None and size > limits.max_reference_bytes:
        raise InvalidField(
            REFERENCE_AUDIO,
            f"reference audio is {format_size(size)}; the limit is {format_size(limits.max_reference_bytes)}",
        )
    if not size:
        raise AudioFieldError(REFERENCE_AUDIO, "reference audio is empty")
    if not clip.text.strip():
        raise InvalidField(REFERENCE_TEXT, "reference audio needs its transcript (", Ref(REFERENCE_TEXT), ")")


def prepare_reference(planner: Planner, clip: ReferenceClip, limits: RequestLimits) -> PreparedReference:
    """Check a reference clip (`check_reference`), decode it and check its audio (`Planner.prepare_reference`:
    length, loudness) and key it for the reference cache (host work): a request's clip and a voice to
    register alike. Raises AudioFieldError / InvalidField."""
    check_reference(clip, limits)
    try:
        audio, sample_rate = read_audio(bytes(clip.audio))
    except AudioError as exc:  # soundfile's message names an in-memory file object: drop it
        reason = re.sub(r"^cannot read reference audio: (Error opening <[^>]*>: )?", "", str(exc)).strip()
        raise AudioFieldError(
            REFERENCE_AUDIO,
            "cannot read reference audio (",
            Ref(REFERENCE_AUDIO),
            f": WAV, FLAC, MP3 or Ogg): {reason}",
        ) from exc
    fingerprint = planner.voices.fingerprint
    assert fingerprint is not None  # the planner's registry is opened with the codec's fingerprint
    key = reference_key(bytes(clip.audio), clip.text, fingerprint)
    try:
        return planner.prepare_reference(audio, sample_rate, clip.text, key=key)
    except (AudioError, InvalidRequest) as exc:  # too short, too long, silent
        raise with_field(exc, REFERENCE_AUDIO) from exc


def prepare_session_voice(
    planner: Planner, voice: str | None, clip: ReferenceClip | None, limits: RequestLimits
) -> PreparedReference | None:
    """A streaming session's voice source, by a one-shot request's rules: a voice name or a reference clip,
    not both (`check_voice_source`), the clip checked, decoded and keyed (`prepare_reference`: size,
    transcript, format, length, loudness). Host work: a front runs it on a worker thread before it opens
    the session (`EngineThread.open_session(reference=...)`, which encodes the clip once). Returns the
    prepared clip, None without one. Raises InvalidField / AudioFieldError naming the field at fault."""
    check_voice_source(voice, clip is not None)
    return None if clip is None else prepare_reference(planner, clip, limits)


__all__ = [
    "CHUNK_FRAMES",
    "FIELDS",
    "FIRST_CHUNK_FRAMES",
    "REFERENCE_AUDIO",
    "REFERENCE_TEXT",
    "TEXT",
    "VOICE",
    "ReferenceClip",
    "RequestError",
    "RequestLimits",
    "Sampling",
    "SpeechRequest",
    "check_chunk_frames",
    "check_reference",
    "check_voice_source",
    "format_size",
    "plan_job",
    "prepare_reference",
    "prepare_session_voice",
]
