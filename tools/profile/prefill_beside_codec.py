"""The prefill's cost by prompts packed into one pass, alone and beside the codec stage's decode calls.

    python tools/profile/prefill_beside_codec.py --out prefill_beside_codec.json

S2-Pro shape (random bf16 weights) with the prefill's graphs captured at start-up, on a high-priority
stream as the service's engine thread runs it; for each prompt length in --tokens and each count in
--packed, a pass over that many prompts: its host wall time (the launch and a synchronization) and its
device time (CUDA events), the median of --reps. Then the same while a second thread replays the S2-Pro
DAC's batched decode (--codec-rows streams x 16 frames, graph, dilated convs by phases) back to back on
a low-priority stream, as the codec stage's worker does under load. A pass that costs about the same
for one prompt as for four is bound by its kernels' count, not their work; one that grows beside the
codec waits for the SMs its kernels hold.

`--step-batch B` also times a frame step of B running rows, alone and beside the codec. `--codec-sms N`
runs the codec on a stream of a CUDA green context of N SMs (torch's `GreenContext`; needs the
cuda-bindings package and a driver with green contexts), `--codec-eager` launches its decode kernel by
kernel instead of replaying its graph: whether the engine's work then finds SMs free.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path[:0] = [
    str(Path(__file__).resolve().parents[2]),
    str(Path(__file__).resolve().parents[1] / "microbench"),
]

from dac_batched import capture_decode, codes_for  # noqa: E402
from tts_tools.bench import _prompt, load_bench_model  # noqa: E402

from graphs.runner import DEFAULT_BUCKETS  # noqa: E402
from tts.codec.dac.codec import DACCodec  # noqa: E402
from tts.codec.dac.net import DACConfig  # noqa: E402
from tts.codec.dac.random_init import random_codec_state  # noqa: E402
from tts.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from tts.model.kv_cache import blocks_needed  # noqa: E402
from tts.runtime.codec_stage import codec_stream  # noqa: E402


def codec_call(rows: int, stream: torch.cuda.Stream, eager: bool = False):
    """A batched decode of `rows` streams x 16 frames (random S2-Pro DAC weights) as a callable: its
    captured graph's replay, or with `eager` the decode launched kernel by kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "codec.pth"
        torch.save(random_codec_state(DACConfig(), seed=0), path)
        codec = DACCodec.from_file(path, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream), torch.inference_mode():
        dec = codec.batched_stream(rows)
        dec.dilated_by_phases = True
        slots = torch.arange(rows, device="cuda")
        codes = codes_for(codec, rows, 16, seed=1).to("cuda")
        lengths = torch.full((rows,), 16, dtype=torch.int64, device="cuda")
        graph, _, _ = capture_decode(dec, slots, codes, lengths)
    if not eager:
        return graph.replay

    def decode() -> None:
        with torch.inference_mode():
            dec.decode(slots, codes, lengths)

    return decode


def build_engine(model, rows: int, step_batch: int, stream: torch.cuda.Stream) -> Engine:
    """An engine of `rows` rows with its prefill graphs captured at start-up; with `step_batch`, its
    frame step's graph for that bucket too and `step_batch` requests running (prefilled, never ending)."""
    with torch.cuda.stream(stream):
        config = EngineConfig(
            max_batch=rows,
            max_waiting=rows,
            graphs="startup" if step_batch else "lazy",
            buckets=[step_batch] if step_batch else DEFAULT_BUCKETS,
            prefill_graphs="startup",
            max_context=4096,
            ignore_eos=True,
        )
        engine = Engine(model, config)
        if step_batch:
            params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_new_frames=3000, seed=0)
            for i in range(step_batch):
                engine.submit(_prompt(model, 60, seed=i), params)
            while engine.num_running < step_batch:
                engine.step()
    return engine


