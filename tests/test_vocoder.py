"""The learned causal vocoder (tts/codec/vocoder.py) and its trainer's data alignment
(training/train_vocoder.py): streaming equals offline, causality, bounded context, the codec's delay."""

import math
import random
import sys
from pathlib import Path

import pytest
import torch

from tts.codec.mel import FRAME_LENGTH, HOP, N_FFT, LogMel
from tts.codec.vocoder import CausalVocoder, overlap_add

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import train_vocoder  # noqa: E402


@pytest.fixture(scope="module")
def vocoder():
    torch.manual_seed(0)
    return untrained_vocoder(channels=32, blocks=2)


def untrained_vocoder(**shape) -> CausalVocoder:
    """A random vocoder whose output is speech-sized (RMS ~0.2, never clipped) and whose every block
    reaches as far back as the receptive field says (an untrained block's scale, 1e-2, would let distant
    frames matter only in the last bits)."""
    model = CausalVocoder(**shape).eval()
    with torch.no_grad():
        model.head.weight.mul_(3.0)
        for block in model.blocks:
            block.scale.fill_(1.0)
    return model


def speech_like_logmel(frames: int, seed: int) -> torch.Tensor:
    return LogMel()(torch.randn(frames * HOP, generator=torch.Generator().manual_seed(seed)) * 0.1)


