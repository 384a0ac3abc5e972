"""Pieces shared by the context strategies: shard_map specs, global token indices of local pieces, the local kernel,
what a strategy's backward reads of its query rows."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from parallel import kernels, tensor
from parallel.kernels import Options, Tokens
from parallel.kernels.softmax import backward_delta
from parallel.mesh import logical_spec
from parallel.reorder import from_balanced, layout_index, to_balanced


def axis_names(axis) -> tuple[str, ...]:
    """'context' -> ('context',); ('context', 'ulysses') stays."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def axis_shards(mesh, axis) -> int:
    """Number of devices along one mesh axis or the product over several."""
    return math.prod(mesh.shape[name] for name in axis_names(axis))


def layout_shards(mesh, axis) -> int:
    """The ranks a row's layout is balanced over (parallel.settings.to_layout's `context`): the axis's, or the ring
    axis's under usp (axis = (ring axis, ulysses axis)), whose pieces the row is then split into in (ring, ulysses)
    order."""
    return axis_shards(mesh, axis_names(axis)[0])


def specs(mesh, axis):
    """PartitionSpecs of q / k-v ([batch, length, heads, d]) and segment ids ([batch, length]) with the length
    sharded over `axis`, batch and heads as the logical rules say."""
    batch = logical_spec(("batch",), mesh)[0]
    heads, kv_heads = logical_spec(("heads",), mesh)[0], logical_spec(("kv_heads",), mesh)[0]
    length = axis if isinstance(axis, str) else tuple(axis)
    return (
        PartitionSpec(batch, length, heads, None),
        PartitionSpec(batch, length, kv_heads, None),
        PartitionSpec(batch, length),
    )


def global_index(length: int, parallelism, shards: int) -> np.ndarray:
    """int32 [length]: original token index of each position of a sequence in `parallelism.layout` for `shards`
    ranks."""
    if parallelism.layout != "contiguous" and shards > 1:
        return layout_index(length, shards, parallelism.layout, parallelism.stripe)
    return np.arange(length, dtype=np.int32)


def local_piece(index: np.ndarray, shards: int, rank):
    """Rows of `index` [length] held by `rank` (traced) when split into `shards` equal pieces -> [length/shards]."""
    table = jnp.asarray(index.reshape(shards, -1))
    return lax.dynamic_index_in_dim(table, rank, axis=0, keepdims=False)


