"""Needle-in-a-haystack retrieval, scored by teacher forcing (no generation, so it runs at 128K tokens).

A haystack is filler text (held-out data) with needles — "The special magic number for KEY is VALUE." — inserted
at chosen depths, then a question and its answer. The model gets the whole row once; a task is retrieved when
every answer token is the model's argmax after the tokens before it. The variants follow RULER's needle tasks:
`single` (one needle), `multi_key` (the asked key among distractor keys), `multi_value` (several values of one
key, all asked for in order of appearance).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.loss import logits
from models.dtypes import compute_dtype
from parallel import plan as plans
from parallel.configure import to_layout
from parallel.mesh import batch_sharding, batch_shards, length_shards
from parallel.reorder import layout_index
from train.data import splits
from train.errors import DataError
from train.sources import open_source
from train.state import abstract_model

TASKS = ("single", "multi_key", "multi_value")
NEEDLES = 4  # needles of the multi_key and multi_value tasks


@dataclasses.dataclass(frozen=True)
class Haystack:
    """tokens: [length] int32, the whole row (bos, filler with needles, question, answer); answer: [n] int32
    indices of the answer tokens in `tokens`; needles: the token index where each needle starts, the asked one
    (multi_key) or the first (multi_value) first."""

    tokens: np.ndarray
    answer: np.ndarray
    needles: tuple[int, ...]


def _needle(key: str, value: str) -> str:
    return f" The special magic number for {key} is {value}. "


def build(task: str, filler: Sequence[int], tokenizer, length: int, depth: float, rng: np.random.Generator) -> Haystack:
    """A `task` haystack of exactly `length` tokens whose asked needle starts at fraction `depth` (0..1) of the
    filler; other needles go to random depths. `filler`: token ids of held-out text (repeated if short)."""
    if task not in TASKS:
        raise ValueError(f"needle task {task!r} is unknown; choose one of {', '.join(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} must be in [0, 1]")
    count = 1 if task == "single" else NEEDLES
    keys = [f"{word}-{rng.integers(100, 1000)}" for word in rng.choice(_KEY_WORDS, size=count, replace=False)]
    values = [str(rng.integers(1_000_000, 10_000_000)) for _ in range(count)]
    if task == "multi_value":
        keys = [keys[0]] * count
    needles = [tokenizer.encode(_needle(key, value)) for key, value in zip(keys, values, strict=True)]
    question = (
        f" What are all the special magic numbers for {keys[0]}? They are"
        if task == "multi_value"
        else f" What is the special magic number for {keys[0]}? It is"
    )
    question_ids = tokenizer.encode(question)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    answer_ids = tokenizer.encode(" " + ", ".join(values if task == "multi_value" else values[:1]))
    budget = length - len(bos) - sum(map(len, needles)) - len(question_ids) - len(answer_ids)
    if budget < 1:
        raise ValueError(f"a {task} haystack needs more than {length - budget} tokens; got length {length}")
    hay = np.resize(np.asarray(filler, np.int32), budget)
    cuts = [round(depth * budget), *sorted(rng.integers(0, budget + 1, size=count - 1))]
    order = np.argsort(cuts, kind="stable")  # needles in filler order; the asked one keeps index 0 in `starts`
    if task == "multi_value":  # the k-th needle of the row holds the k-th value of the answer
        needles = [needles[int(np.flatnonzero(order == i)[0])] for i in range(count)]
    pieces, starts, position, done = [np.asarray(bos, np.int32)], [0] * count, len(bos), 0
    for i in order:
        pieces.append(hay[done : cuts[i]])
        position += cuts[i] - done
        starts[i], done = position, cuts[i]
        pieces.append(np.asarray(needles[i], np.int32))
        position += len(needles[i])
    pieces += [hay[done:], np.asarray(question_ids, np.int32), np.asarray(answer_ids, np.int32)]
    tokens = np.concatenate(pieces)
    return Haystack(tokens, np.arange(length - len(answer_ids), length, dtype=np.int32), tuple(starts))


def answer_positions(haystacks: Sequence[Haystack]) -> np.ndarray:
    """[rows, n] int32 answer indices, a shorter answer (another tokenization of its number) repeating its last."""
    n = max(len(h.answer) for h in haystacks)
    return np.stack([np.pad(h.answer, (0, n - len(h.answer)), mode="edge") for h in haystacks])


def score(predict: Callable[[np.ndarray, np.ndarray], np.ndarray], haystacks: Sequence[Haystack]) -> float:
    """Fraction of `haystacks` whose every answer token is predicted. `predict(tokens [rows, length], at [rows,
    n])` returns the model's argmax token after each position `at` (the token it predicts at `at + 1`)."""
    tokens = np.stack([h.tokens for h in haystacks])
    answers = answer_positions(haystacks)
    predicted = predict(tokens, answers - 1)
    return float(np.mean(np.all(predicted == np.take_along_axis(tokens, answers, axis=1), axis=1)))


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


