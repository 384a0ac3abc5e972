"""Needle-in-a-haystack rows (numpy only): filler text with needles ("The special magic number for KEY is VALUE.")
inserted at chosen depths, then a question and its answer, and their scoring by teacher forcing: a row is
retrieved when every answer token is the model's argmax after the tokens before it. The tasks follow RULER's
needle tasks: `single` (one needle), `multi_key` (the asked key among distractor keys), `multi_value` (several
values of one key, all asked for in order of appearance). The retrieval data source (train/data/retrieval.py) and the
needle evaluation of a model (train/needle.py) both build on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

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


def needle_haystacks(filler, tokenizer, *, tasks, lengths, depths, samples: int, seed: int):
    """(task, length, depth, its `samples` haystacks) for each grid point, in order; the same for the same seed.
    ValueError naming the task and the length a row needs where a length is too short for a task."""
    rng = np.random.default_rng(seed)
    for task in tasks:
        for length in lengths:
            for depth in depths:
                yield task, length, depth, [build(task, filler, tokenizer, length, depth, rng) for _ in range(samples)]


def needle_grid(predict, filler, tokenizer, **grid) -> list[dict]:
    """One record {task, length, depth, accuracy} per grid point of `needle_haystacks(filler, tokenizer, **grid)`."""
    return [
        {"task": task, "length": length, "depth": depth, "accuracy": score(predict, haystacks)}
        for task, length, depth, haystacks in needle_haystacks(filler, tokenizer, **grid)
    ]


def check_grid(filler, tokenizer, **grid) -> None:
    """Every haystack of `needle_haystacks(filler, tokenizer, **grid)` builds (ValueError naming the first that
    cannot): checked before a run trains or an evaluation compiles."""
    for _ in needle_haystacks(filler, tokenizer, **grid):
        pass


_KEY_WORDS = (
    "amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper", "kestrel",
    "lantern", "meadow", "nimbus", "onyx", "pepper", "quartz", "raven", "saffron", "timber", "umber", "violet",
)  # fmt: skip
