"""The modded DAC's batched streaming decoder (`DACCodec.batched_stream`): every stream's audio equals
its offline decode whatever the batch around it, in float32 and (within a stated tolerance) bfloat16;
on CUDA, a captured graph replays what eager computes, without host syncs."""

import pytest
import torch
from helpers import decode_in_pushes
from torch.utils._python_dispatch import TorchDispatchMode

from tts.codec.dac.batched import BatchedDACDecoder
from tts.codec.dac.codec import DACCodec
from tts.codec.dac.net import ModdedDAC
from tts.codec.dac.random_init import random_codec_state, tiny_dac_config
from tts.codec.dac.weights import fuse_weight_norm
from tts.model.randinit import hashed_randint

# Measured on a 2-core x86 CPU, float32, the tiny codec below (audio peaks near 1):
# max |batched stream - offline decode| 9.7e-6 on SCHEDULE and 7.2e-6 on the 150-frame stream (the
# per-stream DACStreamingDecoder shows 5e-6 to 7e-6 against offline: convs over different lengths and
# batch sizes round differently); the tolerances leave room for other CPUs' kernels.
ATOL_OFFLINE = 2e-5
# Measured max |batched - DACStreamingDecoder| pushed the same chunks: 8.7e-6.
ATOL_STREAM = 2e-5
# bfloat16 decode path vs float32, same codes (audio RMS 0.49): measured relative RMS error 0.033 (about
# 30 dB SNR) and max |error| 0.185, accumulated evenly over the ~30 layers (no one stage dominates; the
# offline bf16 decode is as far from float32: 0.176).
BF16_REL_RMS = 0.05
BF16_MAX_ABS = 0.25


def _codec(window: int = 8, dtype=torch.float32, device="cpu") -> DACCodec:
    """The tiny DAC (decoder narrowed to 16 channels to keep the CPU tests fast), seed 1."""
    cfg = tiny_dac_config(decoder_dim=16, transformer_window=window)
    model = ModdedDAC(cfg)
    model.load_state_dict(fuse_weight_norm(random_codec_state(cfg, seed=1)))
    return DACCodec(model, device=device, dtype=dtype)


@pytest.fixture(scope="module")
def codec():
    """An 8-frame attention window, so that short streams run past it."""
    return _codec()


def _codes(frames: int, name: str) -> torch.Tensor:
    """Valid codes `[10, frames]` (semantic row < 4096, residual rows < 1024), a function of `name`."""
    return torch.cat(
        [hashed_randint((1, frames), 11, name + "s", 4096), hashed_randint((9, frames), 11, name, 1024)]
    )


# Streams and a schedule of calls: (T, rows), a row being (stream, frames) or ("pad", frames). A stream's
# first row resets the lowest free slot; its slot is freed after the call that ends it. With 3 slots,
# b's slot goes to c, d's to e; rows of length 0 (a stream that has nothing due) and pad rows on the
# scratch slot (lengths 0 and T, pad codes that are not zeros) mix with streams at different positions;
# B varies from 1 to 5 and T from 2 to 16; a (37 frames) runs well past the 8-frame window.
STREAMS = {"a": 37, "b": 9, "c": 21, "d": 14, "e": 6}
SCHEDULE = [
    (4, [("a", 4), ("b", 4), ("pad", 4)]),
    (8, [("pad", 0), ("b", 5), ("a", 0)]),
    (8, [("c", 8), ("a", 8), ("d", 3)]),
    (16, [("pad", 16), ("a", 16), ("d", 11), ("c", 0), ("pad", 0)]),
    (4, [("c", 4), ("e", 4), ("a", 0)]),
    (2, [("e", 1)]),
    (16, [("a", 9), ("pad", 16), ("c", 9), ("e", 1)]),
]


