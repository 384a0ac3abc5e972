"""Needle-in-a-haystack retrieval of a model, scored by teacher forcing (no generation, so it runs at 128K tokens):
the haystacks of train/data/haystack.py with the run's held-out text as filler, one forward pass of the model per
grid point over the run's mesh and sequence layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.loss import logits
from models.dtypes import compute_dtype
from parallel.mesh import batch_sharding, batch_shards, length_shards
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import layout_index
from parallel.rounding import round_up
from parallel.settings import to_layout
from train.config import ConfigError
from train.data.haystack import TASKS, check_grid, needle_grid
from train.data.pipeline import splits
from train.data.sources import open_source
from train.errors import DataError
from train.state import abstract_model


def filler_tokens(config, tokenizer, count: int, source=None) -> np.ndarray:
    """At least `count` token ids of the run's held-out documents (all of them when fewer), in order (a mixture's
    component by component). `source`:
    the run's opened data source (default: open_source(config.data))."""
    source = open_source(config.data) if source is None else source
    source, _, held = splits(source, config.data)
    eval_indices = np.concatenate(held)
    if not len(eval_indices):
        raise DataError("the run holds out no documents (data.eval_fraction=0): there is no filler for haystacks")
    tokens, total = [], 0
    for index in eval_indices:
        tokens.append(tokenizer.encode(source[int(index)]))
        total += len(tokens[-1])
        if total >= count:
            break
    return np.concatenate([np.asarray(t, np.int32) for t in tokens])


def model_predictor(
    graphdef, mesh, parallelism: Parallelism
) -> Callable[[nnx.State, np.ndarray, np.ndarray], np.ndarray]:
    """`predict(state, tokens, at)`, which with a model state bound (functools.partial) is the `predict` of
    train/data/haystack.py's `score`: the model of `graphdef` (the model alone) on its sharded `state`, one forward pass
    per call over `mesh`, the rows in `parallelism`'s sequence layout (context parallelism included), the head applied
    only at the positions `at`. Compiled once per shape, whatever the state."""
    context = mesh.shape["context"]

    @jax.jit
    def argmax_at(state, batch, at):
        with use_parallelism(parallelism):
            model = nnx.merge(graphdef, state)
            hidden, _ = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
            picked = jnp.take_along_axis(hidden, at[..., None], axis=1)  # [rows, n, embed]
            return jnp.argmax(logits(picked, model.output_kernel(), compute_dtype(model.compute)), axis=-1)

    def predict(state: nnx.State, tokens: np.ndarray, at: np.ndarray) -> np.ndarray:
        rows, length = tokens.shape
        if length % length_shards(mesh):
            raise ValueError(f"needle length {length} must be a multiple of {length_shards(mesh)} on this mesh")
        padded = round_up(rows, batch_shards(mesh))  # every batch shard gets a row
        tokens = np.resize(tokens, (padded, length))
        batch = {
            "tokens": tokens,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
            "segment_ids": np.ones_like(tokens),
        }
        batch = jax.device_put(to_layout(batch, parallelism, context), batch_sharding(mesh))
        if parallelism.layout != "contiguous":  # where each original position sits in the layout
            at = np.argsort(layout_index(length, context, parallelism.layout, parallelism.stripe))[at]
        with jax.set_mesh(mesh):
            predicted = argmax_at(state, batch, jnp.asarray(np.resize(at, (padded, at.shape[1]))))
        return np.asarray(predicted)[:rows]

    return predict


def needle_evaluation(config, mesh, parallelism, tokenizer, source) -> Callable[[nnx.State], dict[str, float]]:
    """The training run's needle check: model state -> {needle/<task>: mean accuracy over train.needle_lengths x
    train.needle_depths}, on haystacks of held-out text from the run's opened `source` (the same every time),
    compiled once. ConfigError, before anything trains, when a task is unknown or a length too short for one."""
    t = config.train
    tasks = t.needle_tasks or TASKS
    unknown = [task for task in tasks if task not in TASKS]
    if unknown:
        raise ConfigError(f"train.needle_tasks={list(tasks)}: {', '.join(unknown)} unknown; choose from {TASKS}")
    filler = filler_tokens(config, tokenizer, max(t.needle_lengths), source)
    grid = dict(tasks=tasks, lengths=t.needle_lengths, depths=t.needle_depths, samples=t.needle_samples, seed=t.seed)
    try:
        check_grid(filler, tokenizer, **grid)
    except ValueError as error:
        raise ConfigError(
            f"train.needle_lengths={list(t.needle_lengths)}: {error}; give longer lengths, or choose the tasks with "
            f"train.needle_tasks (of {', '.join(TASKS)})"
        ) from None
    predictor = model_predictor(abstract_model(config.model, mesh, compute=config.compute)[0], mesh, parallelism)

    def scores(model_state) -> dict[str, float]:
        records = needle_grid(functools.partial(predictor, model_state), filler, tokenizer, **grid)
        by_task = {task: [r["accuracy"] for r in records if r["task"] == task] for task in tasks}
        return {f"needle/{task}": float(np.mean(accuracies)) for task, accuracies in by_task.items()}

    return scores