def step_ms(engine: Engine, stream: torch.cuda.Stream, reps: int) -> float:
    """Median wall milliseconds of the engine's iteration (a frame step of its running rows, ending
    with the frame's copy to the host: a synchronization), after two untimed ones."""
    walls = []
    with torch.cuda.stream(stream):
        for i in range(reps + 2):
            t = time.perf_counter()
            engine.step()
            if i >= 2:
                walls.append((time.perf_counter() - t) * 1e3)
    return statistics.median(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="60,100", help="prompt lengths (comma list)")
    p.add_argument("--packed", default="1,2,4,8", help="prompts per pass (comma list)")
    p.add_argument("--codec-rows", type=int, default=48)
    p.add_argument("--codec-sms", type=int, default=0, help="the codec on a green context of N SMs (0: all)")
    p.add_argument("--codec-eager", action="store_true", help="launch the codec's kernels, no graph")
    p.add_argument("--step-batch", type=int, default=0, help="also time a frame step of B rows (0: none)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="prefill_beside_codec.json")
    a = p.parse_args()
    packed = [int(k) for k in a.packed.split(",")]
    model = load_bench_model("s2-pro-shape", "cuda", torch.bfloat16)
    high = torch.cuda.Stream(priority=min(torch.cuda.Stream.priority_range()))  # type: ignore[call-arg]
    # (the green context, if any, stays referenced while its stream is used)
    low, _green = codec_stream(torch.device("cuda", torch.cuda.current_device()), a.codec_sms)
    engine = build_engine(model, max(max(packed), a.step_batch), a.step_batch, high)
    runner, allocator, bs = engine.runner, engine.scheduler.allocator, engine.config.block_size
    decode = codec_call(a.codec_rows, low, eager=a.codec_eager)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(low):
        decode()
        start.record()
        decode()
        end.record()
    torch.cuda.synchronize()
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "codec_sms": a.codec_sms or None,
        "codec_eager": a.codec_eager,
        "codec_call_ms": start.elapsed_time(end),
        "runs": [],
    }
    print(f"{report['gpu']}: codec call {a.codec_rows} x 16 frames {report['codec_call_ms']:.2f} ms alone")

    def measure(k: int, T: int) -> tuple[float, float]:
        prompts = [_prompt(model, T + 1, seed=i) for i in range(k)]
        tables = [allocator.allocate(blocks_needed(T + 1, bs)) for _ in prompts]
        walls, device = [], []
        with torch.cuda.stream(high):
            for i in range(a.reps + 2):
                t = time.perf_counter()
                start.record()
                if k > 1:
                    runner.prefill_packed(prompts, tables)
                else:
                    runner.prefill(prompts[0], tables[0])
                end.record()
                high.synchronize()
                if i >= 2:  # (the first two: warm-up)
                    walls.append((time.perf_counter() - t) * 1e3)
                    device.append(start.elapsed_time(end))
        for table in tables:
            allocator.free(table)
        return statistics.median(walls), statistics.median(device)

    stop = threading.Event()

    def codec_load() -> None:
        with torch.cuda.stream(low):
            while not stop.is_set():
                decode()
                low.synchronize()

    for beside in (False, True):
        worker = threading.Thread(target=codec_load, daemon=True)
        if beside:
            worker.start()
            time.sleep(0.2)
        where = "beside the codec" if beside else "alone"
        if a.step_batch:
            wall = step_ms(engine, high, a.reps)
            report["runs"].append({"beside_codec": beside, "step_rows": a.step_batch, "wall_ms": wall})
            print(f"{where}: frame step of {a.step_batch} rows: wall {wall:.2f} ms", flush=True)
        for T in (int(t) for t in a.tokens.split(",")):
            for k in packed:
                wall, device = measure(k, T)
                report["runs"].append(
                    {"beside_codec": beside, "prompts": k, "tokens": T, "wall_ms": wall, "device_ms": device}
                )
                print(f"{where}: {k} x {T} tokens: device {device:.2f} ms, wall {wall:.2f} ms", flush=True)
        if beside:
            stop.set()
            worker.join()
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
