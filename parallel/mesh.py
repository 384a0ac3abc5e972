"""Device mesh from config and the one table mapping logical axis names to mesh axes.

Axes: data, fsdp, expert, context, ulysses, tensor (ulysses inside context, so Ulysses all-to-alls stay between
neighbouring devices; expert shards the experts and, for everything else, the batch). Written for multi-host:
after `jax.distributed.initialize()`, `jax.devices()` lists every host's devices and the same code builds the
global mesh.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "expert", "context", "ulysses", "tensor")

# logical axis -> mesh axes, in priority order. A mesh axis already used by an earlier dimension of
# the same array is dropped, so e.g. [batch, length, embed] activations shard embed nowhere while parameters shard
# their embed dimension over every fsdp and sequence-parallel device (ZeRO-3 style, gathered where used).
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("context", "ulysses"),
    "embed": ("fsdp", "context", "ulysses"),  # parameters: sequence-parallel devices hold shards too
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": ("expert", "context", "ulysses", "tensor"),  # expert parallelism (parallel/experts.py)
    "q_lora": ("fsdp", "context", "ulysses"),  # latent-attention parameters: sharded like embed (activations:
    "kv_lora": ("fsdp", "context", "ulysses"),  # their batch and length take these axes first)
    "head_dim": (),
    "index_heads": (),  # the sparse-attention indexer's heads (every device scores its queries with all of them)
    "norm": (),
    "taps": (),  # a convolution's taps (Gated DeltaNet)
    "layers": (),
}


class MeshError(ValueError):
    """The mesh sizes do not fit the devices or the batch."""


def mesh_shape(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Resolves one -1 axis so that the product of sizes equals `num_devices`."""
    fixed = math.prod(size for size in sizes.values() if size != -1)
    fills = [name for name, size in sizes.items() if size == -1]
    resolved = dict(sizes)
    if fills:
        if num_devices % fixed:
            raise MeshError(f"mesh {sizes}: {num_devices} devices are not divisible by the fixed axes' product {fixed}")
        resolved[fills[0]] = num_devices // fixed
    if math.prod(resolved.values()) != num_devices:
        raise MeshError(
            f"mesh {sizes} uses {math.prod(resolved.values())} devices but {num_devices} are available; "
            f"make the product of mesh sizes equal {num_devices} or set one axis to -1"
        )
    return resolved


def make_mesh(config, devices=None) -> Mesh:
    """Builds the mesh (axes data, fsdp, context, ulysses, tensor) from a MeshConfig-like object."""
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape({name: getattr(config, name) for name in AXES}, len(devices))
    grid = np.asarray(devices).reshape([shape[name] for name in AXES])
    return Mesh(grid, AXES)


def logical_spec(names, mesh: Mesh | None = None, shape: tuple[int, ...] | None = None) -> PartitionSpec:
    """PartitionSpec for logical axis names; mesh axes of size 1 or absent (when a mesh is given) are left out, and
    with a `shape` so are axes a dimension does not divide into (e.g. 2 key/value heads over tensor=4 replicate)."""
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        axes = tuple(
            a
            for a in LOGICAL_RULES.get(name, ())
            if name is not None and a not in used and (mesh is None or mesh.shape.get(a, 1) > 1)
        )
        if shape is not None and mesh is not None:
            kept, parts = [], 1
            for axis in axes:
                if shape[dim] % (parts * mesh.shape[axis]) == 0:
                    kept.append(axis)
                    parts *= mesh.shape[axis]
            axes = tuple(kept)
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def state_shardings(state, mesh: Mesh):
    """NamedSharding for every variable of an nnx state, from its `out_sharding` logical names (a mesh axis that
    does not divide a dimension is left out for it)."""

    def one(variable):
        names = variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape)
        return variable.replace(NamedSharding(mesh, logical_spec(names, mesh, variable.shape)))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of [batch, length] input arrays: batch over data x fsdp x expert, length over context x ulysses."""
    return NamedSharding(mesh, logical_spec(("batch", "length"), mesh))


def process_rows(mesh: Mesh, batch_size: int) -> np.ndarray:
    """int [rows]: the rows of a [batch_size, length] batch that this process's devices hold, in order (every row
    when the batch is not split across processes), as `jax.make_array_from_process_local_data` takes them."""
    held = batch_sharding(mesh).addressable_devices_indices_map((batch_size, mesh.size)).values()
    starts = sorted({index[0].indices(batch_size)[:2] for index in held})
    return np.concatenate([np.arange(start, stop) for start, stop in starts])


def batch_shards(mesh: Mesh) -> int:
    """How many pieces the batch axis is split into: the product of the mesh axes of the `batch` rule."""
    return math.prod(mesh.shape.get(axis, 1) for axis in LOGICAL_RULES["batch"])


def length_shards(mesh: Mesh) -> int:
    """How many pieces a sequence may be split into: the mesh axes of the `length` rule, times `tensor` (a
    scattered residual stream, parallel/tensor.py)."""
    return math.prod(mesh.shape.get(axis, 1) for axis in (*LOGICAL_RULES["length"], "tensor"))


def check_batch(batch_size: int, accum_steps: int, mesh: Mesh) -> None:
    """Each micro-batch (batch_size / accum_steps rows) must split evenly over the batch axes."""
    shards = batch_shards(mesh)
    if (batch_size // accum_steps) % shards:
        raise MeshError(
            f"train.batch_size={batch_size} / train.grad_accum_steps={accum_steps} must be divisible "
            f"by mesh {' x '.join(LOGICAL_RULES['batch'])} = {shards}"
        )
