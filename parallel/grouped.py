"""The grouped matmul of the experts, rows [m, k] sorted by group x w [groups, k, n] with group_sizes [groups] ->
[m, n] (rows past the groups are padding, their results unspecified), by the implementation the parallelism names:

- `xla`: `jax.lax.ragged_dot`. XLA's TPU compiler runs it as a grouped matmul; XLA's GPU compiler expands it into one
  dense matmul over every group ([m, groups x k] x [groups x k, n]: groups times the FLOPs, and that operand in HBM).
- `tokamax`: tokamax's Mosaic GPU kernel (an optional extra, Python >= 3.12): tiles of one group's rows, the tiles
  past the groups skipped, and a custom VJP of two more grouped kernels.

Each call runs in the named scope `grouped_matmul`, inside `grouped_matmul_filled_<share>` where the ragged dispatch
(parallel/experts.py) says what share of its receive buffer, sized for a device's worst case, a balanced load fills:
the speed estimate (train/planning/speed.py) costs a kernel that skips the empty rows at that share.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging

import jax

from parallel.parallelism import current_parallelism

GROUPED_MATMULS = ("xla", "tokamax")
SCOPE = "grouped_matmul"
FILLED = "grouped_matmul_filled_{share:.4f}"
TOKAMAX_INSTALL = "pip install 'longctx[tokamax]' (Python >= 3.12)"


def tokamax_installed() -> bool:
    """Whether tokamax is installed here (found, not imported)."""
    return importlib.util.find_spec("tokamax") is not None


def filled(share: float):
    """Context: the grouped matmuls traced inside fill `share` of their rows under a balanced load."""
    return jax.named_scope(FILLED.format(share=share))


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [m, k] sorted by group, w [groups, k, n], group_sizes [groups] int32 -> [m, n] in x's dtype."""
    with jax.named_scope(SCOPE):
        parallelism = current_parallelism()
        if parallelism.grouped_matmul == "tokamax":
            varying = (_varying(x), _varying(w))
            return _tokamax(parallelism.device, varying, x, w, group_sizes)
        return jax.lax.ragged_dot(x, w, group_sizes)


# tokamax picks its kernels' tiles for JAX's default device when it traces them, so they trace with the parallelism's
# device as the default (a compile-only GPU when planning). Inside a shard_map its kernels' results are typed as the
# same on every device whatever their operands vary over, and JAX would then sum the cotangent of such a result over
# the devices; so the forward gives out the mesh axes x and w vary over, and the backward calls the kernels itself (dx:
# the grouped matmul with w transposed; dw: per group x^T dout; tokamax's own backward fails on the types) and gives
# each gradient the axes its primal varies over.
WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tokamax(device, varying, x, w, group_sizes):
    with _default(device):
        out = _tokamax_module().ragged_dot(x, w, group_sizes, implementation="mosaic_gpu")
    return _varying_as(out, varying[0] | varying[1])


def _tokamax_forward(device, varying, x, w, group_sizes):
    return _tokamax(device, varying, x, w, group_sizes), (x, w, group_sizes)


def _tokamax_backward(device, varying, residuals, dout):
    x, w, group_sizes = residuals
    tokamax = _tokamax_module()
    with _default(device):
        dx = tokamax.ragged_dot(dout, w.swapaxes(1, 2), group_sizes, implementation="mosaic_gpu")
        dw = tokamax.ragged_dot_general(x, dout, group_sizes, WEIGHT_GRADIENT, implementation="mosaic_gpu")
    return _varying_as(dx.astype(x.dtype), varying[0]), _varying_as(dw.astype(w.dtype), varying[1]), None


_tokamax.defvjp(_tokamax_forward, _tokamax_backward)


def _varying_as(cotangent: jax.Array, axes) -> jax.Array:
    """`cotangent` summed over the mesh axes it varies over and its primal does not, and marked varying over those
    the primal varies over and it does not."""
    extra = tuple(sorted(_varying(cotangent) - axes))
    cotangent = jax.lax.psum(cotangent, extra) if extra else cotangent
    missing = tuple(sorted(axes - _varying(cotangent)))
    return jax.lax.pcast(cotangent, missing, to="varying") if missing else cotangent


def _varying(x: jax.Array) -> frozenset:
    """The mesh axes x varies over inside a shard_map (JAX >= 0.11, which tokamax needs)."""
    return jax.typeof(x).manual_axis_type.varying


def _tokamax_module():
    """tokamax (the optional extra: parallel.settings refuses `tokamax` where it is not installed)."""
    import tokamax

    _quiet_cache_misses()
    return tokamax


@functools.cache
def _quiet_cache_misses() -> None:
    """Leaves out of the log tokamax's warning for each shape its autotuning cache lacks (it then uses its
    heuristics): one long line per kernel shape of every plan and run."""
    logging.getLogger("absl").addFilter(lambda record: not str(record.msg).startswith("Autotuning cache miss"))


def _default(device):
    return contextlib.nullcontext() if device is None else jax.default_device(device)
