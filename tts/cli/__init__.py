"""The `tts` command: one module per command (serve, text, write_checkpoint; the tools register theirs
through entry points), the top-level parser and the shared option groups in `tts.cli.main`."""
