"""The `tts` command: one module per command, shared option groups in `tts.cli.main`."""

from tts.cli.main import main

__all__ = ["main"]
