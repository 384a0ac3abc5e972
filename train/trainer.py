"""The step loop of a run: `Trainer` runs the train steps and, at the steps its `Cadence` names, logs (with rates
over the timed steps since the last log), evaluates, saves a checkpoint, and stops for a signal; then samples.
train/loop.py sets a run up (data, mesh, state, resume) and hands it one.

A step's metrics are read (which waits for the step) only where something needs them: a log, an evaluation, a
save, a stop. Any other step's are checked for a non-finite loss while the next step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from models.dtypes import compute_dtype
from parallel.mesh import batch_sharding, process_rows
from parallel.settings import to_layout
from train import divergence
from train.config import Config, to_dict
from train.errors import CheckpointError, NonFiniteLoss
from train.metrics import MetricsLogger
from train.optimizer import learning_rate_schedule
from train.planning.flops import Peak, batch_flops, peak_flops_per_device
from train.process import library_log, peers, stall
from train.process.stop import Stop
from train.sample import generate
from train.state import TrainState
from train.step import configured_train_step, make_eval_step, position_buckets


def global_batch(batch: dict, sharding, rows: np.ndarray) -> dict:
    """The whole batch (numpy [batch, length], the same in every process) -> global jax arrays sharded over the
    batch and sequence axes, each process placing its `rows` (`process_rows`)."""
    return {
        key: jax.make_array_from_process_local_data(sharding, np.asarray(value)[rows], np.shape(value))
        for key, value in batch.items()
    }


class Evaluation(NamedTuple):
    """What an evaluation runs: the held-out batches (None: no evaluation) and the needle grid (None: off)."""

    dataset: object
    needles: Callable[[nnx.State], dict[str, float]] | None


@dataclasses.dataclass(frozen=True)
class Cadence:
    """Which steps log, evaluate and save: every `log_every`-th, `eval_every`-th (0: the last only; `evaluates`
    False: none) and `save_every`-th (None: checkpoints off), and the last step each of them."""

    steps: int
    log_every: int
    eval_every: int
    evaluates: bool
    save_every: int | None

    @classmethod
    def of(cls, config: Config) -> Cadence:
        t, c = config.train, config.checkpoint
        return cls(
            t.steps, t.log_every_steps, t.eval_every_steps, bool(t.eval_batches), c.every_steps * c.enabled or None
        )

    def evaluates_at(self, step: int) -> bool:
        return self.evaluates and (step == self.steps or (bool(self.eval_every) and step % self.eval_every == 0))

    def logs_at(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.steps or self.evaluates_at(step)

    def saves_at(self, step: int, stopping: bool) -> bool:
        return self.save_every is not None and (step % self.save_every == 0 or step == self.steps or stopping)


@dataclasses.dataclass
class Window:
    """The timed steps since the last logged one: when the window started, how many steps, their model FLOPs. The
    first step of a run (it includes compiling) opens it without being counted."""

    start: float | None = None
    steps: int = 0
    flops: float = 0.0

    def finished(self, now: float, flops: float) -> None:
        if self.start is None:
            self.start = now
        else:
            self.steps, self.flops = self.steps + 1, self.flops + flops

    def exclude(self, seconds: float) -> None:
        """Time spent on no step (a save) leaves the window."""
        if self.start is not None:
            self.start += seconds

    def restart(self) -> None:
        self.start, self.steps, self.flops = time.perf_counter(), 0, 0.0


class Trainer:
    """Trains `train_state` from step `start` + 1 to train.steps on `train_iter`'s batches over `mesh` in
    `parallelism`'s layout; `checkpoints` (a Checkpointer, or None) saves, with `data_record` (what the data position
    depends on); `main_process` writes the metrics."""

    def __init__(
        self,
        config: Config,
        train_state: TrainState,
        mesh,
        parallelism,
        train_iter,
        evaluation: Evaluation,
        checkpoints,
        start: int,
        tokenizer,
        main_process: bool,
        data_record: dict | None = None,
    ):
        t = config.train
        self.config, self.mesh, self.parallelism, self.train_iter, self.evaluation = (
            config,
            mesh,
            parallelism,
            train_iter,
            evaluation,
        )
        self.checkpoints, self.start, self.tokenizer, self.main_process = checkpoints, start, tokenizer, main_process
        self.train_state, self.state = train_state, train_state.state
        self.cadence = Cadence.of(config)
        chunk, self.output = config.compute.loss_chunk_size, pathlib.Path(t.output_dir)
        self.train_step = configured_train_step(train_state, mesh, config, parallelism)
        self.buckets = position_buckets(t.eval_position_buckets, config.data.seq_len)
        self.eval_step = make_eval_step(
            train_state, mesh, chunk_size=chunk, parallelism=parallelism, buckets=self.buckets
        )
        self.sharding, self.rows = batch_sharding(mesh), process_rows(mesh, t.batch_size)
        self.schedule = learning_rate_schedule(config.optimizer, t.steps)
        self.tokens_per_step = t.batch_size * config.data.seq_len
        peak = peak_flops_per_device(t.peak_tflops_per_device, compute_dtype(config.compute)) * jax.device_count()
        self.peak = Peak(peak)
        self.meta = {"config": to_dict(config), "data": data_record}  # data_record: train/data/record.py
        self.logger = MetricsLogger(
            self.output, total_steps=t.steps, start_step=start, progress_bar=t.progress_bar, enabled=main_process
        )
        self.window = Window()
        self.last: dict = {}  # the last logged step's metrics
        self.unhealthy: set[int] = set()  # steps whose state gave a non-finite loss or all-zero gradients next

    def run(self) -> dict:
        """Trains to train.steps (a signal: saves and raises SystemExit(128 + signal)), samples; returns the last
        step's metrics."""
        stop = Stop(self.checkpoints.directory if self.checkpoints else None)
        if self.start >= self.cadence.steps:
            self.logger.message(
                f"resumed at step {self.start}, which train.steps={self.cadence.steps} does not pass: nothing to "
                f"train (raise train.steps to train on)"
            )
        try:
            try:
                stopped_by = self._steps(stop)
            except BaseException as error:
                self._close(error)
                raise
            stop.finishing()  # no step boundary is left to stop at: a signal now ends the process at once
            self._close()
            if stopped_by is not None:
                raise SystemExit(128 + stopped_by)
            self._sample()
        finally:
            stop.restore()
        return self.last

    def _steps(self, stop: Stop) -> int | None:
        """The steps; the signal that stopped them, or None."""
        pending = None  # a step whose metrics nothing waits for: recorded once the next step is dispatched
        for step in range(self.start + 1, self.cadence.steps + 1):
            batch = next(self.train_iter)
            flops = batch_flops(self.config.model, batch["segment_ids"])  # on the host while the last step runs
            batch = self._device_batch(batch)
            # the first dispatch compiles; a later one may wait for the devices
            with stall.waiting(f"step {step}") if step > self.start + 1 else contextlib.nullcontext():
                self.state, metrics = self.train_step(self.state, batch)
            peers.step_finished(step)  # dispatched: a hung collective blocks the loop within two steps
            if pending:
                self._record(*pending)
                pending = None
            stopping = stop.requested()  # read once: a signal arriving later is handled after the next step
            save = self.cadence.saves_at(step, stopping is not None)
            if save or stopping is not None or self.cadence.logs_at(step):
                self._record(step, metrics, flops)  # blocks: timing and saving need the step done
            else:
                pending = (step, metrics, flops)
            if save:
                self._save(step)
            if stopping is not None:
                saved = (
                    "checkpoint saved, rerun the same command to resume" if self.checkpoints else "checkpoints are off"
                )
                self.logger.message(f"stopped by signal {stopping} at step {step}; {saved}")
                return stopping
        return None

    def _device_batch(self, batch: dict) -> dict:
        """Host batch -> global arrays in the parallelism's sequence layout (reordered here, once per batch)."""
        return global_batch(to_layout(batch, self.parallelism, self.mesh.shape["context"]), self.sharding, self.rows)

    def _record(self, step: int, metrics: dict, flops: float) -> None:
        """Checks the step's loss and gradient norm are finite (a non-finite gradient has poisoned the update, which
        is then never saved), counts it in the window (`flops`: its batch's model FLOPs) and, at a log step, writes
        its metrics: the learning rate its update used, rates when a step of the window was timed, and the
        evaluation at an evaluation step (of the state after it: `step` is the last step dispatched)."""
        with stall.waiting(f"step {step}"):
            values = {key: float(value) for key, value in jax.device_get(metrics).items()}
        self._check_finite(step, values)
        now = time.perf_counter()
        self.window.finished(now, flops)
        if not self.cadence.logs_at(step):
            self.logger.advance(step)
            return
        values["learning_rate"] = float(self.schedule(step - 1))  # optax counts the updates made before this one
        values.update(self._rates(now))
        if self.cadence.evaluates_at(step):
            try:
                values.update(self._evaluate())
            except Exception as error:  # noqa: BLE001 - an evaluation never costs the run or the step's checkpoint
                first = (str(error).strip().splitlines() or [""])[0][:300]
                self.logger.message(
                    f"the evaluation at step {step} failed ({type(error).__name__}: {first}); training goes on"
                )
        self.logger.log(step, values)
        self.last = {"step": step, **values}
        self.window.restart()

    def _check_finite(self, step: int, values: dict[str, float]) -> None:
        if not divergence.healthy(values):
            self.unhealthy.add(step - 1)  # the state step ran on
        if math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"]):
            return
        saved, directory = [], None
        if self.checkpoints:
            self.checkpoints.wait()
            saved, directory = list(self.checkpoints.manager.all_steps()), self.output / "checkpoints"
        raise NonFiniteLoss(divergence.message(step, values, self.config, directory, saved, self.unhealthy))

    def _rates(self, now: float) -> dict[str, float]:
        """tokens_per_sec, mfu (the model FLOPs of the window's batches) and step_time over the window's timed
        steps; none when it has none (only the step that compiled)."""
        w = self.window
        if not w.steps:
            return {}
        elapsed = now - w.start
        return {
            "tokens_per_sec": w.steps * self.tokens_per_step / elapsed,
            "mfu": self.peak.mfu(w.flops / elapsed, self.logger.message),
            "step_time": elapsed / w.steps,
        }

    def _evaluate(self) -> dict[str, float]:
        """eval_loss, eval_loss/pos_<start>_<end> for each position bucket that holds loss tokens, and the needle
        scores when they are on, of the current state."""
        eval_iter = iter(self.evaluation.dataset)  # from its start: every evaluation sees the same held-out batches
        batches = range(self.config.train.eval_batches)
        sums = [self._eval_sums(eval_iter) for _ in batches]
        eval_iter.close()
        totals, counts = (np.sum([s[i] for s in sums], axis=0) for i in (0, 1))
        losses = {"eval_loss": float(totals[0] / max(counts[0], 1.0))}
        for (begin, end), total, count in zip(self.buckets, totals[1:], counts[1:], strict=True):
            if count:
                losses[f"eval_loss/pos_{begin}_{end}"] = float(total / count)
        if self.evaluation.needles:
            losses.update(self.evaluation.needles(self.state[0]))
        return losses

    def _eval_sums(self, eval_iter) -> tuple:
        """The eval step's loss sums of the next held-out batch (its first call compiles; the wait is watched)."""
        sums = self.eval_step(self.state, self._device_batch(next(eval_iter)))
        with stall.waiting("an evaluation"):
            return jax.device_get(sums)

    def _save(self, step: int) -> None:
        began = time.perf_counter()
        self.checkpoints.save(step, self.state, self.train_iter, self.meta)
        self.window.exclude(time.perf_counter() - began)  # a save is no step's time

    def _close(self, failure: BaseException | None = None) -> None:
        """Closes the data, waits for the last save (CheckpointError when it failed) and closes the checkpointer and
        the metrics writers. After a `failure` (the error that stops the run) what fails here goes to the library
        log instead of over it, and after a failed save nothing waits for orbax."""
        self.train_iter.close()
        errors = []
        if self.checkpoints and not isinstance(failure, CheckpointError):
            try:
                self.checkpoints.wait()
                self.checkpoints.close()  # not after a failed save: it would wait minutes for orbax's threads
            except Exception as error:  # noqa: BLE001 - the writers close whatever happened
                errors.append(error)
        try:
            self.logger.close()
        except Exception as error:  # noqa: BLE001
            errors.append(error)
        for error in errors if failure else errors[1:]:
            library_log.note(f"while closing the run: {error!r}")
        if errors and not failure:
            raise errors[0]

    def _sample(self) -> None:
        """The end-of-run sample, when train.sample_tokens asks for one and this run trained a step: every process
        generates (each generation step is a global program), process 0 prints."""
        t = self.config.train
        if not t.sample_tokens or self.start >= t.steps:
            return
        text = generate(
            dataclasses.replace(self.train_state, state=self.state),
            self.mesh,
            self.tokenizer,
            t.sample_prompt,
            max_new_tokens=t.sample_tokens,
            temperature=t.sample_temperature,
            seed=t.seed,
        )
        if self.main_process:
            print(f"\n--- sample ---\n{t.sample_prompt}{text}\n--------------", flush=True)
