"""Audio output formats (mp3, opus, aac, flac, wav, pcm): streaming encoders through PyAV (FFmpeg), used by
the HTTP front (`service/http.py`) and by `tts synthesize` / `tts client` for their output files.

`AudioEncoder` takes mono float32 chunks as the engine produces them and returns encoded bytes as soon as
the codec and the container release them, so a response can be streamed while the audio is generated:

| format | container, codec | sample rate out | notes |
|---|---|---|---|
| `mp3` | MPEG audio, libmp3lame, 64 kbit/s (128 from 32 kHz up) | the model's | |
| `opus` | Ogg, libopus, 48 kbit/s | 48 kHz (resampled) | Ogg pages of at most 40 ms |
| `aac` | ADTS, FFmpeg's AAC (LC), 64 kbit/s (128 from 32 kHz up) | the model's | |
| `flac` | FLAC, 16-bit | the model's | lossless |
| `wav` | RIFF WAVE, PCM 16-bit (or float32) | the model's | |
| `pcm` | none: raw 16-bit little-endian mono (or float32) | the model's | |

Streamed (non-seekable output) containers cannot go back to fill in lengths: a streamed WAV has the RIFF
and `data` sizes 0xFFFFFFFF (the convention of most streaming servers; libsndfile, FFmpeg and browsers
read it to the end of the data), a streamed FLAC's STREAMINFO says "total samples unknown" (FFmpeg and
browsers decode it; libsndfile's `soundfile.read` cannot size it), a streamed MP3 has no Xing/LAME
header, so decoders do not trim the encoder delay and padding (the decoded clip is up to about 2,600
samples longer). With `seekable=True` (files) the headers are complete: exact WAV sizes, FLAC total
samples, MP3 gapless info.

`speed` (0.25-4.0) changes the tempo without changing the pitch through FFmpeg's `atempo` filter
(chained: two 0.5 steps and the rest below 0.5); the audio lasts about `1 / speed` as long (atempo's
output length is exact to within one of its analysis windows).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: the CLI's parser reads FORMATS without numpy)
    import numpy as np


MIN_SPEED, MAX_SPEED = 0.25, 4.0
OGG_PAGE_MICROSECONDS = 40_000  # an Ogg page holds at most this much audio: low latency when streaming


@dataclass(frozen=True)
class AudioFormat:
    """One output format: its name (OpenAI's `response_format`), HTTP media type and file extension;
    `container` / `codec` are FFmpeg's names (None for raw PCM), `rate` a fixed output sample rate
    (None = the model's), `bit_rate` in bit/s for lossy codecs (0 = none)."""

    name: str
    media_type: str
    extension: str
    container: str | None
    codec: str | None
    rate: int | None = None
    bit_rate: int = 0


FORMATS: dict[str, AudioFormat] = {
    f.name: f
    for f in (
        AudioFormat("mp3", "audio/mpeg", ".mp3", "mp3", "libmp3lame", bit_rate=64_000),
        AudioFormat("opus", "audio/ogg", ".opus", "ogg", "libopus", rate=48_000, bit_rate=48_000),
        AudioFormat("aac", "audio/aac", ".aac", "adts", "aac", bit_rate=64_000),
        AudioFormat("flac", "audio/flac", ".flac", "flac", "flac"),
        AudioFormat("wav", "audio/wav", ".wav", "wav", "pcm_s16le"),
        AudioFormat("pcm", "audio/pcm", ".pcm", None, None),
    )
}
# File name extensions -> format (`tts synthesize -o out.ogg` writes Ogg Opus).
EXTENSIONS = {f.extension: f.name for f in FORMATS.values()} | {".ogg": "opus", ".raw": "pcm"}


class AudioFormatError(ValueError):
    """An unknown format name or file extension, or a speed out of range."""


def get_format(name: str) -> AudioFormat:
    """The AudioFormat called `name` (case-insensitive); raises AudioFormatError naming the known ones."""
    fmt = FORMATS.get(name.lower()) if isinstance(name, str) else None
    if fmt is None:
        raise AudioFormatError(f"unknown audio format {name!r} (known: {', '.join(FORMATS)})")
    return fmt


def format_for_path(path: str | os.PathLike, explicit: str | None = None) -> AudioFormat:
    """The format to write `path` in: `explicit` if given, else from the extension (`.mp3`, `.opus`,
    `.ogg`, `.aac`, `.flac`, `.wav`, `.pcm`, `.raw`; case-insensitive). `-` (stdout) without `explicit`
    is WAV. Raises AudioFormatError for an unknown name or extension."""
    if explicit is not None:
        return get_format(explicit)
    if str(path) == "-":
        return FORMATS["wav"]
    suffix = Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        known = ", ".join(sorted(EXTENSIONS))
        what = f"extension {suffix!r}" if suffix else "no extension"
        raise AudioFormatError(
            f"cannot tell the audio format of {str(path)!r} ({what}; known: {known}); use --format"
        )
    return FORMATS[EXTENSIONS[suffix]]


def check_speed(speed: float) -> float:
    """`speed` as a float if it is within [0.25, 4.0]; raises AudioFormatError otherwise."""
    speed = float(speed)
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise AudioFormatError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed:g}")
    return speed


def _clean(samples) -> np.ndarray:
    """float32 [S] in [-1, 1], NaN -> 0 (what every output format can hold)."""
    import numpy as np

    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    return np.clip(np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


class _Sink:
    """A write-only, non-seekable file object for FFmpeg's muxers; `take()` returns what was written."""

    def __init__(self):
        self._buf = bytearray()

    def write(self, data) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class _Tempo:
    """FFmpeg `atempo` filters in a chain (each step must be >= 0.5): tempo change without pitch change."""

    def __init__(self, speed: float, sample_rate: int):
        import av

        self._av = av
        self.graph = av.filter.Graph()
        node = self.graph.add_abuffer(
            format="flt", sample_rate=sample_rate, layout="mono", time_base=Fraction(1, sample_rate)
        )
        steps = []
        while speed < 0.5:
            steps.append(0.5)
            speed /= 0.5
        steps.append(speed)
        for step in steps:
            nxt = self.graph.add("atempo", f"{step:.6f}")
            node.link_to(nxt)
            node = nxt
        sink = self.graph.add("abuffersink")
        node.link_to(sink)
        self.graph.configure()
        self.rate = sample_rate
        self.pts = 0

    def push(self, samples: np.ndarray | None) -> list[np.ndarray]:
        """Feed float32 samples (None = end of input); returns the float32 pieces the filter released."""
        import numpy as np

        av = self._av
        if samples is None:
            self.graph.push(None)
        else:
            frame = av.AudioFrame.from_ndarray(samples[None, :], format="flt", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self.pts, Fraction(1, self.rate)
            self.pts += len(samples)
            self.graph.push(frame)
        out: list[np.ndarray] = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                return out
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))


class AudioEncoder:
    """Streaming encoder for one clip: `encode(chunk)` per float32 chunk, then `finish()`; each returns the
    bytes that became ready (possibly b""). Their concatenation is a complete file of the format.

    fmt: a format name (see FORMATS) or AudioFormat. sample_rate: Hz of the input chunks (the model's).
    speed: 0.25-4.0, tempo change without pitch change (1.0 = none). seekable: encode into a seekable
    buffer and return everything from `finish()` with complete headers (files), instead of streaming.
    pcm_float: wav and pcm carry float32 samples instead of 16-bit.
    `output_rate` is the sample rate of the encoded audio (48 kHz for opus). Calls are serialized by a
    lock, so `close()` from one thread waits for an `encode()` running on another. One clip per encoder.
    Raises AudioFormatError for an unknown format or speed out of range.
    """

    def __init__(
        self,
        fmt: str | AudioFormat,
        sample_rate: int,
        *,
        speed: float = 1.0,
        seekable: bool = False,
        pcm_float: bool = False,
    ):
        self.format = fmt if isinstance(fmt, AudioFormat) else get_format(fmt)
        self.sample_rate = int(sample_rate)
        self.speed = check_speed(speed)
        self.pcm_float = pcm_float
        self.samples_in = 0  # input samples received
        self.samples_out = 0  # samples given to the codec (after tempo and resampling)
        self._tempo = _Tempo(self.speed, self.sample_rate) if self.speed != 1.0 else None
        self._container = None
        self._finished = False
        self._seekable = seekable
        self._lock = threading.Lock()
        self.output_rate = self.sample_rate
        self._sink = None
        if self.format.container is None:
            return
        import av

        self._av = av
        self._sink = _Sink() if not seekable else None
        self._file = io.BytesIO() if seekable else self._sink
        options = {"fflags": "+bitexact"}  # no encoder version tags: same input, same bytes
        if self.format.container == "ogg":
            options["page_duration"] = str(OGG_PAGE_MICROSECONDS)
        self._container = av.open(self._file, "w", format=self.format.container, container_options=options)
        codec = self.format.codec
        assert codec is not None  # a format with a container names its codec (FORMATS)
        if self.format.name == "wav" and pcm_float:
            codec = "pcm_f32le"
        rate = self.format.rate or self._supported_rate(av.codec.Codec(codec, "w").audio_rates)
        self.output_rate = rate
        stream = self._container.add_stream(codec, rate=rate, layout="mono")
        assert isinstance(stream, av.AudioStream)  # an audio codec's stream
        self._stream = stream
        ctx = stream.codec_context
        if self.format.bit_rate:
            ctx.bit_rate = self.format.bit_rate * (2 if rate >= 32000 and self.format.name != "opus" else 1)
        self._resampler = av.AudioResampler(
            format=ctx.format.name, layout="mono", rate=rate, frame_size=ctx.frame_size or None
        )

    def _supported_rate(self, rates) -> int:
        """The input rate if the codec takes it, else the lowest supported rate above it (else the
        highest)."""
        if not rates or self.sample_rate in rates:
            return self.sample_rate
        higher = [r for r in rates if r >= self.sample_rate]
        return min(higher) if higher else max(rates)

    @property
    def media_type(self) -> str:
        return self.format.media_type

    def encode(self, samples) -> bytes:
        """Encode float32 mono `samples [S]` (values outside [-1, 1] are clipped); returns ready bytes.
        Raises RuntimeError after finish() or close()."""
        x = _clean(samples)
        with self._lock:
            if self._finished:
                raise RuntimeError("encode() after finish() or close()")
            self.samples_in += len(x)
            pieces = self._tempo.push(x) if self._tempo is not None else [x]
            return b"".join(self._encode_float(p) for p in pieces if len(p)) + self._take()

    def finish(self) -> bytes:
        """Flush the tempo filter, resampler, codec and container; returns the last bytes (all of them
        when seekable). The encoder cannot be used afterwards."""
        with self._lock:
            return self._finish()

    def _finish(self) -> bytes:
        if self._finished:
            return b""
        out = []
        if self._tempo is not None:
            out += [self._encode_float(p) for p in self._tempo.push(None) if len(p)]
        self._finished = True
        if self._container is None:
            return b"".join(out)
        for frame in self._resampler.resample(None):
            self._encode_frame(frame)
        self._container.mux(self._stream.encode(None))
        self._container.close()
        self._container = None
        if self._seekable:
            assert isinstance(self._file, io.BytesIO)  # a seekable encoder writes into a BytesIO
            return self._file.getvalue()
        return b"".join(out) + self._take()

    def close(self) -> None:
        """Release the codec and container without flushing (an abandoned clip). Idempotent."""
        with self._lock:
            self._finished = True
            if self._container is not None:
                try:
                    self._container.close()
                except Exception:  # noqa: BLE001 - closing an unfinished muxer may complain; nothing to save
                    pass
                self._container = None

    # internals

    def _encode_float(self, x: np.ndarray) -> bytes:
        if self._container is None:  # raw PCM
            self.samples_out += len(x)
            if self.pcm_float:
                return x.astype("<f4").tobytes()
            return (x * 32767.0).round().astype("<i2").tobytes()
        frame = self._av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        for out in self._resampler.resample(frame):
            self._encode_frame(out)
        return b""

    def _encode_frame(self, frame) -> None:
        frame.pts, frame.time_base = self.samples_out, Fraction(1, self.output_rate)
        self.samples_out += frame.samples
        assert self._container is not None  # only called while the container is open
        self._container.mux(self._stream.encode(frame))

    def _take(self) -> bytes:
        return self._sink.take() if self._sink is not None else b""


def encode_audio(
    samples, sample_rate: int, fmt: str | AudioFormat, *, speed: float = 1.0, pcm_float: bool = False
) -> bytes:
    """A whole clip (float32 mono `[S]` at `sample_rate` Hz) as a complete file of `fmt` with full headers
    (exact WAV sizes, FLAC total samples, MP3 gapless info). Raises AudioFormatError."""
    encoder = AudioEncoder(fmt, sample_rate, speed=speed, seekable=True, pcm_float=pcm_float)
    try:
        head = encoder.encode(samples)  # raw PCM comes back at once; containers at finish()
        return head + encoder.finish()
    finally:
        encoder.close()


def write_audio_file(
    path: str | os.PathLike, samples, sample_rate: int, fmt: str | AudioFormat, *, pcm_float: bool = False
) -> None:
    """Encode a whole clip and write it to `path` atomically (a temporary file in the same directory, then
    a rename: the path holds a complete file or nothing), or to stdout when `path` is "-" (one write once
    the clip is encoded). Raises AudioFormatError, FileNotFoundError if the directory does not exist."""
    data = encode_audio(samples, sample_rate, fmt, pcm_float=pcm_float)
    if str(path) == "-":
        out = sys.stdout.buffer
        out.write(data)
        out.flush()
        return
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"output directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
