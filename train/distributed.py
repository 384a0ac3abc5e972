"""Multi-process start-up: `python -m train --distributed` joins the processes of one run into one JAX cluster.

Settings come from flags, else the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
else JAX's cluster auto-detection (SLURM, Open MPI, TPU metadata). CPU devices of different processes talk over
gloo, so a two-process run works on one machine.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax

from parallel import compat
from train import peers
from train.config import ConfigError

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
    """Joins the cluster (blocks until every process has joined) and starts watching the peers (train/peers.py;
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