def run_schedule(dec: BatchedDACDecoder, device="cpu", decode=None, reset=None):
    """Drive `dec` through SCHEDULE; returns ({stream: concatenated audio}, {stream: chunk sizes}).
    `decode(slots, codes, lengths)` and `reset(slots)` default to `dec`'s (the CUDA test passes a graph
    replay and a reset of two decoders)."""
    decode, reset = decode or dec.decode, reset or dec.reset
    codes = {s: _codes(n, s) for s, n in STREAMS.items()}
    done = dict.fromkeys(STREAMS, 0)
    slot_of: dict[str, int] = {}
    free = list(range(dec.max_streams))
    audio = {s: [] for s in STREAMS}
    sizes = {s: [] for s in STREAMS}
    fl = dec.frame_length
    for call, (T, rows) in enumerate(SCHEDULE):
        for s, _ in rows:
            if s != "pad" and s not in slot_of:
                slot_of[s] = free.pop(0)
                reset(torch.tensor([slot_of[s]], device=device))
        batch = _codes(len(rows) * T, f"pad{call}").view(10, len(rows), T).permute(1, 0, 2).clone()
        for i, (s, n) in enumerate(rows):
            if s != "pad":
                batch[i, :, :n] = codes[s][:, done[s] : done[s] + n]
        slots = torch.tensor([dec.scratch_slot if s == "pad" else slot_of[s] for s, _ in rows])
        lengths = torch.tensor([n for _, n in rows])
        out = decode(slots.to(device), batch.to(device), lengths.to(device)).cpu()
        assert out.shape == (len(rows), T * fl) and out.dtype == torch.float32
        for i, (s, n) in enumerate(rows):
            if s != "pad":
                audio[s].append(out[i, : n * fl])
                sizes[s].append(n)
                done[s] += n
        positions = dec.positions.cpu()
        for s, slot in list(slot_of.items()):
            assert positions[slot] == done[s]  # frames decoded so far, what a codec stage would check
            if done[s] == STREAMS[s]:
                free.append(slot)
                free.sort()
                del slot_of[s]
        assert positions[dec.scratch_slot] == 0
    assert done == STREAMS
    return {s: torch.cat(a) for s, a in audio.items()}, sizes


def test_streams_joining_and_leaving_equal_offline_decode(codec):
    dec = codec.batched_stream(3)
    assert isinstance(dec, BatchedDACDecoder) and dec.graph_safe and dec.scratch_slot == 3
    audio, sizes = run_schedule(dec)
    for s, n in STREAMS.items():
        codes = _codes(n, s)
        torch.testing.assert_close(audio[s], codec.decode(codes), rtol=0, atol=ATOL_OFFLINE)
        pushed = decode_in_pushes(codec, codes, sizes[s])  # DACStreamingDecoder, the same chunks
        torch.testing.assert_close(audio[s], pushed, rtol=0, atol=ATOL_STREAM)


def test_dilated_convs_by_phases_equal_the_dilated_conv():
    from tts.codec.dac.batched import _conv_by_phases

    torch.manual_seed(0)
    for dilation, length in ((3, 18 + 40), (9, 54 + 64), (9, 54 + 5), (2, 12 + 1), (3, 18 + 42), (3, 18 + 3)):
        x, w, b = torch.randn(3, 5, length), torch.randn(4, 5, 7), torch.randn(4)
        expected = torch.nn.functional.conv1d(x, w, b, dilation=dilation)
        got = _conv_by_phases(x, w, b, dilation)
        assert got.shape == expected.shape and got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            _conv_by_phases(x, w, None, dilation), expected - b.view(4, 1), rtol=1e-5, atol=1e-5
        )
        w2 = torch.randn(4, 5, 7)  # grouped (the ConvNeXt depthwise convs' form): in 10 = 2 groups of 5
        x2 = torch.randn(3, 10, length)
        expected = torch.nn.functional.conv1d(x2, w2, b, dilation=dilation, groups=2)
        torch.testing.assert_close(_conv_by_phases(x2, w2, b, dilation, 2), expected, rtol=1e-5, atol=1e-5)


def test_dilated_convs_by_phases_decode_the_same_audio(codec):
    """On CUDA the residual units' dilated convs run by phases; forced on here, the schedule's audio is
    the plain decoder's."""
    plain, phased = codec.batched_stream(3), codec.batched_stream(3)
    assert not plain.dilated_by_phases  # (on a CPU)
    phased.dilated_by_phases = True
    expected, _ = run_schedule(plain)
    audio, _ = run_schedule(phased)
    for s in STREAMS:
        torch.testing.assert_close(audio[s], expected[s], rtol=0, atol=1e-5)


