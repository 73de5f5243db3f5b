"""fish-speech 1.5's Firefly-GAN codec: parity with fish-speech v1.5.1, streaming, batching, files."""

import pytest
import torch
from fish_golden import CASES, encode_signal, golden

from tts.codec.base import CodecCheckpointError
from tts.codec.firefly import (
    FIREFLY_FILE,
    FireflyCodec,
    FireflyConfig,
    random_firefly_state,
    tiny_firefly_config,
)
from tts.model.randinit import hashed_randint

SPEC = CASES["firefly"]


@pytest.fixture(scope="module")
def codec(fish_checkpoints):
    # The golden codec is the generator file of the tiny 1.5 checkpoint (seed SPEC["seed"]).
    fam = CASES["families"]["fish-1.5"]
    assert fam["shape"] == SPEC["shape"] and fam["seed"] == SPEC["seed"]
    return FireflyCodec.from_file(fish_checkpoints["fish-1.5"] / FIREFLY_FILE)


def _codes(T: int, high: int = 1000) -> torch.Tensor:
    return hashed_randint((8, T), SPEC["decode_seed"], "codes", high)


def test_properties_and_config(codec):
    assert (codec.sample_rate, codec.frame_length, codec.num_codebooks, codec.codebook_size) == (
        44100,
        2048,
        8,
        1000,
    )
    cfg = SPEC["config"]
    assert codec.cfg == tiny_firefly_config()
    assert list(codec.cfg.encoder_depths) == cfg["encoder_depths"]
    assert list(codec.cfg.encoder_dims) == cfg["encoder_dims"]
    assert codec.cfg.upsample_initial_channel == cfg["upsample_initial_channel"]


def test_decode_matches_reference_within_1e_5(codec):
    ref = golden("fish_firefly")
    audio = codec.decode(_codes(SPEC["decode_frames"]))
    assert audio.shape == (SPEC["decode_frames"] * 2048,) and audio.dtype == torch.float32
    torch.testing.assert_close(audio[:: SPEC["audio_stride"]], ref["decode_audio_strided"], rtol=0, atol=1e-5)
    torch.testing.assert_close(audio[:2048], ref["decode_audio_head"], rtol=0, atol=1e-5)


def test_encode_codes_identical_to_reference(codec):
    codes = codec.encode(encode_signal(SPEC["encode_seconds"]), 44100)
    ref = golden("fish_firefly")["encode_codes"].long()
    assert codes.shape == ref.shape == (8, 22)  # ceil((44100 // 512) / 4)
    assert torch.equal(codes, ref)


def test_codes_past_the_fsq_codebook_are_clamped(codec):
    codes = _codes(3, 1024)
    codes[:, 1] = 1023
    clamped = codes.clamp(max=999)
    assert torch.equal(codec.decode(codes), codec.decode(clamped))


@pytest.mark.parametrize("pieces", [(1, 1, 1, 5), (3, 5), (8,)])
def test_stream_equals_offline_decode(codec, pieces):
    codes = _codes(sum(pieces))
    offline = codec.decode(codes)
    stream, out, start = codec.stream(), [], 0
    for n in pieces:
        out.append(stream.push(codes[:, start : start + n]))
        start += n
    streamed = torch.cat(out)
    assert streamed.shape == offline.shape
    torch.testing.assert_close(streamed, offline, rtol=0, atol=1e-6)
    assert stream.flush().numel() == 0


def test_batched_stream_equals_offline_for_ragged_rows(codec):
    a, b = _codes(9), hashed_randint((8, 6), 5, "codes", 1000)
    dec = codec.batched_stream(4)
    assert dec.graph_safe and dec.scratch_slot == 4
    dec.reset(torch.tensor([1, 2]))
    T = 5
    codes = torch.zeros(3, 8, T, dtype=torch.int64)
    codes[0, :, :4], codes[1, :, :2] = a[:, :4], b[:, :2]
    codes[2] = 7  # a pad row on the scratch slot
    first = dec.decode(torch.tensor([1, 2, 4]), codes, torch.tensor([4, 2, 5]))
    assert first.shape == (3, T * 2048)
    codes = torch.zeros(2, 8, 5, dtype=torch.int64)
    codes[0], codes[1, :, :4] = a[:, 4:9], b[:, 2:6]
    second = dec.decode(torch.tensor([1, 2]), codes, torch.tensor([5, 4]))
    stream_a = torch.cat([first[0, : 4 * 2048], second[0]])
    stream_b = torch.cat([first[1, : 2 * 2048], second[1, : 4 * 2048]])
    torch.testing.assert_close(stream_a, codec.decode(a), rtol=0, atol=1e-6)
    torch.testing.assert_close(stream_b, codec.decode(b), rtol=0, atol=1e-6)
    zero = dec.decode(torch.tensor([1]), a[None, :, :1], torch.tensor([0]))  # length 0: state unchanged
    assert zero.shape == (1, 2048)
    dec.reset(torch.tensor([1]))
    torch.testing.assert_close(
        dec.decode(torch.tensor([1]), a[None, :, :3], torch.tensor([3]))[0],
        codec.decode(a[:, :3]),
        rtol=0,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="codes must be"):
        dec.decode(torch.tensor([1]), a[None, :3], torch.tensor([3]))


@pytest.mark.parametrize("form", ["old", "fused"])
def test_other_weight_norm_storage_forms_load_the_same(tmp_path, form, codec):
    cfg = tiny_firefly_config()
    torch.save(random_firefly_state(cfg, SPEC["seed"], form=form), tmp_path / FIREFLY_FILE)
    other = FireflyCodec.from_file(tmp_path / FIREFLY_FILE)
    codes = _codes(2)
    torch.testing.assert_close(other.decode(codes), codec.decode(codes), rtol=0, atol=1e-6)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(CodecCheckpointError, match="no codec file"):
        FireflyCodec.from_file(tmp_path / "missing.pth")
    state = random_firefly_state(tiny_firefly_config(), 0)
    del state["head.conv_post.conv.bias"]
    torch.save(state, tmp_path / "a.pth")
    with pytest.raises(CodecCheckpointError, match="head.conv_post.conv.bias"):
        FireflyCodec.from_file(tmp_path / "a.pth")
    torch.save({"encoder.block.0.conv.weight": torch.zeros(1)}, tmp_path / "b.pth")
    with pytest.raises(CodecCheckpointError, match="not a Firefly-GAN generator"):
        FireflyCodec.from_file(tmp_path / "b.pth")


def test_full_size_config_is_fish_speech_15():
    cfg = FireflyConfig()
    assert cfg.frame_length == 2048 and cfg.codebook_size == 1000 and cfg.latent_dim == 512
    assert (cfg.n_mels, cfg.n_groups, cfg.upsample_rates) == (160, 8, (8, 8, 2, 2, 2))
