"""Audio codecs behind one interface (`Codec`): encode, decode, streaming decode."""

from tts.codec.base import AudioError, Codec, StreamingDecoder, prepare_audio
from tts.codec.wavetable import WaveTableCodec

__all__ = ["AudioError", "Codec", "StreamingDecoder", "WaveTableCodec", "prepare_audio"]
