"""Per-device memory of the training step, planned by compiling the real step ahead of time on abstract shapes.

Nothing is allocated and no data is read: the state comes from `nnx.eval_shape`, state and batch are
`jax.ShapeDtypeStruct`s with the run's NamedShardings, and the jitted train step is lowered and compiled for
the configured mesh. Parameters, optimizer state, gradients and the batch are exact (their per-device shard
shapes); temporaries and the total come from `compiled.memory_analysis()`, i.e. from the buffer assignment of
the backend that compiled the plan: simulated CPU devices, or compile-only GPUs (parallel/targets.py), for which
XLA's GPU compiler runs as for a real run, with the kernels and expert dispatch a GPU run would use.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import jax
import numpy as np
from flax import nnx

from models.remat import check_policy
from parallel.experts import expert_axes, ragged_as_capacity
from parallel.mesh import batch_sharding, make_mesh
from parallel.settings import make_parallelism
from train.config import Config, check_built_mesh
from train.data.batch import BATCH_FIELDS
from train.optimizer import make_optimizer
from train.planning.compiling import compiling
from train.planning.sizes import format_size
from train.state import TrainState, abstract_state
from train.step import configured_train_step

log = logging.getLogger(__name__)

# The plan never runs the step: on CPU, LLVM's optimisations are skipped (the compile takes about half as long;
# the buffer assignment is the same, as the tests check against a default compile)
CPU_OPTIONS = {"xla_backend_optimization_level": 0}
# A compile-only GPU has no device to ask for a CUB radix sort's scratch size, so sorts compile as XLA's own sort
# kernel (a real run's sort scratch differs by a few MiB at most: the MoE sorts tokens x experts per token ids)
GPU_PLAN_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
# What a compile without a device cannot know, printed with every GPU plan
GPU_UNKNOWNS = (
    "not in the GPU compiler's numbers: cuDNN's workspace (chosen at run time), autotuning (none without a device: "
    "default GEMM and fusion configs), CUB sort scratch (sorts planned without CUB)"
)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one training step, and the step that was compiled.

    params, model_state (other model variables, e.g. router biases), optimizer, gradients (one gradient
    tree: the parameters' shapes and dtypes) and batch are exact shard sizes. arguments, outputs, aliased
    (outputs written into the donated state) and temporaries (gradients, activations, collectives' buffers)
    are the compiler's; gradients live among the temporaries."""

    params: int
    model_state: int
    optimizer: int
    gradients: int
    batch: int
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    platform: str
    devices: int
    device_kind: str
    mesh: dict[str, int]
    attention_kernel: str
    expert_dispatch: str
    expert_axes: tuple[str, ...]  # the mesh axes the experts split over (none: every device runs all, dropless)
    config: Config  # as planned: compute.dtype resolved (for_accelerator)
    hosts: tuple[int, ...]  # the process (host) of each partition of the compiled program
    compile_seconds: float
    compiled: jax.stages.Compiled = dataclasses.field(repr=False, compare=False)
    grouped_matmul: str = "xla"  # the ragged dispatch's (parallel/grouped.py)

    @property
    def total(self) -> int:
        """Peak per device: inputs + the outputs not written into donated inputs + temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def fits(self, device_memory: int) -> bool:
        return self.total <= device_memory


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (the largest shard of each)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def for_accelerator(config: Config) -> Config:
    """`compute.dtype=auto` made explicit as bfloat16, the compute dtype of the GPU/TPU run being planned."""
    if config.compute.dtype != "auto":
        return config
    return dataclasses.replace(config, compute=dataclasses.replace(config.compute, dtype="bfloat16"))


def abstract_batch(config: Config, mesh) -> dict:
    """The step's input arrays as ShapeDtypeStructs [train.batch_size, data.seq_len] with the batch sharding."""
    shape, sharding = (config.train.batch_size, config.data.seq_len), batch_sharding(mesh)
    return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for key, dtype in BATCH_FIELDS.items()}


