"""The modded-DAC codec: parity with fish-speech, streaming, checkpoint forms and bad files."""

import dataclasses

import pytest
import torch
from fish_golden import CASES, encode_signal, golden

from tts.codec.base import CodecCheckpointError
from tts.codec.dac.codec import DACCodec
from tts.codec.dac.net import ModdedDAC
from tts.codec.dac.random_init import random_codec_state, tiny_dac_config
from tts.codec.dac.weights import fuse_weight_norm
from tts.model.randinit import hashed_randint

SPEC = CASES["codec"]
# An even smaller codec for the tests that do not compare with goldens.
SMALL = dataclasses.replace(tiny_dac_config(), encoder_dim=4, latent_dim=64, decoder_dim=16)


@pytest.fixture(scope="module")
def codec(fish_checkpoints):
    # The golden codec is the codec.pth of the tiny S2 checkpoint (seed SPEC["seed"]).
    assert (
        CASES["families"]["s2"]["shape"] == SPEC["shape"] and CASES["families"]["s2"]["seed"] == SPEC["seed"]
    )
    return DACCodec.from_file(fish_checkpoints["s2"] / "codec.pth")


def _codes(T: int) -> torch.Tensor:
    seed, high = SPEC["decode_seed"], SPEC["decode_residual_high"]
    return torch.cat(
        [hashed_randint((1, T), seed, "codes", 4096), hashed_randint((9, T), seed, "codes", high)]
    )


def test_properties(codec):
    assert (codec.sample_rate, codec.frame_length, codec.num_codebooks) == (44100, 2048, 10)
    assert codec.codebook_size == 4096 and codec.residual_codebook_size == 1024
    assert abs(codec.frame_rate - 21.533) < 1e-3


def test_decode_matches_reference_within_1e_4(codec):
    ref = golden("fish_codec")
    audio = codec.decode(_codes(SPEC["decode_frames"]))  # residual codes above 1023 are clamped
    assert audio.shape == (SPEC["decode_frames"] * 2048,) and audio.dtype == torch.float32
    torch.testing.assert_close(audio[:: SPEC["audio_stride"]], ref["decode_audio_strided"], rtol=0, atol=1e-4)
    torch.testing.assert_close(
        audio[: SPEC["head_frames"] * 2048], ref["decode_audio_head"], rtol=0, atol=1e-4
    )


def test_windowed_transformer_matches_reference_beyond_128_frames(codec):
    # The post-quantizer transformer's output for 140 frames: frames past 128 only match when keys
    # older than the 128-frame window are masked exactly as fish-speech masks them.
    ref = golden("fish_codec")["latents"]
    with torch.inference_mode():
        z = codec.model.decode_latents(_codes(SPEC["latent_frames"]).unsqueeze(0))[
            0, : SPEC["latent_channels"]
        ]
    torch.testing.assert_close(z, ref, rtol=1e-4, atol=1e-4)


def test_encode_codes_identical_to_reference(codec):
    codes = codec.encode(encode_signal(SPEC["encode_seconds"]), 44100)
    ref = golden("fish_codec")["encode_codes"].long()
    assert codes.shape == ref.shape == (10, 22)  # ceil(44100 / 2048)
    assert torch.equal(codes, ref)


def test_streamed_transformer_equals_offline_across_the_window(codec):
    codes = _codes(SPEC["latent_frames"]).unsqueeze(0)
    m = codec.model
    with torch.inference_mode():
        offline = m.decode_latents(codes)
        state, pieces, i = {}, [], 0
        for n in (1, 5, 30, 64, 40):
            pieces.append(m.decode_latents(codes[..., i : i + n], i, state))
            i += n
    torch.testing.assert_close(torch.cat(pieces, dim=-1), offline, rtol=0, atol=1e-4)


def test_streamed_decode_equals_offline(codec):
    codes = _codes(24)
    offline = codec.decode(codes)
    stream = codec.stream()
    sizes = (1, 4, 3, 9, 7)
    pieces, i = [], 0
    for n in sizes:
        pieces.append(stream.push(codes[:, i : i + n]))
        i += n
    assert i == codes.shape[1] and [p.numel() for p in pieces] == [n * 2048 for n in sizes]
    assert stream.flush().numel() == 0 and stream.push(codes[:, :0]).numel() == 0
    torch.testing.assert_close(torch.cat(pieces), offline, rtol=0, atol=1e-4)


