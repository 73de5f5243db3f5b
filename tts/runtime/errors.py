"""The errors a caller's input can cause, in one place: the CLI prints them as one line with exit
code 2, the service maps them to INVALID_ARGUMENT / NOT_FOUND. `os_error_reason` words a file or socket
error for such a line.

A light module (the CLI imports it for `tts --help`): the error classes of the layers below load
torch, so the tuples are built on first use. A request's errors that carry their field are in
`tts.runtime.request_errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    BAD_INPUT_ERRORS: tuple[type[Exception], ...]
    NOT_FOUND_ERRORS: tuple[type[Exception], ...]


class UserError(Exception):
    """A problem with the user's command-line input: printed as one line, exit code 2."""


def __getattr__(name: str):
    """`BAD_INPUT_ERRORS` (every error a caller's input can cause) and `NOT_FOUND_ERRORS`, built on first
    use: their classes live in modules that load torch, and `UserError` alone must not (`tts --help`)."""
    if name not in ("BAD_INPUT_ERRORS", "NOT_FOUND_ERRORS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from tts.checkpoints.bundle import CheckpointError
    from tts.codec.base import AudioError
    from tts.engine.request import InvalidRequest
    from tts.model.config import ConfigError
    from tts.runtime.voices import VoiceExists, VoiceNotFound
    from tts.text.normalize import TextError
    from tts.text.tokenizer import TokenizerError

    errors = {
        "BAD_INPUT_ERRORS": (
            UserError, TextError, InvalidRequest, AudioError, VoiceNotFound, VoiceExists, CheckpointError,
            ConfigError, TokenizerError,
        ),
        "NOT_FOUND_ERRORS": (VoiceNotFound,),
    }  # fmt: skip
    globals().update(errors)
    return errors[name]


def os_error_reason(exc: OSError) -> str:
    """Why an OSError happened, in lower-case words and without the file name it carries (which may be
    a temporary file the user never named): "permission denied", "read-only file system",
    "address already in use"."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return reason[:1].lower() + reason[1:]
