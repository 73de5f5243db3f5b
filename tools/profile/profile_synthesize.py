"""Where `tts synthesize` spends its wall time: load, the first synthesis, warm syntheses, and a profile.

    python tools/profile/profile_synthesize.py --model default --device cuda --out synth.txt

Loads the model as `tts synthesize` does (one stream, graphs captured at start-up), then synthesizes
the same sentence --repeats times with seeds 0, 1, ... and prints each call's wall time, audio seconds,
RTF (wall / audio) and time to first audio; then profiles one more call (torch.profiler, CPU and CUDA)
and writes the top operators by CPU and by device time to --out.
"""

import argparse
import sys
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tts.api import TTS  # noqa: E402
from tts.checkpoints.load import load_bundle  # noqa: E402
from tts.engine import EngineConfig  # noqa: E402

TEXT = "Please call Stella and ask her to bring these things."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cuda")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    t0 = time.perf_counter()
    bundle = load_bundle(args.model, device=args.device)
    t1 = time.perf_counter()
    tts = TTS(bundle, EngineConfig(max_batch=1, graphs="startup"))
    t2 = time.perf_counter()
    print(f"load {t1 - t0:.3f} s, engine + capture {t2 - t1:.3f} s ({bundle.describe()})")
    for seed in range(args.repeats):
        r = tts.synthesize(args.text, seed=seed)
        print(
            f"seed {seed}: {r.frames} frames, {r.audio_seconds:.2f} s audio, wall {r.wall_seconds:.3f} s, "
            f"RTF {r.rtf:.4f}, first audio {1e3 * (r.first_audio_seconds or 0):.1f} ms"
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        r = tts.synthesize(args.text, seed=0)
    print(f"profiled: wall {r.wall_seconds:.3f} s, RTF {r.rtf:.4f}")
    lines = [f"profiled call: {r.frames} frames, wall {r.wall_seconds:.3f} s, RTF {r.rtf:.4f}"]
    averages = prof.key_averages()
    lines.append(averages.table(sort_by="cpu_time_total", row_limit=30))
    if args.device.startswith("cuda"):
        lines.append(averages.table(sort_by="self_cuda_time_total", row_limit=20))
    text = "\n".join(lines)
    if args.out:
        args.out.write_text(text)
    print(text[:6000])
    tts.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
