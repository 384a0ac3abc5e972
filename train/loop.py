"""The training run: data, sharded state, resume, the step loop, evaluation, checkpoints, sampling.

Restarting with the same command on the same output directory resumes from the newest complete checkpoint
and continues bit-identically. SIGTERM / SIGINT save a checkpoint at the next step boundary and stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import pathlib
import signal
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import yaml
from flax import nnx

from models.dtypes import compute_dtype
from parallel.configure import to_layout
from parallel.mesh import batch_sharding, make_mesh, process_rows
from train import peers
from train.checkpoint import Checkpointer, has_checkpoints, restore_model_params
from train.config import Config, ConfigError, check_built_mesh, to_dict
from train.data import build_dataset
from train.errors import NonFiniteLoss
from train.flops import Peak, batch_flops, peak_flops_per_device
from train.lock import make_run_directory, run_directory_lock
from train.metrics import MetricsLogger
from train.needle import needle_evaluation
from train.optimizer import learning_rate_schedule, make_optimizer
from train.run_plan import run_plan
from train.sample import generate
from train.sources import open_source
from train.state import TrainState, abstract_state, create_state
from train.step import make_eval_step, make_train_step, position_buckets
from train.tokenizer import make_tokenizer

log = logging.getLogger(__name__)


class Evaluation(NamedTuple):
    """What an evaluation runs: the held-out batches (None: no evaluation) and the needle grid (None: off)."""

    dataset: object
    needles: Callable[[nnx.State], dict[str, float]] | None


class Stop:
    """Remembers a SIGTERM / SIGINT so the loop can checkpoint and stop at a step boundary."""

    def __init__(self):
        self.signal = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, _frame):
        self.signal = signum

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# what a resumed run must keep: the architecture, and what the data position in a checkpoint means
RESUME_KEEPS = {"model": None, "data": None, "train": ("batch_size",)}  # None: the whole section


def check_run_directory(output: pathlib.Path, config: Config) -> None:
    """A run directory belongs to one model and one data stream: resuming with another architecture, data
    settings or batch size is refused, not overwritten (how it computes, e.g. `compute` or `mesh`, may change)."""
    saved = output / "config.yaml"
    if not saved.exists():
        return
    previous, current, defaults = yaml.safe_load(saved.read_text()) or {}, to_dict(config), to_dict(Config())
    for section, keys in RESUME_KEEPS.items():
        # a key the saved config lacks was added since: the run used its default
        before, now = {**defaults[section], **(previous.get(section) or {})}, current[section]
        for key in sorted(now if keys is None else keys):
            if before.get(key) != now[key]:
                raise ConfigError(
                    f"train.output_dir={str(output)!r} holds a run with {section}.{key}={before.get(key)!r}, now "
                    f"{now[key]!r}: a resumed run keeps its model, data and batch size. To go on from it with "
                    f"the new setting, start a new train.output_dir with checkpoint.init_from={str(output)!r}"
                    f"/checkpoints"
                )


def global_batch(batch: dict, sharding, rows: np.ndarray) -> dict:
    """The whole batch (numpy [batch, length], the same in every process) -> global jax arrays sharded over the
    batch and sequence axes, each process placing its `rows` (`process_rows`)."""
    return {
        key: jax.make_array_from_process_local_data(sharding, np.asarray(value)[rows], np.shape(value))
        for key, value in batch.items()
    }


def run(config: Config) -> dict:
    """Trains as configured; returns the last logged metrics."""
    t, output = config.train, pathlib.Path(config.train.output_dir)
    tokenizer = make_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"tokenizer {config.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={config.model.vocab_size}; model.vocab_size must be >= {tokenizer.vocab_size}"
        )
    source = open_source(config.data)  # opened and indexed once for both splits; fails early on bad data
    # every process reads the whole batch and keeps its rows: the data (and the iterator state in a checkpoint)
    # is the same whatever the number of processes
    datasets = {
        split: build_dataset(config.data, tokenizer, split=split, batch_size=t.batch_size, source=source)
        for split in (("train", "eval") if t.eval_batches else ("train",))
    }
    mesh = make_mesh(config.mesh)
    check_built_mesh(config, mesh)
    plan = run_plan(config, mesh)
    needle_scores = needle_evaluation(config, mesh, plan, tokenizer, source) if t.needle_lengths else None
    check_run_directory(output, config)
    tx = make_optimizer(config.optimizer, t.steps)
    abstract = abstract_state(config.model, tx, mesh, compute=config.compute)  # (graphdef, state, shardings)
    resuming = config.checkpoint.enabled and has_checkpoints(output / "checkpoints")
    # seeding parameters is the last check that can fail on the configuration: before the run directory is made
    seed = (
        restore_model_params(config.checkpoint.init_from, abstract[1][0])
        if config.checkpoint.init_from and not resuming
        else None
    )
    make_run_directory(output)
    main_process = jax.process_index() == 0
    with run_directory_lock(output) if main_process else contextlib.nullcontext():
        checkpoints = (
            Checkpointer(output / "checkpoints", keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
            if config.checkpoint.enabled
            else None
        )
        train_iter = iter(datasets["train"])
        start, train_state = _initial_state(config, checkpoints, train_iter, tx, mesh, abstract, seed)
        if main_process:  # once the state fits the run: a refused resume leaves the directory as it was
            (output / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        with jax.set_mesh(mesh):
            return _loop(
                config,
                train_state,
                mesh,
                plan,
                train_iter,
                Evaluation(datasets.get("eval"), needle_scores),
                checkpoints,
                start,
                tokenizer,
                main_process,
            )


def _initial_state(config: Config, checkpoints, train_iter, tx, mesh, abstract, seed) -> tuple[int, TrainState]:
    """(step, state) of the newest checkpoint (the iterator restored with it), else fresh parameters at step 0
    (replaced by `seed`, checkpoint.init_from's parameters, when given)."""
    graphdef, abstract, shardings = abstract
    restored = checkpoints.restore_latest(abstract, train_iter, to_dict(config)) if checkpoints else None
    if restored:
        log.info("resumed from step %d", restored[0])
        return restored[0], TrainState(graphdef, restored[1], shardings)
    train_state = create_state(config.model, tx, mesh, config.train.seed, compute=config.compute)
    if seed is not None:
        train_state.state[0] = seed
    return 0, train_state


def _loop(config, train_state, mesh, plan, train_iter, evaluation, checkpoints, start, tokenizer, main_process) -> dict:
    t, output = config.train, pathlib.Path(config.train.output_dir)
    chunk = config.compute.loss_chunk_size
    train_step = make_train_step(train_state, mesh, chunk_size=chunk, accum_steps=t.grad_accum_steps, plan=plan)
    buckets = position_buckets(t.eval_position_buckets, config.data.seq_len)
    eval_step = make_eval_step(train_state, mesh, chunk_size=chunk, plan=plan, buckets=buckets)
    sharding, rows = batch_sharding(mesh), process_rows(mesh, t.batch_size)

    def device_batch(batch: dict) -> dict:
        """Host batch -> global arrays in the plan's sequence layout (reordered here, once per batch)."""
        return global_batch(to_layout(batch, plan, mesh.shape["context"]), sharding, rows)

    schedule = learning_rate_schedule(config.optimizer, t.steps)
    tokens_per_step = t.batch_size * config.data.seq_len
    peak = Peak(peak_flops_per_device(t.peak_tflops_per_device, compute_dtype(config.compute)) * jax.device_count())
    meta = {"config": to_dict(config)}
    logger = MetricsLogger(
        output, total_steps=t.steps, start_step=start, progress_bar=t.progress_bar, enabled=main_process
    )
    stop = Stop()
    window = {"start": None, "steps": 0, "flops": 0.0}  # the timed steps since the last logged one
    last: dict = {}
    state = train_state.state

    def evaluate(state) -> dict[str, float]:
        """eval_loss, and eval_loss/pos_<start>_<end> for each position bucket that holds loss tokens."""
        eval_iter = iter(evaluation.dataset)  # from its start: every evaluation sees the same held-out batches
        sums = [jax.device_get(eval_step(state, device_batch(next(eval_iter)))) for _ in range(t.eval_batches)]
        eval_iter.close()
        totals, counts = (np.sum([s[i] for s in sums], axis=0) for i in (0, 1))
        losses = {"eval_loss": float(totals[0] / max(counts[0], 1.0))}
        for (begin, end), total, count in zip(buckets, totals[1:], counts[1:], strict=True):
            if count:
                losses[f"eval_loss/pos_{begin}_{end}"] = float(total / count)
        return losses

    def wants_eval(step: int) -> bool:
        if not t.eval_batches:
            return False
        return step == t.steps or (bool(t.eval_every_steps) and step % t.eval_every_steps == 0)

    def rates(elapsed: float) -> dict[str, float]:
        """tokens_per_sec, mfu (the model FLOPs of the window's batches) and step_time over its timed steps."""
        return {
            "tokens_per_sec": window["steps"] * tokens_per_step / elapsed,
            "mfu": peak.mfu(window["flops"] / elapsed, logger.message),
            "step_time": elapsed / window["steps"],
        }

    def record(step: int, metrics: dict, flops: float, eval_state=None) -> None:
        """Checks the loss and the gradient norm are finite (a non-finite gradient has poisoned the update, which is
        then never saved); at log steps writes metrics (with eval_loss when eval_state is given): the learning rate
        the step's update used, and rates only when a step since the last logged one was timed (`flops`: the
        model FLOPs of the step's batch)."""
        nonlocal last
        values = {key: float(value) for key, value in jax.device_get(metrics).items()}
        if not (math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])):
            if checkpoints:
                checkpoints.wait()
            kept = checkpoints.manager.latest_step() if checkpoints else None
            raise NonFiniteLoss(
                f"not finite at step {step}: loss {values['loss']}, grad_norm {values['grad_norm']}; "
                f"stopped without saving this state. Last good checkpoint: "
                f"{'none' if kept is None else f'step {kept}'} in {output / 'checkpoints'}. "
                f"Try a lower optimizer.learning_rate or optimizer.clip_norm > 0."
            )
        now = time.perf_counter()
        if window["start"] is None:  # the first step includes compilation: time from after it
            window.update(start=now)
        else:
            window["steps"] += 1
            window["flops"] += flops
        if step % t.log_every_steps and eval_state is None:
            logger.advance(step)
            return
        values["learning_rate"] = float(schedule(step - 1))  # optax counts the updates made before this one
        if window["steps"]:
            values.update(rates(now - window["start"]))
        if eval_state is not None:
            values.update(evaluate(eval_state))
            if evaluation.needles:
                values.update(evaluation.needles(eval_state[0]))
        logger.log(step, values)
        last = {"step": step, **values}
        window.update(start=time.perf_counter(), steps=0, flops=0.0)

    stopped = False
    try:
        pending = None  # a non-logged step's record, checked for finiteness while the next step runs
        for step in range(start + 1, t.steps + 1):
            batch = next(train_iter)
            flops = batch_flops(config.model, batch["segment_ids"])  # on the host while the last step runs
            state, metrics = train_step(state, device_batch(batch))
            peers.step_finished(step)  # dispatched: a hung collective blocks the loop within two steps
            if pending:
                record(*pending)
                pending = None
            stopping = stop.signal is not None  # read once: a signal arriving later is handled after the next step
            save = checkpoints and (step % config.checkpoint.every_steps == 0 or step == t.steps or stopping)
            if save or stopping or wants_eval(step) or step % t.log_every_steps == 0:
                record(step, metrics, flops, state if wants_eval(step) else None)  # blocks: timing, saving need it
            else:
                pending = (step, metrics, flops)
            if save:
                began = time.perf_counter()
                checkpoints.save(step, state, train_iter, meta)
                window["start"] += time.perf_counter() - began  # a save is no step's time
            if stopping:
                saved = "checkpoint saved, rerun the same command to resume" if checkpoints else "checkpoints are off"
                logger.message(f"stopped by signal {stop.signal} at step {step}; {saved}")
                stopped = True
                break
    finally:
        train_iter.close()
        stop.restore()
        try:
            if checkpoints:
                checkpoints.wait()  # raises CheckpointError when the last save failed
        finally:
            if checkpoints:
                checkpoints.close()
            logger.close()
    if stopped:
        raise SystemExit(128 + stop.signal)
    if t.sample_tokens and start < t.steps:  # every process: each generation step is a global program
        text = generate(
            dataclasses.replace(train_state, state=state),
            mesh,
            tokenizer,
            t.sample_prompt,
            max_new_tokens=t.sample_tokens,
            temperature=t.sample_temperature,
            seed=t.seed,
        )
        if main_process:
            print(f"\n--- sample ---\n{t.sample_prompt}{text}\n--------------", flush=True)
    return last
