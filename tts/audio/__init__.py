"""Audio files and encoded formats."""
