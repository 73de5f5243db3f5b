import numpy as np
import pytest
import torch

from tts.audio.files import to_pcm16
from tts.codec import AudioError, WaveTableCodec, prepare_audio


@pytest.fixture(scope="module")
def codec():
    return WaveTableCodec(sample_rate=16000, frame_length=320, num_codebooks=3, codebook_size=32, seed=1)


def test_decode_length_and_range(codec):
    codes = torch.randint(0, 32, (3, 13))
    audio = codec.decode(codes)
    assert audio.dtype == torch.float32 and audio.shape == (13 * 320,)
    assert audio.abs().max() <= 1.0


def test_encode_decode_round_trip_recovers_codes(codec):
    # Fixed codes (a seeded generator): 200 frames recover 194 first-stage codes (97%). Frames
    # overlap-add into their neighbours, so a few are re-encoded as another entry; 90% is the bound.
    codes = torch.randint(0, 32, (3, 200), generator=torch.Generator().manual_seed(0))
    again = codec.encode(codec.decode(codes), codec.sample_rate)
    assert again.shape == (3, 200)
    assert (again[0] == codes[0]).float().mean() > 0.9


@pytest.mark.parametrize("pieces", [[1] * 12, [4, 8], [5, 1, 6], [12]])
def test_streaming_equals_offline(codec, pieces):
    codes = torch.randint(0, 32, (3, sum(pieces)))
    stream = codec.stream()
    out, start = [], 0
    for n in pieces:
        out.append(stream.push(codes[:, start : start + n]))
        start += n
    out.append(stream.flush())
    torch.testing.assert_close(torch.cat(out), codec.decode(codes), rtol=0, atol=1e-6)


def test_prepare_audio_mixes_to_mono_and_resamples():
    t = np.arange(8000) / 8000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), np.zeros_like(t)]).astype(np.float32)
    x = prepare_audio(stereo, 8000, 16000)
    assert x.shape == (16000,)
    assert abs(float(x.abs().max()) - 0.5) < 0.02  # the mean of one tone and silence


@pytest.mark.parametrize("bad", [np.zeros(0), np.array([np.nan, 0.0]), np.zeros((2, 2, 2))])
def test_prepare_audio_rejects_bad_input(bad):
    with pytest.raises(AudioError):
        prepare_audio(bad, 16000, 16000)


def test_same_device_treats_cuda_without_index_as_the_current_device(monkeypatch):
    """A decoder on `cuda` takes inputs on `cuda:0` when that is the current device (the codec stage's
    start-up capture failed on the GPU with "slots must be on cuda, got cuda:0")."""
    from tts.codec.base import same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert same_device("cuda", "cuda:0") and same_device(torch.device("cuda:0"), "cuda")
    assert not same_device("cuda", "cuda:1") and not same_device("cpu", "cuda:0")
    assert same_device("cpu", "cpu") and same_device("cuda:1", "cuda:1")


def test_to_pcm16_clips_rounds_half_to_even_and_zeroes_nan():
    x = np.array([np.nan, np.inf, -np.inf, 1.5, -2.0, 1e38, 0.5, -0.5, 1.0, -1.0], np.float32)
    assert to_pcm16(x).tolist() == [0, 32767, -32767, 32767, -32767, 32767, 16384, -16384, 32767, -32767]
    # Half-way products round to even: 32767 * (k + 0.5) / 32767 -> k + 0.5.
    halves = (np.array([0.5, 1.5, 2.5, -2.5], np.float64) / 32767).astype(np.float32)
    expected = np.rint(np.clip(halves, -1, 1) * np.float32(32767)).astype(np.int16)
    assert to_pcm16(halves).tolist() == expected.tolist()
    # The same values as the formula it replaced (np.nan_to_num, clip, scale, round), on random audio.
    audio = np.random.default_rng(0).normal(0, 0.6, 20000).astype(np.float32)
    old = (np.clip(np.nan_to_num(audio, nan=0.0, posinf=1.0, neginf=-1.0), -1, 1) * 32767.0).round()
    assert np.array_equal(to_pcm16(audio), old.astype(np.int16))
    assert to_pcm16(0.5) == 16384 and to_pcm16(np.float32(np.nan)) == 0  # scalars too
