"""`python -m train.evaluate CHECKPOINT [--config FILE] [--lengths 1024,4096] [--depths 0.1,0.5,0.9] [k=v ...]`: does
the model retrieve what its context holds? Needle retrieval (train/needle.py) over a grid of lengths x depths for
each task, on the parameters of a run's newest readable checkpoint (RUN_DIR; a damaged newer one is passed over
with a warning, and nothing is moved), of one step directory (RUN_DIR/checkpoints/N) or of an import (`python -m
train.hf import`'s OUT), over any mesh the overrides choose (e.g. mesh.context=8 parallel.context_strategy=ring for
128K rows), whatever the devices they were saved on. A CHECKPOINT that holds none is named before any data is read.

The run config is --config, else RUN_DIR/config.yaml, else an import's model.yaml with data.tokenizer its
tokenizer.json (when it has one); checkpoint.init_from is ignored. Writes OUT/needle.json (one record per task,
length and depth with its accuracy over --samples haystacks), OUT/needle.png (one heatmap per task: depth x
length) and TensorBoard scalars `needle/<task>/<length>/<depth>` under OUT/tensorboard. OUT is --out, else
RUN_DIR/eval (an import: its OUT/eval). The haystacks' filler is the held-out part of the config's data. Ctrl-C
ends it in one line (exit status 130).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import signal
import sys

import jax
import matplotlib
import numpy as np

from parallel.mesh import MeshError, make_mesh
from train.checkpoints.checkpoint import model_directories, restore_model_params
from train.config import ConfigError, check_built_mesh, load_config, warn_repeated
from train.data.haystack import TASKS, check_grid, needle_grid
from train.data.tokenizer import make_tokenizer
from train.errors import CheckpointError, DataError, leave
from train.hf import MODEL_YAML, TOKENIZER
from train.needle import filler_tokens, model_predictor
from train.planning.run_parallelism import run_parallelism
from train.process import environment, library_log
from train.state import abstract_model

matplotlib.use("Agg")  # files only, no display
from matplotlib import pyplot


@dataclasses.dataclass(frozen=True)
class Target:
    """What evaluating CHECKPOINT reads and writes: `checkpoint` (parameters: a step directory, an import, or a
    run's checkpoints/ for its newest step), `config` (the run config file), `implied` (overrides applied before
    the command line's) and `out` (the default output folder)."""

    checkpoint: pathlib.Path
    config: pathlib.Path
    implied: tuple[str, ...]
    out: pathlib.Path


def locate(path: pathlib.Path, config: pathlib.Path | None = None) -> Target:
    """The Target of `path`: a run directory (holds config.yaml), one of its step directories
    (RUN_DIR/checkpoints/N) or a directory with a `model` item (an import); `config` replaces the run config."""
    for run_dir in (path, path.parent.parent):
        if (run_dir / "config.yaml").is_file():
            checkpoint = run_dir / "checkpoints" if path == run_dir else path
            return Target(checkpoint, config or run_dir / "config.yaml", (), run_dir / "eval")
    if (path / "model").is_dir():
        if config is None and not (path / MODEL_YAML).is_file():
            raise ConfigError(f"{path} holds parameters but no {MODEL_YAML}: name their run config with --config FILE")
        tokenizer = path / TOKENIZER
        implied = (f"data.tokenizer={json.dumps(str(tokenizer))}",) if config is None and tokenizer.is_file() else ()
        return Target(path, config or path / MODEL_YAML, implied, path / "eval")
    raise ConfigError(
        f"{path} is neither a run directory (with config.yaml), a step directory of one, nor a directory with a "
        "`model` item (python -m train.hf import's output)"
    )


def heatmap(records: list[dict], path: pathlib.Path) -> None:
    """One panel per task: accuracy by depth (rows) and length (columns), written as a PNG."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    figure, axes = pyplot.subplots(
        1, len(tasks), figsize=(1.2 + 1.1 * len(lengths) * len(tasks), 1 + 0.5 * len(depths))
    )
    for axis, task in zip(np.atleast_1d(axes), tasks, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for r in records:
            if r["task"] == task:
                grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
        axis.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        axis.set_title(task)
        axis.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], rotation=45)
        axis.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        axis.set_xlabel("length (tokens)")
        axis.set_ylabel("needle depth")
        for (i, j), value in np.ndenumerate(grid):
            axis.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)


def evaluate(
    path: pathlib.Path,
    overrides,
    *,
    tasks,
    lengths,
    depths,
    samples: int,
    out: pathlib.Path | None,
    config_file: pathlib.Path | None = None,
) -> list:
    """Runs the needle grid on the checkpoint at `path` (see `locate`; `config_file`: --config) and writes
    needle.json, needle.png and TensorBoard scalars under `out` (default: the Target's); returns the records."""
    target = locate(path, config_file)
    model_directories(target.checkpoint)  # a run without a checkpoint is named before any data is read
    # the parameters come from `path`: a run's init_from (perhaps since removed) is not read
    config = load_config(target.config, [*target.implied, *overrides, "checkpoint.init_from="])
    tokenizer = make_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer={config.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={config.model.vocab_size}; evaluate with the tokenizer the model was trained with"
        )
    filler = filler_tokens(config, tokenizer, max(lengths))
    grid = dict(tasks=tasks, lengths=lengths, depths=depths, samples=samples, seed=config.train.seed)
    check_grid(filler, tokenizer, **grid)  # a length too short for a task is named before anything compiles
    mesh = make_mesh(config.mesh)
    check_built_mesh(config, mesh)
    parallelism = run_parallelism(config, mesh)
    graphdef, abstract = abstract_model(config.model, mesh, compute=config.compute)
    state = restore_model_params(target.checkpoint, abstract)
    predict = functools.partial(model_predictor(graphdef, mesh, parallelism), state)
    records = needle_grid(predict, filler, tokenizer, **grid)
    if jax.process_index() == 0:
        out = out or target.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "needle.json").write_text(json.dumps(records, indent=1) + "\n")
        heatmap(records, out / "needle.png")
        from tensorboardX import SummaryWriter

        with SummaryWriter(str(out / "tensorboard")) as writer:
            for r in records:
                writer.add_scalar(f"needle/{r['task']}/{r['length']}/{r['depth']}", r["accuracy"])
    return records


def _numbers(kind, text: str) -> list:
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None


def main(argv=None) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C from here on: the one line below
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", type=pathlib.Path, help="a run directory, one of its checkpoints/<step>, or an import's OUT"
    )
    parser.add_argument(
        "--config", type=pathlib.Path, help="run config (default: RUN_DIR/config.yaml, or an import's model.yaml)"
    )
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. mesh.context=8")
    parser.add_argument("--lengths", type=lambda t: _numbers(int, t), default=[1024, 4096], help="tokens per row")
    parser.add_argument("--depths", type=lambda t: _numbers(float, t), default=[0.1, 0.5, 0.9], help="0..1")
    parser.add_argument("--tasks", type=lambda t: t.split(","), default=list(TASKS), help=", ".join(TASKS))
    parser.add_argument("--samples", type=int, default=8, help="haystacks per grid point")
    parser.add_argument("--out", type=pathlib.Path, help="output folder (default RUN_DIR/eval)")
    args = parser.parse_intermixed_args(argv)
    environment.set_up()
    library_log.install()
    unknown = [task for task in args.tasks if task not in TASKS]
    if unknown:
        parser.error(f"--tasks {','.join(unknown)}: choose from {', '.join(TASKS)}")
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: give at least 1 haystack per grid point")
    warn_repeated(args.overrides)
    try:
        records = evaluate(
            args.checkpoint.absolute(),
            args.overrides,
            tasks=args.tasks,
            lengths=args.lengths,
            depths=args.depths,
            samples=args.samples,
            out=args.out,
            config_file=args.config,
        )
    except (ConfigError, MeshError, DataError, CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}{library_log.mention()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: stopped by Ctrl-C before the evaluation of {args.checkpoint} finished", file=sys.stderr)
        return 128 + signal.SIGINT
    for r in records:
        print(f"{r['task']:>12} {r['length']:>8,} tokens  depth {r['depth']:.0%}  {r['accuracy']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(leave(main()))
