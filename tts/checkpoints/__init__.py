"""Checkpoints: files -> ModelBundle (the native format, presets, Fish checkpoints)."""
