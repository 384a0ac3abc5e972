"""How tokamax's kernels (the optional `tokamax` extra, Python >= 3.12: the experts' grouped matmul,
parallel/grouped.py, and flash attention, parallel/kernels/tokamax_attention.py) are traced into our programs.

tokamax picks its kernels' tiles for JAX's default device when it traces them, so they trace with the parallelism's
device as the default (a compile-only GPU when planning). Inside a shard_map its results are typed as the same on
every device whatever their operands vary over (JAX >= 0.11): JAX would then sum the cotangent of such a result over
the devices, and a custom VJP's gradient must vary as its primal does; so results are given the axes they vary over.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging

import jax

INSTALL = "pip install 'longctx[tokamax]' (Python >= 3.12)"


def installed() -> bool:
    """Whether tokamax is installed here (found, not imported)."""
    return importlib.util.find_spec("tokamax") is not None


def traced_for(device):
    """Context: JAX's default device is `device` (None: as it is)."""
    return contextlib.nullcontext() if device is None else jax.default_device(device)


def axes_of(x: jax.Array) -> frozenset:
    """The mesh axes x varies over (empty outside a shard_map)."""
    return jax.typeof(x).manual_axis_type.varying


def typed_as(x: jax.Array, axes) -> jax.Array:
    """x summed over the mesh axes it varies over and `axes` do not hold, and marked varying over those of `axes` it
    does not vary over."""
    extra = tuple(sorted(axes_of(x) - axes))
    x = jax.lax.psum(x, extra) if extra else x
    missing = tuple(sorted(axes - axes_of(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


@functools.cache
def quiet_cache_misses() -> None:
    """Leaves out of the log tokamax's warning for each shape its autotuning cache lacks (it then uses its
    heuristics): one long line per kernel shape of every plan and run."""
    logging.getLogger("absl").addFilter(lambda record: not str(record.msg).startswith("Autotuning cache miss"))
