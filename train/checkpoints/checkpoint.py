"""Orbax checkpoints: model state, optimizer state, data-iterator state, step and resolved config.

Items of a step directory: `model` and `optimizer` (pure dicts of arrays), `data` (JSON: the grain iterator
state, the same in every process since each reads the whole batch; process 0 writes it and any number of
processes restore it; checkpoints written before hold one `process_I-of-N.json` per process, all alike, and one
of them is read) and `meta` (JSON: step and the resolved config). Saves are asynchronous and atomic (orbax
writes a temporary directory and renames it when complete), so a kill mid-save leaves the previous
checkpoints intact.

Only a checkpoint whose arrays cannot be read is damaged: training renames it `<step>.corrupt`, logging the
`mv` that undoes it, and uses the one before. One that reads but holds another structure (a changed optimizer
or model) or a data position this run cannot use is not damaged: it is refused by step and difference, and
nothing is moved. Readers of parameters (`restore_model_params`: init_from, evaluation, export) place them on
the devices of the process that reads them and pass over unreadable steps without moving anything.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import TypeVar

import jax
import orbax.checkpoint as ocp
from flax import nnx

from train.errors import CheckpointError
from train.planning.sizes import format_size

log = logging.getLogger(__name__)

ARRAYS = ("model", "optimizer")  # the items of a step directory that hold arrays
DATA_FILE = "metadata"  # the file of a JSON item (orbax's JsonCheckpointHandler)
T = TypeVar("T")


class Unreadable(CheckpointError):
    """A checkpoint's arrays cannot be read (damaged or cut short), as opposed to read but not fitting."""


def _pure(state: nnx.State) -> dict:
    return nnx.to_pure_dict(state)


def _first_line(error: Exception) -> str:
    """`Type: the first line of the message`, without the TensorStore spec orbax appends."""
    lines = str(error).splitlines()
    first = lines[0].split(" See full TensorStore details")[0] if lines else ""
    return f"{type(error).__name__}: {first}"


def _leaves(tree) -> dict:
    """A pure dict of arrays or an orbax tree metadata -> {"a/b/c": leaf}."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf for path, leaf in leaves}


def structure_difference(saved, expected, dtypes: bool = False) -> str:
    """How the arrays of `saved` (an orbax item's metadata) differ from `expected` (a pure dict of abstract
    arrays) in keys and shapes, and with `dtypes` in dtypes (which a restore would otherwise cast); "" when they
    match."""
    have, want = _leaves(saved), _leaves(expected)
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    common = sorted(want.keys() & have.keys())
    shape = {key: (tuple(have[key].shape), tuple(want[key].shape)) for key in common}
    dtype = {key: (jax.numpy.dtype(have[key].dtype), jax.numpy.dtype(want[key].dtype)) for key in common if dtypes}
    reshaped = [key for key, (there, here) in shape.items() if there != here]
    retyped = [key for key, (there, here) in dtype.items() if there != here]
    there, here = dtype[retyped[0]] if retyped else (None, None)
    parts = [
        *([f"{len(missing)} arrays missing there (e.g. {missing[0]})"] if missing else []),
        *([f"{len(extra)} arrays this run does not have (e.g. {extra[0]})"] if extra else []),
        *([f"{reshaped[0]} has shape {shape[reshaped[0]][0]} there, {shape[reshaped[0]][1]} here"] if reshaped else []),
        *(
            [f"{len(retyped)} arrays of another dtype (e.g. {retyped[0]}: {there} there, {here} here)"]
            if retyped
            else []
        ),
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


def data_state(path: pathlib.Path) -> dict:
    """The iterator state in the `data` item of step directory `path`: its JSON, or, in a checkpoint that holds one
    `process_I-of-N.json` per process (all alike), the first. Raises CheckpointError naming the step and what the
    item holds instead."""
    item = path / "data"
    files = [item / DATA_FILE] if (item / DATA_FILE).is_file() else sorted(item.glob("process_*-of-*.json"))
    if not files:
        found = sorted(child.name for child in item.iterdir()) if item.is_dir() else []
        what = f"its `data` item holds {', '.join(found) or 'nothing'}" if item.is_dir() else "it has no `data` item"
        raise _unusable_position(path, f"{what}, not {DATA_FILE} or process_I-of-N.json")
    try:
        return json.loads(files[0].read_text())
    except (OSError, ValueError) as error:
        raise _unusable_position(path, f"{files[0].name} does not read ({_first_line(error)})") from None


def _data_record(path: pathlib.Path) -> dict | None:
    """The record of the data saved in step directory `path`'s meta (train/data/record.py), or None when it has none
    (saved before records were kept) or its meta cannot be read (logged)."""
    try:
        return read_meta(path).get("data")
    except Unreadable as error:
        log.warning("%s: its data is not checked", error)
        return None


def set_position(iterator, path: pathlib.Path) -> None:
    """Sets `iterator` to the data position saved in step directory `path` and starts its prefetching; raises
    CheckpointError (see `data_state`) when it cannot take it."""
    state = data_state(path)
    try:
        iterator.set_state(state)
    except Exception as error:  # noqa: BLE001 - grain raises whatever the state's shape provokes
        raise _unusable_position(
            path,
            f"its iterator state does not fit this run's data pipeline ({_first_line(error)}): saved by a version of "
            f"longctx whose pipeline keeps its place otherwise, or on other data settings",
        ) from None
    iterator.start_prefetch()


def _unusable_position(path: pathlib.Path, what: str) -> CheckpointError:
    """A refusal of step directory `path`'s data position: nothing is moved, and the message says what to do."""
    return CheckpointError(
        f"checkpoint step {path.name} in {path.parent} has no data position this run can use: {what}. Nothing was "
        f"moved. To resume from the checkpoint before it, move this one out of the way (mv {path} {path}.unused); "
        f"to keep its model, optimizer and step, start the data position fresh with data.on_change=restart; to keep "
        f"its parameters only, start a new train.output_dir with checkpoint.init_from={path}"
    )


