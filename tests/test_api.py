import numpy as np
import pytest
import torch

from tts import TTS, InvalidRequest, VoiceNotFound
from tts.codec import AudioError
from tts.text import TextError


@pytest.fixture(scope="module")
def tts(tiny_bundle):
    return TTS(tiny_bundle)


def test_synthesize_returns_audio_of_frames_times_frame_length(tts):
    r = tts.synthesize("Hello there.", seed=3, max_new_frames=20)
    assert r.audio.dtype == np.float32
    assert len(r.audio) == r.frames * tts.bundle.codec.frame_length
    assert 0 < r.frames <= 20
    assert r.sample_rate == 16000 and r.rtf > 0


def test_stream_chunks_concatenate_to_synthesize_and_to_offline_decode(tts):
    chunks = list(
        tts.stream("Streaming works.", seed=5, max_new_frames=30, first_chunk_frames=2, chunk_frames=5)
    )
    whole = tts.synthesize("Streaming works.", seed=5, max_new_frames=30)
    assert chunks[0].frame_end - chunks[0].frame_start == 2 or len(chunks) == 1
    assert [c.frame_start for c in chunks[1:]] == [c.frame_end for c in chunks[:-1]]
    audio = np.concatenate([c.samples for c in chunks])
    assert len(audio) == len(whole.audio)
    np.testing.assert_allclose(audio, whole.audio, atol=1e-6)
    offline = tts.bundle.codec.decode(whole.codes).numpy()
    np.testing.assert_allclose(audio, offline, atol=1e-5)


def test_same_seed_same_audio_and_voices_change_output(tts):
    a = tts.synthesize("Same seed.", seed=11, max_new_frames=15)
    b = tts.synthesize("Same seed.", seed=11, max_new_frames=15)
    assert torch.equal(a.codes, b.codes)
    c = tts.synthesize("Same seed.", seed=11, max_new_frames=15, voice="alpha")
    assert not torch.equal(a.codes, c.codes)


def test_long_text_is_chunked_with_context(tts):
    text = "One sentence here. " * 30
    chunks = tts.plan(text)
    assert len(chunks) > 1
    r = tts.synthesize(text, seed=1, max_new_frames=5)
    assert len(r.finish_reasons) == len(chunks)
    assert tts.engine.scheduler.allocator.num_free == tts.engine.scheduler.allocator.num_usable


def test_bad_inputs(tts):
    with pytest.raises(TextError):
        tts.synthesize("  ")
    with pytest.raises(InvalidRequest):
        tts.synthesize("hi", top_k=-1)
    with pytest.raises(VoiceNotFound):
        tts.synthesize("hi", voice="nobody")
    with pytest.raises(InvalidRequest, match="context"):
        tts.synthesize("word " * 2000, chunk_length=0)


def test_reference_audio_checks(tts):
    sr = 8000
    t = np.arange(sr * 2) / sr
    stereo = np.stack([np.sin(2 * np.pi * 300 * t), np.sin(2 * np.pi * 500 * t)]).astype(np.float32) * 0.3
    ref = tts.reference_from_audio(stereo, sr, "Some words.")
    assert ref.codes.shape == (4, 50)  # 2 s at 16 kHz / 640 samples per frame
    with pytest.raises(AudioError, match="silent"):
        tts.reference_from_audio(np.zeros(sr * 2, np.float32), sr, "x")
    with pytest.raises(AudioError, match="long"):
        tts.reference_from_audio(stereo[:, :1000], sr, "x")
    with pytest.raises(InvalidRequest, match="transcript"):
        tts.reference_from_audio(stereo, sr, " ")
    # 40 s: over a quarter of the tiny model's 1024-token context (256 frames = 10.24 s). Refused with a
    # message naming the limit: cutting the audio would separate it from its transcript.
    long_clip = np.tile(stereo, 20)
    with pytest.raises(
        AudioError, match=r"reference audio is 40\.0 s long; this model takes at most 10\.2 s"
    ):
        tts.reference_from_audio(long_clip, sr, "long")
    assert tts.reference_from_audio(long_clip[:, : int(10.2 * sr)], sr, "long").codes.shape[1] == 255


def test_abandoned_stream_frees_its_request(tts):
    gen = tts.stream("Stop early please.", seed=2, max_new_frames=50, first_chunk_frames=1)
    next(gen)
    gen.close()
    assert tts.engine.num_running == 0
    assert tts.engine.scheduler.allocator.num_free == tts.engine.scheduler.allocator.num_usable


def test_seed_of_every_text_chunk_is_checked_before_work(tts):
    with pytest.raises(InvalidRequest, match="seed"):
        tts.prepare("One sentence here. Another sentence there.", seed=2**63 - 1, chunk_length=25)
