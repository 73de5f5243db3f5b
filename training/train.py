"""Train the default voice: a small `tts.model.transformer.DualARTransformer` on the corpus codes
(training/corpus.py).

Inputs (`--data`, the `codes/` folder of the corpus work directory, plus `codec/codec.json`):
`codes-XXXX.pt` shards (per utterance: phoneme token ids, codec codes `[N, T]`, speaker, split) and
`tokenizer.json`. Needs only torch, safetensors and tokenizers (no espeak-ng, phonemizer or soundfile),
so it runs on a bare GPU machine.

Every training example is a real inference prompt built by `tts.text.prompt.S2PromptFormat` (Fish S2
layout, docs/fish_dual_ar.md §3.2) followed by the target frames and `<|im_end|>`:
* speaker 0 (the default voice), half the time: no reference (what `tts synthesize` without a voice
  sends);
* otherwise: a reference clip of the same speaker (its phonemes + codes) in the system message, as in
  Fish voice cloning;
* independently, `--history-rate` of examples (default 15%) also carry an earlier turn of the same
  speaker: another utterance's text and codes, of at most `--history-frames` frames (default 110), as
  the runtime sends the previous text chunk (up to 200 bytes, several sentences) with every later one
  of a long text. The shipped model was trained with the defaults; the next one (with the corpus's
  `--paragraphs` utterances) is meant to see chunk-length history often, e.g. `--history-rate 0.5
  --history-frames 320`.
Loss: cross-entropy of the slow head over [semantic tokens + <|im_end|>] (what the runtime samples
from) at every target position, plus the fast head's cross-entropy over codebooks 1..N-1 at every
target frame (codebook 0 is derived from the main token, docs/fish_dual_ar.md §1.4). With
`--end-weight` / `--tail-frames` and `--tail-weight` the slow loss weighs each utterance's end token and
its last frames more (end-of-speech modelling; `val_slow` stays the unweighted loss).

Resumable: `--resume DIR` starts from a weights directory written by an earlier run (model shards +
`train_state.json`: step and schedule; the optimizer moments restart, with a short warm-up) or from
a full `checkpoint.pt` when one is there; give every run the same `--schedule-seconds` so that the
runs make one learning-rate schedule (each call of a GPU machine is at most 10 minutes). Stops by
itself after `--max-seconds` of wall time and then writes, into `--out`: the model weights as bf16
safetensors shards under 15 MB each, `config.json`, `train_state.json`, `loss.csv`; with
`--full-checkpoint PATH` also a full fp32 + optimizer checkpoint.

    python training/train.py --data training/work/codes --codec training/work/codec --out OUT \
        --max-seconds 420 --batch-tokens 65536
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts.checkpoints.bundle import save_weights  # noqa: E402
from tts.model.config import ModelArgs  # noqa: E402
from tts.model.transformer import DualARTransformer, TransformerBlock, dense_causal_attend  # noqa: E402
from tts.text.prompt import S2PromptFormat, Turn, VoiceReference  # noqa: E402
from tts.text.tokenizer import TextTokenizer  # noqa: E402

MAX_REF_FRAMES = 110  # reference clips up to ~5 s
MAX_LEN = 1024


def model_config(tokenizer: TextTokenizer, num_codebooks: int, codebook_size: int, size: str) -> ModelArgs:
    """The default model's architecture (Fish S2 features: qk-norm, tied head, scaled codebook sums,
    post-norm fast input, GQA)."""
    shapes = {
        # The shipped default (CPU speed: the fast AR runs once per codebook, so it is kept narrow).
        "fast": dict(
            n_layer=4,
            dim=384,
            n_head=6,
            n_local_heads=2,
            intermediate_size=1024,
            n_fast_layer=1,
            fast_dim=256,
            fast_n_head=4,
            fast_n_local_heads=2,
            fast_head_dim=64,
            fast_intermediate_size=768,
        ),
        "small": dict(n_layer=6, dim=384, n_head=6, n_local_heads=2, intermediate_size=1152, n_fast_layer=1),
        "base": dict(n_layer=8, dim=448, n_head=7, n_local_heads=1, intermediate_size=1344, n_fast_layer=1),
        "test": dict(n_layer=2, dim=128, n_head=2, n_local_heads=1, intermediate_size=256, n_fast_layer=1),
    }
    # "fast" with 3 slow layers: a quarter less slow-AR work per frame for CPU speed (the RTF
    # target); trained from "fast" with `--init-from` (its first 3 layers, all other weights).
    shapes["fast3"] = {**shapes["fast"], "n_layer": 3}
    shape = shapes[size]
    dim, heads = shape["dim"], shape["n_head"]
    return ModelArgs(
        model_type="dual_ar",
        vocab_size=tokenizer.vocab_size,
        head_dim=dim // heads,
        rope_base=1e4,
        norm_eps=1e-6,
        max_seq_len=2048,
        tie_word_embeddings=True,
        attention_qk_norm=True,
        codebook_size=codebook_size,
        num_codebooks=num_codebooks,
        semantic_begin_id=tokenizer.semantic_begin_id,
        semantic_end_id=tokenizer.semantic_end_id,
        scale_codebook_embeddings=True,
        norm_fastlayer_input=True,
        eos_token_id=tokenizer.eos_id,
        **shape,
    )


# ---- data ------------------------------------------------------------------------------------------


def shard_paths(data: Path) -> list[Path]:
    """The `codes-XXXX.pt` shards of a codes folder, in order."""
    return sorted(data.glob("codes-*.pt"))


def iter_shards(data: Path):
    """Every utterance of every shard (all splits), shard by shard; `list()` of it builds several
    `Corpus` from one read."""
    return (u for path in shard_paths(data) for u in torch.load(path))


class Corpus:
    """Utterances from the codes shards, and prompt assembly into frame columns `[T, 1 + N]`."""

    def __init__(
        self,
        data: Path,
        num_codebooks: int,
        limit: int | None = None,
        split: str = "train",
        utterances: list[dict] | None = None,
        history_rate: float = 0.15,
        history_frames: int = MAX_REF_FRAMES,
        ref_min_frames: int = 0,
    ):
        """The first `limit` utterances of `split` in the shards of `data` (read lazily, up to the limit),
        or in `utterances` when the caller read the shards already (`iter_shards`). history_rate: the
        share of examples with an earlier turn; history_frames: that turn's longest utterance, in
        frames; ref_min_frames: a reference clip's shortest (the defaults are the shipped model's)."""
        if not 0.0 <= history_rate <= 1.0:
            raise ValueError(f"history_rate must be within [0, 1], got {history_rate}")
        self.history_rate = history_rate
        self.tokenizer = TextTokenizer.from_file(data / "tokenizer.json")
        self.fmt = S2PromptFormat(self.tokenizer, num_codebooks)
        self.N = num_codebooks
        source = utterances if utterances is not None else iter_shards(data)
        items = []
        for u in source:
            if u["split"] == split:
                items.append(u)
                if limit and len(items) >= limit:
                    break
        self.items = items
        for u in self.items:
            u["codes"] = u["codes"][:num_codebooks].long()
            u["text"] = self.tokenizer.decode(u["tokens"].long().tolist())
        self.by_speaker: dict[int, list[int]] = {}
        for i, u in enumerate(self.items):
            self.by_speaker.setdefault(u["speaker"], []).append(i)
        self.short = {  # reference candidates
            s: [i for i in ids if self.items[i]["codes"].shape[1] >= ref_min_frames]
            for s, ids in self._up_to(MAX_REF_FRAMES).items()
        }
        if split == "train" and (none := sorted(s for s, ids in self.short.items() if not ids)):
            raise ValueError(
                f"speakers {none} have no reference clip of {ref_min_frames}-{MAX_REF_FRAMES} frames"
            )
        self.history_pool = self._up_to(history_frames)
        self.seconds = sum(u["seconds"] for u in self.items)

    def example(self, i: int, r: random.Random) -> tuple[torch.Tensor, int]:
        """Frame columns of one training example and the index where the target frames start."""
        u = self.items[i]
        spk = u["speaker"]
        refs, history = [], []
        if not (spk == 0 and r.random() < 0.5):
            j = r.choice(self.short[spk])
            if j == i:
                j = r.choice(self.short[spk])
            refs = [VoiceReference(self.items[j]["codes"], self.items[j]["text"])]
        if r.random() < self.history_rate and self.history_pool.get(spk):
            k = r.choice(self.history_pool[spk])
            history = [Turn(self.items[k]["text"], self.items[k]["codes"])]
        return self.columns(i, refs, history)

    def _up_to(self, frames: int) -> dict[int, list[int]]:
        """Per speaker, the indices of its utterances of at most `frames` frames."""
        return {
            s: [i for i in ids if self.items[i]["codes"].shape[1] <= frames]
            for s, ids in self.by_speaker.items()
        }

    def columns(self, i: int, refs: list[VoiceReference], history: list[Turn]) -> tuple[torch.Tensor, int]:
        """Prompt (with `refs` and `history`) + utterance i's frames + `<|im_end|>`, and the target start."""
        u = self.items[i]
        prompt = self.fmt.build(u["text"], refs, history)
        codes = u["codes"]
        target = torch.empty(codes.shape[1] + 1, 1 + self.N, dtype=torch.int64)
        target[:-1, 0] = codes[0] + self.tokenizer.semantic_begin_id
        target[:-1, 1:] = codes.T
        target[-1] = 0
        target[-1, 0] = self.tokenizer.eos_id
        return torch.cat([prompt, target]), prompt.shape[0]

    def batch(self, r: random.Random, batch_tokens: int, device) -> dict:
        """Random examples packed up to `batch_tokens` (padded) tokens, similar lengths together."""
        pool = [self.example(r.randrange(len(self.items)), r) for _ in range(max(8, batch_tokens // 300))]
        pool = [p for p in pool if p[0].shape[0] <= MAX_LEN]
        pool.sort(key=lambda p: p[0].shape[0])
        start = r.randrange(len(pool))
        chosen, longest = [], 0
        for p in pool[start:] + pool[:start][::-1]:
            longest2 = max(longest, p[0].shape[0])
            if chosen and longest2 * (len(chosen) + 1) > batch_tokens:
                break
            chosen.append(p)
            longest = longest2
        return self.pack(chosen, device)

    def pack(self, chosen: list[tuple[torch.Tensor, int]], device) -> dict:
        """Examples (frame columns, target start) -> padded batch: frames `[B, T, 1 + N]`, mask `[B, T]`."""
        B, T = len(chosen), max(cols.shape[0] for cols, _ in chosen)
        frames = torch.zeros(B, T, 1 + self.N, dtype=torch.int64)
        target_mask = torch.zeros(B, T, dtype=torch.bool)  # position t predicts the column at t + 1
        for b, (cols, start) in enumerate(chosen):
            frames[b, : cols.shape[0]] = cols
            target_mask[b, start - 1 : cols.shape[0] - 1] = True
        return {"frames": frames.to(device), "mask": target_mask.to(device)}


# ---- loss ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EndWeights:
    """How much the slow head's loss counts at the end of each utterance (1 everywhere by default):
    `end` at the `<|im_end|>` target (where the model learns to stop), `tail` at the last `tail_frames`
    audio frames before it (the last syllables, which a model that ends early or trails off gets
    wrong). The slow loss is then the weighted mean over targets; the held-out loss stays unweighted."""

    end: float = 1.0
    tail: float = 1.0
    tail_frames: int = 0

    def active(self) -> bool:
        return self.end != 1.0 or (self.tail != 1.0 and self.tail_frames > 0)


def target_weights(m: torch.Tensor, is_end: torch.Tensor, weights: EndWeights) -> torch.Tensor:
    """Per-target weights of the slow loss, `[M]` float32 in the order of `m`'s True entries.

    m `[B, T]` bool: the target positions of each row (one utterance a row: its frames, then its end
    token); is_end `[M]` bool: which of those targets is `<|im_end|>`. A target's distance from its
    row's last target (0 at the end token) is counted along the row, so the `tail_frames` targets before
    the end token get `tail` and the end token `end`."""
    after = m.flip(1).cumsum(1).flip(1) - 1  # [B, T]: targets after this one in its row
    distance = after[m]
    w = torch.ones(distance.shape, dtype=torch.float32, device=m.device)
    if weights.tail_frames > 0:
        w = torch.where((distance >= 1) & (distance <= weights.tail_frames), weights.tail, w)
    return torch.where(is_end, weights.end, w)


def compute_loss(
    model: DualARTransformer, frames: torch.Tensor, mask: torch.Tensor, weights: EndWeights | None = None
) -> tuple[torch.Tensor, dict]:
    """Teacher-forced loss of the slow and fast heads (same math as `DualARTransformer.forward`, but the
    slow head restricted to [semantic ids + <|im_end|>] and the fast AR run only where a frame follows).

    frames `[B, T, 1 + N]`, mask `[B, T]` (True where position t's next column is a target). weights:
    the slow loss's weights at each utterance's end (`EndWeights`; None: every target counts once).
    The returned `slow` is always the unweighted mean, comparable across runs.
    """
    c = model.config
    B, T, _ = frames.shape
    x = model.embed(frames)
    h_pre, h_post = model.slow_layers(x, model.freqs_cis[:T], lambda i: dense_causal_attend)
    head = model.lm_head_weight()
    sem_head = torch.cat(
        [head[c.semantic_begin_id : c.semantic_end_id + 1], head[c.eos_token_id : c.eos_token_id + 1]]
    )
    nxt = frames[:, 1:]  # next columns [B, T-1, 1+N]
    m = mask[:, :-1]
    tok = nxt[..., 0][m]
    n_sem = c.semantic_end_id - c.semantic_begin_id + 1
    tgt = torch.where(tok == c.eos_token_id, n_sem, tok - c.semantic_begin_id)
    logits = F.linear(h_post[:, :-1][m], sem_head).float()
    slow_loss = F.cross_entropy(logits, tgt)
    slow_objective = slow_loss
    if weights is not None and weights.active():
        w = target_weights(m, tok == c.eos_token_id, weights)
        slow_objective = (F.cross_entropy(logits, tgt, reduction="none") * w).sum() / w.sum()
    # Fast AR on positions whose next column is an audio frame.
    audio = m & (nxt[..., 0] != c.eos_token_id)
    codes = nxt[..., 1:][audio]  # [M, N]
    hidden = model.fast_input(h_pre[:, :-1][audio], h_post[:, :-1][audio])
    n = c.num_codebooks
    fast_in = torch.cat([hidden.unsqueeze(1), model.fast_embeddings(codes[:, :-1])], dim=1)
    y = model.fast_layers_forward(fast_in, model.fast_freqs_cis[:n], lambda i: dense_causal_attend)
    fast_logits = model.fast_logits(y[:, 1:]).float()  # predicts codes 1..N-1
    fast_loss = F.cross_entropy(fast_logits.reshape(-1, fast_logits.shape[-1]), codes[:, 1:].reshape(-1))
    with torch.no_grad():
        acc0 = (logits.argmax(-1) == tgt).float().mean()
    loss = slow_objective + fast_loss
    # Detached tensors: reading them (a GPU sync) is left to the logging steps.
    return loss, {"slow": slow_loss.detach(), "fast": fast_loss.detach(), "acc0": acc0, "frames": audio.sum()}


@torch.no_grad()
def heldout_loss(model: DualARTransformer, heldout: Corpus, device: torch.device) -> dict:
    """Slow/fast loss and main-token accuracy on the held-out utterances (corpus split "heldout": never
    trained on), each prompted without a reference, as `tts synthesize` with no voice. Plain eager."""
    was_training = model.training
    model.eval()
    b = heldout.pack([heldout.columns(i, [], []) for i in range(len(heldout.items))], device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        _, info = compute_loss(model, b["frames"], b["mask"])
    model.train(was_training)
    return {
        "val_slow": round(float(info["slow"]), 5),
        "val_fast": round(float(info["fast"]), 5),
        "val_acc0": round(float(info["acc0"]), 5),
    }


# ---- main ------------------------------------------------------------------------------------------


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of `peak` as `progress` goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def schedule_progress(
    steps_done: int,
    steps_left: int,
    seconds: float,
    budget: float,
    trained_seconds: float = 0.0,
    schedule_seconds: float | None = None,
) -> float:
    """How far along the cosine decay is (0 -> 1): by this run's steps of its `steps_left`, or by time,
    whichever is further. By time: with `schedule_seconds`, the training seconds of every run so far
    (`trained_seconds` of the resumed runs + this run's `seconds`) over it, so that runs resumed over
    several GPU calls make one schedule; without, this run's seconds over its own `budget`."""
    by_time = (trained_seconds + seconds) / schedule_seconds if schedule_seconds else seconds / budget
    return max(steps_done / max(1, steps_left), by_time)


class Batches(torch.utils.data.IterableDataset):
    """Endless training batches. Prompt assembly is Python work, so a `DataLoader` runs this in
    `--workers` processes (each with its own random stream) while the GPU trains."""

    def __init__(self, corpus: Corpus, seed: int, batch_tokens: int):
        self.corpus, self.seed, self.batch_tokens = corpus, seed, batch_tokens

    def __iter__(self):
        """Yields dicts of CPU tensors: frames `[B, T, 1 + N]` int64, mask `[B, T]` bool."""
        info = torch.utils.data.get_worker_info()
        r = random.Random(self.seed * 7919 + (info.id if info else 0))
        while True:
            yield self.corpus.batch(r, self.batch_tokens, "cpu")


def batch_loader(corpus: Corpus, seed: int, batch_tokens: int, workers: int):
    """Iterator over batches (dicts of CPU tensors); `workers` = 0 builds them in this process."""
    ds = Batches(corpus, seed, batch_tokens)
    if workers == 0:
        return iter(ds)
    return iter(
        torch.utils.data.DataLoader(
            ds,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=4,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=True,
        )
    )


def add_residual_dropout(model: DualARTransformer, p: float) -> None:
    """Dropout with rate `p` on the output of every block's attention and feed-forward branch, before it is
    added to the residual stream ("residual dropout": Vaswani et al., "Attention Is All You Need", 2017,
    section 5.4), in the slow and the fast transformer. Forward hooks, so the model's code and its saved
    weights are untouched; active only while the model is in training mode (the held-out loss and
    inference see none). Raises ValueError unless 0 <= p < 1."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")

    def hook(module: torch.nn.Module, _args, out: torch.Tensor) -> torch.Tensor:
        return F.dropout(out, p, module.training)

    for block in model.modules():
        if isinstance(block, TransformerBlock):
            block.attention.register_forward_hook(hook)
            block.feed_forward.register_forward_hook(hook)


def init_from(model: DualARTransformer, folder: Path) -> None:
    """Copy the weights of the model in `folder` (safetensors shards) into `model` wherever a name and
    shape match; prints what was dropped (names `model` lacks) and what keeps its random init."""
    from safetensors.torch import load_file

    from tts.checkpoints.bundle import weight_files

    source = {}
    for f in weight_files(folder):
        source.update(load_file(str(f)))
    own = model.state_dict()
    matched = {k: v.float() for k, v in source.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(matched, strict=False)
    dropped = sorted(set(source) - set(matched))
    fresh = sorted(set(own) - set(matched))
    print(
        f"init from {folder}: {len(matched)} tensors; dropped {dropped or 'none'}; fresh {fresh or 'none'}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="the corpus codes/ folder")
    p.add_argument("--codec", type=Path, required=True, help="folder with codec.json (+ codec.safetensors)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="fast", choices=["fast", "fast3", "small", "base", "test"])
    p.add_argument("--workers", type=int, default=8, help="batch-building processes (0: in the main process)")
    p.add_argument("--num-codebooks", type=int, default=None, help="default: the codec's")
    p.add_argument("--steps", type=int, default=100_000, help="stop after this many steps")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=420,
        help="stop and save after this wall time; the cosine decay follows max(step/steps, time/max-seconds)",
    )
    p.add_argument(
        "--schedule-seconds",
        type=float,
        default=None,
        help="training seconds one learning-rate schedule spans, summed over resumed runs (give every run "
        "the same value); default: each run decays over its own --max-seconds",
    )
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--limit", type=int, default=None, help="use only this many utterances (CPU tests)")
    p.add_argument(
        "--history-rate",
        type=float,
        default=0.15,
        help="share of examples whose prompt carries an earlier turn of the same speaker (text + codes), "
        "as the runtime sends the previous chunk of a long text (default 0.15, the shipped model's)",
    )
    p.add_argument(
        "--history-frames",
        type=int,
        default=MAX_REF_FRAMES,
        help=f"longest earlier turn, in frames (default {MAX_REF_FRAMES}, ~5 s; a 200-byte chunk is up to "
        "~15 s, 320)",
    )
    p.add_argument(
        "--ref-min-frames",
        type=int,
        default=0,
        help="shortest reference clip, in frames (default 0, the shipped model's; a corpus of one-word "
        "utterances wants references like the preset voices' 2.5-4.5 s, e.g. 43 = 2 s)",
    )
    p.add_argument("--resume", type=Path, default=None)
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this model folder's weights wherever name and shape match (e.g. a deeper model "
        "whose extra layers are dropped); a fresh run otherwise (step 0, warm-up, new optimizer)",
    )
    p.add_argument(
        "--full-checkpoint", type=Path, default=None, help="also save/resume fp32 + optimizer here"
    )
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="residual dropout rate in every transformer block while training (default 0: none; the "
        "flite model's slow head overfit without it, training/RESULTS.md)",
    )
    p.add_argument(
        "--end-weight",
        type=float,
        default=1.0,
        help="weight of the slow loss at each utterance's end token, where the model learns to stop "
        "(default 1: as every other target)",
    )
    p.add_argument(
        "--tail-frames",
        type=int,
        default=0,
        help="the last this many frames before each end token weigh --tail-weight in the slow loss "
        "(default 0: none)",
    )
    p.add_argument("--tail-weight", type=float, default=1.0, help="see --tail-frames (default 1)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--val-every", type=int, default=500, help="held-out loss every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the loss (default: on CUDA); about 1 min to compile, then ~2x faster steps",
    )
    a = p.parse_args()
    if not 0.0 <= a.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {a.dropout}")
    if not (0 < a.end_weight < math.inf and 0 < a.tail_weight < math.inf and a.tail_frames >= 0):
        p.error("--end-weight and --tail-weight must be finite and above 0, --tail-frames at least 0")
    t_start = time.time()
    torch.manual_seed(a.seed)
    codec_cfg = json.loads((a.codec / "codec.json").read_text())
    N = a.num_codebooks or codec_cfg["num_codebooks"]
    utterances = list(iter_shards(a.data))  # one read for the training and the held-out utterances
    corpus = Corpus(
        a.data,
        N,
        a.limit,
        utterances=utterances,
        history_rate=a.history_rate,
        history_frames=a.history_frames,
        ref_min_frames=a.ref_min_frames,
    )
    heldout = Corpus(a.data, N, split="heldout", utterances=utterances)
    print(f"corpus: {len(corpus.items)} utterances, {corpus.seconds / 3600:.1f} h, {N} codebooks", flush=True)
    args = model_config(corpus.tokenizer, N, codec_cfg["codebook_size"], a.size)
    device = torch.device(a.device)
    model = DualARTransformer(args).to(device)
    for name, prm in model.named_parameters():
        if prm.dim() > 1:
            torch.nn.init.normal_(
                prm,
                std=0.02 / (math.sqrt(2 * args.n_layer) if name.endswith(("wo.weight", "w2.weight")) else 1),
            )
    step, history, trained_seconds = 0, [], 0.0  # (trained_seconds: by the runs this one resumes)
    opt = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.05, fused=device.type == "cuda"
    )
    rewarm = False
    if a.full_checkpoint and a.full_checkpoint.is_file():
        ck = torch.load(a.full_checkpoint, map_location=device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, history, trained_seconds = ck["step"], ck["history"], ck.get("train_seconds", 0.0)
        print(f"resumed full checkpoint at step {step}", flush=True)
    elif a.resume:
        from safetensors.torch import load_file

        from tts.checkpoints.bundle import weight_files

        state = {}
        for f in weight_files(a.resume):
            state.update(load_file(str(f)))
        model.load_state_dict({k: v.float() for k, v in state.items()})
        st = json.loads((a.resume / "train_state.json").read_text())
        step, history, trained_seconds = st["step"], st.get("history", []), st.get("train_seconds", 0.0)
        rewarm = True
        print(f"resumed weights at step {step}", flush=True)
    elif a.init_from:
        init_from(model, a.init_from)
    n_params = sum(x.numel() for x in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters; device {device}", flush=True)
    if a.dropout:
        add_residual_dropout(model, a.dropout)
    model.train()
    use_amp = device.type == "cuda"
    loss_fn = compute_loss
    weights = EndWeights(a.end_weight, a.tail_weight, a.tail_frames)
    if device.type == "cuda":
        # cuDNN attention builds a plan per (batch, length) shape, and every batch here has a new one:
        # with it, steps ran 6x slower from the loader than on one repeated batch (profile_train.py).
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.compile if a.compile is not None else device.type == "cuda":
        loss_fn = torch.compile(compute_loss, dynamic=True)
    t_train = time.time()
    start_step = step
    budget = a.max_seconds - (t_train - t_start) - 20  # leave time to save
    batches = batch_loader(corpus, a.seed * 1000 + step, a.batch_tokens, a.workers)
    while step < a.steps and time.time() - t_train < budget:
        progress = schedule_progress(
            step - start_step,
            a.steps - start_step,
            time.time() - t_train,
            budget,
            trained_seconds,
            a.schedule_seconds,
        )
        lr = lr_at(step, progress, a.lr, a.warmup)
        if rewarm:  # fresh optimizer moments after resuming from weights: ramp up again
            lr *= min(1.0, (step - start_step + 1) / 100)
        for g in opt.param_groups:
            g["lr"] = lr
        b = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            loss, info = loss_fn(model, b["frames"], b["mask"], weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            rec = {
                "step": step,
                "seconds": round(time.time() - t_train, 1),
                "lr": lr,
                "loss": loss.item(),
                **{k: (int(v) if k == "frames" else round(float(v), 5)) for k, v in info.items()},
                "grad_norm": float(gn),
            }
            if heldout.items and (step % a.val_every == 0 or step == 1):
                rec.update(heldout_loss(model, heldout, device))
            history.append(rec)
            print(json.dumps(rec), flush=True)
    train_seconds = time.time() - t_train
    print(f"trained {step - start_step} steps in {train_seconds:.0f} s (step {step})", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    args_out = args.to_dict()
    (a.out / "config.json").write_text(json.dumps(args_out, indent=2))
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_weights(state, a.out)
    (a.out / "train_state.json").write_text(
        json.dumps(
            {
                "step": step,
                "size": a.size,
                "num_codebooks": N,
                "batch_tokens": a.batch_tokens,
                "lr": a.lr,
                "steps": a.steps,
                "train_seconds": trained_seconds + train_seconds,
                "schedule_seconds": a.schedule_seconds,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "parameters": n_params,
                "utterances": len(corpus.items),
                "history_rate": a.history_rate,
                "history_frames": a.history_frames,
                "ref_min_frames": a.ref_min_frames,
                "init_from": str(a.init_from) if a.init_from else None,
                "dropout": a.dropout,
                "end_weight": a.end_weight,
                "tail_frames": a.tail_frames,
                "tail_weight": a.tail_weight,
                "hours": corpus.seconds / 3600,
                "history": history,
            },
            indent=1,
        )
    )
    with open(a.out / "loss.csv", "w", newline="") as f:
        # Every key any record has (held-out losses only on some steps; older runs' records lack them).
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for rec in history for k in rec)))
        w.writeheader()
        w.writerows(history)
    if a.full_checkpoint:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "history": history,
                "train_seconds": trained_seconds + train_seconds,
            },
            a.full_checkpoint,
        )
    print(f"wrote {a.out} ({time.time() - t_start:.0f} s total)", flush=True)


if __name__ == "__main__":
    main()
