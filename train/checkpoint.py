"""Orbax checkpoints: model state, optimizer state, data-iterator state, step and resolved config.

Items of a step directory: `model` and `optimizer` (pure dicts of arrays), `data` (grain iterator state, one
file per process) and `meta` (JSON: step and the resolved config). Saves are asynchronous and atomic (orbax
writes a temporary directory and renames it when complete), so a kill mid-save leaves the previous
checkpoints intact. A newest checkpoint that fails to restore is moved aside and the one before is used.
"""

from __future__ import annotations

import logging
import pathlib

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

log = logging.getLogger(__name__)


def _pure(state: nnx.State) -> dict:
    return nnx.to_pure_dict(state)


class Checkpointer:
    """Saves and restores training state under `directory`, keeping the newest `keep` checkpoints."""

    def __init__(self, directory: str | pathlib.Path, *, keep: int, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: nnx.State, data_iterator, meta: dict) -> None:
        """Starts an asynchronous save of (model, optimizer) state, iterator state and metadata at `step`."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                model=ocp.args.StandardSave(_pure(state[0])),
                optimizer=ocp.args.StandardSave(_pure(state[1])),
                data=grain.checkpoint.CheckpointSave(data_iterator),
                meta=ocp.args.JsonSave({"step": step, **meta}),
            ),
            force=True,
        )

    def restore_latest(self, abstract: nnx.State, data_iterator) -> tuple[int, nnx.State] | None:
        """Restores the newest readable checkpoint into `abstract`'s shapes and shardings, and the iterator.

        Returns (step, state), or None when there is no checkpoint. Unreadable checkpoints are renamed to
        `<step>.corrupt` with a warning, and the next older one is tried."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardRestore(_pure(abstract[0])),
                        optimizer=ocp.args.StandardRestore(_pure(abstract[1])),
                        data=grain.checkpoint.CheckpointRestore(data_iterator),
                    ),
                )
            except Exception as error:  # noqa: BLE001 - any failure to read means this checkpoint is unusable
                self._set_aside(step, error)
                continue
            state = jax.tree.map(lambda x: x, abstract)
            nnx.replace_by_pure_dict(state[0], restored["model"])
            nnx.replace_by_pure_dict(state[1], restored["optimizer"])
            return step, state
        return None

    def _set_aside(self, step: int, error: Exception) -> None:
        path = self.directory / str(step)
        aside = self.directory / f"{step}.corrupt"
        log.warning(
            "checkpoint %s cannot be restored (%s: %s); moved to %s, trying an older one",
            path,
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
            aside,
        )
        if jax.process_index() == 0 and path.exists():
            path.rename(aside)
        self.manager.reload()

    def wait(self) -> None:
        """Blocks until the last asynchronous save is complete."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def step_directory(checkpoint: str | pathlib.Path) -> pathlib.Path:
    """The directory holding a `model` item: CHECKPOINT itself (a step directory or an import), or the newest step
    directory in it (a run's checkpoints/)."""
    path = pathlib.Path(checkpoint).absolute()
    if (path / "model").is_dir():
        return path
    steps = ocp.utils.checkpoint_steps(path) if path.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"{path} holds no `model` item and no checkpoint step directories")
    return path / str(max(steps))


def restore_model_params(path: str | pathlib.Path, abstract_model: nnx.State) -> nnx.State:
    """Params-only initialisation: the `model` item of `step_directory(path)`, into `abstract_model`'s shapes and
    shardings."""
    step_dir = step_directory(path)
    restored = ocp.StandardCheckpointer().restore(step_dir / "model", _pure(abstract_model))
    state = jax.tree.map(lambda x: x, abstract_model)
    nnx.replace_by_pure_dict(state, restored)
    return state
