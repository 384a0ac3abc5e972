"""Expert parallelism: the routed experts of a mixture-of-experts block inside one shard_map over the whole mesh.

Tokens stay where the residual stream has them. Each device routes its own tokens, sends every (token, expert)
assignment to the device that holds the expert with one all-to-all over the expert-parallel axes, runs its local
experts, and gets the results back with a second all-to-all: nothing gathers all tokens or all experts, and no
sort spans more than one device's tokens.

Expert-parallel axes: `expert`, then `context`, `ulysses` and `tensor` while the product of their sizes divides
the number of experts (the rule that shards the matrices' `experts` dimension, parallel/mesh.py). Every other axis
the tokens are split over (data, fsdp, a sequence axis that does not divide) is data parallelism for the experts:
their matrices are gathered over it, as FSDP gathers any layer. Where the residual stream is replicated (`tensor`
without scattering), each copy takes its share of the length and the outputs are all-gathered at the end.

Dispatch (parallelism.expert_dispatch):
The buffers are sized by factor = parallelism.expert_capacity (1 = exactly the balanced load).
- `capacity` (every backend): per (source device, expert) a buffer of C = ceil(factor x tokens x k / experts)
  rows, one tiled all-to-all there and one back, the local experts as batched einsums. Assignments past C, in
  (token, k) order, are dropped (weight zero) and counted.
- `ragged` (GPU/TPU): the routed rows themselves, one slice per expert, by `ragged_all_to_all` into a receive
  buffer of ceil(factor x tokens x k) rows grouped by expert, and the grouped matmul (parallel/grouped.py) over the
  local experts. Rows that do not fit, last experts' last sources first, are dropped and counted. Dropless (factor
  inf), the buffer holds COMMON_LOAD x the balanced load, and only a step in which some device would receive more
  runs a run-time branch that sends the tokens in passes over pieces of them, each piece's worst case (every
  source's piece to one device) within a buffer of that size: the element-wise work around the grouped matmul costs
  the usual load, and no buffer is sized by the worst case of all tokens (16 x the usual one over DeepSeek-V3's 128
  expert devices). XLA:CPU cannot compile it.
Without expert-parallel axes (one device, or none divides the experts), every device runs all experts on its own
tokens, dropless; so do all tokens when their shape does not split over the mesh (a sampled prompt). Local tokens
pass through in chunks of at most parallelism.expert_chunk tokens (a scan with remat), so the dispatch scratch does not
grow with the local sequence.

What a load-balancing loss reads comes back per row of the batch: the assignments and the router's probabilities
summed per expert over each row's tokens, psum'd over the axes that split the length only (a row's pieces), so a
per-sequence loss sees whole rows under context parallelism.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from parallel.grouped import filled
from parallel.kernels.visible import FALLBACK
from parallel.mesh import logical_spec, spec_axes
from parallel.parallelism import current_parallelism
from parallel.rounding import ceil_div
from parallel.tensor import token_layout

DISPATCHES = ("capacity", "ragged")
COMMON_LOAD = 2.0  # dropless ragged dispatch: the usual receive buffer, x the balanced load (see _ragged)
# (tokens [n, embed], *params) -> (weights [n, k], experts [n, k], router probabilities [n, experts])
Route = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
Ffn = Callable[..., jax.Array]  # (rows, *matrices, group_sizes=None) -> rows, see `routed_experts`


def expert_axes(mesh, num_experts: int) -> tuple[str, ...]:
    """The expert-parallel mesh axes: those the `experts` dimension of an expert kernel is sharded over."""
    return spec_axes(logical_spec(("experts",), mesh, (num_experts,))[0])


def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Rows per (source device, expert) of the capacity dispatch: ceil(factor x tokens x k / experts), at most
    `tokens` (a token picks an expert once): factor = inf never drops a token."""
    return max(1, tokens if math.isinf(factor) else min(tokens, math.ceil(factor * tokens * k / num_experts)))


