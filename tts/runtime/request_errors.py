"""A request's errors carry the request field at fault (`RequestError`): a canonical name (`text`, `voice`,
`reference.audio`, `reference.text`, `sampling.top_p`, `output.chunk_frames`, ...; see
`tts.runtime.request`) that each front maps to its own (HTTP `input`, gRPC `voice.reference.audio`, the CLI's
`--reference-audio`), in the error's `param` and in the message wherever the message names a field
(`RequestError.message(names)`), never by guessing from the message's text. Each subclass keeps the
lower layer's error type too, so an `except` of that type still catches it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tts.codec.base import AudioError
from tts.params import InvalidRequest
from tts.runtime.voices import VoiceNotFound
from tts.text.normalize import TextError


@dataclass(frozen=True)
class Ref:
    """A request field named inside an error message (canonical name; each front renders its own)."""

    name: str


class RequestError(Exception):
    """Mixin of a request's errors: `field` is the canonical name of the request field at fault, the
    message is made of `parts` (text, and `Ref`s to fields that each front names its way). `str(exc)` is
    the message with canonical names; a front calls `message(names)` with its own."""

    field: str
    parts: tuple[str | Ref, ...]

    def __init__(self, field: str, *parts: str | Ref):
        self.field, self.parts = field, parts
        super().__init__(self.message())

    def message(self, names: Mapping[str, str] | None = None) -> str:
        """The message, each field it names as `names` calls it (missing ones: canonical)."""
        names = names or {}
        return "".join(names.get(p.name, p.name) if isinstance(p, Ref) else p for p in self.parts)

    def field_name(self, names: Mapping[str, str] | None = None) -> str:
        """The field at fault as `names` calls it (canonical where `names` does not say)."""
        return (names or {}).get(self.field, self.field)

    def __str__(self) -> str:
        return self.message()


class InvalidField(RequestError, InvalidRequest):
    """A request value that can never run (INVALID_ARGUMENT, HTTP 400)."""


class AudioFieldError(RequestError, AudioError):
    """A reference clip that cannot be used (INVALID_ARGUMENT, HTTP 400)."""


class TextFieldError(RequestError, TextError):
    """Text with nothing to speak (INVALID_ARGUMENT, HTTP 400)."""


class UnknownVoice(RequestError, VoiceNotFound):
    """A voice name that no preset or registered voice has (NOT_FOUND, HTTP 404)."""


def with_field(exc: Exception, field: str) -> Exception:
    """`exc` (a TextError, InvalidRequest, AudioError or VoiceNotFound: raised by the layers below, which
    know no request fields) as the matching RequestError naming `field`, message kept; `exc` itself if it
    names a field already or is of another type. Raise the result `from exc`."""
    if isinstance(exc, RequestError):
        return exc
    kinds: tuple[tuple[type[Exception], type[RequestError]], ...] = (
        (VoiceNotFound, UnknownVoice),
        (TextError, TextFieldError),
        (AudioError, AudioFieldError),
        (InvalidRequest, InvalidField),
    )
    for base, kind in kinds:
        if isinstance(exc, base):
            return kind(field, str(exc))
    return exc


def field_of(exc: BaseException) -> str | None:
    """The canonical request field `exc` is about: a RequestError's `field`; `sampling.<parameter>` for an
    InvalidRequest of a sampling range (`tts.params.SamplingParams.validate` sets its `parameter`); None for
    any other error."""
    if isinstance(exc, RequestError):
        return exc.field
    parameter = getattr(exc, "parameter", None) if isinstance(exc, InvalidRequest) else None
    return f"sampling.{parameter}" if parameter else None
