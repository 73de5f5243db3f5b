"""Batched streaming decode of the mel codecs (`MelVQCodec.batched_stream`, `MelRVQCodec.batched_stream`):
every stream's concatenated output equals `codec.decode` of all its codes, whatever the batch around it.

Griffin-Lim (16 momentum iterations) turns a 1-ulp change in its input into sample differences of
~1e-2, so "equal" here means bit-identical on the CPU: the batched decoder, `stream()` and `decode`
run the same per-frame arithmetic. The tests pin one torch thread, as the codec thread runs (the
equality was also measured with 2 and 8 threads on the development machine).
"""

import copy
import random

import pytest
import torch
import torchaudio

from tts.checkpoints.bundle import DEFAULT_MODEL_DIR
from tts.checkpoints.load import load_bundle
from tts.codec.mel import FRAME_LENGTH, GriffinLim
from tts.codec.melrvq import MelRVQCodec
from tts.codec.melvq import MelVQCodec, MelVQNet
from tts.codec.vocoder import CausalVocoder

L = FRAME_LENGTH


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def default_codec():
    """The shipped default codec: its net with the learned vocoder its codec.json names."""
    return load_bundle("default").codec


@pytest.fixture(scope="module")
def default_gl_codec(default_codec):
    """The default codec's net with Griffin-Lim (what a mel codec without a vocoder entry decodes with)."""
    c = default_codec
    return MelVQCodec(c.net, c.mean, c.std, c.gl_context, c.gl_iters)


@pytest.fixture(scope="module")
def small_codec():
    torch.manual_seed(0)
    net = MelVQNet(num_codebooks=3, codebook_size=16, channels=32, latent=8, decoder_dilations=(1, 2, 1))
    net.codebooks.normal_()
    return MelVQCodec(net, torch.full((320,), -4.0), torch.full((320,), 2.0), gl_context=2, gl_iters=4)


@pytest.fixture(scope="module")
def learned_codec(small_codec):
    """small_codec's net with a small learned vocoder (`tts.codec.vocoder`) in place of Griffin-Lim."""
    torch.manual_seed(2)
    vocoder = CausalVocoder(channels=16, blocks=2)
    with torch.no_grad():  # speech-sized output, never clipped; every block reaches its full context
        vocoder.head.weight.mul_(3.0)
        for block in vocoder.blocks:
            block.scale.fill_(1.0)
    return MelVQCodec(copy.deepcopy(small_codec.net), small_codec.mean, small_codec.std, vocoder_net=vocoder)


@pytest.fixture(scope="module")
def rvq_codec():
    g = torch.Generator().manual_seed(1)
    books = torch.randn(2, 32, 320, generator=g)
    return MelRVQCodec(books, torch.full((320,), -4.0), torch.full((320,), 1.5), gl_context=3, gl_iters=4)


def _codes(codec, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.codebook_size, (codec.num_codebooks, frames), generator=g)


def run_schedule(codec, streams: dict[str, torch.Tensor], max_streams: int, seed: int, device="cpu"):
    """Decode `streams` (name -> codes `[N, frames]`) through one batched decoder with a random schedule:
    streams join and leave at different calls (a finished stream's slot is reset and reused), every call
    has its own T, rows have ragged lengths including 0, and pad rows on the scratch slot fill the batch
    to a random size. Returns ({name: concatenated audio [frames * L] on the CPU}, the decoder)."""
    rnd = random.Random(seed)
    dec = codec.batched_stream(max_streams, device=device)
    pending = list(streams)
    active: dict[str, list] = {}  # name -> [slot, position, pieces]
    free = list(range(max_streams))
    done = {}
    N = codec.num_codebooks
    while pending or active:
        while pending and free and (not active or rnd.random() < 0.5):  # join mid-way
            name = pending.pop(0)
            slot = free.pop(rnd.randrange(len(free)))
            dec.reset(torch.tensor([slot], device=device))
            active[name] = [slot, 0, []]
        T = rnd.choice([1, 2, 3, 4, 5, 8, 16])
        rows = list(active.items())
        rnd.shuffle(rows)
        B = len(rows) + rnd.randint(0, 2)  # pad rows
        slots = torch.full((B,), dec.scratch_slot, dtype=torch.int64)
        codes = torch.randint(0, codec.codebook_size, (B, N, T))  # padding frames hold arbitrary codes
        lengths = torch.full((B,), rnd.randint(0, T), dtype=torch.int64)  # pad rows: any length
        for i, (name, (slot, pos, _)) in enumerate(rows):
            n = min(rnd.choice([0, 1, T, T, T]), streams[name].shape[1] - pos)
            slots[i], lengths[i] = slot, n
            codes[i, :, :n] = streams[name][:, pos : pos + n]
        out = dec.decode(slots.to(device), codes.to(device), lengths.to(device)).cpu()
        assert out.shape == (B, T * L) and out.dtype == torch.float32
        for i, (name, entry) in enumerate(rows):
            n = int(lengths[i])
            entry[2].append(out[i, : n * L])
            entry[1] += n
            if entry[1] == streams[name].shape[1]:  # leaves; its slot goes back to the pool
                done[name] = torch.cat(entry[2])
                free.append(entry[0])
                del active[name]
    return done, dec


