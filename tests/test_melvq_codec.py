"""The default model's learned codec (tts/codec/melvq.py) and its trainer (training/train_codec.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import decode_in_pushes
from test_melrvq_codec import _voice_like

from tts.checkpoints.bundle import DEFAULT_MODEL_DIR, load_codec
from tts.codec.mel import FRAME_LENGTH, SAMPLE_RATE, LogMel
from tts.codec.melvq import MelVQCodec, MelVQNet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def codec():
    torch.manual_seed(0)
    net = MelVQNet(num_codebooks=3, codebook_size=16, channels=32, latent=8)
    net.codebooks.normal_()
    return MelVQCodec(net, torch.full((320,), -4.0), torch.full((320,), 2.0), gl_context=2, gl_iters=4)


def test_frame_layout_and_context(codec):
    audio = _voice_like(1.0, 150, 9)
    codes = codec.encode(audio, SAMPLE_RATE)
    T = math.ceil(audio.numel() / FRAME_LENGTH)
    assert codes.shape == (3, T) and codes.dtype == torch.int64
    assert 0 <= int(codes.min()) and int(codes.max()) < 16
    out = codec.decode(codes)
    assert out.shape == (T * FRAME_LENGTH,) and out.dtype == torch.float32
    # decoder receptive field 2 * (1 + 2 + 1) frames, plus Griffin-Lim's window and cross-fade
    assert codec.context_frames == 8 + 2 + 1


def test_decode_depends_on_bounded_context(codec):
    codes = torch.randint(0, 16, (3, 30))
    changed = codes.clone()
    changed[:, :5] = (changed[:, :5] + 7) % 16
    a, b = codec.decode(codes), codec.decode(changed)
    first_free = (5 + codec.context_frames) * FRAME_LENGTH
    assert torch.allclose(a[first_free:], b[first_free:], atol=1e-5)
    assert not torch.allclose(a[:first_free], b[:first_free], atol=1e-3)


def test_streaming_equals_offline(codec):
    codes = torch.randint(0, 16, (3, 40))
    offline = codec.decode(codes)
    streamed = decode_in_pushes(codec, codes, (1, 3, 7, 9, 20))
    assert streamed.shape == offline.shape
    # The convolutions round differently for different lengths (~1e-6 in log-mel); Griffin-Lim's
    # momentum iterations amplify that to ~3e-4 in samples at most. A context bug would be ~1e-1.
    assert torch.allclose(streamed, offline, atol=1e-3)


@pytest.mark.parametrize("sizes", [(6, 10, 14), (8, 22), (1, 12, 17)])
def test_streaming_keeps_its_whole_context_for_any_push_size(codec, sizes):
    """First pushes shorter than `context_frames` (11 here) must keep every frame as context."""
    codes = torch.randint(0, 16, (3, sum(sizes)))
    streamed = decode_in_pushes(codec, codes, sizes)
    assert torch.allclose(streamed, codec.decode(codes), atol=1e-3)


def test_decode_tail_is_the_end_of_decode(codec):
    codes = torch.randint(0, 16, (3, 25))
    assert torch.allclose(codec.decode_tail(codes, 4), codec.decode(codes)[-4 * FRAME_LENGTH :], atol=1e-5)


def test_save_and_load_through_codec_json(codec, tmp_path):
    codec.save(tmp_path)
    cfg = json.loads((tmp_path / "codec.json").read_text())
    assert cfg["type"] == "mel_vqvae" and cfg["decoder_dilations"] == [1, 2, 1]
    loaded = load_codec(tmp_path)
    assert isinstance(loaded, MelVQCodec) and loaded.context_frames == codec.context_frames
    codes = torch.randint(0, 16, (3, 12))
    # the convolutions are stored in float16: decoded audio moves by little
    assert torch.allclose(loaded.decode(codes), codec.decode(codes), atol=2e-2)
    assert torch.equal(loaded.net.codebooks, codec.net.codebooks)  # codebooks stay float32


@pytest.mark.parametrize("freeze", [False, True])
def test_codec_loss_trains_the_encoder_unless_frozen(freeze):
    sys.path.insert(0, str(ROOT / "training"))
    from train_codec import EMAQuantizer, codec_loss

    torch.manual_seed(0)
    net = MelVQNet(num_codebooks=2, codebook_size=16, channels=16, latent=8)
    if freeze:
        for p in [*net.enc_in.parameters(), *net.enc_blocks.parameters(), *net.enc_out.parameters()]:
            p.requires_grad_(False)
    loss, recon, commit, _ = codec_loss(net, EMAQuantizer(net, 0.99), torch.randn(4, 320, 12), 0.25)
    loss.backward()
    assert float(commit.detach()) > 0 and net.dec_out.weight.grad.abs().sum() > 0
    if freeze:
        assert net.enc_in.weight.grad is None
    else:  # both the reconstruction (straight through the quantizer) and the commitment reach it
        assert net.enc_in.weight.grad.abs().sum() > 0 and net.enc_out.weight.grad.abs().sum() > 0


def _tiny_work(tmp_path: Path) -> Path:
    """A corpus work folder as corpus.py leaves it after `text` and `synth`: 6 train clips, 2 held out."""
    work = tmp_path / "work"
    (work / "shards").mkdir(parents=True)
    rows, mels, ids = [], [], []
    for i in range(8):
        uid = f"u{i}"
        rows.append({"id": uid, "split": "train" if i < 6 else "heldout"})
        mels.append(LogMel()(_voice_like(1.2, 110 + 20 * i, i)).to(torch.float16))
        ids.append(uid)
    (work / "sentences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.save({"ids": ids, "seconds": [1.2] * 8, "mels": mels}, work / "shards" / "mel-0000.pt")
    return work


def test_train_codec_learns_and_writes_a_loadable_codec(tmp_path):
    work = _tiny_work(tmp_path)
    out = tmp_path / "codec"
    cmd = [
        sys.executable,
        str(ROOT / "training" / "train_codec.py"),
        "--work",
        str(work),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--steps",
        "120",
        "--batch",
        "8",
        "--segment",
        "8",
        "--channels",
        "32",
        "--latent",
        "8",
        "--codebook-size",
        "16",
        "--num-codebooks",
        "2",
        "--warmup",
        "10",
        "--lr",
        "3e-3",
        "--log-every",
        "20",
        "--max-seconds",
        "900",  # steps end it; the wall-time cap only guards a loaded machine
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=960)
    state = json.loads((out / "train_state.json").read_text())
    recon = [h["recon"] for h in state["history"]]
    assert state["steps"] == 120 and max(recon[-2:]) < 0.6 * recon[0]
    codec = load_codec(out)
    codes = codec.encode_audio(_voice_like(1.0, 150, 3))
    assert codes.shape[0] == 2 and int(codes.max()) < 16
    assert codec.decode(codes).shape == (codes.shape[1] * FRAME_LENGTH,)


def _envelope_lag(x: torch.Tensor, y: torch.Tensor, hop: int = 16, max_lag: int = 2048) -> int:
    """Samples by which `y` lags `x`: the peak of the cross-correlation of their amplitude envelopes."""
    ex, ey = (torch.nn.functional.avg_pool1d(s.abs()[None, None], 4 * hop, hop)[0, 0] for s in (x, y))
    n = min(len(ex), len(ey))
    ex, ey = ex[:n] - ex[:n].mean(), ey[:n] - ey[:n].mean()

    def corr(lag: int) -> float:
        return float((ex[max(0, -lag) : n - max(0, lag)] * ey[max(0, lag) : n - max(0, -lag)]).sum())

    return hop * max(range(-max_lag // hop, max_lag // hop + 1), key=corr)


@pytest.mark.skipif(
    not (DEFAULT_MODEL_DIR / "codec.json").is_file(), reason="the default model is not installed"
)
def test_the_default_codecs_audio_lags_its_input_by_its_delay():
    # word timings put frame t's sound at t * frame_length + delay on the audio's clock
    codec = load_codec(DEFAULT_MODEL_DIR)
    assert codec.delay == 512
    x = _voice_like(2.0, 150, 3)
    assert abs(_envelope_lag(x, codec.decode(codec.encode(x, SAMPLE_RATE))) - codec.delay) <= 64
