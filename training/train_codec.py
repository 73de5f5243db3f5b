"""Train the default voice's learned codec (`tts.codec.melvq`, type `mel_vqvae`) on the corpus log-mels.

Input: the corpus work directory of `training/corpus.py` after its `text` and `synth` stages
(`sentences.jsonl` for the train/held-out split, `shards/mel-XXXX.pt` log-mel clips). Output: a codec
folder (`codec.json` + `codec.safetensors`) that `corpus.py encode` then uses to write the codes the
model trains on.

Method (VQ-VAE with residual VQ, as in SoundStream / EnCodec, but on log-mel instead of waveform):
* batches of random `--segment`-frame windows of the training clips (concatenated), standardized with
  the per-dimension mean and std of the training frames;
* loss = L1 + MSE between the decoder's output and the input features, plus `--commit` x the
  commitment term `|z - sg(q)|^2`; gradients pass the quantizer straight through;
* codebooks are not trained by gradient: each vector is the exponential moving average (decay
  `--ema`) of the encoder residuals assigned to it; vectors used less than once per 1,000 frames
  are re-seeded from random residuals of the current batch; every stage starts from random residuals;
* AdamW, linear warm-up then cosine decay, stops after `--steps` or `--max-seconds`.
* `--freeze-encoder` keeps the encoder at its (seeded) random initialization and trains only the
  decoder and the codebooks. The shipped codec was trained that way, by a bug
  that detached the encoder's gradient; this flag reproduces it.
The held-out clips' reconstruction error (standardized L1, quantized and not) is printed at the end
and stored in `train_state.json`.

    python training/train_codec.py --work training/work --out training/work/codec --max-seconds 240
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts.codec.mel import stack_frames  # noqa: E402
from tts.codec.melrvq import nearest_centroid  # noqa: E402
from tts.codec.melvq import MelVQCodec, MelVQNet  # noqa: E402


def load_features(work: Path, max_shards: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stacked log-mel frame vectors `[T, 320]` float32 of the train and held-out clips."""
    split = {}
    with open(work / "sentences.jsonl") as f:
        for line in f:
            u = json.loads(line)
            split[u["id"]] = u["split"]
    train, held = [], []
    for path in sorted((work / "shards").glob("mel-*.pt"))[:max_shards]:
        shard = torch.load(path)
        for uid, mel in zip(shard["ids"], shard["mels"], strict=True):
            (train if split[uid] == "train" else held).append(stack_frames(mel.float()))
    return train, held


class EMAQuantizer:
    """EMA codebook updates and dead-vector re-seeding for `MelVQNet.codebooks` (module docstring)."""

    def __init__(self, net: MelVQNet, decay: float):
        self.net, self.decay = net, decay
        N, K, D = net.codebooks.shape
        self.count = torch.ones(N, K, device=net.codebooks.device)
        self.sum = net.codebooks.detach().clone()
        self.initialized = False

    def __call__(self, z: torch.Tensor, train: bool) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """z `[B, D, T]` -> (straight-through quantized `[B, D, T]`, commitment loss, per-stage perplexity).
        Gradients reach z through both outputs; the codebooks change only by the EMA updates."""
        with torch.no_grad():
            q, perplexity = self._quantize(z.detach(), train)
        commit = F.mse_loss(z, q)
        return z + (q - z).detach(), commit, perplexity

    @torch.no_grad()
    def _quantize(self, z: torch.Tensor, train: bool) -> tuple[torch.Tensor, list[float]]:
        B, D, T = z.shape
        flat = z.transpose(1, 2).reshape(-1, D).float()
        residual = flat
        total = torch.zeros_like(flat)
        books = self.net.codebooks
        perplexity = []
        for i in range(books.shape[0]):
            if train and not self.initialized:
                books[i] = residual[torch.randperm(residual.shape[0], device=z.device)[: books.shape[1]]]
                self.sum[i] = books[i]
            idx, _ = nearest_centroid(residual, books[i])
            if train:
                onehot_count = torch.bincount(idx, minlength=books.shape[1]).float()
                sums = torch.zeros_like(books[i]).index_add_(0, idx, residual)
                self.count[i].mul_(self.decay).add_(onehot_count, alpha=1 - self.decay)
                self.sum[i].mul_(self.decay).add_(sums, alpha=1 - self.decay)
                n = self.count[i].sum()
                smoothed = (self.count[i] + 1e-5) / (n + books.shape[1] * 1e-5) * n
                books[i] = self.sum[i] / smoothed.unsqueeze(1)
                dead = self.count[i] < 1e-3 * residual.shape[0] / books.shape[1]  # 0.1% of a fair share
                if dead.any():
                    pick = torch.randint(0, residual.shape[0], (int(dead.sum()),), device=z.device)
                    books[i][dead] = residual[pick]
                    self.sum[i][dead] = residual[pick]
                    self.count[i][dead] = 1.0
            p = torch.bincount(idx, minlength=books.shape[1]).float() / idx.numel()
            perplexity.append(float(torch.exp(-(p * (p + 1e-10).log()).sum())))
            q = books[i][idx]
            total = total + q
            residual = residual - q
        self.initialized = True
        return total.reshape(B, T, D).transpose(1, 2).to(z.dtype), perplexity


