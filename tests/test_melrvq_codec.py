"""The default model's codec: log-mel RVQ + windowed Griffin-Lim (tts/codec/melrvq.py)."""

import json
import math

import pytest
import torch
from helpers import decode_in_pushes

from tts.checkpoints.bundle import load_codec
from tts.codec.mel import FRAME_LENGTH, SAMPLE_RATE, LogMel, stack_frames
from tts.codec.melrvq import MelRVQCodec, fit_rvq


def _voice_like(seconds: float, f0: float, seed: int) -> torch.Tensor:
    """A harmonic tone with a moving formant-like envelope and pauses: speech-shaped, deterministic."""
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * SAMPLE_RATE)
    t = torch.arange(n) / SAMPLE_RATE
    pitch = f0 * (1 + 0.1 * torch.sin(2 * math.pi * 0.7 * t))
    phase = 2 * math.pi * torch.cumsum(pitch, 0) / SAMPLE_RATE
    formant = 600 + 400 * torch.sin(2 * math.pi * (1.3 + 0.2 * torch.rand(1, generator=g)) * t)
    k = torch.arange(1, 13, dtype=torch.float32).unsqueeze(1)
    x = (torch.sin(k * phase) * torch.exp(-(((k * pitch - formant) / 500) ** 2))).sum(0)
    gate = (torch.sin(2 * math.pi * 1.5 * t) > -0.6).float()
    return (0.3 * x * gate / x.abs().max()).float()


@pytest.fixture(scope="module")
def codec():
    clips = [_voice_like(1.5, f0, seed) for seed, f0 in enumerate((110, 150, 210, 260))]
    vecs = torch.cat([stack_frames(LogMel()(c)) for c in clips])
    mean, std = vecs.mean(0), vecs.std(0).clamp_min(1e-3)
    books = fit_rvq((vecs - mean) / std, num_codebooks=3, codebook_size=32, iters=8)
    return MelRVQCodec(books, mean, std, gl_context=2, gl_iters=8)


def test_frame_layout(codec):
    assert codec.frame_rate == pytest.approx(21.533, abs=1e-3)
    audio = _voice_like(1.0, 150, 9)
    codes = codec.encode(audio, SAMPLE_RATE)
    T = math.ceil(audio.numel() / FRAME_LENGTH)
    assert codes.shape == (3, T) and codes.dtype == torch.int64
    assert int(codes.min()) >= 0 and int(codes.max()) < 32
    out = codec.decode(codes)
    assert out.shape == (T * FRAME_LENGTH,) and out.dtype == torch.float32
    assert float(out.abs().max()) <= 1.0


def test_round_trip_keeps_the_spectrum(codec):
    """Re-encoding decoded audio lands near the original mel; a wrong-pitch clip lands far."""
    audio = _voice_like(1.5, 150, 1)
    mel = LogMel()(audio)
    rt = LogMel()(codec.decode(codec.encode_audio(audio)))
    other = LogMel()(_voice_like(1.5, 260, 3))
    n = min(mel.shape[0], rt.shape[0], other.shape[0]) - 8  # the codec delays by 512 samples
    err = (rt[2 : n + 2] - mel[:n]).abs().mean()
    baseline = (other[:n] - mel[:n]).abs().mean()
    assert err < 0.6 * baseline


def test_quantizer_error_drops_with_each_codebook(codec):
    x = codec.features(_voice_like(2.0, 180, 2))
    errors = []
    for n in range(1, 4):
        partial = MelRVQCodec(codec.codebooks, codec.mean, codec.std, num_codebooks=n)
        q = sum(partial.codebooks[i][c] for i, c in enumerate(partial.quantize(x)))
        errors.append(float((x - q).pow(2).mean()))
    assert errors[0] > errors[1] > errors[2]


def test_streaming_equals_offline(codec):
    codes = codec.encode_audio(_voice_like(1.5, 140, 4))
    offline = codec.decode(codes)
    streamed = decode_in_pushes(codec, codes, (1, 3, 7, 9, 100))
    assert streamed.shape == offline.shape
    assert torch.allclose(streamed, offline, atol=1e-4)


def test_decode_depends_on_bounded_context(codec):
    """Frame t's samples depend on codes t - context_frames .. t only."""
    codes = codec.encode_audio(_voice_like(1.5, 170, 5))
    changed = codes.clone()
    changed[:, :5] = (changed[:, :5] + 7) % 32
    a, b = codec.decode(codes), codec.decode(changed)
    first_free = (5 + codec.context_frames) * FRAME_LENGTH
    assert torch.equal(a[first_free:], b[first_free:])
    assert not torch.equal(a[:first_free], b[:first_free])


def test_save_and_load_through_codec_json(codec, tmp_path):
    codec.save(tmp_path)
    assert json.loads((tmp_path / "codec.json").read_text())["type"] == "mel_rvq"
    loaded = load_codec(tmp_path)
    codes = torch.randint(0, 32, (3, 12))
    assert loaded.context_frames == codec.context_frames
    assert torch.equal(loaded.decode(codes), codec.decode(codes))
