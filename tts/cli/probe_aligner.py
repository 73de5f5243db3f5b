"""`tts probe-aligner`: find the attention heads of a checkpoint that follow its text, and record them.

    tts probe-aligner --model /data/my-checkpoint            # probe, print the table, write config.json
    tts probe-aligner --model /data/my-checkpoint --dry-run  # probe and print only

The aligner heads drive the loop guard and measured word timings (`tts.engine.aligner`,
`tts.runtime.timings`). For each probe sentence (built in, or `--texts FILE`, one per line) the model
speaks it (one text chunk, its default voice and sampling, `--seed`, loop guard off), then the prompt and
the frames it generated run again teacher-forced through the slow transformer, recording every layer's
queries and keys. For every query head, at every generated frame (the query that produced the frame):

* `mass`: the share of its attention on the sentence's text tokens (mean over frames);
* `backward`: the share of frames whose median text token (attention renormalized over the text) moved
  back by more than 2 tokens;
* `reach`: its furthest median over the text's length (1.0: it got to the last token).

A head follows the text when mass >= `--min-mass`, backward <= `--max-backward` and reach >=
`--min-reach` (means over the sentences). The layer whose best such head scores highest (mass x (1 -
backward) x reach) is chosen, with its passing heads (at most `--max-heads`, best first). They are written
to the checkpoint's config.json: `tts_runtime.aligner` for the project's own bundles, the top-level
`tts_aligner` key for Fish checkpoints (whose config must keep fish-speech's shape). Exit 1 when no head
passes (nothing written), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

# Sentences the probe speaks by default: plain English of several lengths.
PROBE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "She sells sea shells by the sea shore every summer morning.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "A rainbow is a division of white light into many beautiful colors.",
    "When the sunlight strikes raindrops in the air, they act as a prism and form a rainbow.",
    "We will meet at the station at half past nine tomorrow.",
    "Reading a good book on a quiet evening is one of life's simple pleasures.",
    "The committee decided to postpone the meeting until next week.",
)


@dataclass
class HeadScore:
    """One query head's means over the probe sentences (see the module docstring)."""

    layer: int
    head: int
    mass: float
    backward: float
    reach: float

    @property
    def score(self) -> float:
        return self.mass * (1.0 - self.backward) * self.reach


