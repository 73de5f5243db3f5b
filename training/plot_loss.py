"""Plot a training run's loss curve: `python training/plot_loss.py RUN/loss.csv OUT.png`."""

from __future__ import annotations

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        rows = list(csv.DictReader(f))
    step = [int(r["step"]) for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label in (
        ("loss", "total"),
        ("slow", "slow head (semantic + end)"),
        ("fast", "fast head (codebooks 1-3)"),
    ):
        ax[0].plot(step, [float(r[key]) for r in rows], label=label)
    val = [r for r in rows if r.get("val_slow")]  # held-out losses, logged every --val-every steps
    for key, label, color in (("val_slow", "held-out slow", "C1"), ("val_fast", "held-out fast", "C2")):
        if val:
            ax[0].plot(
                [int(r["step"]) for r in val], [float(r[key]) for r in val], "--", color=color, label=label
            )
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy (nats)")
    ax[0].legend()
    ax[0].grid(alpha=0.3)
    ax[1].plot(step, [float(r["acc0"]) for r in rows], color="C3", label="training batches")
    if val:
        ax[1].plot(
            [int(r["step"]) for r in val],
            [float(r["val_acc0"]) for r in val],
            "--",
            color="C3",
            label="held-out",
        )
        ax[1].legend()
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("teacher-forced accuracy of the main token")
    ax[1].grid(alpha=0.3)
    secs = float(rows[-1]["seconds"])
    fig.suptitle(f"default voice training: {step[-1]} steps, {secs:.0f} s on one H200 (bf16)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main()
