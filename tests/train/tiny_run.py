"""The small run the training tests share: configs/tiny.yaml shrunk to compile and step in seconds on CPU."""

import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
MODEL = [
    "model.embed_dim=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=32",
    "model.mlp_dim=128",
]
SMALL = [
    *MODEL,
    "data.seq_len=64",
    "data.max_documents=60",
    "train.batch_size=8",
    "train.progress_bar=false",
    "train.log_every_steps=1",
]


def records(output: str | pathlib.Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (pathlib.Path(output) / "metrics.jsonl").read_text().splitlines()]