def test_stream_past_the_128_frame_window_equals_offline():
    # The real 128-frame window: 150 frames in chunks of 16, next to a second stream 5 frames ahead.
    codec = _codec(window=128)
    dec = codec.batched_stream(2)
    long, other = _codes(150, "long"), _codes(155, "other")
    dec.reset(torch.tensor([0, 1]))
    dec.decode(torch.tensor([1]), other[None, :, :16], torch.tensor([5]))
    pad = lambda x: torch.nn.functional.pad(x, (0, 16 - x.shape[-1]), value=7)  # noqa: E731
    pieces = []
    for i in range(0, 150, 16):
        n = min(16, 150 - i)
        batch = torch.stack([pad(long[:, i : i + 16]), pad(other[:, i + 5 : i + 21])])
        out = dec.decode(torch.tensor([0, 1]), batch, torch.tensor([n, n]))
        pieces.append(out[0, : n * 2048])
    assert dec.positions.tolist() == [150, 155, 0]
    torch.testing.assert_close(torch.cat(pieces), codec.decode(long), rtol=0, atol=ATOL_OFFLINE)


def test_reset_starts_a_slot_over(codec):
    dec = codec.batched_stream(1)
    codes = _codes(12, "r")
    dec.reset(torch.tensor([0]))
    first = dec.decode(torch.tensor([0]), codes[None], torch.tensor([12]))
    dec.reset(torch.tensor([0]))
    assert dec.positions.tolist() == [0, 0]
    again = dec.decode(torch.tensor([0]), codes[None], torch.tensor([12]))
    assert torch.equal(first, again)


def test_a_stream_past_max_frames_goes_on_without_an_error(codec):
    # The documented overrun: frames past the RoPE table are rotated as at its last row (wrong audio, no
    # device-side index error); frames before the limit are exact.
    dec = codec.batched_stream(1, max_frames=16)
    codes = _codes(20, "m")
    dec.reset(torch.tensor([0]))
    first = dec.decode(torch.tensor([0]), codes[None, :, :12], torch.tensor([12]))
    torch.testing.assert_close(first[0], codec.decode(codes[:, :12]), rtol=0, atol=ATOL_OFFLINE)
    over = dec.decode(torch.tensor([0]), codes[None, :, 12:], torch.tensor([8]))
    assert dec.positions.tolist() == [20, 0] and torch.isfinite(over).all()


def test_bfloat16_decode_path_within_stated_tolerance_of_float32():
    fp32, bf16 = _codec(), _codec(dtype=torch.bfloat16)
    assert bf16.model.decode_dtype == torch.bfloat16
    assert bf16.model.quantizer.quantizer.quantizers[0].codebook.weight.dtype == torch.float32  # encode's
    codes = torch.stack([_codes(24, "x"), _codes(24, "y")])
    outs = []
    for codec in (fp32, bf16):
        dec = codec.batched_stream(2)
        assert dec.state_bytes() > 0 and all(t.dtype == codec.dtype for t in dec._keys)
        dec.reset(torch.tensor([0, 1]))
        chunks = [
            dec.decode(torch.tensor([0, 1]), codes[..., i : i + 8], torch.tensor([8, 8])) for i in (0, 8, 16)
        ]
        outs.append(torch.cat(chunks, dim=1))
    assert outs[1].dtype == torch.float32
    err = outs[1] - outs[0]
    assert err.pow(2).mean().sqrt() <= BF16_REL_RMS * outs[0].pow(2).mean().sqrt()
    assert err.abs().max() <= BF16_MAX_ABS
    # The offline bf16 decode is within the same budget of float32 (chunking only changes rounding).
    off = bf16.decode(codes[0])
    assert off.dtype == torch.float32 and (off - outs[0][0]).abs().max() <= BF16_MAX_ABS


