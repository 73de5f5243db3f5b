"""The errors a caller's input can cause, in one place: the CLI prints them as one line with exit
code 2, the service maps them to INVALID_ARGUMENT / NOT_FOUND."""

from .bundle import CheckpointError
from .codec.base import AudioError
from .config import ConfigError
from .engine.request import InvalidRequest
from .text import TextError
from .tokenizer import TokenizerError
from .voices import VoiceExists, VoiceNotFound


class UserError(Exception):
    """A problem with the user's command-line input: printed as one line, exit code 2."""


BAD_INPUT_ERRORS: tuple[type[Exception], ...] = (
    UserError, TextError, InvalidRequest, AudioError, VoiceNotFound, VoiceExists, CheckpointError, ConfigError,
    TokenizerError,
)  # fmt: skip
NOT_FOUND_ERRORS: tuple[type[Exception], ...] = (VoiceNotFound,)
