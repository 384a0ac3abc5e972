"""Orbax checkpoints: model state, optimizer state, data-iterator state, step and resolved config.

Items of a step directory: `model` and `optimizer` (pure dicts of arrays), `data` (grain iterator state, one
file per process) and `meta` (JSON: step and the resolved config). Saves are asynchronous and atomic (orbax
writes a temporary directory and renames it when complete), so a kill mid-save leaves the previous
checkpoints intact. A newest checkpoint that fails to read is moved aside and the one before is used; one that
reads but holds another structure (a changed optimizer or model) is not damaged, and is refused by name.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import shutil

import grain
import jax
import orbax.checkpoint as ocp
from flax import nnx

from train.errors import CheckpointError
from train.memory import format_size

log = logging.getLogger(__name__)


def _pure(state: nnx.State) -> dict:
    return nnx.to_pure_dict(state)


def _first_line(error: Exception) -> str:
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """A pure dict of arrays or an orbax tree metadata -> {"a/b/c": shape}."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(leaf.shape) for path, leaf in leaves
    }


def structure_difference(saved, expected) -> str:
    """How the arrays of `saved` (an orbax item's metadata) differ from `expected` (a pure dict of abstract
    arrays) in keys and shapes; "" when they match."""
    have, want = _shapes(saved), _shapes(expected)
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    reshaped = sorted(key for key in want.keys() & have.keys() if want[key] != have[key])
    parts = [
        *([f"{len(missing)} arrays missing there (e.g. {missing[0]})"] if missing else []),
        *([f"{len(extra)} arrays this run does not have (e.g. {extra[0]})"] if extra else []),
        *([f"{reshaped[0]} has shape {have[reshaped[0]]} there, {want[reshaped[0]]} here"] if reshaped else []),
    ]
    return "; ".join(parts)


def _item_metadata(directory: pathlib.Path):
    return ocp.PyTreeCheckpointHandler().metadata(directory)


