"""Setting up a training run: data, mesh, sharded state, resume (the step loop is train/trainer.py's `Trainer`).

Restarting with the same command on the same output directory resumes from the newest complete checkpoint
and continues bit-identically. SIGTERM / SIGINT save a checkpoint at the next step boundary and stop.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib

import jax
import yaml

from models.deepseek import INDEXER
from parallel.mesh import make_mesh
from train.checkpoints.architecture import check_architecture
from train.checkpoints.checkpoint import Checkpointer, has_checkpoints, restore_model_params
from train.checkpoints.lock import make_run_directory, run_directory_lock
from train.checkpoints.origin import keep_origin
from train.config import Config, ConfigError, check_built_mesh, to_dict
from train.data.pipeline import build_dataset
from train.data.record import data_record, resumes_position
from train.data.sources import open_source
from train.data.tokenizer import make_tokenizer
from train.needle import needle_evaluation
from train.optimizer import make_optimizer
from train.planning.run_parallelism import run_parallelism
from train.process import library_log, stall
from train.state import TrainState, abstract_state, create_state
from train.trainer import Evaluation, Trainer

log = logging.getLogger(__name__)


# what a resumed run must keep: the architecture, and what the data position in a checkpoint means
RESUME_KEEPS = {"model": None, "data": None, "train": ("batch_size",)}  # None: the whole section


def check_run_directory(output: pathlib.Path, config: Config) -> None:
    """A run directory belongs to one model and one data stream: resuming with another architecture, data
    settings or batch size is refused, not overwritten (how it computes, e.g. `compute` or `mesh`, may change;
    data.on_change=restart starts the data position fresh, so the data settings may change with it)."""
    saved = output / "config.yaml"
    if not saved.exists():
        return
    previous, current, defaults = yaml.safe_load(saved.read_text()) or {}, to_dict(config), to_dict(Config())
    keeps = {section: keys for section, keys in RESUME_KEEPS.items() if section != "data"}
    if config.data.on_change != "restart":
        keeps["data"] = tuple(key for key in current["data"] if key != "on_change")
    for section, keys in keeps.items():
        # a key the saved config lacks was added since: the run used its default
        before, now = {**defaults[section], **(previous.get(section) or {})}, current[section]
        for key in sorted(now if keys is None else keys):
            if before.get(key) == now[key]:
                continue
            was = f"{section}.{key}={before.get(key)!r}, now {now[key]!r}"
            held = f"train.output_dir={str(output)!r} holds a run with {was}"
            if not has_checkpoints(output / "checkpoints"):
                raise ConfigError(
                    f"{held}, and no checkpoint to go on from: start afresh in another train.output_dir, or remove "
                    f"{str(output)!r}"
                )
            raise ConfigError(
                f"{held}: a resumed run keeps its model, data and batch size. To go on from it with the new setting, "
                f"start a new train.output_dir with checkpoint.init_from={str(output / 'checkpoints')!r}"
                + (
                    " (its parameters only), or, for a data setting, keep the model, optimizer and step with "
                    "data.on_change=restart, which starts the data position fresh"
                    if section == "data"
                    else ""
                )
            )


def run(config: Config) -> dict:
    """Trains as configured; returns the last logged metrics."""
    t, output = config.train, pathlib.Path(config.train.output_dir)
    tokenizer = make_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"tokenizer {config.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={config.model.vocab_size}; model.vocab_size must be >= {tokenizer.vocab_size}"
        )
    if t.sample_tokens:  # the sample re-runs its whole buffer a token at a time: it holds no more than a step does
        prompt, step_tokens = (
            len(tokenizer.encode(t.sample_prompt)) + (tokenizer.bos_id is not None),
            t.batch_size * config.data.seq_len,
        )
        if prompt + t.sample_tokens > step_tokens:
            raise ConfigError(
                f"train.sample_prompt is {prompt} tokens, and with train.sample_tokens={t.sample_tokens} the sample "
                f"needs {prompt + t.sample_tokens} positions, more than the {step_tokens} tokens a train step holds "
                f"(train.batch_size x data.seq_len); shorten the prompt or the sample (train.sample_tokens=0: none)"
            )
    source = open_source(config.data)  # opened and indexed once for both splits; fails early on bad data
    record = data_record(source, tokenizer)  # what a checkpoint's data position depends on
    # every process reads the whole batch and keeps its rows: the data (and the iterator state in a checkpoint)
    # is the same whatever the number of processes
    datasets = {
        split: build_dataset(config.data, tokenizer, split=split, batch_size=t.batch_size, source=source)
        for split in (("train", "eval") if t.eval_batches else ("train",))
    }
    mesh = make_mesh(config.mesh)
    check_built_mesh(config, mesh)
    parallelism = run_parallelism(config, mesh, stall.waiting)
    needle_scores = needle_evaluation(config, mesh, parallelism, tokenizer, source) if t.needle_lengths else None
    check_run_directory(output, config)
    tx = make_optimizer(config.optimizer, t.steps)
    abstract = abstract_state(config.model, tx, mesh, compute=config.compute)  # (graphdef, state, shardings)
    resuming = config.checkpoint.enabled and has_checkpoints(output / "checkpoints")
    # seeding parameters is the last check that can fail on the configuration: before the run directory is made
    seed = (
        restore_model_params(
            config.checkpoint.init_from,
            abstract[1][0],
            lambda directory: check_architecture(directory, config.model),
            may_lack=INDEXER if config.model.indexer_training == "warmup" else None,  # a new indexer, trained alone
        )
        if config.checkpoint.init_from and not resuming
        else None
    )
    make_run_directory(output)
    library_log.move_to(output, jax.process_index())
    main_process = jax.process_index() == 0
    with run_directory_lock(output) if main_process else contextlib.nullcontext():
        checkpoints = (
            Checkpointer(output / "checkpoints", keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
            if config.checkpoint.enabled
            else None
        )
        if checkpoints:  # before the first step compiles
            checkpoints.check_room(abstract[1])
        train_iter = iter(datasets["train"])
        takes_position = lambda saved, where: resumes_position(saved, record, config.data.on_change, where)
        start, train_state = _initial_state(config, checkpoints, train_iter, takes_position, tx, mesh, abstract, seed)
        if main_process:  # once the state fits the run: a refused resume leaves the directory as it was
            (output / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
            if seed is not None and start == 0:  # an import's config.json and tokenizer, for export
                keep_origin(config.checkpoint.init_from, output)
        with jax.set_mesh(mesh):
            evaluation = Evaluation(datasets.get("eval"), needle_scores)
            return Trainer(
                config,
                train_state,
                mesh,
                parallelism,
                train_iter,
                evaluation,
                checkpoints,
                start,
                tokenizer,
                main_process,
                data_record=record,
            ).run()


def _initial_state(
    config: Config, checkpoints, train_iter, takes_position, tx, mesh, abstract, seed
) -> tuple[int, TrainState]:
    """(step, state) of the newest checkpoint (the iterator restored with it where `takes_position` says so, see
    Checkpointer.restore_latest), else fresh parameters at step 0 (replaced by `seed`, checkpoint.init_from's
    parameters, when given, but for those it lacks)."""
    graphdef, abstract, shardings = abstract
    restored = None
    if checkpoints:
        restart = config.data.on_change == "restart"
        restored = checkpoints.restore_latest(abstract, train_iter, to_dict(config), takes_position, restart)
    if restored:
        log.info("resumed from step %d", restored[0])
        return restored[0], TrainState(graphdef, restored[1], shardings)
    train_state = create_state(config.model, tx, mesh, config.train.seed, compute=config.compute)
    if seed is not None:  # what the seed lacks (a new indexer) keeps its fresh values
        fresh = lambda seeded, new: new if isinstance(seeded, jax.ShapeDtypeStruct) else seeded
        train_state.state[0] = jax.tree.map(fresh, seed, train_state.state[0])
    return 0, train_state
