"""GPUs and TPUs to compile for without one. GPUs: compile-only devices from a GPU target config (a text proto of
the device kept in parallel/gpu_targets/), through JAX's CUDA plugin with JAX_PLATFORMS=cpu. A mesh over them and
`jit(...).lower().compile()` run XLA's whole GPU pipeline to cubins, and `memory_analysis()` gives the GPU
compiler's buffer assignment; nothing runs. TPUs likewise through libtpu (parallel/tpu_targets.py).

    devices = compile_only_devices("h100", 16)  # 2 hosts x 8 H100s
    devices = compile_only_devices("v5p", 16)  # a v5p slice of 16 chips
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from typing import TYPE_CHECKING

from parallel import compat
from parallel.rates import Rates
from parallel.tpu_targets import TPU_TARGETS, TpuTarget, TpuTargetError, compile_only_tpus

if TYPE_CHECKING:
    import jax

GPU_INSTALL = "pip install -e '.[cuda13]' or '.[cuda12]' (JAX's CUDA plugin at the installed JAX version)"
GPUS_PER_HOST = 8
SPECS = pathlib.Path(__file__).with_name("gpu_targets")


# Measured on an H200: 708 TFLOP/s chained 8192^3 matmuls; 3.5-3.7 TB/s copies; cuDNN 240 and Pallas 110 TFLOP/s
# (GQA 32/8 x 128 at 128K), blockwise 24. An H100 SXM is the same chip (132 SMs, same clocks) with 3.35 TB/s of
# HBM against the H200's 4.8: the same compute rates, memory scaled by 3.35 / 4.8. NVLink 4: 450 GB/s a direction,
# of which NCCL's collectives reach about 80%; between hosts 8 x 400 Gb/s InfiniBand, 50 GB/s a GPU, about 80% too.
H200_RATES = Rates(
    matmul=708e12,
    attention={"cudnn": 240e12, "pallas": 110e12, "blockwise": 24e12},
    memory=3.6e12,
    nvlink=360e9,
    network=40e9,
)
H100_RATES = dataclasses.replace(H200_RATES, memory=3.6e12 * 3.35 / 4.8)


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to compile for: `spec` the target config file in parallel/gpu_targets/; `rates` what it sustains."""

    name: str
    spec: str
    rates: Rates = dataclasses.field(hash=False, compare=False, default=H100_RATES)
    platform = "gpu"

    @property
    def config(self) -> str:
        """The target config text proto."""
        return (SPECS / self.spec).read_text()

    @property
    def memory(self) -> int:
        """Bytes of device memory, as the target config gives them (the device's whole memory)."""
        return int(re.search(r"device_memory_size: (\d+)", self.config).group(1))


TARGETS = {"h100": Target("h100", "h100_sxm.txtpb", H100_RATES), "h200": Target("h200", "h200.txtpb", H200_RATES)}
ALL = (*TARGETS, *TPU_TARGETS)  # what --target accepts


class TargetError(ValueError):
    """A target that is unknown or cannot be compiled for here; the message says what would be accepted."""


def target(name: str) -> Target | TpuTarget:
    """The GPU or TPU target called `name`; TargetError names the value and the known targets."""
    if name not in ALL:
        raise TargetError(f"--target {name!r} is unknown; choose one of {', '.join(ALL)}")
    return TARGETS.get(name) or TPU_TARGETS[name]


def topology(count: int) -> str:
    """'1 x hosts x GPUs per host' for `count` devices: one host up to GPUS_PER_HOST, else whole hosts of it."""
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise TargetError(
            f"--devices={count}: a GPU plan takes 1 to {GPUS_PER_HOST} devices (one host) or a multiple of "
            f"{GPUS_PER_HOST} ({GPUS_PER_HOST} per host)"
        )
    hosts = max(1, count // GPUS_PER_HOST)
    return f"1x{hosts}x{count // hosts}"


def plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (which holds XLA's GPU compiler), for CUDA 12 or 13, is installed."""
    return compat.cuda_plugin() is not None


def compile_only_devices(name: str, count: int) -> tuple:
    """`count` compile-only devices of target `name` (GPUs: process i holds devices 8i .. 8i + 7; TPUs: a slice, see
    parallel/tpu_targets.py); JAX runs on CPU if no platform was chosen yet (the compiles need a host backend, not a
    GPU). TargetError when the target is unknown, the count does not make whole hosts (a slice), or the CUDA plugin
    (libtpu) is missing (with the install command)."""
    spec = target(name)
    if isinstance(spec, TpuTarget):
        try:
            return compile_only_tpus(spec, count)
        except TpuTargetError as error:
            raise TargetError(str(error)) from None
    shape = topology(count)
    if not plugin_installed():
        raise TargetError(f"compiling for {name} needs XLA's GPU compiler: {GPU_INSTALL}")
    return _topology_devices(spec, shape)


@functools.cache
def _topology_devices(spec: Target, shape: str) -> tuple:
    """The devices of topology `shape` ('1 x hosts x GPUs') of `spec`, made once per process."""
    import jax
    from jax.experimental import topologies

    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")

    return tuple(topologies.get_topology_desc(platform="cuda", topology=shape, target_config=spec.config).devices)


def target_mesh(devices) -> jax.sharding.Mesh:
    """A one-axis mesh ("devices") over compile-only `devices`. Compile inside `jax.set_mesh(target_mesh(...))` when
    the program holds Pallas kernels and no mesh of its own: JAX 0.11 and newer take the GPU a Triton kernel lowers
    for from the mesh's devices (else from a concrete GPU, which this machine need not have)."""
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.asarray(devices), ("devices",))


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (its device nodes), asked without starting a JAX backend."""
    return any(pathlib.Path("/dev").glob("nvidia[0-9]*"))
