"""TPUs to compile for without one: compile-only chips of a TPU generation through libtpu (the `tpu` extra) with
JAX_PLATFORMS=cpu. A mesh over them and `jit(...).lower().compile()` run the TPU compiler to the end, and
`memory_analysis()` gives its buffer assignment; nothing runs.

    devices = compile_only_tpus(TPU_TARGETS["v5p"], 16)  # a v5p slice of 16 chips: v5p:2x2x4, 4 hosts of 4 chips

`--devices N` counts JAX devices, as a run on the slice sees them: one a chip, two on Ironwood (tpu7x). A slice is a
torus of chips (2-D on v5e and v6e, 3-D on v5p and Ironwood) whose sides grow by doubling, on hosts of the chips the
generation's hosts hold; one chip alone is planned too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os

from parallel.rates import Rates

TPU_INSTALL = "pip install -e '.[tpu]' (libtpu, the TPU compiler, at the installed JAX version)"
GiB = 1 << 30


# The shares of a data sheet's rates the speed estimate assumes a TPU sustains: none is measured on a TPU here.
MATMUL_SHARE = 0.8  # large bfloat16 matmuls (an H200 measured 72% of its peak: parallel/targets.py)
# Splash attention's kernels, on the matmuls each computes: MaxText's published v5p runs (53% MFU at 64K, about half of
# it attention) imply 51-60% with tuned blocks of 1-2K, a fused backward and the output saved; 50%, since ours run
# blocks of 512 and dq as its own kernel. Ironwood measured 34% forward and 37% backward at 128K with heads of 128
# (tokamax's splash microbenchmarks): `TpuTarget.splash`.
SPLASH_SHARE = 0.5
BLOCKWISE_SHARE = 24 / 708  # the blockwise kernel against large matmuls, as an H200 measured them
MEMORY_SHARE = 0.75  # HBM (an H200 measured 3.6 of 4.8 TB/s)
ICI_SHARE = 0.8  # of one torus dimension's links, which a collective over one mesh axis uses


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A TPU generation to compile for: `topology` libtpu's name for it, `host` the chips a host holds (x, y, z),
    `torus` the dimensions of a slice (2 or 3), `devices_per_chip` the JAX devices a chip is, `memory` the HBM bytes
    of one device (the data sheet's per chip over devices_per_chip). From the data sheet, per chip: `peak` bfloat16
    FLOP/s, `bandwidth` HBM bytes/s, `ici` bytes/s over all its inter-chip links; `splash` the share of peak splash's
    kernels sustain."""

    name: str
    topology: str
    host: tuple[int, int, int]
    torus: int
    devices_per_chip: int
    memory: int
    peak: float
    bandwidth: float
    ici: float
    splash: float = SPLASH_SHARE
    platform = "tpu"

    @property
    def rates(self) -> Rates:
        """What one device sustains, for the speed estimate: the data sheet's rates per device at the shares above
        (a collective over one mesh axis runs on one torus dimension's links)."""
        per_device = 1 / self.devices_per_chip
        peak = self.peak * per_device
        ici = self.ici * per_device / self.torus * ICI_SHARE
        return Rates(
            matmul=peak * MATMUL_SHARE,
            attention={"splash": peak * self.splash, "blockwise": peak * MATMUL_SHARE * BLOCKWISE_SHARE},
            memory=self.bandwidth * per_device * MEMORY_SHARE,
            nvlink=ici,
            network=ici,
            platform="tpu",
        )


# Data sheets (cloud.google.com/tpu/docs/<generation>): bfloat16 peak, HBM bandwidth, ICI bandwidth per chip.
TPU_TARGETS = {
    "v5e": TpuTarget("v5e", "v5e", (2, 4, 1), 2, 1, 16 * GiB, 197e12, 819e9, 1600e9 / 8),
    "v5p": TpuTarget("v5p", "v5p", (2, 2, 1), 3, 1, 95 * GiB, 459e12, 2765e9, 4800e9 / 8),
    "v6e": TpuTarget("v6e", "v6e", (2, 4, 1), 2, 1, 32 * GiB, 918e12, 1640e9, 3584e9 / 8),
    # Ironwood: 192 GiB a chip, two devices; 4,614 TFLOP/s in fp8, half that in bfloat16; 1.2 TB/s of ICI
    "tpu7x": TpuTarget("tpu7x", "tpu7x", (2, 2, 1), 3, 2, 96 * GiB, 2307e12, 7370e9, 1200e9, splash=0.35),
}


class TpuTargetError(ValueError):
    """A TPU slice that cannot be planned here; the message says what would be accepted."""


def slice_shape(target: TpuTarget, chips: int) -> tuple[int, ...] | None:
    """The torus of `chips` chips of `target` as libtpu names it (2x4, 2x2x4, 4x4x8), or None when no slice has that
    many: one chip, or 2x2 (3-D: 2x2x1) doubled again and again along the last of its shortest sides."""
    if chips == 1:
        return (1,) * target.torus
    shape = [2, 2] if target.torus == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        shortest = min(shape)
        shape[max(i for i, side in enumerate(shape) if side == shortest)] *= 2
    return tuple(shape) if math.prod(shape) == chips else None


def sizes(target: TpuTarget, up_to: int = 1024) -> list[int]:
    """The device counts a slice of `target` can have, up to `up_to` chips."""
    chips = [n for n in (1, *(2**k for k in range(2, up_to.bit_length()))) if slice_shape(target, n)]
    return [n * target.devices_per_chip for n in chips]


def libtpu_installed() -> bool:
    """Whether libtpu (the TPU compiler) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def compile_only_tpus(target: TpuTarget, count: int) -> tuple:
    """`count` compile-only devices of a `target` slice; JAX runs on CPU if no platform was chosen yet (the compiles
    need a host backend, not a TPU). TpuTargetError when no slice has `count` devices or libtpu is missing (with the
    install command)."""
    chips, extra = divmod(count, target.devices_per_chip)
    shape = None if extra else slice_shape(target, chips)
    if shape is None:
        raise TpuTargetError(
            f"--devices={count}: a {target.name} slice has one of {', '.join(map(str, sizes(target)))}, ... devices"
            + (f" ({target.devices_per_chip} a chip)" if target.devices_per_chip > 1 else "")
        )
    if not libtpu_installed():
        raise TpuTargetError(f"compiling for {target.name} needs the TPU compiler: {TPU_INSTALL}")
    return _slice_devices(target, shape)


@functools.cache
def _slice_devices(target: TpuTarget, shape: tuple[int, ...]) -> tuple:
    """The devices of a `target` slice of torus `shape`, on hosts of the generation's chips, made once a process."""
    import jax
    from jax.experimental import topologies

    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    # libtpu takes a lock on /tmp for the chips it drives; compiling drives none, so processes that compile at once
    # (test workers, a plan beside a test) may each load it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    host = tuple(min(side, bound) for side, bound in zip((*shape, 1)[:3], target.host, strict=True))
    name = f"{target.topology}:{'x'.join(map(str, shape))}"
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=host).devices)
