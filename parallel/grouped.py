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

import functools

import jax

from parallel import tokamax_calls
from parallel.parallelism import current_parallelism

GROUPED_MATMULS = ("xla", "tokamax")
SCOPE = "grouped_matmul"
FILLED = "grouped_matmul_filled_{share:.4f}"


def filled(share: float):
    """Context: the grouped matmuls traced inside fill `share` of their rows under a balanced load."""
    return jax.named_scope(FILLED.format(share=share))


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [m, k] sorted by group, w [groups, k, n], group_sizes [groups] int32 -> [m, n] in x's dtype."""
    with jax.named_scope(SCOPE):
        parallelism = current_parallelism()
        if parallelism.grouped_matmul == "tokamax":
            axes = (tokamax_calls.axes_of(x), tokamax_calls.axes_of(w))
            return _tokamax(parallelism.device, axes, x, w, group_sizes)
        return jax.lax.ragged_dot(x, w, group_sizes)


# tokamax's kernels traced as parallel/tokamax_calls.py says: the forward gives out the mesh axes x and w vary over, and
# the backward calls the kernels itself (dx: the grouped matmul with w transposed; dw: per group x^T dout; tokamax's
# own backward fails on the types) and gives each gradient the axes its primal varies over.
WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tokamax(device, axes, x, w, group_sizes):
    with tokamax_calls.traced_for(device):
        out = _tokamax_module().ragged_dot(x, w, group_sizes, implementation="mosaic_gpu")
    return tokamax_calls.typed_as(out, axes[0] | axes[1])


def _tokamax_forward(device, axes, x, w, group_sizes):
    return _tokamax(device, axes, x, w, group_sizes), (x, w, group_sizes)


def _tokamax_backward(device, axes, residuals, dout):
    x, w, group_sizes = residuals
    tokamax = _tokamax_module()
    with tokamax_calls.traced_for(device):
        dx = tokamax.ragged_dot(dout, w.swapaxes(1, 2), group_sizes, implementation="mosaic_gpu")
        dw = tokamax.ragged_dot_general(x, dout, group_sizes, WEIGHT_GRADIENT, implementation="mosaic_gpu")
    return (
        tokamax_calls.typed_as(dx.astype(x.dtype), axes[0]),
        tokamax_calls.typed_as(dw.astype(w.dtype), axes[1]),
        None,
    )


_tokamax.defvjp(_tokamax_forward, _tokamax_backward)


def _tokamax_module():
    """tokamax (the optional extra: parallel.settings refuses `tokamax` where it is not installed)."""
    import tokamax

    tokamax_calls.quiet_cache_misses()
    return tokamax