def as_capacity(settings, model, mesh):
    """The parallel settings with the capacity dispatch in place of the ragged one, its buffers of the same size."""
    sources = math.prod(mesh.shape[axis] for axis in expert_axes(mesh, model.num_experts))
    factor = math.inf if settings.expert_capacity_factor is None else settings.expert_capacity_factor
    factor = ragged_as_capacity(factor, model.experts_per_token, model.num_experts, sources)
    return dataclasses.replace(settings, expert_dispatch="capacity", expert_capacity_factor=factor)


def plan_memory(config: Config, devices=None) -> MemoryPlan:
    """Compiles the configured train step for the mesh over `devices` (default: all; compile-only GPUs too) on
    abstract state and batch, and returns the bytes per device (`compute.dtype=auto` planned as bfloat16, see
    for_accelerator). The attention kernel and expert dispatch are resolved for the devices' platform; on CPU the
    ragged expert dispatch (and auto's, ragged on a GPU) is planned as the capacity dispatch with buffers of the same
    size, and the Pallas and cuDNN attention kernels as the blockwise one, which holds the same per-block
    temporaries."""
    config = for_accelerator(config)
    mesh = make_mesh(config.mesh, devices)
    check_built_mesh(config, mesh)
    device = mesh.devices.flat[0]
    platform = device.platform
    check_policy(config.compute.remat_policy, platform)
    parallel_config = config.parallel
    # auto: ragged on the GPUs a plan is for
    if platform == "cpu" and parallel_config.expert_dispatch in ("ragged", "auto") and config.model.num_experts:
        parallel_config = as_capacity(parallel_config, config.model, mesh)
    if platform == "cpu" and parallel_config.attention_kernel in ("pallas", "cudnn", "flash3", "tokamax"):
        parallel_config = dataclasses.replace(parallel_config, attention_kernel="blockwise")
    tx = make_optimizer(config.optimizer, config.train.steps)
    graphdef, state, shardings = abstract_state(config.model, tx, mesh, compute=config.compute)
    batch = abstract_batch(config, mesh)
    with jax.set_mesh(mesh):
        parallelism = make_parallelism(parallel_config, mesh.shape, device)
        step = configured_train_step(TrainState(graphdef, state, shardings), mesh, config, parallelism)
        log.info(compiling(parallelism, mesh))
        start = time.perf_counter()
        options = {"cpu": CPU_OPTIONS, "gpu": GPU_PLAN_OPTIONS}.get(platform, {})
        compiled = step.lower(state, batch).compile(options)
        seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    model, optimizer = state[0], state[1]
    params = shard_bytes(nnx.filter_state(model, nnx.Param))
    return MemoryPlan(
        params=params,
        model_state=shard_bytes(model) - params,
        optimizer=shard_bytes(optimizer),
        gradients=params,
        batch=shard_bytes(batch),
        arguments=stats.argument_size_in_bytes,
        outputs=stats.output_size_in_bytes,
        aliased=stats.alias_size_in_bytes,
        temporaries=stats.temp_size_in_bytes,
        platform=platform,
        devices=mesh.size,
        device_kind=device.device_kind,
        mesh={name: size for name, size in mesh.shape.items() if size > 1},
        attention_kernel=parallelism.kernel,
        expert_dispatch=parallelism.expert_dispatch if config.model.num_experts else "none",
        grouped_matmul=parallelism.grouped_matmul,
        expert_axes=expert_axes(mesh, config.model.num_experts) if config.model.num_experts else (),
        config=config,
        hosts=tuple(d.process_index for d in mesh.devices.flat),
        compile_seconds=seconds,
        compiled=compiled,
    )