# XLA status codes of failures outside the checkpoint's files: out of memory, a peer or service gone, a timeout
NOT_DAMAGE = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")


def is_damage(error: Exception) -> bool:
    """Whether a failure to restore a checkpoint's arrays may be its files' fault (so that it is set aside), rather
    than the process's: out of memory or a distributed runtime error (NOT_DAMAGE)."""
    if isinstance(error, MemoryError):
        return False
    return not (isinstance(error, jax.errors.JaxRuntimeError) and str(error).startswith(NOT_DAMAGE))


# what orbax names a checkpoint being written (STEP.orbax-checkpoint-tmp-TIME): left whole by an interrupted save,
# and removed by orbax's own clean-up (cleanup_tmp_directories)
PARTIAL = ".orbax-checkpoint-tmp"


def _partial_bytes(directory: pathlib.Path) -> int:
    """The bytes of the partial checkpoints an interrupted save left in `directory`: orbax removes them, so they are
    free for the next save (files it removes meanwhile count nothing)."""
    total = 0
    for partial in directory.glob(f"*{PARTIAL}*"):
        for folder, _, files in os.walk(partial):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.stat(os.path.join(folder, name)).st_size
    return total


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
        """Starts an asynchronous save of (model, optimizer) state, iterator state (`data_iterator.get_state()`,
        JSON) and metadata at `step`, once the previous save is complete and the disk has room for this one (else
        CheckpointError)."""
        self.wait()
        self._check_space(f"checkpoint step {step}", state)
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    model=ocp.args.StandardSave(_pure(state[0])),
                    optimizer=ocp.args.StandardSave(_pure(state[1])),
                    data=ocp.args.JsonSave(data_iterator.get_state()),
                    meta=ocp.args.JsonSave({"step": step, **meta}),
                ),
                force=True,
            )
        except Exception as error:
            raise self._failed(f"saving checkpoint step {step}", error) from error
        self.pending = step

    def check_room(self, state: nnx.State) -> None:
        """Refuses, before any step, a checkpoint directory that cannot be written or has no room for one
        checkpoint of `state` (arrays or abstract ones)."""
        try:
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as error:
            raise CheckpointError(
                f"cannot write checkpoints to {self.directory} ({_first_line(error)}); make it writable or choose "
                f"another train.output_dir (checkpoint.enabled=false trains without checkpoints)"
            ) from None
        self._check_space("one checkpoint", state)

    def _check_space(self, what: str, state: nnx.State) -> None:
        """Refuses a save the disk has no room for: older checkpoints go only once a newer one is complete; an
        interrupted save's partial checkpoint counts as free."""
        needed = sum(
            math.prod(x.shape) * x.dtype.itemsize for part in (state[0], state[1]) for x in jax.tree.leaves(_pure(part))
        )
        free = shutil.disk_usage(self.directory).free + _partial_bytes(self.directory)
        if free < needed:
            raise self._failed(
                f"{what} needs about {format_size(needed)} but {self.directory} has {format_size(free)} free", None
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
        self,
        abstract: nnx.State,
        data_iterator,
        config: dict | None = None,
        takes_position: Callable[[dict | None, str], bool] | None = None,
        fresh_if_unusable: bool = False,
    ) -> tuple[int, nnx.State] | None:
        """Restores the newest readable checkpoint into `abstract`'s shapes and shardings, and the iterator.

        Returns (step, state), or None when there is no checkpoint. One whose arrays cannot be read is renamed to
        `<step>.corrupt` with a warning (naming the `mv` that undoes it) and the next older one is tried. Raises
        CheckpointError, moving nothing, when the newest readable one holds another structure than `abstract`
        (`config`, the run's resolved config, lets the message name what changed) or a data position
        `data_iterator` cannot take, and when none can be read but some were set aside (now or by an earlier
        run). `takes_position(the data record saved in its meta or None, "checkpoint step N")` decides whether the
        iterator takes the saved position (else it starts fresh) and may refuse the checkpoint by raising;
        `fresh_if_unusable` starts it fresh, with a warning, where it cannot take the position instead of refusing."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            path = self.directory / str(step)
            try:
                saved = {item: _item_metadata(path / item) for item in ARRAYS}
            except Exception as error:  # noqa: BLE001 - any failure to read means this checkpoint is unusable
                self._set_aside(step, error)
                continue
            self._check_structure(path, saved, abstract, config)
            if takes_position is None or takes_position(_data_record(path), f"checkpoint step {step}"):
                try:
                    set_position(data_iterator, path)  # first: the iterator prefetches while the arrays are read
                except CheckpointError as error:
                    if not fresh_if_unusable:
                        raise
                    unusable = str(error).split(". Nothing was moved")[0]
                    log.warning("%s; data.on_change=restart: the data position starts fresh", unusable)
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardRestore(_pure(abstract[0])),
                        optimizer=ocp.args.StandardRestore(_pure(abstract[1])),
                    ),
                )
            except Exception as error:
                if not is_damage(error):
                    raise CheckpointError(
                        f"restoring checkpoint step {step} failed ({_first_line(error)}), which says nothing about "
                        f"its files: nothing was moved. Fix the cause (e.g. memory, a stopped process), then rerun "
                        f"the same command to resume"
                    ) from error
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
                f"train.output_dir) to start from step 0; a step set aside goes back with "
                f"`mv {self.directory}/STEP.corrupt {self.directory}/STEP`"
            )
        return None

    def _check_structure(self, path: pathlib.Path, saved: dict, abstract: nnx.State, config: dict | None) -> None:
        """Raises CheckpointError when the checkpoint at `path` reads but does not fit this run's state."""
        differences = {
            item: structure_difference(saved[item], _pure(part), dtypes=True)
            for item, part in zip(saved, (abstract[0], abstract[1]), strict=True)
        }
        differences = {item: text for item, text in differences.items() if text}
        if not differences:
            return
        try:
            changes = changed_settings(read_meta(path)["config"], config) if config else []
        except Exception:  # noqa: BLE001 - the settings only help the message
            changes = []
        raise CheckpointError(
            f"checkpoint {path} does not fit this run: "
            + "; ".join(f"{item} state: {text}" for item, text in differences.items())
            + (f". Changed since it was saved: {', '.join(changes)}" if changes else "")
            + f". Resume with the settings it was saved with, or start a new train.output_dir with "
            f"checkpoint.init_from={self.directory} (its parameters only)"
        )

    def _set_aside(self, step: int, error: Exception) -> None:
        """Renames a step directory whose arrays cannot be read to `<step>.corrupt` (or `.corrupt.N` beside an older
        one), logging the `mv` that undoes it."""
        path = self.directory / str(step)
        names = itertools.chain([f"{step}.corrupt"], (f"{step}.corrupt.{n}" for n in itertools.count(1)))
        aside = next(self.directory / name for name in names if not (self.directory / name).exists())
        log.warning(
            "checkpoint step %d cannot be read (%s); moved it to %s and trying an older one (to undo: mv %s %s)",
            step,
            _first_line(error),
            aside,
            aside,
            path,
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


def read_meta(directory: pathlib.Path) -> dict:
    """The `meta` item (step and resolved config) of step directory `directory`; raises Unreadable when it cannot
    be read."""
    try:
        return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(directory / "meta")
    except Exception as error:  # noqa: BLE001 - any failure to read means the item is unusable
        raise Unreadable(f"cannot read the config in {directory / 'meta'} ({_first_line(error)})") from None


def model_directories(checkpoint: str | pathlib.Path) -> list[pathlib.Path]:
    """The directories with a `model` item that CHECKPOINT names, newest first: CHECKPOINT itself (a step directory
    or an import), else its step directories (a run's checkpoints/). Raises CheckpointError when there is none."""
    path = pathlib.Path(checkpoint).absolute()
    if (path / "model").is_dir():
        return [path]
    steps = ocp.utils.checkpoint_steps(path) if path.is_dir() else []
    if not steps:
        raise CheckpointError(
            f"{path} holds no checkpoint: neither a `model` item nor checkpoint step directories"
            + ("" if path.is_dir() else " (it does not exist)")
        )
    return [path / str(step) for step in sorted(steps, reverse=True)]


def newest_readable(checkpoint: str | pathlib.Path, read: Callable[[pathlib.Path], T]) -> tuple[pathlib.Path, T]:
    """(directory, read(directory)) for the newest of `model_directories(checkpoint)` that `read` can read: one
    that raises Unreadable is passed over with a warning and left where it is. Raises Unreadable (naming each) when
    none can be read, and any other error of `read` (e.g. a mismatch) at once."""
    directories = model_directories(checkpoint)
    failures = []
    for directory in directories:
        try:
            return directory, read(directory)
        except Unreadable as error:
            failures.append(error)
            if directory != directories[-1]:
                log.warning("%s; trying the checkpoint before it (nothing is moved)", error)
    if len(failures) == 1:
        raise failures[0]
    raise Unreadable(
        f"no checkpoint in {pathlib.Path(checkpoint).absolute()} can be read: {'; '.join(map(str, failures))}"
    )


def _without(tree: dict, name: str) -> dict:
    """A pure dict without the entries under a key `name`, at any depth."""
    return {
        key: _without(value, name) if isinstance(value, dict) else value for key, value in tree.items() if key != name
    }


def _on_this_process(abstract: dict) -> dict:
    """`abstract` (a pure dict of abstract arrays) with each leaf that has no sharding placed on this process's
    first device: orbax would otherwise restore onto the saved sharding, whose devices may not exist here."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda leaf: (
            leaf if leaf.sharding is not None else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device)
        ),
        abstract,
    )


def read_model_params(directory: pathlib.Path, abstract_model: nnx.State, may_lack: str | None = None) -> nnx.State:
    """The `model` item of `directory` (a step directory or an import) in `abstract_model`'s shapes and shardings
    (this process's first device for a leaf without one); an item without any parameter under an attribute named
    `may_lack` leaves those abstract, for fresh ones. Raises Unreadable when its arrays cannot be read, and
    CheckpointError naming the first mismatched parameter."""
    item = directory / "model"
    expected = _on_this_process(_pure(abstract_model))
    try:
        saved = _item_metadata(item)
    except Exception as error:  # noqa: BLE001 - any failure to read means the item is unusable
        raise Unreadable(f"cannot read the parameters in {item} ({_first_line(error)})") from None
    difference = structure_difference(saved, expected)
    if difference and may_lack is not None and not structure_difference(saved, _without(expected, may_lack)):
        expected, difference = _without(expected, may_lack), ""
    if difference:
        raise CheckpointError(f"the parameters in {item} do not fit the configured model: {difference}")
    try:
        restored = ocp.StandardCheckpointer().restore(item, expected)
    except Exception as error:  # noqa: BLE001
        raise Unreadable(f"cannot read the parameters in {item}: truncated or damaged ({_first_line(error)})") from None
    state = jax.tree.map(lambda x: x, abstract_model)
    nnx.replace_by_pure_dict(state, restored)
    return state


def restore_model_params(
    path: str | pathlib.Path,
    abstract_model: nnx.State,
    check: Callable[[pathlib.Path], None] | None = None,
    may_lack: str | None = None,
) -> nnx.State:
    """Params-only initialisation: `read_model_params` of the newest readable of `model_directories(path)`, whose
    directory is written to stderr (init_from, evaluation and export all say which step they read); `check`
    (e.g. of its architecture) runs on that directory first and may refuse it by raising; `may_lack` as
    read_model_params takes it."""

    def read(directory: pathlib.Path) -> nnx.State:
        if check is not None:
            check(directory)
        return read_model_params(directory, abstract_model, may_lack)

    directory, params = newest_readable(path, read)
    print(f"parameters from {directory}", file=sys.stderr, flush=True)
    return params
