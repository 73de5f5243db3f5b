"""Where a batched DAC decode call's time goes (S2-Pro-size modded DAC, random weights, one GPU).

    python tools/profile/dac_profile.py --device cuda --shapes 1x16,16x16,64x16 --out dac_profile.json

For each (B streams x T frames) and each cudnn.benchmark setting: the graph replay's latency (CUDA
events, median); the eager call split by stage (post transformer, quantizer upsampling, decoder; CUDA
events around each, synchronized, so a stage's number is its own latency); and a torch.profiler table of
one eager call's kernels (count and device time per kernel name, top `--top`). A call's cost that does
not grow with B is launch- or kernel-shape-bound; one that grows with B x T is arithmetic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

# this checkout's code, and the DAC microbenchmark's helpers
sys.path[:0] = [
    str(Path(__file__).resolve().parents[2]),
    str(Path(__file__).resolve().parents[1] / "microbench"),
]

from dac_batched import call_ms, capture_decode, codes_for  # noqa: E402

from tts.codec.dac.codec import DACCodec  # noqa: E402
from tts.codec.dac.net import DACConfig  # noqa: E402
from tts.codec.dac.random_init import random_codec_state, tiny_dac_config  # noqa: E402
from tts.model.kernels import fused_kernels_enabled  # noqa: E402


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(int(b), int(t)) for b, t in (s.split("x") for s in text.split(",") if s)]


CUDA = False  # main() sets it from --device: CUDA events time the calls, else the wall clock


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(call_ms(fn, CUDA) for _ in range(iters))


def stages(dec, slots, codes, lengths, iters: int) -> dict[str, float]:
    """Each stage of `BatchedDACDecoder.decode` timed on its own (eager)."""
    from tts.codec.dac.batched import _Rows

    model = dec.model
    out: dict[str, float] = {}
    rows = _Rows(slots, lengths)
    positions = dec.positions.index_select(0, slots)
    z0 = model.lookup(codes)
    out["lookup"] = _median_ms(lambda: model.lookup(codes), iters)
    out["transformer"] = _median_ms(lambda: dec._transformer(z0, _Rows(slots, lengths), positions), iters)
    z = dec._transformer(z0, rows, positions)

    def upsample():
        r = _Rows(slots, lengths)
        x = z
        for stage in model.quantizer.upsample:
            x = dec._run(stage, x, r)
        return x, r

    out["upsample"] = _median_ms(upsample, iters)
    zu, r = upsample()

    def decoder():
        rr = _Rows(slots, lengths)
        rr.rate = r.rate
        if fused_kernels_enabled(zu):
            return dec._decoder_fused(zu, rr)
        return dec._run(model.decoder, zu, rr)

    out["decoder"] = _median_ms(decoder, iters)
    return out


def kernels(fn, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name]
            a[0] += 1
            a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for v in agg.values())
    print(f"    device time {total / 1e3:.2f} ms in {sum(v[0] for v in agg.values())} kernels")
    out = []
    for name, (n, us) in rows[:top]:
        print(f"    {us / 1e3:8.3f} ms {n:5d}x  {name[:110]}")
        out.append({"name": name, "count": n, "us": us})
    return [{"total_us": total}] + out


def record_convs(call) -> list[tuple]:
    """The convolutions one decode call makes, in order: (kind, input shape, weight, bias, stride,
    padding, dilation, groups, output_padding)."""
    import torch.nn.functional as F

    seen: list[tuple] = []
    conv1d, conv_t = F.conv1d, F.conv_transpose1d

    def rec1(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
        seen.append(("conv", tuple(x.shape), w, b, stride, padding, dilation, groups, 0))
        return conv1d(x, w, b, stride, padding, dilation, groups)

    def rect(x, w, b=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        seen.append(("convT", tuple(x.shape), w, b, stride, padding, dilation, groups, output_padding))
        return conv_t(x, w, b, stride, padding, output_padding, groups, dilation)

    F.conv1d, F.conv_transpose1d = rec1, rect
    try:
        call()
    finally:
        F.conv1d, F.conv_transpose1d = conv1d, conv_t
    return seen


def _one(v):
    return v[0] if isinstance(v, tuple | list) else v


def conv_variants(convs: list[tuple], iters: int) -> dict:
    """Each recorded conv timed alone: as called ([B, C, L], "ncl"), and as a 2-D conv over a
    channels-last `[B, C, 1, L]` input and weight ("nhwc", layout conversion not counted)."""
    import torch.nn.functional as F

    total = {"ncl": 0.0, "nhwc": 0.0}
    rows = []
    for kind, shape, w, b, stride, padding, dilation, groups, opad in convs:
        x = torch.randn(shape, device=w.device, dtype=w.dtype)
        s, p, d, op = _one(stride), _one(padding), _one(dilation), _one(opad)
        x2 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        w2 = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        if kind == "conv":
            f1 = partial(F.conv1d, x, w, b, s, p, d, groups)
            f2 = partial(F.conv2d, x2, w2, b, (1, s), (0, p), (1, d), groups)
        else:
            f1 = partial(F.conv_transpose1d, x, w, b, s, p, op, groups, d)
            f2 = partial(F.conv_transpose2d, x2, w2, b, (1, s), (0, p), (0, op), groups, (1, d))
        with torch.inference_mode():
            a, c = _median_ms(f1, iters), _median_ms(f2, iters)
        total["ncl"] += a
        total["nhwc"] += c
        rows.append({"kind": kind, "x": shape, "w": tuple(w.shape), "dilation": d, "ncl_ms": a, "nhwc_ms": c})
        print(f"    {kind:5s} x {shape} w {tuple(w.shape)} d {d}: ncl {a:.3f} ms, nhwc {c:.3f} ms")
    print(f"  convs alone: ncl {total['ncl']:.2f} ms, nhwc {total['nhwc']:.2f} ms")
    return {"total_ms": total, "convs": rows}


@torch.inference_mode()
def graph_ms(dec, slots, codes, lengths, iters: int) -> float:
    graph, _, _ = capture_decode(dec, slots, codes, lengths)
    return _median_ms(graph.replay, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shapes", type=_shapes, default=_shapes("1x16,16x16,64x16"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--benchmark", default="off,on", help="cudnn.benchmark settings to run")
    p.add_argument("--phases", default="off,on", help="dilated convs by phases (BatchedDACDecoder)")
    p.add_argument("--detail", type=_shapes, default=_shapes("16x16"), help="shapes to split and profile")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--convs", action="store_true", help="time each conv alone, NCL vs channels-last")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default="dac_profile.json")
    a = p.parse_args()
    cfg = tiny_dac_config() if a.tiny else DACConfig()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "codec.pth"
        torch.save(random_codec_state(cfg, seed=0), path)
        codec = DACCodec.from_file(path, device=a.device, dtype=getattr(torch, a.dtype))
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    report: dict = {"gpu": gpu, "torch": torch.__version__, "runs": []}
    global CUDA
    cuda = CUDA = a.device.startswith("cuda")
    for bm in a.benchmark.split(","):
        torch.backends.cudnn.benchmark = bm == "on"
        for phases in a.phases.split(","):
            for B, T in a.shapes:
                dec = codec.batched_stream(max(B, 1))
                dec.dilated_by_phases = phases == "on"
                slots = torch.arange(B, device=a.device)
                codes = codes_for(codec, B, T, seed=1).to(a.device)
                lengths = torch.full((B,), T, dtype=torch.int64, device=a.device)
                call = torch.inference_mode()(partial(dec.decode, slots, codes, lengths))
                print(f"== cudnn.benchmark {bm}, dilated convs by phases {phases}, B={B} T={T}")
                run: dict = {"benchmark": bm, "phases": phases, "B": B, "T": T}
                run["graph_ms"] = graph_ms(dec, slots, codes, lengths, a.iters) if cuda else float("nan")
                run["eager_ms"] = _median_ms(call, a.iters)
                print(f"  graph {run['graph_ms']:.2f} ms, eager {run['eager_ms']:.2f} ms")
                if (B, T) in a.detail:
                    with torch.inference_mode():
                        run["stages_ms"] = stages(dec, slots, codes, lengths, a.iters)
                    print("  stages " + ", ".join(f"{k} {v:.2f}" for k, v in run["stages_ms"].items()))
                    run["kernels"] = kernels(call, a.top)
                    if a.convs:
                        run["convs"] = conv_variants(record_convs(call), a.iters)
                report["runs"].append(run)
                Path(a.out).write_text(json.dumps(report, indent=1))
                del dec, call
                if cuda:
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
