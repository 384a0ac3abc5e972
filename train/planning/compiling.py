"""The line a command logs before it compiles a step: the software stack and what the step compiles, so that a
compile that crashes the process (no Python error, a signal) is reported with what it was compiling."""

from __future__ import annotations

from parallel import compat
from parallel.parallelism import Parallelism


def compiling(parallelism: Parallelism, mesh) -> str:
    """'compiling for 8 gpu devices (NVIDIA H100 80GB HBM3), mesh context=4 fsdp=2, with jax 0.11.2, ...: context
    strategy ring (dual_chunk), attention kernel cudnn'."""
    device = mesh.devices.flat[0]
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items() if size > 1) or "of one device"
    layout = f" ({parallelism.layout})" if parallelism.strategy != "none" else ""
    return (
        f"compiling for {mesh.size} {device.platform} device(s) ({device.device_kind}), mesh {axes}, with "
        f"{compat.stack()}: context strategy {parallelism.strategy}{layout}, attention kernel {parallelism.kernel}"
    )
