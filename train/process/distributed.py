"""Multi-process start-up: `python -m train --distributed` joins the processes of one run into one JAX cluster.

Settings come from flags, else the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
else JAX's cluster auto-detection (SLURM, Open MPI, TPU metadata). CPU devices of different processes talk over
gloo, so a two-process run works on one machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import typing

import jax

from parallel import compat
from train.config import ConfigError
from train.process import peers

CONFIG_KEY = "longctx/config/"  # + process index: that process's resolved config, as JSON
ENVIRONMENT = {
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where the coordinator listens (host:port), how many processes, and which one this is; None = detect."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _number(name: str, text: str | None, source: str) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{source}={text!r}: {name} must be an integer") from None


def resolve(coordinator: str | None, num_processes: int | None, process_id: int | None, environ=os.environ) -> Cluster:
    """Flags first, then the environment (`ENVIRONMENT`); checks the settings are complete and consistent."""
    env = {key: environ.get(name) for key, name in ENVIRONMENT.items()}
    cluster = Cluster(
        coordinator=coordinator or env["coordinator"] or None,
        num_processes=num_processes
        if num_processes is not None
        else _number("num_processes", env["num_processes"], ENVIRONMENT["num_processes"]),
        process_id=process_id
        if process_id is not None
        else _number("process_id", env["process_id"], ENVIRONMENT["process_id"]),
    )
    given = {key: value for key, value in dataclasses.asdict(cluster).items() if value is not None}
    if (cluster.num_processes, cluster.process_id) != (None, None) and len(given) < 3:
        missing = [f"--{key.replace('_', '-')} (or {ENVIRONMENT[key]})" for key in ENVIRONMENT if key not in given]
        raise ConfigError(
            f"--distributed got {', '.join(f'{k}={v}' for k, v in given.items())} but not {', '.join(missing)}: "
            f"give all three, or at most the coordinator to detect the cluster (SLURM, Open MPI, TPU)"
        )
    if cluster.num_processes is not None and cluster.num_processes < 1:
        raise ConfigError(f"num_processes={cluster.num_processes} must be >= 1")
    if cluster.process_id is not None and not 0 <= cluster.process_id < cluster.num_processes:
        raise ConfigError(f"process_id={cluster.process_id} must be in [0, num_processes={cluster.num_processes})")
    if cluster.coordinator is not None and ":" not in cluster.coordinator:
        raise ConfigError(f"coordinator={cluster.coordinator!r} must be host:port, e.g. 10.0.0.1:1234")
    return cluster


def initialize(cluster: Cluster, timeouts: peers.Timeouts, checkpoints: pathlib.Path | None) -> None:
    """Joins the cluster (blocks until every process has joined) and starts watching the peers (train/process/peers.py;
    `checkpoints` names the step to resume from when one stops); CPU collectives across processes use gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            heartbeat_timeout_seconds=timeouts.jax_heartbeat_timeout(),
        )
    except (ValueError, RuntimeError) as error:
        raise ConfigError(
            f"--distributed could not join a cluster ({str(error).splitlines()[0]}); outside SLURM, Open MPI and "
            f"TPU give --coordinator HOST:PORT, --num-processes N and --process-id I "
            f"(or {', '.join(ENVIRONMENT.values())})"
        ) from None
    if jax.process_count() > 1:
        store = compat.distributed_state().client  # the coordination service's key-value store
        peers.watch(peers.Watchdog(store, jax.process_index(), jax.process_count(), timeouts, checkpoints))


def check_same_config(config: dict, timeouts: peers.Timeouts) -> None:
    """Refuses (ConfigError naming the keys) to train when the processes resolved different configs, e.g. one
    started with another data.seed or train.steps: they would train on mixed data or wait for each other forever.
    Each publishes its config in the coordination service and reads the others' (waiting past the peer timeout,
    so that the watchdog names a process that died first)."""
    if jax.process_count() == 1:
        return
    store = compat.distributed_state().client
    try:
        agree(store, jax.process_index(), jax.process_count(), config, timeouts.peer + 30)
    except ConfigError:  # every process finds the same differences: all leave the cluster together, then say so
        peers.stop_watching()
        jax.distributed.shutdown()
        raise


def agree(store, process: int, count: int, config: dict, timeout_s: float) -> None:
    """`check_same_config` on a key-value `store` (key_value_set, blocking_key_value_get)."""
    store.key_value_set(f"{CONFIG_KEY}{process}", json.dumps(config, sort_keys=True))
    configs = {
        peer: json.loads(store.blocking_key_value_get(f"{CONFIG_KEY}{peer}", int(timeout_s * 1000)))
        for peer in range(count)
    }
    differing = config_differences(configs)
    if differing:
        raise ConfigError(
            f"the {count} processes of this run resolved different configs: {'; '.join(differing[:5])}"
            f"{'; ...' if len(differing) > 5 else ''}. Start every process with the same config and overrides"
        )


def config_differences(configs: dict[int, dict]) -> list[str]:
    """`key: value in process I, value in process J` for each dotted key whose value differs between processes."""
    flat = {process: _flatten(config) for process, config in configs.items()}
    keys = sorted(set().union(*flat.values()))
    found = []
    for key in keys:
        values = {process: settings.get(key) for process, settings in flat.items()}
        if len({json.dumps(value) for value in values.values()}) > 1:
            found.append(f"{key}: " + ", ".join(f"{value!r} in process {process}" for process, value in values.items()))
    return found


def _flatten(tree: typing.Any, prefix: str = "") -> dict[str, typing.Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are values."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    flat = {}
    for name, child in tree.items():
        flat.update(_flatten(child, f"{prefix}.{name}" if prefix else name))
    return flat