def needle_grid(predict, filler, tokenizer, *, tasks, lengths, depths, samples: int, seed: int) -> list[dict]:
    """One record {task, length, depth, accuracy} per grid point, each over `samples` haystacks."""
    rng, records = np.random.default_rng(seed), []
    for task in tasks:
        for length in lengths:
            for depth in depths:
                haystacks = [build(task, filler, tokenizer, length, depth, rng) for _ in range(samples)]
                records.append({"task": task, "length": length, "depth": depth, "accuracy": score(predict, haystacks)})
    return records


def model_predictor(graphdef, mesh, plan: plans.Plan) -> Callable[[nnx.State, np.ndarray, np.ndarray], np.ndarray]:
    """`predict(state, tokens, at)`, which with a model state bound (functools.partial) is `score`'s predict: the
    model of `graphdef` (the model alone) on its sharded `state`, one forward pass per call over `mesh`, the rows in
    `plan`'s sequence layout (context parallelism included), the head applied only at the positions `at`. Compiled
    once per shape, whatever the state."""
    context = mesh.shape["context"]

    @jax.jit
    def argmax_at(state, batch, at):
        with plans.use(plan):
            model = nnx.merge(graphdef, state)
            hidden, _ = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
            picked = jnp.take_along_axis(hidden, at[..., None], axis=1)  # [rows, n, embed]
            return jnp.argmax(logits(picked, model.output_kernel(), compute_dtype(model.compute)), axis=-1)

    def predict(state: nnx.State, tokens: np.ndarray, at: np.ndarray) -> np.ndarray:
        rows, length = tokens.shape
        if length % length_shards(mesh):
            raise ValueError(f"needle length {length} must be a multiple of {length_shards(mesh)} on this mesh")
        padded = -(-rows // batch_shards(mesh)) * batch_shards(mesh)  # every batch shard gets a row
        tokens = np.resize(tokens, (padded, length))
        batch = {
            "tokens": tokens,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape),
            "segment_ids": np.ones_like(tokens),
        }
        batch = jax.device_put(to_layout(batch, plan, context), batch_sharding(mesh))
        if plan.layout != "contiguous":  # where each original position sits in the layout
            at = np.argsort(layout_index(length, context, plan.layout, plan.stripe))[at]
        with jax.set_mesh(mesh):
            predicted = argmax_at(state, batch, jnp.asarray(np.resize(at, (padded, at.shape[1]))))
        return np.asarray(predicted)[:rows]

    return predict


def needle_evaluation(config, mesh, plan, tokenizer, source) -> Callable[[nnx.State], dict[str, float]]:
    """The training run's needle check: model state -> {needle/<task>: mean accuracy over train.needle_lengths x
    train.needle_depths}, on haystacks of held-out text from the run's opened `source` (the same every time),
    compiled once."""
    t = config.train
    predictor = model_predictor(abstract_model(config.model, mesh, compute=config.compute)[0], mesh, plan)
    filler = filler_tokens(config, tokenizer, max(t.needle_lengths), source)

    def scores(model_state) -> dict[str, float]:
        records = needle_grid(
            functools.partial(predictor, model_state),
            filler,
            tokenizer,
            tasks=TASKS,
            lengths=t.needle_lengths,
            depths=t.needle_depths,
            samples=t.needle_samples,
            seed=t.seed,
        )
        by_task = {task: [r["accuracy"] for r in records if r["task"] == task] for task in TASKS}
        return {f"needle/{task}": float(np.mean(accuracies)) for task, accuracies in by_task.items()}

    return scores


_KEY_WORDS = (
    "amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
    "lantern", "meadow", "nimbus", "onyx", "pepper", "quartz", "raven", "saffron", "timber", "umber", "violet",
)  # fmt: skip
