"""`python -m train CONFIG [section.key=value ...]`: train (or resume) as configured.

`--plan` trains nothing: it compiles the train step on abstract shapes and prints the memory per device (see
train/planning/memory.py), for simulated CPU devices or, with `--target h100|h200`, for compile-only GPUs through XLA's
GPU compiler (parallel/targets.py; needs the `gpu` extra, no GPU), or with `--target v5e|v5p|v6e|tpu7x` for a
compile-only TPU slice through libtpu (parallel/tpu_targets.py; needs the `tpu` extra, no TPU)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import pathlib
import sys

import jax  # importing starts no backend: --plan can still choose the devices

from models.remat import RematError, check_policy
from parallel import targets
from parallel.mesh import AXES, MeshError
from parallel.targets import TargetError
from train.config import ConfigError, check_positions, load_config, to_dict, warn_repeated
from train.errors import CheckpointError, DataError, NonFiniteLoss, leave
from train.planning.memory import format_plan, plan_memory
from train.planning.sizes import format_size, parse_size
from train.planning.speed import estimate_plan, format_estimate
from train.process import distributed, environment, library_log, peers, stall

DOES_NOT_FIT = 4  # exit status of --plan when the step does not fit --device-memory
SINGLE_STEP_TIMEOUT = 300.0  # seconds a single-process run waits for a step's results before calling it hung


def seconds(text: str) -> float:
    """--peer-timeout / --step-timeout value -> seconds; argparse reports a value that is not a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def device_memory(text: str) -> int:
    """--device-memory value -> bytes; argparse reports a bad value with the allowed forms."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def plan_device_count(mesh, devices: int | None) -> int:
    """--devices, else the product of the mesh sizes (an axis of -1 needs --devices)."""
    if devices is not None:
        if devices < 1:
            raise ConfigError(f"--devices={devices} must be >= 1")
        return devices
    fills = [name for name in AXES if getattr(mesh, name) == -1]
    if fills:
        raise ConfigError(
            f"mesh.{fills[0]}=-1 takes the remaining devices: give --devices N (how many to plan for) "
            f"or set every mesh size"
        )
    return math.prod(getattr(mesh, name) for name in AXES)


def simulate_cpu_devices(count: int) -> None:
    """Makes JAX start `count` CPU devices. Takes effect only before JAX starts a backend; a process that has
    started one keeps its devices (the plan then uses the first `count`, if there are that many)."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend is running already
        return
    jax.config.update("jax_platforms", "cpu")


def plan(config, devices: int | None, memory: int | None, target: str | None = None) -> int:
    """Prints the memory plan for simulated CPU devices, or compile-only GPUs or TPUs of `target`; returns
    DOES_NOT_FIT when it exceeds `memory` (for a target by default the memory a run lets XLA take), else 0."""
    count = plan_device_count(config.mesh, devices)
    if target is not None:
        spec = targets.target(target)
        plan_devices = targets.compile_only_devices(spec.name, count)
        if memory is None and spec.platform == "tpu":
            memory = spec.memory
            print(f"{spec.name}: {format_size(memory)} of HBM per device", flush=True)
        elif memory is None:  # the share a run lets XLA take (environment.default_environment)
            fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", environment.GPU_MEMORY_FRACTION)
            memory = int(spec.memory * float(fraction))
            print(
                f"{spec.name}: {format_size(spec.memory)} per device, of which a run lets XLA take "
                f"{format_size(memory)} (XLA_PYTHON_CLIENT_MEM_FRACTION={fraction})",
                flush=True,
            )
    else:
        simulate_cpu_devices(count)
        if jax.device_count() < count:
            raise MeshError(
                f"the plan needs {count} devices but JAX started with {jax.device_count()} before --devices "
                f"could take effect"
            )
        plan_devices = jax.devices()[:count]
    result = plan_memory(config, plan_devices)
    print(format_plan(result, memory), flush=True)
    if target is not None:
        print(format_estimate(estimate_plan(result, spec.rates), spec.name), flush=True)
    return DOES_NOT_FIT if memory is not None and not result.fits(memory) else 0