def test_context_frames_bounds_the_receptive_field():
    # Decoding a window of `context_frames` frames of left context at its absolute positions reproduces
    # the offline samples of the window's last frames: the receptive field is within the bound.
    cfg = dataclasses.replace(SMALL, transformer_window=4, post_transformer_layers=2)
    model = ModdedDAC(cfg)
    model.load_state_dict(fuse_weight_norm(random_codec_state(cfg, seed=3)))
    codec = DACCodec(model)
    ctx = codec.context_frames
    assert ctx == 2 * 3 + 11
    T = ctx + 6
    codes = hashed_randint((10, T), 5, "codes", 1024).unsqueeze(0)
    with torch.inference_mode():
        offline = model.decode(codes)[0, 0]
        start = T - 2 - ctx  # decode frames start .. T-1, keep the last 2
        window = model.decode(codes[..., start:], start, {})[0, 0]
    torch.testing.assert_close(window[-2 * 2048 :], offline[-2 * 2048 :], rtol=0, atol=1e-5)


def test_weight_norm_storage_forms_decode_identically(tmp_path):
    cfg = SMALL
    codes = hashed_randint((10, 6), 9, "codes", 1024)
    outs = []
    for form in ("fish", "old", "fused"):
        state = random_codec_state(cfg, seed=4, form=form)
        if form == "fish":
            assert any(k.endswith("parametrizations.weight.original0") for k in state)
            assert any(k.endswith("in_proj.weight_g") for k in state)
        torch.save(state, tmp_path / f"{form}.pth")
        outs.append(DACCodec.from_file(tmp_path / f"{form}.pth").decode(codes))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_wrapped_and_prefixed_codec_files_load(tmp_path):
    cfg = SMALL
    state = random_codec_state(cfg, seed=4)
    plain = tmp_path / "plain.pth"
    torch.save(state, plain)
    wrapped = tmp_path / "wrapped.pth"
    stale = {"quantizer.post_module.freqs_cis": torch.zeros(4, 32, 2, dtype=torch.bfloat16)}
    torch.save({"state_dict": {f"generator.{k}": v for k, v in {**state, **stale}.items()}}, wrapped)
    codes = hashed_randint((10, 4), 9, "codes", 1024)
    assert torch.equal(DACCodec.from_file(plain).decode(codes), DACCodec.from_file(wrapped).decode(codes))


def test_out_of_range_codes_are_clamped(codec):
    codes = hashed_randint((10, 5), 2, "codes", 1024)
    high = codes.clone()
    high[0, 0], high[3, 2] = 9999, 5000
    clamped = codes.clone()
    clamped[0, 0], clamped[3, 2] = 4095, 1023
    assert torch.equal(codec.decode(high), codec.decode(clamped))
    with pytest.raises(ValueError, match=r"codes must be \[10, T\]"):
        codec.decode(codes[:8])


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda s: s.pop("decoder.model.0.conv.bias"), "missing key 'decoder.model.0.conv.bias'"),
        (
            lambda s: s.update({"decoder.extra.weight": torch.zeros(1)}),
            "unexpected key 'decoder.extra.weight'",
        ),
        (
            lambda s: s.update({"quantizer.post_module.norm.weight": torch.ones(7)}),
            "shape mismatch for 'quantizer.post_module.norm.weight'",
        ),
        (
            lambda s: s.pop("decoder.model.0.conv.parametrizations.weight.original0"),
            "weight-norm pair of 'decoder.model.0.conv' is incomplete",
        ),
        (lambda s: [s.pop(k) for k in list(s) if k.startswith("encoder.")], "not a modded-DAC codec"),
    ],
)
def test_bad_codec_files_name_the_problem(tmp_path, corrupt, message):
    state = random_codec_state(SMALL, seed=4)
    corrupt(state)
    torch.save(state, tmp_path / "codec.pth")
    with pytest.raises(CodecCheckpointError, match=message):
        DACCodec.from_file(tmp_path / "codec.pth")


def test_unreadable_codec_files(tmp_path):
    with pytest.raises(CodecCheckpointError, match="no codec file"):
        DACCodec.from_file(tmp_path / "missing.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CodecCheckpointError, match="cannot read"):
        DACCodec.from_file(tmp_path / "junk.pth")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CodecCheckpointError, match="does not hold a state dict"):
        DACCodec.from_file(tmp_path / "list.pth")