def test_bad_inputs_raise_value_errors(codec):
    dec = codec.batched_stream(2)
    slots, lengths, codes = torch.tensor([0, 1]), torch.tensor([1, 1]), _codes(2, "z").expand(2, 10, 2)
    with pytest.raises(ValueError, match="codes must be"):
        dec.decode(slots, codes[:, :9], lengths)
    with pytest.raises(ValueError, match="lengths must be"):
        dec.decode(slots, codes, torch.tensor([1]))
    with pytest.raises(ValueError, match="slots must be"):
        dec.decode(slots.int(), codes, lengths)
    with pytest.raises(ValueError, match="at least one frame"):
        dec.decode(slots, codes[..., :0], lengths)
    with pytest.raises(ValueError, match="max_streams"):
        codec.batched_stream(0)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _codec(dtype=torch.float16)


class _HostReads(TorchDispatchMode):
    """Records every op that reads a tensor's value on the host (`.item()`, `int(t)`, `bool(t)`,
    `nonzero`, ...) or makes a tensor from Python data (`torch.tensor([...])`). (`.tolist()` reads memory
    without an op, so only the CUDA sync test sees it.) Under inference mode `.item()` shows as
    `item`, outside it as `_local_scalar_dense`."""

    FORBIDDEN = {
        "item",
        "_local_scalar_dense",
        "lift_fresh",
        "nonzero",
        "masked_select",
        "equal",
        "is_nonzero",
    }

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.FORBIDDEN:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_decode_and_reset_read_nothing_back_to_the_host(codec):
    # The CPU stand-in for graph safety (the CUDA tests check the real thing): no op in decode or reset
    # reads a value on the host or builds a tensor from Python data.
    dec = codec.batched_stream(3)
    slots, lengths = torch.tensor([0, 3, 2]), torch.tensor([3, 4, 0])
    codes = torch.stack([_codes(4, "h0"), _codes(4, "h1"), _codes(4, "h2")])
    dec.decode(slots, codes, lengths)  # first call outside: lazily built constants are fine
    with _HostReads() as mode:
        dec.reset(slots[:1])
        dec.decode(slots, codes, lengths)
    assert mode.seen == []


# ---- CUDA (run on the GPU machine; skipped here) -----------------------------------------------------