def test_griffin_lim_is_torchaudios_without_the_host_sync():
    g = torch.Generator().manual_seed(0)
    mag = torch.rand(5, 513, 12, generator=g).pow(4) * 3  # torchaudio's layout [N, freq, frames]
    window = torch.hann_window(1024)
    ref = torchaudio.functional.griffinlim(
        mag, window, 1024, 256, 1024, power=1.0, n_iter=16, momentum=0.99, length=256 * 11, rand_init=False
    )
    ours = GriffinLim(12, 16)(mag.transpose(1, 2).contiguous())
    assert ours.shape == (5, 256 * 11)
    assert torch.equal(ours, ref)  # same operations in the same order on the CPU
    # each window on its own: the result of one does not depend on the batch around it
    assert torch.equal(GriffinLim(12, 16)(mag[3:4].transpose(1, 2).contiguous()), ref[3:4])


def test_decode_frames_is_the_conv_decoder_and_continues_from_history(small_codec):
    net = small_codec.net
    q = torch.randn(2, 8, 23)
    with torch.no_grad():
        ref = net.decode(q).transpose(1, 2)  # [2, 23, 320]
        whole, _ = net.decode_frames(q.transpose(1, 2).contiguous())
        first, seqs = net.decode_frames(q[:, :, :9].transpose(1, 2).contiguous())
        history = [s[:, 9:] for s in seqs]  # each block's last 2 * dilation inputs
        rest, _ = net.decode_frames(q[:, :, 9:].transpose(1, 2).contiguous(), history)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-5)
    assert torch.equal(torch.cat([first, rest], dim=1), whole)


def assert_same_audio(audio: torch.Tensor, offline: torch.Tensor, what) -> None:
    """Batched Griffin-Lim equals the offline decode to float rounding, which its iterations amplify: the
    same length, and at least 40 dB of signal over the difference. (Bit-identical on some CPU builds of
    torch, not on all: the batched and single-stream STFTs may round differently, and 32 iterations of
    phase recovery carry that into samples up to a few 1e-3 apart.)"""
    assert audio.shape == offline.shape, what
    noise = float((audio - offline).pow(2).sum())
    signal = float(offline.pow(2).sum())
    assert noise <= signal * 1e-4, (what, noise, signal)


@pytest.mark.parametrize("which", ["small", "rvq"])
def test_batched_streams_equal_offline_decode(which, small_codec, rvq_codec):
    codec = small_codec if which == "small" else rvq_codec
    lengths = [3, 40, 1, 25, 17, 60, 8]  # 40 and 60 run past context_frames (11 and 4)
    streams = {f"s{i}": _codes(codec, n, seed=i) for i, n in enumerate(lengths)}
    for seed in range(3):
        if seed == 2:  # the codec stage's worker decodes under inference mode
            with torch.inference_mode():
                done, _ = run_schedule(codec, streams, max_streams=3, seed=seed)
        else:
            done, _ = run_schedule(codec, streams, max_streams=3, seed=seed)
        assert set(done) == set(streams)
        for name, audio in done.items():
            assert_same_audio(audio, codec.decode(streams[name]), (which, seed, name))


def test_default_codec_with_griffin_lim_batched_equals_offline_decode(default_gl_codec):
    codec = default_gl_codec
    assert codec.vocoder_net is None and codec.context_frames == 19
    streams = {
        "long": _codes(codec, 45, 1),
        "mid": _codes(codec, 21, 2),
        "short": _codes(codec, 3, 3),
        "late": _codes(codec, 12, 4),
    }
    done, dec = run_schedule(codec, streams, max_streams=2, seed=0)
    assert dec.graph_safe and dec.device == torch.device("cpu")
    for name, audio in done.items():
        assert_same_audio(audio, codec.decode(streams[name]), name)
    # and the per-stream StreamingDecoder, which shares the arithmetic, agrees too
    stream = codec.stream()
    pieces = [stream.push(streams["long"][:, a:b]) for a, b in ((0, 5), (5, 30), (30, 45))]
    assert_same_audio(torch.cat(pieces), codec.decode(streams["long"]), "per-stream decoder")