def changed_settings(saved: dict, current: dict, sections=("model", "optimizer")) -> list[str]:
    """`section.key: old -> new` for each setting of `sections` that differs between two resolved configs."""
    return [
        f"{section}.{key}: {saved.get(section, {}).get(key)!r} -> {value!r}"
        for section in sections
        for key, value in current.get(section, {}).items()
        if saved.get(section, {}).get(key) != value
    ]


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
        self.pending: int | None = None  # the step of the last save started

    def save(self, step: int, state: nnx.State, data_iterator, meta: dict) -> None:
        """Starts an asynchronous save of (model, optimizer) state, iterator state and metadata at `step`, once the
        previous save is complete and the disk has room for this one (else CheckpointError)."""
        self.wait()
        self._check_space(step, state)
        try:
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
        except Exception as error:
            raise self._failed(f"saving checkpoint step {step}", error) from error
        self.pending = step

    def _check_space(self, step: int, state: nnx.State) -> None:
        """Refuses a save the disk has no room for: older checkpoints go only once a newer one is complete."""
        needed = sum(x.nbytes for part in (state[0], state[1]) for x in jax.tree.leaves(_pure(part)))
        free = shutil.disk_usage(self.directory).free
        if free < needed:
            raise self._failed(
                f"checkpoint step {step} needs about {format_size(needed)} but {self.directory} has "
                f"{format_size(free)} free",
                None,
            )

    def _failed(self, what: str, error: Exception | None) -> CheckpointError:
        self.manager.reload()
        cause = f" ({_first_line(error)})" if error else ""
        kept = sorted(self.manager.all_steps())
        return CheckpointError(
            f"{what}{cause}; "
            + (f"the checkpoints saved before it are intact (steps {kept})" if kept else "no checkpoint is saved yet")
            + ". Fix the cause (e.g. free disk space), then rerun the same command to resume"
        )

    def restore_latest(
        self, abstract: nnx.State, data_iterator, config: dict | None = None
    ) -> tuple[int, nnx.State] | None:
        """Restores the newest readable checkpoint into `abstract`'s shapes and shardings, and the iterator.

        Returns (step, state), or None when there is no checkpoint. An unreadable checkpoint is renamed to
        `<step>.corrupt` with a warning and the next older one is tried. Raises CheckpointError when the newest
        readable one holds another structure than `abstract` (`config`, the run's resolved config, lets the
        message name what changed), or when none can be read but some were set aside (now or by an earlier run)."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self.directory / str(step)
            try:
                saved = {item: _item_metadata(path / item) for item in ("model", "optimizer")}
            except Exception as error:  # noqa: BLE001 - any failure to read means this checkpoint is unusable
                self._set_aside(step, error)
                continue
            self._check_structure(path, saved, abstract, config)
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardRestore(_pure(abstract[0])),
                        optimizer=ocp.args.StandardRestore(_pure(abstract[1])),
                        data=grain.checkpoint.CheckpointRestore(data_iterator),
                    ),
                )
            except Exception as error:  # noqa: BLE001
                self._set_aside(step, error)
                continue
            state = jax.tree.map(lambda x: x, abstract)
            nnx.replace_by_pure_dict(state[0], restored["model"])
            nnx.replace_by_pure_dict(state[1], restored["optimizer"])
            return step, state
        set_aside = sorted(self.directory.glob("*.corrupt*"))
        if set_aside:
            raise CheckpointError(
                f"no checkpoint in {self.directory} can be read (set aside: {', '.join(p.name for p in set_aside)}); "
                f"refusing to start over on top of this run. Move the run directory away (or choose another "
                f"train.output_dir) to start from step 0"
            )
        return None

    def _check_structure(self, path: pathlib.Path, saved: dict, abstract: nnx.State, config: dict | None) -> None:
        """Raises CheckpointError when the checkpoint at `path` reads but does not fit this run's state."""
        differences = {
            item: structure_difference(saved[item], _pure(part))
            for item, part in zip(saved, (abstract[0], abstract[1]), strict=True)
        }
        differences = {item: text for item, text in differences.items() if text}
        if not differences:
            return
        try:
            changes = changed_settings(self._meta(path)["config"], config) if config else []
        except Exception:  # noqa: BLE001 - the settings only help the message
            changes = []
        raise CheckpointError(
            f"checkpoint {path} does not fit this run: "
            + "; ".join(f"{item} state: {text}" for item, text in differences.items())
            + (f". Changed since it was saved: {', '.join(changes)}" if changes else "")
            + f". Resume with the settings it was saved with, or start a new train.output_dir with "
            f"checkpoint.init_from={self.directory} (its parameters only)"
        )

    @staticmethod
    def _meta(path: pathlib.Path) -> dict:
        return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(path / "meta")

    def _set_aside(self, step: int, error: Exception) -> None:
        """Renames an unreadable step directory to `<step>.corrupt` (or `.corrupt.N` beside an older one)."""
        path = self.directory / str(step)
        names = itertools.chain([f"{step}.corrupt"], (f"{step}.corrupt.{n}" for n in itertools.count(1)))
        aside = next(self.directory / name for name in names if not (self.directory / name).exists())
        log.warning(
            "checkpoint %s cannot be read (%s); moved to %s, trying an older one", path, _first_line(error), aside
        )
        if jax.process_index() == 0 and path.exists():
            path.rename(aside)
        self.manager.reload()

    def wait(self) -> None:
        """Blocks until the last asynchronous save is complete; raises CheckpointError when it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            raise self._failed(f"saving checkpoint step {self.pending}", error) from error

    def close(self) -> None:
        self.manager.close()


def has_checkpoints(directory: str | pathlib.Path) -> bool:
    """Whether `directory` holds a checkpoint step directory (a run to resume)."""
    return pathlib.Path(directory).is_dir() and bool(ocp.utils.checkpoint_steps(directory))


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
    shardings. Raises CheckpointError naming the first mismatched parameter, or the item that cannot be read."""
    item = step_directory(path) / "model"
    expected = _pure(abstract_model)
    try:
        saved = _item_metadata(item)
    except Exception as error:  # noqa: BLE001 - any failure to read means the item is unusable
        raise CheckpointError(f"cannot read the parameters in {item} ({_first_line(error)})") from None
    difference = structure_difference(saved, expected)
    if difference:
        raise CheckpointError(f"the parameters in {item} do not fit the configured model: {difference}")
    try:
        restored = ocp.StandardCheckpointer().restore(item, expected)
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(
            f"cannot read the parameters in {item}: truncated or damaged ({_first_line(error)})"
        ) from None
    state = jax.tree.map(lambda x: x, abstract_model)
    nnx.replace_by_pure_dict(state, restored)
    return state