def receive_rows(tokens: int, k: int, factor: float, sources: int, local_experts: int) -> int:
    """Receive-buffer rows per device of the ragged dispatch: ceil(factor x tokens x k), factor x the balanced load,
    at most what `sources` devices of `tokens` tokens can send to `local_experts` experts (factor = inf: that
    bound, never dropping)."""
    most = sources * tokens * min(k, local_experts)
    return max(1, most if math.isinf(factor) else min(most, math.ceil(factor * tokens * k)))


def ragged_as_capacity(factor: float, k: int, num_experts: int, sources: int) -> float:
    """The capacity factor whose capacity dispatch holds as many rows per device as the ragged dispatch's receive
    buffer at `factor` over `sources` expert-parallel devices (a CPU memory plan of a ragged run): dropless, its usual
    buffer (COMMON_LOAD, or the worst case where that is smaller), which its passes do not exceed."""
    return min(COMMON_LOAD, sources * min(k, num_experts // sources) / k) if math.isinf(factor) else factor


class Routed(NamedTuple):
    """What `routed_experts` returns; all but y float32, summed over each row's tokens on every device (counts,
    probabilities) or over every token (dropped)."""

    y: jax.Array  # [batch, length, embed] in x's dtype and layout
    counts: jax.Array  # routed assignments per row and expert [batch, experts]
    dropped: jax.Array  # assignments past the dispatch capacity []
    probabilities: jax.Array  # the router's probabilities summed per row and expert [batch, experts] (a loss's)


def routed_experts(x: jax.Array, route: Route, route_params, ffn: Ffn, matrices, *, num_experts: int) -> Routed:
    """Routed experts of the tokens x [batch, length, embed] (residual stream layout).

    route(tokens [n, embed], *route_params) -> (weights [n, k] float32, experts [n, k] int32, probabilities [n,
    experts] float32) runs on each device's tokens; ffn(rows [experts, rows, embed], *matrices) -> the same shape
    runs the experts batched, and ffn(rows [rows, embed], *matrices, group_sizes=[experts]) grouped; matrices:
    [num_experts, ...] arrays. Gradients flow to the probabilities' sums as to y."""
    mesh = jax.sharding.get_abstract_mesh()
    parallelism = current_parallelism()
    if parallelism.expert_dispatch not in DISPATCHES:
        raise ValueError(
            f"expert dispatch {parallelism.expert_dispatch!r} is unknown; available: {', '.join(DISPATCHES)}"
        )
    layout = token_layout(mesh, x.shape)
    if layout is None:  # one device, or a shape that does not split (e.g. a sampled prompt): placed by the partitioner
        routed = _routed(route, route_params, lambda t, a: _dropless(t, a, ffn, matrices, num_experts), num_experts)
        return Routed(*_chunked(x, parallelism.expert_chunk, routed))
    spec, token_axes, replicated = layout
    shares = math.prod(mesh.shape[a] for a in replicated)
    axes = expert_axes(mesh, num_experts)
    dispatch = {"capacity": _capacity, "ragged": _ragged}[parallelism.expert_dispatch]
    out_spec = PartitionSpec(spec[0], (*spec_axes(spec[1]), *replicated) or None, *spec[2:])  # the copies, split

    def local(x, route_params, matrices):
        if replicated:  # each copy takes its share of the length; the partitioner gathers the outputs
            share = x.shape[1] // shares
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(replicated) * share, share, axis=1)

        def dispatched(t, assignment):
            if not axes:
                return _dropless(t, assignment, ffn, matrices, num_experts)
            return dispatch(t, assignment, ffn, matrices, num_experts, parallelism.expert_capacity, axes)

        y, counts, dropped, probabilities = _chunked(
            x, parallelism.expert_chunk, _routed(route, route_params, dispatched, num_experts)
        )
        row_axes = spec_axes(spec[1]) + replicated  # the axes holding pieces of one row
        counts, probabilities = jax.lax.psum((counts, probabilities), row_axes)
        return Routed(y, counts, jax.lax.psum(dropped, token_axes + replicated), probabilities)

    specs = (spec, PartitionSpec(), PartitionSpec(axes or None))
    rows = PartitionSpec(spec[0])
    routed = jax.shard_map(
        local, mesh=mesh, in_specs=specs, check_vma=True, out_specs=Routed(out_spec, rows, PartitionSpec(), rows)
    )(x, tuple(route_params), tuple(matrices))
    return routed._replace(y=jax.lax.with_sharding_constraint(routed.y, spec))


def _routed(route: Route, route_params, dispatch, num_experts: int):
    """(tokens [m, embed], their rows [m] int32, rows in all) -> (y [m, embed], counts [rows, experts], dropped [],
    probabilities [rows, experts]) float32 but y: routed by route(tokens, *route_params), the assignments sent by
    dispatch(tokens, (weights, experts)) -> (y, dropped), counts and probabilities summed per row."""

    def run(tokens, row, rows):
        weights, experts, probabilities = route(tokens, *route_params)
        y, dropped = dispatch(tokens, (weights, experts))
        counts = jnp.zeros((rows, num_experts), jnp.float32).at[row[:, None], experts].add(1.0)
        by_row = jax.ops.segment_sum(probabilities.astype(jnp.float32), row, num_segments=rows)
        return y, counts, dropped.astype(jnp.float32), by_row

    return run


def _chunked(x, chunk: int, run):
    """run(tokens [m, embed], row [m], rows) -> (y [m, embed], sums...) over the tokens of x [batch, length, embed]
    in chunks of at most `chunk` tokens (0 = all at once): a scan whose steps are rematerialised in the backward
    pass; the sums (counts, drops, ...) are summed -> (y [batch, length, embed], sums...)."""
    batch, length, d = x.shape
    n = batch * length
    tokens, row = x.reshape(n, d), jnp.arange(n, dtype=jnp.int32) // length
    pieces = next(p for p in range(ceil_div(n, chunk) if chunk else 1, n + 1) if n % p == 0)
    if pieces == 1:
        y, *sums = run(tokens, row, batch)
        return y.reshape(x.shape), *sums

    def step(_, piece):
        return None, run(*piece, batch)

    _, (y, *sums) = jax.lax.scan(jax.checkpoint(step), None, (tokens.reshape(pieces, -1, d), row.reshape(pieces, -1)))
    return y.reshape(x.shape), *(s.sum(0) for s in sums)


def _combine(rows: jax.Array, index: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """sum_j weights[:, j] x rows[index[:, j]] accumulated in float32, one [tokens, embed] term at a time (no
    float32 [tokens x k, embed] buffer); an index past the rows (a dropped assignment) contributes zero.
    rows [m, embed], index / weights [tokens, k] -> [tokens, embed] in `dtype`."""
    y = jnp.zeros((index.shape[0], rows.shape[-1]), jnp.float32)
    for j in range(index.shape[1]):
        picked = jnp.take(rows, index[:, j], axis=0, mode="fill", fill_value=0)
        y = y + weights[:, j, None] * picked.astype(jnp.float32)
    return y.astype(dtype)


def _sort_by_expert(experts: jax.Array, num_experts: int):
    """experts [n, k] -> (order [n * k]: assignments sorted by expert, stable; position of each assignment in that
    order [n * k]; assignments per expert [experts] int32)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(flat.size, dtype=order.dtype), unique_indices=True)
    return order, position, jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def _dropless(tokens, assignment, ffn, matrices, num_experts):
    """All experts on the local tokens [n, embed], every assignment kept: rows sorted by expert, grouped ffn."""
    weights, experts = assignment
    n, k = experts.shape
    order, position, counts = _sort_by_expert(experts, num_experts)
    out = ffn(jnp.take(tokens, order // k, axis=0), *matrices, group_sizes=counts)
    return _combine(out, position.reshape(n, k), weights, tokens.dtype), jnp.zeros((), jnp.int32)


def _capacity(tokens, assignment, ffn, matrices, num_experts, factor, axes):
    """Capacity dispatch of the local tokens [n, embed] to the experts over mesh `axes` (see the module doc)."""
    weights, experts = assignment
    n, k = experts.shape
    d = tokens.shape[-1]
    cap = capacity(n, k, num_experts, factor)
    flat = experts.reshape(-1)
    _, position, counts = _sort_by_expert(experts, num_experts)
    rank = position - (jnp.cumsum(counts) - counts)[flat]  # place among the same expert's assignments
    slot = jnp.where(rank < cap, flat * cap + rank, num_experts * cap)  # past the buffer = dropped
    filler = (
        jnp.full((num_experts * cap,), n * k, jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32), mode="drop")
    )
    buffer = jnp.take(tokens, filler // k, axis=0, mode="fill", fill_value=0)  # [experts x cap, embed]
    shards = jax.lax.axis_size(axes)
    local = num_experts // shards
    received = jax.lax.all_to_all(buffer.reshape(shards, local, cap, d), axes, 0, 0, tiled=True)  # [source, ...]
    out = ffn(received.swapaxes(0, 1).reshape(local, shards * cap, d), *matrices)
    out = jax.lax.all_to_all(out.reshape(local, shards, cap, d).swapaxes(0, 1), axes, 0, 0, tiled=True)
    y = _combine(out.reshape(num_experts * cap, d), slot.reshape(n, k), weights, tokens.dtype)
    return y, jnp.sum(rank >= cap)


class RaggedLayout(NamedTuple):
    """Arguments of the two `ragged_all_to_all`s of one device (see `ragged_layout`)."""

    send_offsets: jax.Array  # [experts]: where each expert's rows start in this device's sorted rows
    send_sizes: jax.Array  # [experts]: rows sent to each expert (its device) after overflow
    remote_offsets: jax.Array  # [experts]: where they land in that device's receive buffer
    recv_sizes: jax.Array  # [devices x local experts]: rows received from (source, local expert)
    recv_offsets: jax.Array  # [devices x local experts]: where those rows sit in the receive buffer
    home_offsets: jax.Array  # [devices x local experts]: where they came from in the source's sorted rows
    group_sizes: jax.Array  # [local experts]: received rows per local expert, contiguous from row 0


def ragged_layout(table: jax.Array, me, rows: int) -> RaggedLayout:
    """Offsets and sizes of the ragged dispatch for device `me` (an index over the expert-parallel devices).

    table [devices, experts]: assignments per (source device, expert), the same on every device. A device's
    receive buffer holds `rows` rows ordered by (local expert, source device); what lies past `rows` is dropped."""
    devices, num_experts = table.shape
    local = num_experts // devices
    per_device = table.sum(0).reshape(devices, local)
    expert_start = (jnp.cumsum(per_device, axis=1) - per_device).reshape(num_experts)
    landing = expert_start[None] + jnp.cumsum(table, axis=0) - table  # [source, expert] in the expert's device
    allowed = jnp.clip(rows - landing, 0, table)
    sorted_start = jnp.cumsum(table, axis=1) - table  # [source, expert] in the source's sorted rows

    def mine(a):  # [source, expert] -> [source x local expert] of the experts on device `me`
        return jax.lax.dynamic_slice_in_dim(a, me * local, local, axis=1).reshape(-1)

    return RaggedLayout(
        send_offsets=sorted_start[me],
        send_sizes=allowed[me],
        remote_offsets=landing[me],
        recv_sizes=mine(allowed),
        recv_offsets=mine(landing),
        home_offsets=mine(sorted_start),
        group_sizes=mine(allowed).reshape(devices, local).sum(0),
    )


def _ragged(tokens, assignment, ffn, matrices, num_experts, factor, axes):
    """Ragged dispatch of the local tokens [n, embed] to the experts over mesh `axes` (see the module doc).
    Dropless, the receive buffer holds COMMON_LOAD x the balanced load, and a step in which some device would
    receive more runs `_in_passes` instead: a run-time branch that every device takes alike (all know the table), in
    the `fallback` scope the speed estimate leaves out."""
    weights, experts = assignment
    n, k = experts.shape
    sent, position, counts, table = _routed_rows(tokens, experts, num_experts, axes)
    sources = jax.lax.axis_size(axes)
    local = num_experts // sources
    rows = receive_rows(n, k, factor, sources, local)
    operands = (sent, position, weights, counts, table, ffn, matrices, axes)
    common = receive_rows(n, k, COMMON_LOAD, sources, local)
    if not math.isinf(factor) or common >= rows:
        return _exchange(*operands, rows)
    fullest = jnp.max(table.sum(0).reshape(sources, local).sum(1))  # rows the fullest device receives

    # Each branch rematerialized: differentiated, a branch keeps for the backward what either branch needs, the usual
    # one writing zeros for the other's buffers; a rematerialized branch keeps only its operands.
    def usual():
        return jax.checkpoint(functools.partial(_exchange, rows=common), static_argnums=(5, 7))(*operands)

    @jax.checkpoint
    def worst_case(tokens, weights, experts, matrices):
        with jax.named_scope(FALLBACK):
            return _in_passes(tokens, (weights, experts), ffn, matrices, num_experts, axes, common)

    return jax.lax.cond(fullest > common, lambda: worst_case(tokens, weights, experts, matrices), usual)


def _in_passes(tokens, assignment, ffn, matrices, num_experts, axes, common: int):
    """The dropless ragged dispatch of the local tokens [n, embed] in passes over equal pieces of them, as few as
    let a receive buffer of at most `common` rows hold a piece's worst case (every source's piece to one device's
    experts); one piece of each token if none does. A scan of known length: (outputs [n, embed], 0 dropped)."""
    weights, experts = assignment
    (n, k), d = experts.shape, tokens.shape[-1]
    sources = jax.lax.axis_size(axes)
    local = num_experts // sources

    def worst(piece: int) -> int:
        return receive_rows(piece, k, math.inf, sources, local)

    passes = next((p for p in range(1, n + 1) if n % p == 0 and worst(n // p) <= common), n)

    def one(piece):
        tokens, weights, experts = piece
        sent, position, counts, table = _routed_rows(tokens, experts, num_experts, axes)
        return _exchange(sent, position, weights, counts, table, ffn, matrices, axes, worst(n // passes))

    pieces = (tokens.reshape(passes, -1, d), weights.reshape(passes, -1, k), experts.reshape(passes, -1, k))
    y, dropped = jax.lax.map(jax.checkpoint(one), pieces)  # each pass's buffers recomputed in the backward
    return y.reshape(n, d), dropped.sum()


def _routed_rows(tokens, experts, num_experts: int, axes):
    """The local tokens [n, embed] as the rows their assignments experts [n, k] send: (rows [n * k, embed] sorted by
    expert, so by device; each assignment's place among them [n * k]; assignments per expert [experts]; that count
    of every device [devices, experts])."""
    order, position, counts = _sort_by_expert(experts, num_experts)
    sent = jnp.take(tokens, order // experts.shape[1], axis=0)
    return sent, position, counts, jax.lax.all_gather(counts, axes)


def _exchange(sent, position, weights, counts, table, ffn, matrices, axes, rows: int):
    """The ragged dispatch of the rows `sent` [n * k, embed] (sorted by expert) through a receive buffer of `rows`
    rows: (outputs [n, embed], assignments dropped [])."""
    n, k = weights.shape
    d = sent.shape[-1]
    layout = ragged_layout(table, jax.lax.axis_index(axes), rows)
    # The receive buffers vary over the devices as the rows do (zeros_like keeps `sent`'s varying axes):
    # ragged_all_to_all types its result by its output buffer, and from an invariant one JAX would sum the
    # received rows' gradient over every device before sending it home.
    received = jax.lax.ragged_all_to_all(
        sent,
        jnp.zeros_like(sent, shape=(rows, d)),
        layout.send_offsets,
        layout.send_sizes,
        layout.remote_offsets,
        layout.recv_sizes,
        axis_name=axes,
    )
    with filled(min(1.0, n * k / rows)):  # a balanced load: n x k rows on each device
        out = ffn(received, *matrices, group_sizes=layout.group_sizes)
    out = jnp.where(jnp.arange(rows)[:, None] < layout.group_sizes.sum(), out, 0)  # rows past the groups: padding
    back = jax.lax.ragged_all_to_all(
        out,
        jnp.zeros_like(sent),
        layout.recv_offsets,
        layout.recv_sizes,
        layout.home_offsets,
        layout.send_sizes,
        axis_name=axes,
    )
    y = _combine(back, position.reshape(n, k), weights, sent.dtype)  # dropped rows came back as zeros
    return y, jnp.sum(counts - layout.send_sizes)