def test_the_shipped_default_codec_batched_equals_offline_decode(default_codec):
    """The shipped codec decodes with its learned vocoder: 16 decoder frames + 12 for the vocoder's 42
    mel frames of context, and every stream of a batch equals its offline decode to float rounding."""
    codec = default_codec
    assert codec.vocoder_net is not None and codec.context_frames == 16 + 12
    streams = {"long": _codes(codec, 45, 1), "mid": _codes(codec, 21, 2), "short": _codes(codec, 3, 3)}
    done, dec = run_schedule(codec, streams, max_streams=2, seed=0)
    assert dec.graph_safe
    for name, audio in done.items():
        torch.testing.assert_close(audio, codec.decode(streams[name]), atol=1e-4, rtol=1e-4, msg=name)


def test_a_learned_vocoders_batched_streams_equal_offline_decode(learned_codec, tmp_path):
    """With the learned vocoder, every stream of a mixed batch (rows joining and leaving, ragged lengths,
    length-0 and pad rows) equals the offline decode up to float rounding (the convolutions may block
    differently by length), as do `decode_tail` and the per-stream `stream()`; the codec's files keep
    the vocoder (save, load, same weights)."""
    codec = learned_codec
    assert codec.context_frames == codec.net.receptive_frames + 6  # ceil((18 + 3) / 4) codec frames
    lengths = [3, 40, 1, 25, 17, 60, 8]
    streams = {f"s{i}": _codes(codec, n, seed=i) for i, n in enumerate(lengths)}
    for seed in range(2):
        done, dec = run_schedule(codec, streams, max_streams=3, seed=seed)
        assert dec.graph_safe and set(done) == set(streams)
        for name, audio in done.items():
            offline = codec.decode(streams[name])
            assert offline.abs().max() > 1e-3
            torch.testing.assert_close(audio, offline, atol=1e-4, rtol=1e-4, msg=f"{seed} {name}")
    codes = streams["s5"]
    torch.testing.assert_close(codec.decode_tail(codes, 7), codec.decode(codes)[-7 * L :])
    stream = codec.stream()
    pieces = [stream.push(codes[:, a:b]) for a, b in ((0, 5), (5, 30), (30, 60))]
    torch.testing.assert_close(torch.cat(pieces), codec.decode(codes), atol=1e-4, rtol=1e-4)
    codec.save(tmp_path)
    loaded = MelVQCodec.load(tmp_path)
    assert loaded.vocoder_net is not None and loaded.config() == codec.config()
    assert loaded.config()["vocoder"]["type"] == "causal_vocos"
    saved = loaded.vocoder_net.state_dict()  # float16 on disk (as the net's convolutions), float32 loaded
    assert all(saved[k].dtype == torch.float32 for k in saved)
    assert all(torch.equal(saved[k], v.half().float()) for k, v in codec.vocoder_net.state_dict().items())
    assert loaded.decode(codes).shape == (60 * L,)


def test_rows_of_length_zero_and_pad_rows_change_nothing(small_codec):
    codec = small_codec
    codes = _codes(codec, 20, 7)
    a, b = codec.batched_stream(2), codec.batched_stream(2)
    for d in (a, b):
        d.reset(torch.tensor([0, 1]))
    out_a = [a.decode(torch.tensor([0]), codes[None, :, :6], torch.tensor([6]))[0]]
    out_b = [b.decode(torch.tensor([1]), codes[None, :, :6], torch.tensor([6]))[0]]
    # b: a call where the stream's row has length 0 and two pad rows write the scratch slot
    junk = torch.randint(0, 16, (3, 3, 5))
    b.decode(torch.tensor([1, b.scratch_slot, b.scratch_slot]), junk, torch.tensor([0, 5, 2]))
    out_a.append(a.decode(torch.tensor([0]), codes[None, :, 6:], torch.tensor([14]))[0])
    out_b.append(b.decode(torch.tensor([1]), codes[None, :, 6:], torch.tensor([14]))[0])
    assert torch.equal(torch.cat(out_a), torch.cat(out_b))
    assert torch.equal(torch.cat(out_a), codec.decode(codes))


