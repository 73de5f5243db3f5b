"""Streaming encoders of the output formats (tts/audio_formats.py): every format decodes (PyAV, soundfile)
to the input's duration within that codec's padding, is not silent, streams its bytes while the input
arrives, and changes tempo with `speed`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from tts.audio.formats import (
    FORMATS,
    AudioEncoder,
    AudioFormatError,
    encode_audio,
    format_for_path,
    write_audio_file,
)

av = pytest.importorskip("av")

RATE = 16000
# Extra samples a decoder may return beyond the input, in output-rate samples: a streamed MP3 has no
# gapless header (LAME's delay of 1105 samples plus the last frame's padding, 576 at 16 kHz), ADTS AAC
# carries its 1024-sample priming and the last frame's padding. The other formats are exact.
PADDING = {"mp3": 1105 + 576, "aac": 2 * 1024, "opus": 0, "flac": 0, "wav": 0, "pcm": 0}


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * np.minimum(1.0, t * 20)).astype(np.float32)


def decode(data: bytes, fmt: str, rate: int = RATE) -> tuple[np.ndarray, int]:
    """Encoded bytes -> (float32 samples, sample rate)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767, rate
    container = av.open(io.BytesIO(data))
    frames = list(container.decode(audio=0))
    raw = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
    scale = float(np.iinfo(raw.dtype).max) + 1 if raw.dtype.kind == "i" else 1.0  # s16 / s32 decoders
    return raw.astype(np.float32) / scale, frames[0].sample_rate


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streamed_format_decodes_to_the_input_duration_and_is_not_silent(fmt):
    x = tone(1.5)
    encoder = AudioEncoder(fmt, RATE)
    parts = [encoder.encode(x[i : i + 2000]) for i in range(0, len(x), 2000)]
    parts.append(encoder.finish())
    assert sum(1 for p in parts[:-1] if p) >= len(parts) // 2  # bytes come out while the input arrives
    audio, rate = decode(b"".join(parts), fmt)
    assert rate == encoder.output_rate == (48000 if fmt == "opus" else RATE)
    expected = len(x) * rate // RATE
    assert expected <= len(audio) <= expected + PADDING[fmt] * rate // RATE, (len(audio), expected)
    assert rms(audio) > 0.5 * rms(x)  # not silence (a lossy codec keeps most of a tone's energy)
    if fmt in ("wav", "pcm", "flac"):  # lossless up to 16-bit rounding
        np.testing.assert_allclose(audio[: len(x)], x, atol=1.5 / 32767)


def test_streamed_wav_has_the_unknown_length_header_and_soundfile_reads_it():
    x = tone(0.5)
    encoder = AudioEncoder("wav", RATE)
    data = encoder.encode(x) + encoder.finish()
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[8:12] == b"WAVE"
    assert data[36:40] == b"data" and data[40:44] == b"\xff\xff\xff\xff" and len(data) == 44 + 2 * len(x)
    audio, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == RATE and len(audio) == len(x)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_whole_file_encoding_has_complete_headers(fmt):
    """encode_audio (the CLI's files): exact WAV sizes, FLAC total samples, MP3 gapless info."""
    x = tone(1.0)
    data = encode_audio(x, RATE, fmt)
    audio, rate = decode(data, fmt)
    expected = len(x) * rate // RATE
    exact = fmt != "aac"  # ADTS has no place for the encoder delay
    assert len(audio) == expected if exact else expected <= len(audio) <= expected + PADDING["aac"]
    if fmt in ("wav", "flac"):
        info = sf.info(io.BytesIO(data))
        assert (info.frames, info.samplerate, info.channels) == (len(x), RATE, 1)


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_speed_changes_duration_not_pitch(fmt, speed):
    x = tone(2.0)
    encoder = AudioEncoder(fmt, RATE, speed=speed)
    data = b"".join(encoder.encode(x[i : i + 4000]) for i in range(0, len(x), 4000)) + encoder.finish()
    audio, rate = decode(data, fmt)
    expected = len(x) / speed
    # atempo's length is exact to within about one analysis window (~0.1 s here); MP3 adds its padding.
    assert abs(len(audio) - expected) <= 0.1 * RATE + PADDING[fmt], (len(audio), expected)
    # Same pitch: the strongest frequency of the middle of the clip is still 220 Hz.
    mid = audio[len(audio) // 4 : len(audio) // 4 + RATE // 2]
    peak_hz = np.argmax(np.abs(np.fft.rfft(mid))) * RATE / len(mid)
    assert abs(peak_hz - 220) <= 4


def test_bad_format_speed_and_extension_are_clear_errors():
    with pytest.raises(AudioFormatError, match="unknown audio format 'ogg'"):
        AudioEncoder("ogg", RATE)
    with pytest.raises(AudioFormatError, match=r"speed must be in \[0.25, 4.0\], got 5"):
        AudioEncoder("mp3", RATE, speed=5)
    assert format_for_path("a/b.MP3").name == "mp3" and format_for_path("x.ogg").name == "opus"
    assert format_for_path("-").name == "wav" and format_for_path("-", "flac").name == "flac"
    assert format_for_path("out.txt", "aac").name == "aac"
    with pytest.raises(
        AudioFormatError, match=r"cannot tell the audio format of 'out.m4a' \(extension '.m4a'"
    ):
        format_for_path("out.m4a")
    with pytest.raises(AudioFormatError, match="no extension"):
        format_for_path("out")


def test_write_audio_file_is_atomic_and_stdout_gets_the_bytes(tmp_path, capfdbinary):
    x = tone(0.5)
    write_audio_file(tmp_path / "a.flac", x, RATE, FORMATS["flac"])
    assert [p.name for p in tmp_path.iterdir()] == ["a.flac"]  # no temporary file left behind
    assert sf.info(str(tmp_path / "a.flac")).frames == len(x)
    with pytest.raises(FileNotFoundError):
        write_audio_file(tmp_path / "missing" / "a.wav", x, RATE, "wav")
    capfdbinary.readouterr()
    write_audio_file("-", x, RATE, "wav")
    out = capfdbinary.readouterr().out
    assert out[:4] == b"RIFF" and sf.info(io.BytesIO(out)).frames == len(x)


def test_close_without_finish_and_encode_after_finish():
    encoder = AudioEncoder("mp3", RATE)
    encoder.encode(tone(0.2))
    encoder.close()  # abandoned (a client that went away): no error
    encoder.close()
    with pytest.raises(RuntimeError):
        encoder.encode(tone(0.1))


@pytest.mark.parametrize(
    "fmt, subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("MP3", None), ("OGG", "VORBIS")]
)
def test_a_reference_clip_may_be_any_format_libsndfile_reads(fmt, subtype):
    """Reference clips (--reference-audio, `tts voices add`, the service's clips) are read by soundfile:
    WAV, FLAC, MP3 and Ogg Vorbis all give the clip back at its rate and about its length."""
    from tts.audio.files import read_audio

    if fmt not in sf.available_formats():  # (MP3 needs libsndfile >= 1.1; soundfile's wheels bring 1.2)
        pytest.skip(f"this libsndfile reads no {fmt}")
    rate = 22050
    tone = (0.5 * np.sin(2 * np.pi * 220 * np.arange(rate) / rate)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, tone, rate, format=fmt, subtype=subtype)
    samples, got_rate = read_audio(buf.getvalue())
    assert got_rate == rate and samples.shape[0] == 1
    assert abs(samples.shape[1] - rate) <= 2 * 1152  # (MP3 and Vorbis frames pad the end)
    assert 0.3 < float(np.sqrt(np.mean(samples**2))) < 0.4  # the tone's RMS is 0.354