@torch.no_grad()
def test_streaming_in_pieces_equals_the_offline_synthesis(vocoder):
    T = 9
    logmel = torch.stack([speech_like_logmel(T * 4, s) for s in (1, 2)])  # [2, 36, 80]
    whole = vocoder.synthesize(logmel)
    assert (
        whole.shape == (2, T * FRAME_LENGTH) and 0.05 < whole.pow(2).mean().sqrt() and whole.abs().max() < 1
    )
    state = vocoder.initial_state(2)
    pieces = [vocoder.stream(logmel[:, 4 * a : 4 * b], state) for a, b in ((0, 1), (1, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_a_codec_frame_depends_on_its_own_and_a_bounded_past_of_mel_frames(vocoder):
    """Codec frame t (emitted samples [1024 t, 1024 (t + 1))) is final once its four mel frames are in
    (no look-ahead), and mel frames before 4 t - 3 - receptive_frames do not reach it."""
    R, T, t = vocoder.receptive_frames, 12, 6  # R = 18 mel frames here
    logmel = speech_like_logmel(T * 4, 3).unsqueeze(0)
    base = vocoder.synthesize(logmel)[0]
    frame_t = slice(FRAME_LENGTH * t, FRAME_LENGTH * (t + 1))
    future = logmel.clone()
    future[:, 4 * (t + 1) :] += 3.0
    changed = vocoder.synthesize(future)[0]
    assert torch.equal(changed[: FRAME_LENGTH * (t + 1)], base[: FRAME_LENGTH * (t + 1)])
    assert not torch.allclose(changed[frame_t.stop :], base[frame_t.stop :])
    past = logmel.clone()
    first_needed = 4 * t - 3 - R
    past[:, :first_needed] -= 3.0
    torch.testing.assert_close(vocoder.synthesize(past)[0][frame_t], base[frame_t], atol=1e-6, rtol=1e-5)
    past[:, first_needed] -= 3.0  # the oldest mel frame it does see
    assert not torch.allclose(vocoder.synthesize(past)[0][frame_t], base[frame_t])


def test_synthesis_puts_stft_frames_back_with_the_codecs_512_sample_delay():
    """Overlap-adding a signal's own centred STFT frames, divided by 1.5, rebuilds it 512 samples late:
    the layout both the runtime (`stream`) and the training target (`Clips.batch`) assume."""
    signal = torch.randn(40 * HOP, generator=torch.Generator().manual_seed(4))
    window = torch.hann_window(N_FFT)
    spec = torch.stft(signal, N_FFT, HOP, window=window, center=True, return_complex=True)  # [513, 41]
    frames = torch.fft.irfft(spec.T, n=N_FFT, dim=-1) * window
    out = overlap_add(frames.unsqueeze(0))[0] / 1.5
    # Emitted sample i is signal sample i - 512; from emitted 768 on, four frames overlap.
    torch.testing.assert_close(out[768 : 40 * HOP], signal[256 : 40 * HOP - 512], atol=1e-5, rtol=1e-5)


class OracleVocoder:
    """Stands in for the network in `compute_loss`: its input mel carries each frame's index in the clip
    (pad frames: the log floor), and it returns the clip's true windowed STFT frame at that index."""

    receptive_frames = 5

    def __init__(self, signal: torch.Tensor):
        window = torch.hann_window(N_FFT)
        spec = torch.stft(signal, N_FFT, HOP, window=window, center=True, return_complex=True).T
        self.true_frames = torch.fft.irfft(spec, n=N_FFT, dim=-1) * window  # [frames, 1024]

    def frames(self, mel: torch.Tensor) -> torch.Tensor:
        index = mel[..., 0].round().long()  # [B, M]
        out = self.true_frames[index.clamp(0, self.true_frames.shape[0] - 1)]
        return out * (index >= 0).unsqueeze(-1)


def test_training_crops_line_the_target_audio_and_mel_up_with_the_synthesis():
    """With a perfect network (the clip's own STFT frames), every training crop's synthesized samples
    equal its target audio and their log-mel its target mel: the crops, the delay and the loss region
    agree. A crop off by one mel frame (256 samples) fails."""
    T = 6
    g = torch.Generator().manual_seed(5)
    signal = torch.randn(T * FRAME_LENGTH, generator=g) * torch.linspace(0.05, 0.5, T * FRAME_LENGTH)
    clips = train_vocoder.Clips([signal.to(torch.float16)])
    signal = clips.audio[0]
    clips.input_mel = [torch.arange(4 * T, dtype=torch.float32).unsqueeze(1).expand(-1, 80).clone()]
    oracle = OracleVocoder(signal)
    batch = clips.batch(random.Random(0), 8, frames=12, context=oracle.receptive_frames)
    loss, info = train_vocoder.compute_loss(oracle, batch, LogMel())
    assert float(info["sc"]) < 1e-3 and float(info["log_mag"]) < 1e-2 and float(info["mel"]) < 1e-2, info
    shifted = dict(batch, audio=torch.roll(batch["audio"], HOP, dims=1))
    _, off = train_vocoder.compute_loss(oracle, shifted, LogMel())
    assert float(off["sc"]) > 0.3
    assert math.isfinite(float(loss))


def test_a_small_vocoder_learns_on_the_cpu():
    """Twenty optimizer steps on one clip lower the loss (the training step is wired end to end)."""
    torch.manual_seed(1)
    t = torch.arange(4 * FRAME_LENGTH) / 22050
    clip = (0.3 * torch.sin(2 * math.pi * 220 * t) * torch.sin(2 * math.pi * 3 * t)).to(torch.float16)
    clips = train_vocoder.Clips([clip])
    model = CausalVocoder(channels=32, blocks=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mel_fn, r, losses = LogMel(), random.Random(0), []
    for _ in range(20):
        batch = clips.batch(r, 4, frames=12, context=model.receptive_frames)
        loss, _ = train_vocoder.compute_loss(model, batch, mel_fn)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses


def test_the_learning_rate_is_one_schedule_over_resumed_runs():
    lr = train_vocoder.learning_rate
    assert lr(0, 0.0, 1e-3, 10_000, 600) == pytest.approx(1e-3 / 200)  # warm-up by the global step
    assert lr(5_000, 300.0, 1e-3, 1_000_000, 600) == pytest.approx(0.55e-3)  # half the seconds: midway
    # a resumed run (step 5,000, 300 s trained before) goes on from there, with no second warm-up
    assert lr(5_001, 300.5, 1e-3, 1_000_000, 600) == pytest.approx(0.55e-3, rel=1e-2)
    assert lr(9_000, 700.0, 1e-3, 1_000_000, 600) == pytest.approx(1e-4)  # past the span: the floor


@pytest.mark.parametrize("flag", ["--eval", "--resume"])
def test_eval_and_resume_need_a_trained_folder(tmp_path, flag):
    """Without weights, --eval would score a random network and --resume start afresh: both refuse."""
    import subprocess

    cmd = [sys.executable, str(ROOT / "training" / "train_vocoder.py"), "--out", str(tmp_path), flag]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and flag in done.stderr and str(tmp_path) in done.stderr


@pytest.mark.parametrize(
    "entry, message",
    [
        ("causal_vocos", "must be an object"),
        ({"type": "hifigan", "channels": 8, "blocks": 1, "kernel": 7}, "unknown vocoder type 'hifigan'"),
        ({"type": "causal_vocos", "blocks": 1, "kernel": 7}, "needs integer channels"),
        (
            {"type": "causal_vocos", "channels": 8, "blocks": 1, "kernel": 7},
            "vocoder.safetensors, which are missing",
        ),
    ],
)
def test_a_bad_vocoder_entry_in_codec_json_is_a_checkpoint_error(tmp_path, entry, message):
    """`load_codec` names the file and what is wrong (the CLI prints it as one `tts: error:` line)."""
    import json

    from tts.checkpoints.bundle import CheckpointError, load_codec
    from tts.codec.melvq import MelVQCodec, MelVQNet

    net = MelVQNet(num_codebooks=2, codebook_size=8, channels=8, latent=4, decoder_dilations=(1,))
    MelVQCodec(net, torch.zeros(320), torch.ones(320)).save(tmp_path)
    cfg = json.loads((tmp_path / "codec.json").read_text())
    (tmp_path / "codec.json").write_text(json.dumps({**cfg, "vocoder": entry}))
    with pytest.raises(CheckpointError, match=message) as err:
        load_codec(tmp_path)
    assert str(tmp_path / "codec.json") in str(err.value)


def test_every_discriminator_judges_a_crop_of_any_length():
    """Five period and three resolution discriminators, each giving logits and its layers' features,
    for crops whose length no period divides (the fold pads by reflection)."""
    torch.manual_seed(0)
    disc = train_vocoder.Discriminators()
    out = disc(torch.randn(2, 3001) * 0.1)
    assert len(out) == len(train_vocoder.PERIODS) + len(train_vocoder.RESOLUTIONS) == 8
    for logits, feats in out:
        assert logits.shape[0] == 2 and logits.shape[1] > 0 and torch.isfinite(logits).all()
        assert len(feats) >= 5 and all(torch.isfinite(f).all() for f in feats)


@torch.no_grad()
def test_feature_matching_is_zero_only_for_the_real_audio_itself():
    torch.manual_seed(0)
    disc = train_vocoder.Discriminators()
    real_audio = torch.randn(2, 4096) * 0.1
    real = disc(real_audio)
    adv, fm = train_vocoder.generator_losses(real, disc(real_audio))
    assert float(fm) == 0.0 and float(adv) > 0
    _, fm_other = train_vocoder.generator_losses(real, disc(real_audio * 0.5))
    assert float(fm_other) > 0


def test_the_discriminators_learn_to_tell_a_clip_from_noise():
    """Twenty least-squares steps on one tone (real) against noise (fake) lower the discriminators'
    loss (the adversarial step is wired end to end; the generator's side is `generator_losses`)."""
    torch.manual_seed(2)
    t = torch.arange(2048) / 22050
    real_audio = (0.3 * torch.sin(2 * math.pi * 220 * t)).unsqueeze(0)
    fake_audio = torch.randn(1, 2048) * 0.1
    # (one of each kind, for speed)
    nets = torch.nn.ModuleList(
        [train_vocoder.PeriodDiscriminator(5), train_vocoder.ResolutionDiscriminator(1024, 256)]
    )

    def disc(x):
        return [net(x) for net in nets]

    opt = torch.optim.AdamW(nets.parameters(), lr=2e-4, betas=(0.8, 0.99))
    losses = []
    for _ in range(20):
        loss = train_vocoder.discriminator_loss(disc(real_audio), disc(fake_audio))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_adversarial_step_matches_features_on_the_updated_discriminators():
    """After the discriminators' step, the generator's feature matching compares with real features
    of the updated discriminators: audio equal to the real audio matches exactly (zero), and the
    adversarial loss reaches the generator's output as a gradient. Without `generator`, both are zero."""
    torch.manual_seed(3)
    disc = train_vocoder.Discriminators()
    d_opt = torch.optim.AdamW(disc.parameters(), lr=1e-3, betas=(0.8, 0.99))
    audio = torch.randn(1, 2048) * 0.1
    y = audio.clone().requires_grad_(True)
    adv, fm, d_loss = train_vocoder.adversarial_step(disc, d_opt, y, audio, generator=True)
    assert float(fm.detach()) == 0.0 and float(d_loss) > 0
    adv.backward()
    assert y.grad is not None and float(y.grad.abs().sum()) > 0
    adv0, fm0, _ = train_vocoder.adversarial_step(disc, d_opt, y.detach() * 0.5, audio, generator=False)
    assert float(adv0) == 0.0 and float(fm0) == 0.0


@pytest.mark.skipif(
    __import__("shutil").which("flite") is None, reason="needs the flite binary (apt-get install flite)"
)
def test_clips_are_spoken_in_order_by_each_rows_teacher_in_spawned_workers():
    """`speak_all` after torch has run in this process (a forked worker could hang in flite's
    resampling): one float16 clip per row, in row order, each as long as the teacher speaks it."""
    import corpus

    torch.ones(64, 64) @ torch.ones(64, 64)  # torch's thread pool has run here
    rows = [
        {"teacher": "flite", "text": text, "voice": "slt", "stretch": 1.0, "f0": 0}
        for text in ["Yes.", "Please call Stella and ask her to bring these things with her."]
    ]
    clips = train_vocoder.speak_all(rows, jobs=2)
    assert [c.dtype for c in clips] == [torch.float16] * 2
    assert [len(c) for c in clips] == [len(corpus.speak(r)) for r in rows] and len(clips[0]) < len(clips[1])


def test_speak_all_workers_run_torch_on_one_thread():
    """Each of `speak_all`'s workers runs torch on one thread (many workers with a thread per core each
    crawl); without the pool's initializer they start with one per core (2 on the CI machine)."""
    with train_vocoder.speak_pool(2) as pool:
        assert pool.map(_torch_threads, range(2)) == [1, 1]


def _torch_threads(_: int) -> int:
    return torch.get_num_threads()


def test_a_run_trains_and_evaluates_on_disjoint_rows():
    """`choose_rows`: the held-out rows come first, then the first `utterances` training rows (trained
    on), then with `eval_from` the evaluated training rows from there on, none of them trained on."""
    rows = [{"id": i, "split": "heldout" if i % 10 == 0 else "train"} for i in range(100)]  # 10 held out
    chosen, train_idx, eval_idx = train_vocoder.choose_rows(rows, utterances=20, eval_clips=5)
    train_ids = [r["id"] for r in rows if r["split"] == "train"]
    assert [chosen[i]["id"] for i in eval_idx] == [0, 10, 20, 30, 40]
    assert [chosen[i]["id"] for i in train_idx] == train_ids[:20]
    chosen, train_idx, eval_idx = train_vocoder.choose_rows(rows, utterances=20, eval_clips=5, eval_from=30)
    assert [chosen[i]["id"] for i in train_idx] == train_ids[:20]
    assert [chosen[i]["id"] for i in eval_idx] == train_ids[30:35]
    assert len(chosen) == 10 + 20 + 5
    with pytest.raises(ValueError, match="--eval-from 19 is below --utterances 20"):
        train_vocoder.choose_rows(rows, utterances=20, eval_clips=5, eval_from=19)


@pytest.mark.parametrize(
    "utterances, eval_clips, eval_from, message",
    [
        (20, 5, 88, "has 90 training rows, 2 of them from there on"),  # runs past the end
        (200, 5, 200, "has 90 training rows, 0 of them"),  # more asked for than there are
        (-1, 5, None, "--utterances must be >= 0"),
        (20, 0, None, "--eval-clips >= 1"),
    ],
)
def test_an_evaluation_set_shorter_than_asked_is_refused(utterances, eval_clips, eval_from, message):
    """An evaluation on fewer clips than asked (or none, which would fail only after the training) is
    refused before anything is spoken."""
    rows = [{"id": i, "split": "heldout" if i % 10 == 0 else "train"} for i in range(100)]
    with pytest.raises(ValueError, match=message):
        train_vocoder.choose_rows(rows, utterances=utterances, eval_clips=eval_clips, eval_from=eval_from)


def test_evaluate_scores_both_decoders_and_the_wer_of_each_speaker(monkeypatch):
    """`evaluate` on two clips of two speakers: spectral distances for Griffin-Lim and the vocoder, the
    clip's length in seconds, and each decoder's WER overall and per speaker, from the transcript of
    each speaker's own clips (a stand-in ASR hears speaker 0 right and speaker 1 wrong)."""

    from tts.codec.melvq import MelVQCodec, MelVQNet

    torch.manual_seed(0)
    net = MelVQNet(num_codebooks=2, codebook_size=8, channels=8, latent=4, decoder_dilations=(1,))
    codec = MelVQCodec(net, torch.zeros(320), torch.ones(320))
    rows = [{"text": "good night", "speaker": 1}, {"text": "good morning", "speaker": 0}]
    rows.append({"text": "good evening", "speaker": 1})
    audio = [torch.randn(3000) * 0.1, torch.randn(1100) * 0.1, torch.randn(1100) * 0.1]  # 0.24 s
    heard = []

    class ASR:
        def __init__(self, threads):
            pass

        def transcribe(self, audio, sample_rate):  # decodes come clip by clip, rows in order
            row = rows[len(heard) % 3]
            heard.append(row["speaker"])
            return row["text"] if row["speaker"] == 0 else "bad words"

    def wer(refs, hyps):  # the share of wrong transcripts: enough to see which pairs each speaker got
        return sum(r != h for r, h in zip(refs, hyps, strict=True)) / len(refs)

    import tts_tools.evaluate

    monkeypatch.setattr(tts_tools.evaluate, "ASR", ASR)
    monkeypatch.setattr(tts_tools.evaluate, "wer", wer)
    out = train_vocoder.evaluate(untrained_vocoder(), codec, rows, audio, asr=True)
    assert out["clips"] == 3 and len(heard) == 9
    assert out["audio_seconds"] == round((3072 + 2048 + 2048) / 22050, 1) == 0.3  # whole codec frames
    for name in ("griffin_lim", "vocoder"):
        assert out[name]["log_spectral_distance"] > 0 and out[name]["mfcc_distance_db"] > 0
        assert out[name]["wer"] == 0.6667 and out[name]["wer_per_speaker"] == {"0": 0.0, "1": 1.0}
    assert out["clip"]["wer_per_speaker"] == {"0": 0.0, "1": 1.0}
    one_speaker = train_vocoder.evaluate(untrained_vocoder(), codec, rows[:1], audio[:1], asr=True)
    assert "wer_per_speaker" not in one_speaker["vocoder"] and one_speaker["vocoder"]["wer"] == 1.0
