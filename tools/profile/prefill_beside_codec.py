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

from tts.codec.dac.codec import DACCodec  # noqa: E402
from tts.codec.dac.net import DACConfig  # noqa: E402
from tts.codec.dac.random_init import random_codec_state  # noqa: E402
from tts.engine import Engine, EngineConfig  # noqa: E402
from tts.model.kv_cache import blocks_needed  # noqa: E402


def codec_graph(rows: int, stream: torch.cuda.Stream):
    """A captured batched decode of `rows` streams x 16 frames (random S2-Pro DAC weights)."""
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
    return graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="60,100", help="prompt lengths (comma list)")
    p.add_argument("--packed", default="1,2,4,8", help="prompts per pass (comma list)")
    p.add_argument("--codec-rows", type=int, default=48)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="prefill_beside_codec.json")
    a = p.parse_args()
    packed = [int(k) for k in a.packed.split(",")]
    model = load_bench_model("s2-pro-shape", "cuda", torch.bfloat16)
    high = torch.cuda.Stream(priority=min(torch.cuda.Stream.priority_range()))  # type: ignore[call-arg]
    low = torch.cuda.Stream(priority=0)
    with torch.cuda.stream(high):
        config = EngineConfig(
            max_batch=max(packed), graphs="lazy", prefill_graphs="startup", max_context=4096
        )
        engine = Engine(model, config)
    runner, allocator, bs = engine.runner, engine.scheduler.allocator, engine.config.block_size
    graph = codec_graph(a.codec_rows, low)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(low):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    report: dict = {"gpu": torch.cuda.get_device_name(), "codec_call_ms": start.elapsed_time(end), "runs": []}
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
                graph.replay()
                low.synchronize()

    for beside in (False, True):
        worker = threading.Thread(target=codec_load, daemon=True)
        if beside:
            worker.start()
            time.sleep(0.2)
        for T in (int(t) for t in a.tokens.split(",")):
            for k in packed:
                wall, device = measure(k, T)
                report["runs"].append(
                    {"beside_codec": beside, "prompts": k, "tokens": T, "wall_ms": wall, "device_ms": device}
                )
                where = "beside the codec" if beside else "alone"
                print(f"{where}: {k} x {T} tokens: device {device:.2f} ms, wall {wall:.2f} ms", flush=True)
        if beside:
            stop.set()
            worker.join()
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