def arguments() -> argparse.ArgumentParser:
    """The command line of `python -m train`."""
    parser = argparse.ArgumentParser(
        prog="python -m train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="YAML run config, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 data.seq_len=512")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="several processes (hosts) train as one: run the same command in each. The cluster comes from "
        "--coordinator / --num-processes / --process-id, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
        "JAX_PROCESS_ID, else SLURM, Open MPI or TPU detection",
    )
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="with --distributed: process 0's address")
    parser.add_argument("--num-processes", type=int, metavar="N", help="with --distributed: processes in the run")
    parser.add_argument("--process-id", type=int, metavar="I", help="with --distributed: this process, 0..N-1")
    parser.add_argument(
        "--peer-timeout",
        type=seconds,
        default=peers.Timeouts.peer,
        metavar="S",
        help="with --distributed: a process silent for S seconds has stopped; the others stop too, with exit "
        f"status {peers.PEER_LOST} (default %(default)s)",
    )
    parser.add_argument(
        "--step-timeout",
        type=seconds,
        metavar="S",
        help=f"a hung step stops the run with exit status {peers.PEER_LOST}: alone, a step whose results the run "
        f"waits for S seconds past its compile (default {SINGLE_STEP_TIMEOUT:g}); with --distributed, no step finished "
        f"for S seconds after the first while the processes' steps differ (default {peers.Timeouts.step:g}); 0 = never",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="train nothing: compile the train step on abstract shapes and print the memory per "
        f"device (exit status {DOES_NOT_FIT} when it does not fit --device-memory)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="with --plan: plan for N devices: simulated CPU devices, or with --target compile-only GPUs, 8 per host, "
        "or a TPU slice of N devices (default: the product of the mesh sizes)",
    )
    parser.add_argument(
        "--target",
        choices=targets.ALL,
        help="with --plan: compile for this GPU (no GPU needed; needs a CUDA plugin: pip install -e '.[cuda13]' or "
        "'.[cuda12]') and plan from XLA's GPU compiler, or for this TPU generation (needs libtpu: pip install -e "
        "'.[tpu]') and plan from the TPU compiler; the fit verdict defaults to the memory a run lets XLA take (a TPU's "
        "whole HBM)",
    )
    parser.add_argument(
        "--device-memory",
        type=device_memory,
        metavar="SIZE",
        help="with --plan: memory of one device (80GiB, 80GB, 141e9); says whether the step fits",
    )
    return parser


def main(argv=None) -> int:
    parser = arguments()
    args = parser.parse_intermixed_args(argv)
    if not args.plan and (args.devices is not None or args.device_memory is not None or args.target is not None):
        parser.error("--devices, --device-memory and --target go with --plan")
    cluster_flags = (args.coordinator, args.num_processes, args.process_id)
    if not args.distributed and cluster_flags != (None, None, None):
        parser.error("--coordinator, --num-processes and --process-id go with --distributed")
    if not args.peer_timeout:
        parser.error("--peer-timeout must be > 0 seconds")
    step_timeout = args.step_timeout
    if step_timeout is None:
        step_timeout = peers.Timeouts.step if args.distributed else SINGLE_STEP_TIMEOUT
    timeouts = peers.Timeouts(peer=args.peer_timeout, step=step_timeout)
    environment.set_up()
    # force: an imported library may have configured the root logger already, hiding our INFO lines
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    library_log.install()
    try:
        # a plan reads no parameters: it needs no checkpoint.init_from (e.g. an import not made yet) but the model
        warn_repeated(args.overrides)
        config = load_config(args.config, args.overrides, init_params=not args.plan)
        check_positions(config)
        if args.plan:
            return plan(config, args.devices, args.device_memory, args.target)
        checkpoints = pathlib.Path(config.train.output_dir) / "checkpoints" if config.checkpoint.enabled else None
        if args.distributed:
            distributed.initialize(distributed.resolve(*cluster_flags), timeouts, checkpoints)
            distributed.check_same_config(to_dict(config), timeouts)
        check_policy(config.compute.remat_policy, jax.default_backend())
        from train.loop import run

        with peers.reporting(), stall.watching(0 if args.distributed else step_timeout, checkpoints):
            run(config)
    except (ConfigError, MeshError, RematError, DataError, CheckpointError, OSError, TargetError) as error:
        print(f"error: {error}{library_log.mention()}", file=sys.stderr)
        return 2
    except NonFiniteLoss as error:
        print(f"error: {error}{library_log.mention()}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(leave(main()))
