"""Which attention heads of a model follow its text? The probe behind a bundle's `tts_runtime.aligner`.

    python training/aligner_probe.py --model default --out training/aligner_probe.json

For each held-out sentence (`samples/eval/heldout.txt`, the first `--sentences`), the model speaks it
(one text chunk, its default voice and sampling, seed 0, loop guard off), then the prompt and the frames
it generated run again teacher-forced through the slow transformer, recording every layer's queries
and keys. For every query head, at every generated frame (the query that produced the frame, as the
frame step computes it), the head's attention over the sentence's text tokens gives:

* `mass`: the share of the head's whole attention that lies on the text (mean over frames);
* `median`: the median token of its attention renormalized over the text; from it `backward`, the
  share of frames whose median moved back by more than 2 tokens, and `reach`, its furthest median over
  the text's length (1.0: it got to the last token; after the last word such heads drift back).

A head that follows the text has mass near 1, few backward moves and a reach near 1. The default model's
layer 3 heads 0 and 2 do (training/RESULTS.md); `tts_runtime.aligner` names them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_tools.evaluate import HELDOUT, read_sentences  # noqa: E402

from tts.api import TTS  # noqa: E402
from tts.engine.aligner import median_token  # noqa: E402
from tts.model.transformer import dense_causal_attend  # noqa: E402


def head_statistics(tts: TTS, text: str) -> tuple[dict, int]:
    """`{(layer, head): (mass, medians [frames])}` for one sentence, as the module docstring says, and
    the length of its text span."""
    job = tts.prepare(text, seed=0)
    [chunk] = job.chunks
    prompt, span = tts.planner.prompt_with_span(chunk, job.references, [], job.params)
    assert span is not None, "the model's prompt format gives no text span"
    codes = tts.synthesize(job).codes  # [N, T]
    model, c = tts.bundle.model, tts.bundle.model.config
    frames = torch.zeros(codes.shape[1], 1 + c.num_codebooks, dtype=torch.int64)
    frames[:, 0] = codes[0] + c.semantic_begin_id
    frames[:, 1:] = codes.T
    sequence = torch.cat([prompt, frames])[None]  # [1, P + T, 1 + N]
    P, T = prompt.shape[0], frames.shape[0]
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend_layer(i):
        def attend(q, k, v):
            recorded[i] = q[0].float(), k[0].float()  # [S, H, D], [S, Hkv, D]
            return dense_causal_attend(q, k, v)

        return attend

    with torch.inference_mode():
        model.slow_layers(model.embed(sequence), model.freqs_cis[: sequence.shape[1]], attend_layer)
    start, end = span
    rows = torch.arange(P - 1, P - 1 + T)  # the query that produced frame t sits at position P - 1 + t
    out = {}
    for layer, (q, k) in recorded.items():
        group = c.n_head // c.n_local_heads
        for h in range(c.n_head):
            scores = (q[rows, h] @ k[:, h // group].T) / c.head_dim**0.5  # [T, S]
            causal = torch.arange(k.shape[0])[None] > rows[:, None]
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            text = probs[:, start:end]
            mass = text.sum(-1)
            medians = median_token(text / mass[:, None])
            out[(layer, h)] = (float(mass.mean()), medians)
    return out, end - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--sentences", type=int, default=20, help="held-out sentences to probe (default 20)")
    ap.add_argument("--out", default=None, help="write the per-head table as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tts = TTS.load(args.model, device="cpu", max_batch=1, loop_guard=False)
    totals: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for text in read_sentences(HELDOUT, args.sentences):
        stats, n = head_statistics(tts, text)
        for key, (mass, medians) in stats.items():
            steps = medians[1:] - medians[:-1]
            backward = float((steps < -2).float().mean()) if len(steps) else 0.0
            reach = float(medians.max()) / max(n - 1, 1)
            totals.setdefault(key, []).append((mass, backward, reach))
    table = []
    for (layer, head), values in sorted(totals.items()):
        mass, backward, reach = (sum(v[i] for v in values) / len(values) for i in range(3))
        table.append(
            {
                "layer": layer,
                "head": head,
                "mass": round(mass, 3),
                "backward": round(backward, 3),
                "reach": round(reach, 3),
            }
        )
        print(f"layer {layer} head {head}: mass {mass:.3f}  backward {backward:.3f}  reach {reach:.3f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"model": args.model, "sentences": args.sentences, "heads": table}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