def test_bad_inputs_raise(small_codec):
    dec = small_codec.batched_stream(2)
    with pytest.raises(ValueError, match="codes must be"):
        dec.decode(torch.tensor([0]), torch.zeros(1, 2, 4, dtype=torch.int64), torch.tensor([4]))
    with pytest.raises(ValueError, match="slots and lengths"):
        dec.decode(torch.tensor([0, 1]), torch.zeros(1, 3, 4, dtype=torch.int64), torch.tensor([4]))
    with pytest.raises(ValueError, match="max_streams"):
        small_codec.batched_stream(0)
    assert dec.decode(
        torch.tensor([0]), torch.zeros(1, 3, 0, dtype=torch.int64), torch.tensor([0])
    ).shape == (1, 0)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.mark.cuda
@pytest.mark.parametrize("vocoder", ["griffin_lim", "learned"])
def test_cuda_decode_matches_the_cpu_and_replays_in_a_cuda_graph(vocoder, default_gl_codec, learned_codec):
    """On CUDA the decoder runs wholly on the GPU. cuFFT and cuBLAS round differently from the CPU and
    Griffin-Lim amplifies that: measured on the CPU, relative input errors of 1e-7 / 1e-5 / 1e-3 move
    the samples by 1% / 2% / 20% of the signal's RMS. So the check is 5%: float32 rounding passes (TF32
    matmuls, off by default, would not), while the state bugs tried on the CPU fail (a stale cross-fade
    tail: 8-13%, history cut one frame early: 30-85%). The learned vocoder (a small random one on the
    small codec) amplifies nothing: 1% (cuDNN's TF32 convolutions, on by default, round at ~1e-3). A
    CUDA graph of `decode` replays the same kernels as eager."""
    if vocoder == "griffin_lim":
        cpu_codec, tolerance = default_gl_codec, 0.05
        shipped = MelVQCodec.load(DEFAULT_MODEL_DIR)  # (its own net: the fixtures' stays on the CPU)
        codec = MelVQCodec(shipped.net, shipped.mean, shipped.std, shipped.gl_context, shipped.gl_iters).to(
            "cuda"
        )
        assert codec.net.codebooks.is_cuda and codec.vocoder.inverse_fb.is_cuda
    else:
        cpu_codec, tolerance = learned_codec, 0.01
        codec = copy.deepcopy(learned_codec).to("cuda")
        assert codec.net.codebooks.is_cuda and codec.vocoder_net.head.weight.is_cuda
    streams = {"a": _codes(codec, 40, 1), "b": _codes(codec, 9, 2), "c": _codes(codec, 26, 3)}
    gpu, dec = run_schedule(codec, streams, max_streams=2, seed=1, device="cuda")
    assert dec.device.type == "cuda" and dec.graph_safe
    for name, audio in gpu.items():
        ref = cpu_codec.decode(streams[name])
        assert audio.shape == ref.shape
        err = float((audio - ref).abs().max())
        print(f"cuda vs cpu {name}: max |diff| {err:.2e}, rel rms {_rel_rms(audio, ref):.3f}")
        assert _rel_rms(audio, ref) < tolerance, name
    # offline decode on the GPU too (codec.to moved the vocoder): CPU in and out
    assert codec.decode(streams["b"]).device.type == "cpu"

    # no host sync in decode
    B, T = 3, 4
    slots = torch.tensor([0, 1, dec.scratch_slot], device="cuda")
    lengths = torch.tensor([4, 2, 0], device="cuda")
    codes = torch.randint(0, codec.codebook_size, (B, codec.num_codebooks, T), device="cuda")
    dec.reset(slots[:2])
    dec.decode(slots, codes, lengths)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dec.decode(slots, codes, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # graph: capture decode for (B, T) = (3, 4), replay with new inputs against an eager twin
    graphed, eager = codec.batched_stream(2), codec.batched_stream(2)
    static = [slots.clone(), codes.clone(), lengths.clone()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up with length-0 rows: plans built, state untouched
        graphed.decode(static[0], static[1], torch.zeros_like(static[2]))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = graphed.decode(*static)
    for d in (graphed, eager):
        d.reset(torch.tensor([0, 1], device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(5)
    for step in range(6):
        new_codes = torch.randint(
            0, codec.codebook_size, (B, codec.num_codebooks, T), device="cuda", generator=g
        )
        new_lengths = torch.tensor([4, step % 3, step % 5], device="cuda").clamp(max=T)
        static[1].copy_(new_codes)
        static[2].copy_(new_lengths)
        graph.replay()
        ref = eager.decode(slots, new_codes, new_lengths)
        for i in range(2):  # the real rows; the scratch row is undefined
            n = int(new_lengths[i]) * L
            if n:
                got, want = static_out[i, :n].cpu(), ref[i, :n].cpu()
                print(f"graph vs eager step {step} row {i}: max |diff| {float((got - want).abs().max()):.2e}")
                assert _rel_rms(got, want) < tolerance, (step, i)
