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

* `ends`: the share of readings whose position, fed frame by frame to the runtime's loop guard
  (`tts.engine.aligner.LoopGuard`), was trusted at one of the text's last `END_TOKENS` tokens by the time
  the model stopped: what the runtime's end rule asks before it lets a request end. A reading that ends
  without it would have had its end token refused (and, if refusals cannot mend it, end `short`), so a
  head for `tts_runtime.aligner` wants `ends` near 1 as much as a high reach: a head can follow the text
  and still rest a few tokens short of its end.

A head that follows the text has mass near 1, few backward moves, a reach near 1 and ends near 1. The
default model's layer 3 heads 0 and 2 do (training/RESULTS.md); `tts_runtime.aligner` names them. The
heads the model names are also measured together, as the runtime combines them (their attention
averaged, then its median): the line `named`.
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
from tts.engine.aligner import LoopGuard, median_token  # noqa: E402
from tts.model.config import AlignerSpec  # noqa: E402
from tts.model.transformer import dense_causal_attend  # noqa: E402


def head_statistics(tts: TTS, text: str, named: AlignerSpec | None = None) -> tuple[dict, int]:
    """`{(layer, head): (mass, medians [frames])}` for one sentence, as the module docstring says, and
    the length of its text span. With `named`: also `"named"`: (mass, medians) of those heads combined
    as `tts.engine.aligner.text_alignment` combines them (the mean of their distributions over the
    text, then its median; mass: their mean mass)."""
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
    out: dict = {}
    dists: dict[tuple[int, int], tuple[float, torch.Tensor]] = {}
    for layer, (q, k) in recorded.items():
        group = c.n_head // c.n_local_heads
        for h in range(c.n_head):
            scores = (q[rows, h] @ k[:, h // group].T) / c.head_dim**0.5  # [T, S]
            causal = torch.arange(k.shape[0])[None] > rows[:, None]
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            text = probs[:, start:end]
            mass = text.sum(-1)
            dist = text / mass[:, None]
            out[(layer, h)] = (float(mass.mean()), median_token(dist))
            if named is not None and layer == named.layer and h in named.heads:
                dists[(layer, h)] = (float(mass.mean()), dist)
    if named is not None:
        chosen = [dists[(named.layer, h)] for h in named.heads]
        combined = torch.stack([d for _, d in chosen]).mean(0)
        out["named"] = (sum(m for m, _ in chosen) / len(chosen), median_token(combined))
    return out, end - start


def ends_at_text_end(medians: torch.Tensor, text_tokens: int) -> bool:
    """Whether the runtime's loop guard, fed these per-frame positions (`[frames]`, one reading to its
    end), trusts a position at one of the text's last tokens (`LoopGuard.said_all`): the end rule's test."""
    guard = LoopGuard(text_tokens)
    for position in medians.tolist():
        guard.push(int(position))
    return guard.said_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--sentences", type=int, default=20, help="held-out sentences to probe (default 20)")
    ap.add_argument("--out", default=None, help="write the per-head table as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tts = TTS.load(args.model, device="cpu", max_batch=1, loop_guard=False)
    named = tts.bundle.aligner
    totals: dict = {}
    for text in read_sentences(HELDOUT, args.sentences):
        stats, n = head_statistics(tts, text, named)
        for key, (mass, medians) in stats.items():
            totals.setdefault(key, []).append(reading_statistics(mass, medians, n))
    table = []
    for key in sorted(k for k in totals if k != "named") + (["named"] if named is not None else []):
        values = totals[key]
        mass, backward, reach, ends = (sum(v[i] for v in values) / len(values) for i in range(4))
        if key == "named":
            assert named is not None
            row: dict = {"layer": named.layer, "heads": list(named.heads)}
            label = f"named (layer {named.layer} heads {','.join(map(str, named.heads))})"
        else:
            row = {"layer": key[0], "head": key[1]}
            label = f"layer {key[0]} head {key[1]}"
        row |= {"mass": round(mass, 3), "backward": round(backward, 3), "reach": round(reach, 3)}
        row["ends"] = round(ends, 3)
        table.append(row)
        print(f"{label}: mass {mass:.3f}  backward {backward:.3f}  reach {reach:.3f}  ends {ends:.3f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"model": args.model, "sentences": args.sentences, "heads": table}, indent=1) + "\n"
        )
    return 0


def reading_statistics(mass: float, medians: torch.Tensor, text_tokens: int) -> tuple[float, ...]:
    """One reading's (mass, backward, reach, ends) for one head, as the module docstring defines them."""
    steps = medians[1:] - medians[:-1]
    backward = float((steps < -2).float().mean()) if len(steps) else 0.0
    reach = float(medians.max()) / max(text_tokens - 1, 1)
    return mass, backward, reach, float(ends_at_text_end(medians, text_tokens))


if __name__ == "__main__":
    sys.exit(main())