@pytest.fixture
def exact_fp32_cuda():
    """TF32 off for the test, so float32 CUDA convs and matmuls compare with a float32 tolerance."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(exact_fp32_cuda, dtype):
    """Capture `decode` once for (B, T) = (5, 16), SCHEDULE's largest call, and drive the whole schedule
    through replays, smaller calls padded with scratch rows of length 0; a second decoder runs eagerly on
    the same padded inputs. Same kernels, same shapes: the replay should equal eager bit for bit (the
    assertion allows float32 rounding; the measured difference is printed)."""
    codec = _codec(dtype=dtype, device="cuda")
    B, T = 5, 16
    dec, ref = codec.batched_stream(3), codec.batched_stream(3)
    static_slots = torch.full((B,), dec.scratch_slot, dtype=torch.int64, device="cuda")
    static_codes = torch.zeros(B, 10, T, dtype=torch.int64, device="cuda")
    static_lengths = torch.zeros(B, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuDNN, allocator) off the capture stream, as torch documents
        for _ in range(3):
            dec.decode(static_slots, static_codes, static_lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = dec.decode(static_slots, static_codes, static_lengths)
    worst = []

    def replay(slots, codes, lengths):
        b, _, t = codes.shape
        static_slots.fill_(dec.scratch_slot)
        static_lengths.zero_()
        static_slots[:b].copy_(slots)
        static_codes[:b, :, :t].copy_(codes)
        static_lengths[:b].copy_(lengths)
        eager = ref.decode(static_slots.clone(), static_codes.clone(), static_lengths.clone())
        graph.replay()
        out = static_out[:b, : t * dec.frame_length].clone()
        for i in range(b):
            # Pad rows (the scratch slot) may have any length; their output is undefined (several pad
            # rows share the scratch state), so only real rows are compared.
            n = 0 if int(slots[i]) == dec.scratch_slot else int(lengths[i]) * dec.frame_length
            worst.append(float((out[i, :n] - eager[i, :n]).abs().max()) if n else 0.0)
        return out

    def reset(slots):
        dec.reset(slots)
        ref.reset(slots)

    audio, _ = run_schedule(dec, device="cuda", decode=replay, reset=reset)
    print(f"{dtype}: max |replay - eager| = {max(worst):.3g}")
    assert max(worst) <= (1e-5 if dtype == torch.float32 else BF16_MAX_ABS)
    assert torch.equal(dec.positions, ref.positions)
    if dtype == torch.float32:  # TF32 off: the float32 streaming contract holds on the GPU too
        # cuDNN may pick other algorithms for the offline decode's longer convs than for the chunks, so
        # the bound is looser than on the CPU; the measured value is printed (pytest -s).
        err = max(float((audio[s] - codec.decode(_codes(n, s))).abs().max()) for s, n in STREAMS.items())
        print(f"float32 CUDA: max |stream - offline| = {err:.3g}")
        assert err <= 5e-4


@pytest.mark.cuda
def test_cuda_decode_makes_no_host_sync():
    codec = _codec(device="cuda")
    dec = codec.batched_stream(4)
    slots = torch.tensor([0, 2, 4], device="cuda")
    codes = torch.stack([_codes(8, "p"), _codes(8, "q"), _codes(8, "r")]).cuda()
    lengths = torch.tensor([8, 3, 8], device="cuda")
    dec.reset(slots)
    dec.decode(slots, codes, lengths)  # first call outside: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dec.reset(slots[:1])
        for _ in range(2):
            out = dec.decode(slots, codes, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (3, 8 * 2048) and out.device.type == "cuda"
    assert dec.positions.tolist() == [16, 0, 9, 0, 0]  # slot 0 was reset, slot 2 went on: 3 + 3 + 3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_snake_kernels_match_the_torch_formula(dtype):
    """The fused Snake passes (tts/kernels/snake.py) against `Snake1d`'s torch formula on the GPU, on a
    conv output cut along T (rows not contiguous, T over one 1024-sample block); and the batched
    decoder with them against the same decoder without them (float32, TF32 off)."""
    import tts.model.kernels as K
    from tts.codec.dac.net import Snake1d
    from tts.model.kernels.snake import add_snake, snake

    torch.manual_seed(5)
    m = Snake1d(12).cuda()
    m.alpha.data = torch.rand(1, 12, 1, device="cuda") * 3 + 0.05
    x = (torch.randn(3, 12, 2600, device="cuda") * 4)[..., 100:2500].to(dtype)
    bias, res = torch.randn(12, device="cuda").to(dtype), torch.randn(3, 12, 2400, device="cuda").to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)

    def ref(t):  # `Snake1d`'s formula in float32, rounded once at the end as the kernel does
        t, a = t.float(), m.alpha.float()
        return (t + (a + 1e-9).reciprocal() * torch.sin(a * t).pow(2)).to(dtype)

    with torch.no_grad():
        torch.testing.assert_close(snake(x, m.alpha, bias), ref(x.float() + bias[:, None].float()), **tol)
        total, nxt = add_snake(x, bias, res, m.alpha)
        exact_sum = x.float() + bias[:, None].float() + res.float()
        torch.testing.assert_close(total, exact_sum.to(dtype), **tol)
        torch.testing.assert_close(nxt, ref(exact_sum), **tol)

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        codec = _codec(device="cuda")
        outs = []
        for fused in (False, True):
            K.set_fused_kernels(fused)
            dec = codec.batched_stream(2)
            dec.reset(torch.tensor([0, 1], device="cuda"))
            codes = torch.stack([_codes(16, "f0"), _codes(16, "f1")]).cuda()
            outs.append(
                dec.decode(torch.tensor([0, 1], device="cuda"), codes, torch.tensor([16, 9], device="cuda"))
            )
        fl = codec.frame_length
        err = max(
            float((outs[1][i, : n * fl] - outs[0][i, : n * fl]).abs().max()) for i, n in ((0, 16), (1, 9))
        )
        print(f"batched decode, fused vs torch: max |difference| {err:.3g}")
        assert err <= 1e-4
    finally:
        K.set_fused_kernels(True)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
