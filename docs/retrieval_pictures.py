"""The manual's pictures of the tiny retrieval run (docs/finetune-128k.md), made by running it: trains
configs/retrieval-tiny.yaml with its held-out loss split by position (about five minutes on 2 CPU cores), evaluates
needle retrieval at and beyond its training length, and writes the evaluation's heatmap (docs/needle-tiny.png) and
the held-out loss of each position range over the steps (docs/images/loss-by-position.png). A slow test runs it.

    PYTHONPATH=. python docs/retrieval_pictures.py [RUN_DIR]      # default: runs/retrieval-tiny-pictures
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DOCS = pathlib.Path(__file__).resolve().parent
REPO = DOCS.parent
BUCKETS = (16, 32, 64, 96)  # token positions where the held-out loss is split (rows of 128)
TRAIN = [
    "configs/retrieval-tiny.yaml", "train.eval_batches=4", "train.eval_every_steps=100",
    f"train.eval_position_buckets=[{','.join(map(str, BUCKETS))}]",
]  # fmt: skip
EVALUATE = ["--lengths", "128,192,256", "--depths", "0,0.25,0.5,0.75,1", "--tasks", "single"]


def draw_loss_by_position(metrics: pathlib.Path, path: pathlib.Path) -> None:
    """The held-out loss of each position range (eval_loss/pos_<start>_<end> in metrics.jsonl) over the steps."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [row for row in rows if "eval_loss" in row]
    keys = sorted(
        {k for row in rows for k in row if k.startswith("eval_loss/pos_")}, key=lambda k: int(k.split("_")[2])
    )
    figure, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    for key in keys:
        start, end = key.split("_")[2:]
        ax.plot(
            [r["step"] for r in rows if key in r], [r[key] for r in rows if key in r], label=f"tokens {start}-{end}"
        )
    ax.set_xlabel("step"), ax.set_ylabel("held-out loss (nats per token)"), ax.legend(fontsize=8)
    ax.set_title("Tiny retrieval run: held-out loss by position in the row", fontsize=9)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(run: pathlib.Path, docs: pathlib.Path = DOCS) -> list[pathlib.Path]:
    """Trains and evaluates the run in `run`; writes the two pictures under `docs`; returns their paths."""
    python = [sys.executable, "-m"]
    subprocess.run([*python, "train", *TRAIN, f"train.output_dir={run}"], cwd=REPO, check=True)
    subprocess.run([*python, "train.evaluate", str(run), *EVALUATE], cwd=REPO, check=True)
    (docs / "images").mkdir(parents=True, exist_ok=True)
    heatmap, curves = docs / "needle-tiny.png", docs / "images" / "loss-by-position.png"
    shutil.copyfile(run / "eval" / "needle.png", heatmap)
    draw_loss_by_position(run / "metrics.jsonl", curves)
    return [heatmap, curves]


if __name__ == "__main__":
    print("\n".join(map(str, main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/retrieval-tiny-pictures")))))
