"""The loop guard on a GPU: what its aligner costs the frame step, and the long passages read there.

    python tools/gpu/loop_guard_gpu.py bench --device cuda --out bench.json     # frame step with/without
    python tools/gpu/loop_guard_gpu.py speak --device cuda --seeds 0,1 --out long_on.npz [--loop-guard off]
    python tools/gpu/loop_guard_gpu.py score long_on.npz [long_off.npz ...]     # here: Whisper WER, loops

`bench`: the default model's engine on `--device` with CUDA graphs captured at start-up, `--batches`
requests decoding together (prompts of 600 tokens whose last 250 are each row's text span), timed over
`--frames` frame steps after `--warmup` (the guards see every frame, as in serving), with the aligner
heads and without (`loop_guard=False`: the step computes no text position). Wall time per step,
synchronous (each step ends copying its frame to the host), and the repeats the guards found (random
text has no reading order: they rewind far more often than on speech).
`speak`: `tts.api.TTS` synthesizes the held-out passages (`samples/eval/passages.txt`) at each seed as
`tts eval --long` seeds them, and saves their 16-bit PCM, finish reasons and the guard's repeats.
`score`: transcribes saved readings with `tts eval`'s ASR (Whisper tiny.en, one thread) and reports
WER per reading and transcript loops (`tts_tools.evaluate.loops`), for the machine where the tools extra is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PASSAGES = ROOT / "samples/eval/passages.txt"


def bench(args) -> dict:
    from tts.checkpoints.load import load_bundle
    from tts.engine import Engine, EngineConfig, SamplingParams, for_bundle

    bundle = load_bundle("default", device=args.device)
    c = bundle.model.config
    out: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    out["torch"] = torch.__version__
    for guard in (False, True):
        for batch in args.batches:
            cfg = EngineConfig(max_batch=batch, graphs="startup", ignore_eos=True, loop_guard=guard)
            engine = Engine(bundle.model, for_bundle(cfg, bundle))
            g = torch.Generator().manual_seed(0)
            budget = args.warmup + args.frames + 1
            for i in range(batch):
                prompt = torch.zeros(600, 1 + c.num_codebooks, dtype=torch.int64)
                prompt[:, 0] = torch.randint(0, c.semantic_begin_id, (600,), generator=g)
                engine.submit(prompt, SamplingParams(max_new_frames=budget, seed=i), text_span=(349, 599))
            for _ in range(args.warmup):
                engine.step()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            phases = dict(engine.phase_seconds)
            t0 = time.perf_counter()
            for _ in range(args.frames):
                engine.step()
            ms = (time.perf_counter() - t0) / args.frames * 1e3
            # host wall time per step: the frame step until its frame is on the host, then the per-row work
            # (the loop guards' included)
            phase_ms = {
                k: round((engine.phase_seconds[k] - phases[k]) / args.frames * 1e3, 3) for k in phases
            }
            key = f"{'aligner' if guard else 'none'}_b{batch}"
            out[key] = {
                "step_ms": round(ms, 3),
                "frames_per_s_per_stream": round(1e3 / ms, 1),
                "repeats": engine.loop_repeats,  # (random text: the guards find "repeats" and rewind)
                "phase_ms": phase_ms,
            }
            print(key, out[key], flush=True)
            del engine
    return out


def speak(args) -> None:
    from tts_tools.evaluate import read_sentences

    from tts.api import TTS

    tts = TTS.load("default", device=args.device, max_batch=1, loop_guard=args.loop_guard == "on")
    passages = read_sentences(PASSAGES, None, passages=True)
    tts.synthesize("Warm up.", seed=0, max_new_frames=8, min_new_frames=8)
    arrays, meta = {}, []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for i, text in enumerate(passages):
            before = tts.engine.loop_repeats
            r = tts.synthesize(text, seed=seed * 1000 + i)  # (as `tts eval --long` seeds a passage)
            arrays[f"s{seed}_p{i}"] = (np.clip(r.audio, -1, 1) * 32767).astype(np.int16)
            entry = {
                "key": f"s{seed}_p{i}",
                "text": text,
                "rate": r.sample_rate,
                "finish": [f.value for f in r.finish_reasons],
                "repeats": tts.engine.loop_repeats - before,
                "rtf": round(r.rtf, 4),
                "warnings": r.warnings,
            }
            meta.append(entry)
            print(json.dumps({k: v for k, v in entry.items() if k != "text"}), flush=True)
    np.savez_compressed(args.out, meta=json.dumps(meta), **arrays)


def score(args) -> None:
    from tts_tools.evaluate import ASR, loops, wer, words

    asr = ASR(threads=1)
    for path in args.files:
        data = np.load(path)
        meta = json.loads(str(data["meta"]))
        refs, hyps, found, flagged = [], [], 0, 0
        for m in meta:
            audio = data[m["key"]].astype(np.float32) / 32767
            hyp = words(asr.transcribe(audio, m["rate"]))
            ref = words(m["text"])
            lp = loops(ref, hyp)
            refs.append(ref)
            hyps.append(hyp)
            found += len(lp)
            flagged += "loop" in m["finish"]
            print(
                f"{path} {m['key']}: WER {wer([ref], [hyp]):.3f} repeats {m['repeats']} finish "
                f"{m['finish']} loops {lp}"
            )
        print(f"{path}: WER {wer(refs, hyps):.4f} over {len(meta)} readings, {found} transcript loops, "
              f"{flagged} readings with a chunk ending loop")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--device", default="cuda")
    b.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    b.add_argument("--warmup", type=int, default=20)
    b.add_argument("--frames", type=int, default=200)
    b.add_argument("--out", required=True)
    s = sub.add_parser("speak")
    s.add_argument("--device", default="cuda")
    s.add_argument("--seeds", default="0,1")
    s.add_argument("--loop-guard", choices=["on", "off"], default="on")
    s.add_argument("--out", required=True)
    c = sub.add_parser("score")
    c.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "bench":
        Path(args.out).write_text(json.dumps(bench(args), indent=1) + "\n")
    elif args.cmd == "speak":
        speak(args)
    else:
        score(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
