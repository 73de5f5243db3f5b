"""Audio codecs behind one interface (`Codec`): encode, decode, streaming decode."""

from .base import AudioError, Codec, StreamingDecoder, prepare_audio
from .wavetable import WaveTableCodec

__all__ = ["AudioError", "Codec", "StreamingDecoder", "WaveTableCodec", "prepare_audio"]