def kernel_options(parallelism, *, causal: bool, scale: float, window: int | None) -> Options:
    """The kernel options of a strategy's calls: `causal`, `scale`, `window` and the parallelism's block sizes, with a
    window at most max(64, W // 2) tokens: a block pair across the window's edge is computed whole, so blocks much
    longer than the window compute mostly masked pairs (bench/window.py)."""
    block_q, block_kv = parallelism.block_q, parallelism.block_kv
    if window is not None:
        block_q, block_kv = min(block_q, max(64, window // 2)), min(block_kv, max(64, window // 2))
    return Options(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv, window=window)


def kernel(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, parallelism):
    """The parallelism's attention kernel on q [batch, tq, heads, dqk], k / v [batch, tk, kv_heads, d] and the tokens of
    each side -> (out [batch, tq, heads, dv], lse [batch, tq, heads])."""
    return kernels.attention(q, k, v, q_tokens, kv_tokens, options, kernel=chosen_kernel(parallelism))


def chosen_kernel(parallelism) -> kernels.Kernel:
    """The parallelism's attention kernel for the devices it compiles for."""
    return kernels.select(
        parallelism.kernel,
        interpret=parallelism.interpret,
        backend=parallelism.platform,
        capability=parallelism.capability,
    )


def wants_original_order(parallelism) -> bool:
    """Whether the parallelism's kernel needs a sequence in original token order: the packed kernels (cuDNN's,
    FlashAttention-3's) describe each document as one run of increasing indices (parallel/kernels/packed.py), and
    tokamax's each query's keys as one range of them; the other kernels take any order."""
    return chosen_kernel(parallelism).name in kernels.ORDERED


def whole_sequence(q, k, v, seg, *, shards: int, options: Options, parallelism):
    """The parallelism's kernel over a whole sequence held in `parallelism.layout` for `shards` ranks: q [batch, length,
    heads, dqk], k/v [batch, length, kv_heads, d], seg [batch, length] (None = one document) -> (out [batch, length,
    heads, dv], lse [batch, length, heads]) in that layout. Under cuDNN without a window (which it leaves to its general
    kernel) the call runs in original order (static layout ops there and back), so it is the causal diagonal (or
    all-visible, non-causal) that cuDNN serves."""
    if wants_original_order(parallelism) and options.window is None:
        order = dict(layout=parallelism.layout if shards > 1 else "contiguous", stripe=parallelism.stripe, axis=1)
        seg = jnp.ones(q.shape[:2], jnp.int32) if seg is None else seg
        q, k, v, seg = (from_balanced(x, shards, **order) for x in (q, k, v, seg))
        tokens = Tokens(seg, np.arange(q.shape[1], dtype=np.int32))
        out, lse = kernel(q, k, v, tokens, tokens, options=options, parallelism=parallelism)
        return to_balanced(out, shards, **order), to_balanced(lse, shards, **order)
    tokens = Tokens(seg, global_index(q.shape[1], parallelism, shards))
    return kernel(q, k, v, tokens, tokens, options=options, parallelism=parallelism)


def run_sharded(local, mesh, axis, q, k, v, segment_ids, sinks=None, latent=None, latent_heads=()):
    """Runs `local(q, k, v, seg, sinks)` on each device's pieces (length sharded over `axis`, batch and heads as the
    logical rules say; sinks [heads] by heads, or None) and returns the global output [batch, length, heads, dv].
    None segment ids = one document. Given a `parallel.latent.Latent`, runs `local(q, k, v, seg, sinks, piece)` with
    piece = (rows [batch, n, kv_lora + rope] of this device, kv_b [kv_lora, heads here, nope + dv], nope), kv_b's
    heads split as the queries' and then over the mesh axes `latent_heads` (usp's Ulysses axis)."""
    q_spec, kv_spec, seg_spec = specs(mesh, axis)
    seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    optional = {}
    if sinks is not None:
        optional["sinks"] = sinks, PartitionSpec(q_spec[2])
    if latent is not None:
        group = tensor.AXIS if latent.tokens.shards > 1 else None
        heads = (*(axis_names(q_spec[2]) if q_spec[2] else ()), *axis_names(latent_heads))
        optional["rows"] = latent.tokens.grouped, PartitionSpec(group, *q_spec[:2], None)
        kv_b = latent.kv_b
        if latent_heads:  # gathered over the axes that split its rows first, then split over latent_heads locally:
            # a reshard from rows to heads split over other axes the partitioner can only do by replicating it whole
            kv_b = jax.lax.with_sharding_constraint(kv_b, NamedSharding(mesh, PartitionSpec(None, q_spec[2], None)))
        optional["kv_b"] = kv_b, PartitionSpec(None, heads or None, None)
    names = tuple(optional)

    def body(q, k, v, seg, *rest):
        given = dict(zip(names, rest, strict=True))
        if latent is None:
            return local(q, k, v, seg, given.get("sinks"))
        return local(q, k, v, seg, given.get("sinks"), (given["rows"][0], given["kv_b"], latent.nope))

    operands = (q, k, v, seg, *(x for x, _ in optional.values()))
    in_specs = (q_spec, kv_spec, kv_spec, seg_spec, *(spec for _, spec in optional.values()))
    in_specs, q_spec = tuple(mention_unit_axes(spec, mesh) for spec in in_specs), mention_unit_axes(q_spec, mesh)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)(*operands)


def mention_unit_axes(spec: PartitionSpec, mesh) -> PartitionSpec:
    """`spec` with every mesh axis of size 1 it leaves out added to its first dimension (the same layout).

    A shard_map with check_vma=False transposes an input by summing its cotangent over every mesh axis the input's
    spec leaves out. Over axes of size 1 that psum adds nothing, yet XLA keeps it: an all-reduce of every q / k / v
    gradient over one-device groups (JAX 0.12's XLA prints those groups as mesh axes, `replica_groups=mesh[...]
    {'fsdp','expert','context','ulysses'}`, older ones as `{{0},{1},...}`). Mentioning the axes leaves no psum."""
    used = {name for entry in spec if entry is not None for name in axis_names(entry)}
    unit = tuple(name for name in mesh.axis_names if mesh.shape[name] == 1 and name not in used)
    if not unit or not len(spec):
        return spec
    first = () if spec[0] is None else axis_names(spec[0])
    return PartitionSpec((*first, *unit), *spec[1:])


class RowTerms(NamedTuple):
    """What a strategy's kernel backward calls read of the query rows besides dout and lse: out [batch, n, heads, dv]
    and dlse [batch, n, heads] or None; or in their place delta [batch, n, heads] float32, computed once for all the
    calls by a kernel that takes it (parallel.kernels.Kernel.takes_delta), so out is freed before the first."""

    out: jax.Array | None
    dlse: jax.Array | None
    delta: jax.Array | None

    @classmethod
    def of(cls, impl: kernels.Kernel, out, dout, dlse) -> RowTerms:
        """The terms `impl`'s backward takes of the final out, its cotangent dout and the lse's dlse (or None)."""
        if impl.takes_delta:
            return cls(None, None, backward_delta(out, dout, dlse))
        return cls(out, dlse, None)

    def backward(self, impl: kernels.Kernel, q, k, v, q_tokens: Tokens, kv_tokens: Tokens, lse, dout, **options):
        """impl.backward of one call with these terms (options: its keywords, options= and accumulate= among them)."""
        given = options if self.delta is None else {**options, "delta": self.delta}
        return impl.backward(q, k, v, q_tokens, kv_tokens, self.out, lse, dout, self.dlse, **given)
