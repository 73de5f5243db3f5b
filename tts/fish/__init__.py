"""Fish Audio checkpoints: S2-Pro, OpenAudio S1(-mini) and fish-speech 1.5 (Fish spec, shared/reference).

`load_fish_bundle` is what `tts.bundle.load_bundle` calls for a checkpoint directory without our
"tts_runtime" config key; `load_fish_model` loads just the language model (every family, including 1.5,
whose Firefly-GAN codec is not supported); `write_checkpoint` writes random-weight checkpoints in the
real on-disk formats (`tts write-checkpoint`).
"""

from .checkpoint import SHAPES, write_checkpoint
from .loader import FAMILIES, load_fish_bundle, load_fish_model

__all__ = ["FAMILIES", "SHAPES", "load_fish_bundle", "load_fish_model", "write_checkpoint"]