def format_plan(plan: MemoryPlan, device_memory: int | None = None) -> str:
    """The plan as a table of bytes per device, with a fits / does-not-fit line when `device_memory` is given."""
    mesh = " x ".join(f"{name}={size}" for name, size in plan.mesh.items()) or "one device"
    m, c, t = plan.config.model, plan.config.compute, plan.config.train
    unaliased = plan.outputs - plan.aliased
    rows = [
        ("parameters", plan.params, "exact: sharded shapes"),
        ("model state", plan.model_state, "exact: non-parameter variables"),
        ("optimizer state", plan.optimizer, "exact: sharded shapes"),
        ("batch", plan.batch, "exact: sharded shapes"),
        ("temporaries", plan.temporaries, f"{plan.platform} compiler's buffer assignment, of which:"),
        ("  gradients", plan.gradients, "exact: one gradient tree"),
        ("  activations etc.", plan.temporaries - plan.gradients, "the rest"),
        ("outputs not in place", unaliased, "outputs not written into the donated state"),
        ("total", plan.total, "arguments + temporaries + outputs not in place"),
    ]
    dispatch = "" if plan.expert_dispatch == "none" else f", expert dispatch {plan.expert_dispatch}"
    if plan.expert_dispatch == "ragged":
        dispatch += f" ({plan.grouped_matmul} grouped matmul)"
    lines = [
        f"memory plan: {plan.devices} {plan.platform} devices ({plan.device_kind}), mesh {mesh}; batch "
        f"{t.batch_size} x {plan.config.data.seq_len} tokens in {t.grad_accum_steps} micro-batch(es); remat "
        f"{c.remat_policy}; params {m.param_dtype}, compute {c.dtype}; attention kernel {plan.attention_kernel}"
        f"{dispatch}; compiled in {plan.compile_seconds:.1f} s",
        "per device:",
    ]
    lines += [f"  {name:<22}{format_size(size):>12}   {note}" for name, size, note in rows if size or name == "total"]
    if plan.expert_dispatch != "none":
        lines.append(_capacity_line(plan))
    if plan.platform == "cpu":
        lines.append(
            "temporaries come from the CPU compiler's buffer assignment (a GPU/TPU compile would differ: plan for a "
            "GPU with --target); parameters, optimizer state, gradients and batch are exact"
        )
    if plan.platform == "gpu":
        lines.append(GPU_UNKNOWNS)
    if device_memory is not None:
        verdict = (
            f"fits, {format_size(device_memory - plan.total)} free"
            if plan.fits(device_memory)
            else f"does NOT fit, {format_size(plan.total - device_memory)} over"
        )
        lines.append(
            f"device memory {format_size(device_memory)}: {verdict} (total {plan.total / device_memory:.0%} of it)"
        )
    return "\n".join(lines)


def _capacity_line(plan: MemoryPlan) -> str:
    """What parallel.expert_capacity_factor does on this mesh: only experts split over devices can drop tokens."""
    factor = plan.config.parallel.expert_capacity_factor
    if not plan.expert_axes:
        unused = "" if factor is None else f"; parallel.expert_capacity_factor={factor} has no effect here"
        return f"experts: every device runs all of them on its own tokens, dropless (no expert-parallel axis){unused}"
    axes = " x ".join(f"{axis}={plan.mesh.get(axis, 1)}" for axis in plan.expert_axes)
    matmul = {
        "tokamax": "; the speed estimate costs tokamax's grouped matmuls at the rows a balanced load fills",
        "xla": "; XLA's GPU compiler runs ragged_dot dense over every local expert (parallel.grouped_matmul)",
    }[plan.grouped_matmul] * (plan.expert_dispatch == "ragged" and plan.platform == "gpu")
    if factor is None:
        return f"experts: split over {axes}, dropless (parallel.expert_capacity_factor unset){matmul}"
    return (
        f"experts: split over {axes}; the {plan.expert_dispatch} dispatch keeps at most {factor} x the balanced load "
        f"(parallel.expert_capacity_factor) and drops the assignments past it, counted as expert_dropped; on one "
        f"device, or unset, none is dropped{matmul}"
    )