def codec_loss(net: MelVQNet, quant: EMAQuantizer, x: torch.Tensor, commit_weight: float):
    """Training loss of features `x [B, 320, T]`: (loss, reconstruction, commitment, perplexities);
    also updates the codebooks (EMA)."""
    z = net.encode(x)
    q, commit, perplexity = quant(z, train=True)
    y = net.decode(q)
    recon = F.l1_loss(y, x) + F.mse_loss(y, x)
    return recon + commit_weight * commit, recon, commit, perplexity


def batch(frames: torch.Tensor, size: int, segment: int, g: torch.Generator) -> torch.Tensor:
    """`size` random windows of `segment` frames from `frames [F, 320]` -> `[size, 320, segment]`."""
    start = torch.randint(0, frames.shape[0] - segment, (size,), generator=g)
    idx = (start.unsqueeze(1) + torch.arange(segment)).to(frames.device)
    return frames[idx].transpose(1, 2).float()


@torch.no_grad()
def heldout_error(net: MelVQNet, quant: EMAQuantizer, clips: list[torch.Tensor], mean, std, device) -> dict:
    """Mean absolute error (standardized units) of held-out clips, with and without quantization."""
    net.eval()
    err_q, err_ae, n = 0.0, 0.0, 0
    for c in clips:
        x = ((c - mean) / std).T.unsqueeze(0).to(device)
        z = net.encode(x)
        _, q = net.quantize(z)
        err_q += float((net.decode(q) - x).abs().sum())
        err_ae += float((net.decode(z) - x).abs().sum())
        n += x.numel()
    net.train()
    return {"heldout_l1": err_q / max(1, n), "heldout_l1_unquantized": err_ae / max(1, n)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=ROOT / "training" / "work")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-codebooks", type=int, default=4)
    p.add_argument("--codebook-size", type=int, default=1024)
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--latent", type=int, default=128)
    p.add_argument("--encoder-dilations", default="1,2,4,1", help="one centred residual block per entry")
    p.add_argument("--decoder-dilations", default="1,2,1", help="one causal residual block per entry")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--max-seconds", type=float, default=240)
    p.add_argument("--batch", type=int, default=128, help="windows per batch")
    p.add_argument("--segment", type=int, default=64, help="frames per window")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--commit", type=float, default=0.25)
    p.add_argument("--max-shards", type=int, default=None)
    p.add_argument("--freeze-encoder", action="store_true", help="train only the decoder and codebooks")
    p.add_argument("--log-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    t0 = time.time()
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    train, held = load_features(a.work, a.max_shards)
    frames = torch.cat(train)
    mean, std = frames.mean(0), frames.std(0).clamp_min(1e-3)
    frames = ((frames - mean) / std).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(
        f"{len(train)} train clips ({frames.shape[0]} frames), {len(held)} held out; "
        f"loaded in {time.time() - t0:.0f} s",
        flush=True,
    )
    dil = [tuple(int(v) for v in x.split(",")) for x in (a.encoder_dilations, a.decoder_dilations)]
    net = MelVQNet(a.num_codebooks, a.codebook_size, a.channels, a.latent, *dil).to(device)
    if a.freeze_encoder:
        for prm in [*net.enc_in.parameters(), *net.enc_blocks.parameters(), *net.enc_out.parameters()]:
            prm.requires_grad_(False)
    quant = EMAQuantizer(net, a.ema)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=1e-4)
    g = torch.Generator().manual_seed(a.seed)
    history, step, t_train = [], 0, time.time()
    budget = a.max_seconds - (t_train - t0) - 30
    while step < a.steps and time.time() - t_train < budget:
        progress = max(step / a.steps, (time.time() - t_train) / budget)
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch(frames, a.batch, a.segment, g)
        loss, recon, commit, perplexity = codec_loss(net, quant, x, a.commit)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        step += 1
        if step % a.log_every == 0 or step == 1:
            rec = {
                "step": step,
                "seconds": round(time.time() - t_train, 1),
                "lr": lr,
                "recon": float(recon.detach()),
                "commit": float(commit.detach()),
                "perplexity": [round(v) for v in perplexity],
            }
            history.append(rec)
            print(json.dumps(rec), flush=True)
    result = heldout_error(net, quant, held, mean, std, device)
    print(f"trained {step} steps in {time.time() - t_train:.0f} s; {json.dumps(result)}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    MelVQCodec(net.cpu(), mean, std).save(a.out)
    (a.out / "train_state.json").write_text(
        json.dumps(
            {
                "steps": step,
                "train_seconds": time.time() - t_train,
                "frames": int(frames.shape[0]),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                **result,
                "args": {k: str(v) for k, v in vars(a).items()},
                "history": history,
            },
            indent=1,
        )
    )
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