def head_statistics(tts, text: str, seed: int, max_frames: int) -> tuple[dict, int]:
    """`{(layer, head): (mass, medians [frames])}` for one sentence, and the length of its text span.
    tts: a `tts.api.TTS` whose engine runs without the loop guard."""
    import torch

    from tts.engine.aligner import median_token
    from tts.model.transformer import dense_causal_attend

    job = tts.prepare(text, seed=seed, max_new_frames=max_frames)
    chunk = job.chunks[0]
    prompt, span = tts.planner.prompt_with_span(chunk, job.references, [], job.params)
    if span is None:
        raise ValueError("the model's prompt format gives no text span: it cannot have aligner heads")
    job.chunks, job.budgets = [chunk], job.budgets[:1]
    codes = tts.synthesize(job).codes  # [N, T]
    model, c = tts.bundle.model, tts.bundle.model.config
    frames = torch.zeros(codes.shape[1], 1 + c.num_codebooks, dtype=torch.int64)
    frames[:, 0] = codes[0] + c.semantic_begin_id
    frames[:, 1:] = codes.T
    sequence = torch.cat([prompt, frames])[None].to(model.embeddings.weight.device)
    P, T = prompt.shape[0], frames.shape[0]
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend_layer(i):
        def attend(q, k, v):
            recorded[i] = q[0].float().cpu(), k[0].float().cpu()  # [S, H, D], [S, Hkv, D]
            return dense_causal_attend(q, k, v)

        return attend

    with torch.inference_mode():
        model.slow_layers(model.embed(sequence), model.freqs_cis[: sequence.shape[1]], attend_layer)
    start, end = span
    rows = torch.arange(P - 1, P - 1 + T)  # the query that produced frame t sits at position P - 1 + t
    out = {}
    group = c.n_head // c.n_local_heads
    for layer, (q, k) in recorded.items():
        for h in range(c.n_head):
            scores = (q[rows, h] @ k[:, h // group].T) / c.head_dim**0.5  # [T, S]
            causal = torch.arange(k.shape[0])[None] > rows[:, None]
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            text_probs = probs[:, start:end]
            mass = text_probs.sum(-1)
            medians = median_token(text_probs / mass[:, None].clamp(min=1e-12))
            out[(layer, h)] = (float(mass.mean()), medians)
    return out, end - start


def probe(tts, texts: list[str], seed: int = 0, max_frames: int = 400) -> list[HeadScore]:
    """Every slow-AR query head's scores, means over `texts` (sorted by layer, head)."""
    totals: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
    for text in texts:
        stats, n = head_statistics(tts, text, seed, max_frames)
        for key, (mass, medians) in stats.items():
            steps = medians[1:] - medians[:-1]
            backward = float((steps < -2).float().mean()) if len(steps) else 0.0
            reach = float(medians.max()) / max(n - 1, 1) if len(medians) else 0.0
            totals.setdefault(key, []).append((mass, backward, reach))
    table = []
    for (layer, head), values in sorted(totals.items()):
        mass, backward, reach = (sum(v[i] for v in values) / len(values) for i in range(3))
        table.append(HeadScore(layer, head, mass, backward, reach))
    return table


def choose(
    table: list[HeadScore], min_mass: float, max_backward: float, min_reach: float, max_heads: int
) -> tuple[int, list[int]] | None:
    """The aligner (layer, heads) from a probe's table, or None when no head passes."""
    passing = [h for h in table if h.mass >= min_mass and h.backward <= max_backward and h.reach >= min_reach]
    if not passing:
        return None
    best = max(passing, key=lambda h: (h.score, -h.layer, -h.head))
    heads = sorted((h for h in passing if h.layer == best.layer), key=lambda h: -h.score)[:max_heads]
    return best.layer, sorted(h.head for h in heads)


def record(directory: Path, layer: int, heads: list[int]) -> Path:
    """Write the aligner into `directory/config.json` (see the module docstring); returns its path."""
    from tts.checkpoints.bundle import RUNTIME_KEY
    from tts.checkpoints.fish.loader import FISH_ALIGNER_KEY

    path = directory / "config.json"
    raw = json.loads(path.read_text())
    value = {"layer": layer, "heads": heads}
    if RUNTIME_KEY in raw:
        raw[RUNTIME_KEY]["aligner"] = value
    else:
        raw[FISH_ALIGNER_KEY] = value
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(raw, indent=2) + "\n")
    tmp.replace(path)
    return path


def cmd_probe_aligner(args: argparse.Namespace) -> int:
    import torch

    from tts.api import TTS
    from tts.cli.main import UserError

    directory = Path(args.model)
    if not (directory / "config.json").is_file():
        raise UserError(f"--model: {directory} is not a checkpoint directory (no config.json)")
    if args.sentences < 1 or args.max_heads < 1 or args.max_frames < 2:
        raise UserError("--sentences, --max-heads must be >= 1 and --max-frames >= 2")
    if args.texts:
        try:
            texts = [t.strip() for t in Path(args.texts).read_text().splitlines() if t.strip()]
        except OSError as exc:
            raise UserError(f"--texts: {exc}") from exc
        if not texts:
            raise UserError(f"--texts: {args.texts} has no sentence")
    else:
        texts = list(PROBE_SENTENCES)
    texts = texts[: args.sentences]
    torch.set_num_threads(max(1, args.threads))
    tts = TTS.load(str(directory), device=args.device, max_batch=1, loop_guard=False)
    try:
        table = probe(tts, texts, args.seed, args.max_frames)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    finally:
        tts.close()
    for h in table:
        print(
            f"layer {h.layer} head {h.head}: mass {h.mass:.3f}  backward {h.backward:.3f}  reach "
            f"{h.reach:.3f}"
        )
    chosen = choose(table, args.min_mass, args.max_backward, args.min_reach, args.max_heads)
    if chosen is None:
        print("no head follows the text at these thresholds; nothing written")
        return 1
    layer, heads = chosen
    print(f"aligner: layer {layer} heads {','.join(map(str, heads))}")
    if not args.dry_run:
        print(f"wrote {record(directory, layer, heads)}")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "probe-aligner",
        help="find a checkpoint's attention heads that follow the text and record them in its config",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model", required=True, help="checkpoint directory (its config.json is updated)")
    p.add_argument("--texts", default=None, help="probe sentences, one per line (default: built in)")
    p.add_argument("--sentences", type=int, default=8, help="sentences to probe (default 8)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--max-frames", type=int, default=400, help="frames per sentence at most (default 400)")
    p.add_argument("--min-mass", type=float, default=0.5, help="attention share on the text (default 0.5)")
    p.add_argument("--max-backward", type=float, default=0.1, help="share of backward moves (default 0.1)")
    p.add_argument("--min-reach", type=float, default=0.8, help="furthest median / text length (default 0.8)")
    p.add_argument("--max-heads", type=int, default=4, help="heads recorded at most (default 4)")
    p.add_argument("--device", default="cpu", help="device to run on (default cpu)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--dry-run", action="store_true", help="print the table and the choice; write nothing")
    p.set_defaults(func=cmd_probe_aligner)
