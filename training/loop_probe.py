"""Can a loop guard look at the semantic codes alone? A probe on the long held-out passages.

For each passage of `samples/eval/passages.txt` and each seed, synthesize it (default voice, default
sampling, CPU), find the transcript's loops (`tts_tools.evaluate.loops`, Whisper tiny.en) and measure how much
the semantic codes (codebook 0) repeat themselves: for every lag p of 8 to 100 frames (0.4 to 4.6 s), the
largest share of frames t in a window of 2p frames whose code equals the code p frames earlier, over windows
with more than 6 distinct codes (so silence does not count). A loop that a token check could catch would show
a high share at the loop's period in the passages with loops and not in the others.

    python training/loop_probe.py --out loop_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_tools.evaluate import ASR, loops, read_sentences, words  # noqa: E402

from tts.api import TTS  # noqa: E402


def repetition(codes: list[int], min_lag: int = 8, max_lag: int = 100) -> dict:
    """The best (share, lag, start frame) of codes equal to the code `lag` frames earlier, over windows
    of 2 x lag frames holding more than 6 distinct codes."""
    c = np.asarray(codes)
    best = {"share": 0.0, "lag": None, "start": None}
    for p in range(min_lag, max_lag + 1):
        w = 2 * p
        if len(c) - p < w:
            break
        equal = np.concatenate([[0], np.cumsum(c[p:] == c[:-p])])
        shares = (equal[w:] - equal[:-w]) / w
        for t in np.argsort(shares)[::-1][:8]:
            if len(set(c[t + p : t + p + w].tolist())) > 6:
                if shares[t] > best["share"]:
                    best = {"share": float(shares[t]), "lag": p, "start": int(t)}
                break
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tts, asr = TTS.load("default", device="cpu"), ASR(threads=1)
    passages = read_sentences(ROOT / "samples/eval/passages.txt", None, passages=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for i, text in enumerate(passages):
            result = tts.synthesize(text, seed=seed)
            found = loops(words(text), words(asr.transcribe(result.audio, result.sample_rate)))
            rep = repetition(result.codes[0].tolist())
            rows.append({"seed": seed, "passage": i, "frames": result.frames, "loops": found, **rep})
            print(f"seed {seed} passage {i}: {len(found)} loops {found}; codes repeat at most "
                  f"{rep['share']:.2f} (lag {rep['lag']} frames)", flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
