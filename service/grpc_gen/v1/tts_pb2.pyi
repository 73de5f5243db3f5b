from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_PCM16: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_FLOAT32: _ClassVar[AudioEncoding]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_SHORT: _ClassVar[FinishReason]
    FINISH_REASON_LOOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
AUDIO_ENCODING_PCM16: AudioEncoding
AUDIO_ENCODING_FLOAT32: AudioEncoding
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_SHORT: FinishReason
FINISH_REASON_LOOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "voice", "sampling", "output", "normalize")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    text: str
    voice: Voice
    sampling: SamplingOptions
    output: OutputOptions
    normalize: bool
    def __init__(self, text: _Optional[str] = ..., voice: _Optional[_Union[Voice, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., normalize: _Optional[bool] = ...) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "reference")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    reference: ReferenceAudio
    def __init__(self, name: _Optional[str] = ..., reference: _Optional[_Union[ReferenceAudio, _Mapping]] = ...) -> None: ...

class ReferenceAudio(_message.Message):
    __slots__ = ("audio", "text")
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    audio: bytes
    text: str
    def __init__(self, audio: _Optional[bytes] = ..., text: _Optional[str] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_new_frames", "min_new_frames", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_FRAMES_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_frames: int
    min_new_frames: int
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_frames: _Optional[int] = ..., min_new_frames: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("encoding", "include_codes", "first_chunk_frames", "chunk_frames")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CODES_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    encoding: AudioEncoding
    include_codes: bool
    first_chunk_frames: int
    chunk_frames: int
    def __init__(self, encoding: _Optional[_Union[AudioEncoding, str]] = ..., include_codes: _Optional[bool] = ..., first_chunk_frames: _Optional[int] = ..., chunk_frames: _Optional[int] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("header", "chunk", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    chunk: AudioChunk
    end: StreamEnd
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., chunk: _Optional[_Union[AudioChunk, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class StreamHeader(_message.Message):
    __slots__ = ("request_id", "sample_rate", "channels", "encoding", "frame_rate", "num_codebooks", "model", "seed", "text_chunks", "warnings", "replica")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_rate: int
    channels: int
    encoding: AudioEncoding
    frame_rate: float
    num_codebooks: int
    model: str
    seed: int
    text_chunks: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    replica: str
    def __init__(self, request_id: _Optional[str] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., frame_rate: _Optional[float] = ..., num_codebooks: _Optional[int] = ..., model: _Optional[str] = ..., seed: _Optional[int] = ..., text_chunks: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ..., replica: _Optional[str] = ...) -> None: ...

class Codes(_message.Message):
    __slots__ = ("num_codebooks", "num_frames", "values")
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    num_codebooks: int
    num_frames: int
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_codebooks: _Optional[int] = ..., num_frames: _Optional[int] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("sequence", "audio", "frame_start", "frame_end", "codes")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FRAME_START_FIELD_NUMBER: _ClassVar[int]
    FRAME_END_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    audio: bytes
    frame_start: int
    frame_end: int
    codes: Codes
    def __init__(self, sequence: _Optional[int] = ..., audio: _Optional[bytes] = ..., frame_start: _Optional[int] = ..., frame_end: _Optional[int] = ..., codes: _Optional[_Union[Codes, _Mapping]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("finish_reason", "frames", "audio_seconds", "time_to_first_audio_seconds", "rtf", "chunks", "text_chunk_finish_reasons", "warnings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RTF_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHUNK_FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    frames: int
    audio_seconds: float
    time_to_first_audio_seconds: float
    rtf: float
    chunks: int
    text_chunk_finish_reasons: _containers.RepeatedScalarFieldContainer[FinishReason]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., frames: _Optional[int] = ..., audio_seconds: _Optional[float] = ..., time_to_first_audio_seconds: _Optional[float] = ..., rtf: _Optional[float] = ..., chunks: _Optional[int] = ..., text_chunk_finish_reasons: _Optional[_Iterable[_Union[FinishReason, str]]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class SynthesizeUnaryResponse(_message.Message):
    __slots__ = ("header", "audio", "codes", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: StreamHeader
    audio: bytes
    codes: Codes
    end: StreamEnd
    def __init__(self, header: _Optional[_Union[StreamHeader, _Mapping]] = ..., audio: _Optional[bytes] = ..., codes: _Optional[_Union[Codes, _Mapping]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VoiceInfo(_message.Message):
    __slots__ = ("name", "transcript", "seconds", "kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    transcript: str
    seconds: float
    kind: str
    def __init__(self, name: _Optional[str] = ..., transcript: _Optional[str] = ..., seconds: _Optional[float] = ..., kind: _Optional[str] = ...) -> None: ...

class AddVoiceRequest(_message.Message):
    __slots__ = ("name", "reference", "replace")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    name: str
    reference: ReferenceAudio
    replace: bool
    def __init__(self, name: _Optional[str] = ..., reference: _Optional[_Union[ReferenceAudio, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[VoiceInfo]
    def __init__(self, voices: _Optional[_Iterable[_Union[VoiceInfo, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "family", "parameters", "device", "dtype", "sample_rate", "frame_rate", "num_codebooks", "codebook_size", "max_context", "max_batch", "buckets", "graphs", "capture", "captured_buckets", "replay_share", "max_waiting", "max_reference_bytes", "max_message_bytes", "max_text_bytes", "max_chunk_frames", "text_chunk_bytes", "max_reference_seconds", "max_audio_seconds", "pause_timeout_seconds", "reference_cache_bytes", "codec_dtype", "replica", "kv_cache_bytes", "kv_blocks", "kv_block_size", "kv_memory_fraction")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SHARE_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TEXT_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    model: str
    family: str
    parameters: int
    device: str
    dtype: str
    sample_rate: int
    frame_rate: float
    num_codebooks: int
    codebook_size: int
    max_context: int
    max_batch: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    graphs: bool
    capture: str
    captured_buckets: _containers.RepeatedScalarFieldContainer[int]
    replay_share: float
    max_waiting: int
    max_reference_bytes: int
    max_message_bytes: int
    max_text_bytes: int
    max_chunk_frames: int
    text_chunk_bytes: int
    max_reference_seconds: float
    max_audio_seconds: float
    pause_timeout_seconds: float
    reference_cache_bytes: int
    codec_dtype: str
    replica: str
    kv_cache_bytes: int
    kv_blocks: int
    kv_block_size: int
    kv_memory_fraction: float
    def __init__(self, model: _Optional[str] = ..., family: _Optional[str] = ..., parameters: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., sample_rate: _Optional[int] = ..., frame_rate: _Optional[float] = ..., num_codebooks: _Optional[int] = ..., codebook_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_batch: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., graphs: _Optional[bool] = ..., capture: _Optional[str] = ..., captured_buckets: _Optional[_Iterable[int]] = ..., replay_share: _Optional[float] = ..., max_waiting: _Optional[int] = ..., max_reference_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_text_bytes: _Optional[int] = ..., max_chunk_frames: _Optional[int] = ..., text_chunk_bytes: _Optional[int] = ..., max_reference_seconds: _Optional[float] = ..., max_audio_seconds: _Optional[float] = ..., pause_timeout_seconds: _Optional[float] = ..., reference_cache_bytes: _Optional[int] = ..., codec_dtype: _Optional[str] = ..., replica: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_memory_fraction: _Optional[float] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("start", "text", "flush", "cancel", "close")
    START_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    start: SessionStart
    text: str
    flush: SessionFlush
    cancel: SessionCancel
    close: SessionClose
    def __init__(self, start: _Optional[_Union[SessionStart, _Mapping]] = ..., text: _Optional[str] = ..., flush: _Optional[_Union[SessionFlush, _Mapping]] = ..., cancel: _Optional[_Union[SessionCancel, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ...) -> None: ...

class SessionStart(_message.Message):
    __slots__ = ("voice", "sampling", "output", "normalize")
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    voice: Voice
    sampling: SamplingOptions
    output: OutputOptions
    normalize: bool
    def __init__(self, voice: _Optional[_Union[Voice, _Mapping]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., output: _Optional[_Union[OutputOptions, _Mapping]] = ..., normalize: _Optional[bool] = ...) -> None: ...

class SessionFlush(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("header", "chunk_start", "audio", "timings", "chunk_end", "warning", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_END_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: SessionHeader
    chunk_start: SessionChunkStart
    audio: SessionAudio
    timings: SessionWordTimings
    chunk_end: SessionChunkEnd
    warning: str
    end: SessionEnd
    def __init__(self, header: _Optional[_Union[SessionHeader, _Mapping]] = ..., chunk_start: _Optional[_Union[SessionChunkStart, _Mapping]] = ..., audio: _Optional[_Union[SessionAudio, _Mapping]] = ..., timings: _Optional[_Union[SessionWordTimings, _Mapping]] = ..., chunk_end: _Optional[_Union[SessionChunkEnd, _Mapping]] = ..., warning: _Optional[str] = ..., end: _Optional[_Union[SessionEnd, _Mapping]] = ...) -> None: ...

class SessionHeader(_message.Message):
    __slots__ = ("session_id", "sample_rate", "channels", "encoding", "frame_rate", "num_codebooks", "model", "replica", "max_pending_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sample_rate: int
    channels: int
    encoding: AudioEncoding
    frame_rate: float
    num_codebooks: int
    model: str
    replica: str
    max_pending_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., frame_rate: _Optional[float] = ..., num_codebooks: _Optional[int] = ..., model: _Optional[str] = ..., replica: _Optional[str] = ..., max_pending_bytes: _Optional[int] = ...) -> None: ...

class SessionChunkStart(_message.Message):
    __slots__ = ("chunk", "text", "sample_offset")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    text: str
    sample_offset: int
    def __init__(self, chunk: _Optional[int] = ..., text: _Optional[str] = ..., sample_offset: _Optional[int] = ...) -> None: ...

class SessionAudio(_message.Message):
    __slots__ = ("chunk", "sample_offset", "audio", "frame_start", "frame_end", "codes")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FRAME_START_FIELD_NUMBER: _ClassVar[int]
    FRAME_END_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    sample_offset: int
    audio: bytes
    frame_start: int
    frame_end: int
    codes: Codes
    def __init__(self, chunk: _Optional[int] = ..., sample_offset: _Optional[int] = ..., audio: _Optional[bytes] = ..., frame_start: _Optional[int] = ..., frame_end: _Optional[int] = ..., codes: _Optional[_Union[Codes, _Mapping]] = ...) -> None: ...

class WordTiming(_message.Message):
    __slots__ = ("text", "start", "end", "estimated")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    text: str
    start: float
    end: float
    estimated: bool
    def __init__(self, text: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., estimated: _Optional[bool] = ...) -> None: ...

class SessionWordTimings(_message.Message):
    __slots__ = ("chunk", "words")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    words: _containers.RepeatedCompositeFieldContainer[WordTiming]
    def __init__(self, chunk: _Optional[int] = ..., words: _Optional[_Iterable[_Union[WordTiming, _Mapping]]] = ...) -> None: ...

class SessionChunkEnd(_message.Message):
    __slots__ = ("chunk", "text", "finish_reason", "frames", "audio_start", "audio_end", "prefill_tokens", "cached_tokens", "warnings", "error")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_START_FIELD_NUMBER: _ClassVar[int]
    AUDIO_END_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    text: str
    finish_reason: FinishReason
    frames: int
    audio_start: int
    audio_end: int
    prefill_tokens: int
    cached_tokens: int
    warnings: _containers.RepeatedScalarFieldContainer[str]
    error: str
    def __init__(self, chunk: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., frames: _Optional[int] = ..., audio_start: _Optional[int] = ..., audio_end: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., warnings: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ...) -> None: ...

class SessionEnd(_message.Message):
    __slots__ = ("reason", "audio_samples", "audio_seconds")
    REASON_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    audio_samples: int
    audio_seconds: float
    def __init__(self, reason: _Optional[str] = ..., audio_samples: _Optional[int] = ..., audio_seconds: _Optional[float] = ...) -> None: ...
