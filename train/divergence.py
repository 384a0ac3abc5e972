"""What a run says when its loss or gradient norm stops being finite: the newest checkpoint worth resuming and a
hint fitted to the settings. A checkpoint of step s holds the state step s + 1 ran on, so it is worth resuming when
step s + 1's loss was finite and its gradients were not all zero (a collapsed model has a finite loss and no
gradient): the loop notes each step whose state was not (`healthy`)."""

from __future__ import annotations

import math
import pathlib

from train.config import Config


def healthy(values: dict[str, float]) -> bool:
    """Whether a step's state trained: a finite loss and a finite, nonzero gradient norm."""
    return math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"]) and values["grad_norm"] > 0


def last_good(saved: list[int], unhealthy: set[int]) -> tuple[int | None, list[int]]:
    """(the newest `saved` step not in `unhealthy`, or None; the newer saved steps, which are)."""
    newer = []
    for step in sorted(saved, reverse=True):
        if step not in unhealthy:
            return step, sorted(newer)
        newer.append(step)
    return None, sorted(newer)


def hint(config: Config) -> str:
    """What to change, from the settings the run has."""
    o = config.optimizer
    lower = f"lower optimizer.learning_rate (now {o.learning_rate:g})"
    if not o.clip_norm:
        return f"set optimizer.clip_norm > 0 (e.g. 1.0; now 0: no clipping) or {lower}"
    return f"{lower} or raise optimizer.warmup_steps (now {o.warmup_steps}); gradients are clipped to {o.clip_norm:g}"


def message(
    step: int, values: dict, config: Config, directory: pathlib.Path | None, saved: list[int], unhealthy
) -> str:
    """The error of a non-finite `step`: what was seen, where to resume from (`saved` steps under `directory`, None:
    checkpoints off; `unhealthy`: the states that did not train), what to change."""
    seen = f"not finite at step {step}: loss {values['loss']}, grad_norm {values['grad_norm']}; stopped without saving"
    if directory is None:
        return f"{seen} (checkpoints are off). Then: {hint(config)}."
    good, bad = last_good(saved, unhealthy)
    where = "none" if good is None else f"step {good} in {directory}"
    if bad:
        steps = f"step{'s' * (len(bad) > 1)} {', '.join(map(str, bad))}"
        after = ": move them aside to resume from it" if good is not None else ""
        where += f" ({steps} saved the states that gave a non-finite loss or all-zero gradients{after})"
    return f"{seen} this state. Last good checkpoint: {where}. Then: {hint(config)}."
