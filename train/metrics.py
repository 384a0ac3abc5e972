"""Where metrics go: OUTPUT_DIR/metrics.jsonl (one flushed JSON object per logged step), TensorBoard event
files, and a live progress bar (rich) or plain lines when the output is not a terminal."""

from __future__ import annotations

import json
import math
import pathlib
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from tensorboardX import SummaryWriter


def truncate_jsonl(path: pathlib.Path, last_step: int) -> None:
    """Drops lines logged after `last_step` (a resumed run logs those steps again), and a last line cut short
    when a crash interrupted its write."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if lines and not lines[-1].endswith("}"):
        lines.pop()
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    """Writes every logged step to metrics.jsonl and TensorBoard and shows progress."""

    def __init__(
        self, output_dir: pathlib.Path, *, total_steps: int, start_step: int, progress_bar: bool, enabled: bool = True
    ):
        self.enabled = enabled
        if not enabled:
            return
        self.path = output_dir / "metrics.jsonl"
        truncate_jsonl(self.path, start_step)
        self.file = self.path.open("a")
        self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"), purge_step=start_step + 1)
        self.console = Console(stderr=True)
        self.live = progress_bar and self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=16),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="compiling")
        self.progress.start()

    def log(self, step: int, values: dict) -> None:
        """Records `values` (floats) for `step` everywhere, flushing metrics.jsonl at once."""
        if not self.enabled:
            return
        record = {"step": step, **{key: value if math.isfinite(value) else None for key, value in values.items()}}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")  # strict JSON: non-finite values as null
        self.file.flush()
        for key, value in values.items():
            self.tensorboard.add_scalar(key, value, step)
        self.progress.update(
            self.task,
            completed=step,
            status=_status(values, ("loss", "indexer_loss", "tokens_per_sec", "mfu", "expert_dropped")),
        )
        if not self.live:
            print(f"step {step:>6} {_status(values, FORMATS)}", file=sys.stderr, flush=True)
        elif "eval_loss" in values:
            self.console.print(f"step {step}: {_status(values, ('loss', 'eval_loss'))}")

    def advance(self, step: int) -> None:
        if self.enabled:
            self.progress.update(self.task, completed=step)

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, soft_wrap=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.progress.stop()
        self.file.close()
        self.tensorboard.close()


FORMATS = {
    "loss": ("loss", ".4f"),
    "indexer_loss": ("indexer", ".4f"),
    "eval_loss": ("eval", ".4f"),
    "tokens_per_sec": ("tok/s", ",.0f"),
    "mfu": ("MFU", ".1%"),
    "learning_rate": ("lr", ".2e"),
    "expert_dropped": ("dropped", ".2%"),
}
WHEN_NONZERO = {"expert_dropped"}  # shown only when not zero


def _status(values: dict, keys) -> str:
    """'loss 2.3100  tok/s 2,900 ...' for those of `keys` present in `values`."""
    return "  ".join(
        f"{FORMATS[k][0]} {values[k]:{FORMATS[k][1]}}"
        for k in keys
        if k in values and (values[k] or k not in WHEN_NONZERO)
    )
