"""DeepSeek sparse attention split over context devices equals one device: outputs, the indexer's loss and the
gradients of q, the latent rows, kv_b and the indexer's queries, keys and weights, on packed and unpacked rows, for
ring 4, ring 2 x tensor 2 (heads split) and usp 2 x 2 by default, and every strategy over 2, 4 or 8 devices in both
balanced layouts (slow), rows laid out as the trainer lays them (balanced over the ring's ranks); the devices gather
the row's latents and indexer keys (no K/V and no [T, T] array). The dense warm-up's loss likewise."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced, to_balanced
from parallel.tensor import Tokens
from tests.parallel.attention_reference import packed_segments, relative_error

BATCH, LENGTH, HEADS, LORA, ROPE, NOPE, DV, INDEX_HEADS, INDEX_DIM, COUNT = 2, 64, 4, 12, 4, 8, 16, 3, 8, 6


def inputs():
    """q, latent rows, kv_b, the indexer's queries, keys and weights (positive dot products: no ties among scores,
    so every layout selects the same keys), the output's cotangent."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    positive = lambda *shape: jnp.abs(normal(*shape)) + 0.1
    q, rows, kv_b = (
        normal(BATCH, LENGTH, HEADS, NOPE + ROPE),
        normal(BATCH, LENGTH, LORA + ROPE),
        normal(LORA, HEADS, NOPE + DV) / 4,
    )
    indexer_out = (
        positive(BATCH, LENGTH, INDEX_HEADS, INDEX_DIM),
        positive(BATCH, LENGTH, INDEX_DIM),
        positive(BATCH, LENGTH, INDEX_HEADS),
    )
    return q, rows, kv_b, indexer_out, normal(BATCH, LENGTH, HEADS, DV)


def attend(q, rows, kv_b, indexer_out, seg):
    """-> (out, the indexer's loss)."""
    return parallel.sparse_attention(
        q, parallel.Latent(Tokens(rows[None]), kv_b, NOPE), indexer_out=parallel.IndexerOutput(*indexer_out),
        count=COUNT, segment_ids=seg, scale=0.3,
    )  # fmt: skip


def one_device(q, rows, kv_b, indexer_out, seg, cotangents):
    out, pull = jax.vjp(lambda *x: attend(*x, seg), q, rows, kv_b, indexer_out)
    return out, pull(cotangents)


def warmup(q, rows, kv_b, indexer_out, seg):
    latent = parallel.Latent(Tokens(rows[None]), kv_b, NOPE)
    return parallel.indexer_warmup(
        q, latent, indexer_out=parallel.IndexerOutput(*indexer_out), segment_ids=seg, scale=0.3
    )


@pytest.mark.parametrize(
    "strategy, ring, ulysses, tensor, layout",
    [
        ("ring", 4, 1, 1, "dual_chunk"),
        ("ring", 2, 1, 2, "dual_chunk"),
        ("usp", 2, 2, 1, "dual_chunk"),  # each ring rank's piece split over the Ulysses ranks
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [
                ("ring", 8, 1, 1, "dual_chunk"),
                ("ring", 2, 1, 1, "striped"),
                ("all_gather", 2, 1, 1, "dual_chunk"),
                ("all_gather", 8, 1, 1, "striped"),
                ("all_gather", 2, 1, 1, "contiguous"),
                ("ulysses", 4, 1, 1, "striped"),
                ("ulysses", 2, 1, 1, "dual_chunk"),
                ("usp", 2, 2, 1, "striped"),
                ("usp", 2, 4, 1, "dual_chunk"),
            ]
        ),
    ],
)
def test_context_split_matches_one_device(strategy, ring, ulysses, tensor, layout):
    devices = np.array(jax.devices()[: ring * ulysses * tensor])
    if strategy == "usp":
        mesh, axis = Mesh(devices.reshape(ring, ulysses), ("context", "ulysses")), ("context", "ulysses")
    else:
        mesh, axis = Mesh(devices.reshape(ring, tensor), ("context", "tensor")), "context"
    order = dict(layout=layout, stripe=2, axis=1)  # over the ring's ranks, as the trainer lays rows out (to_layout)
    q, rows, kv_b, indexer_out, w = inputs()
    cotangents = (w, jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, LENGTH)), jnp.float32))

    def run(q, rows, kv_b, indexer_out, seg):
        laid = lambda x: to_balanced(x, ring, **order)

        def split(q, rows, kv_b, indexer_out):
            outputs = attend(laid(q), laid(rows), kv_b, [laid(x) for x in indexer_out], laid(seg))
            return tuple(from_balanced(x, ring, **order) for x in outputs)

        outputs, pull = jax.vjp(split, q, rows, kv_b, indexer_out)
        return outputs, pull(cotangents)

    packed = jnp.asarray(packed_segments(BATCH, LENGTH, seed=ring))
    parallelism = Parallelism(strategy=strategy, axis=axis, layout=layout, stripe=2)
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        lowered = jax.jit(run, in_shardings=NamedSharding(mesh, PartitionSpec())).lower(
            q, rows, kv_b, indexer_out, packed
        )
        program, compiled = lowered.as_text(), lowered.compile()
        results = [
            (seg, compiled(q, rows, kv_b, indexer_out, seg)) for seg in (packed, jnp.ones((BATCH, LENGTH), jnp.int32))
        ]
    gathered = set(re.findall(r"all_gather.*-> (tensor<[^>]*>)", program))
    whole = f"tensor<{BATCH}x{LENGTH}x"
    assert gathered == {f"{whole}{LORA + ROPE}xf32>", f"{whole}{INDEX_DIM}xf32>", f"{whole[:-1]}xi32>"}, gathered
    for seg, (outputs, grads) in results:
        want, want_grads = one_device(q, rows, kv_b, indexer_out, seg, cotangents)
        label = f"{strategy} {ring}x{ulysses}x{tensor} {layout} packed={seg is packed}"
        for name, got, ref in zip(("out", "indexer loss"), outputs, want, strict=True):
            assert relative_error(got, ref) < 2e-5, f"{label}: {name}"
        names = ("q", "rows", "kv_b", "indexer queries", "indexer keys", "indexer weights")
        for name, got, ref in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            assert relative_error(got, ref) < 2e-5, f"{label}: d{name}"


@pytest.mark.parametrize(
    "strategy, ring, tensor, layout",
    [("ring", 2, 2, "striped"), pytest.param("ring", 8, 1, "dual_chunk", marks=pytest.mark.slow)],
)
def test_dense_warmup_loss_split_matches_one_device(strategy, ring, tensor, layout):
    """The warm-up's loss and the gradients of the indexer's queries, keys and weights, packed rows."""
    mesh = Mesh(np.array(jax.devices()[: ring * tensor]).reshape(ring, tensor), ("context", "tensor"))
    order = dict(layout=layout, stripe=2, axis=1)
    q, rows, kv_b, indexer_out, _ = inputs()
    w = jnp.asarray(np.random.default_rng(2).normal(size=(BATCH, LENGTH)), jnp.float32)
    packed = jnp.asarray(packed_segments(BATCH, LENGTH, seed=5))

    def run(indexer_out):
        laid = lambda x: to_balanced(x, ring, **order)
        loss = warmup(laid(q), laid(rows), kv_b, [laid(x) for x in indexer_out], laid(packed))
        return jnp.sum(from_balanced(loss, ring, **order) * w)

    with jax.set_mesh(mesh), use_parallelism(Parallelism(strategy=strategy, axis="context", layout=layout, stripe=2)):
        loss, grads = jax.jit(jax.value_and_grad(run))(indexer_out)
    want, want_grads = jax.value_and_grad(lambda indexer_out: jnp.sum(warmup(q, rows, kv_b, indexer_out, packed) * w))(
        indexer_out
    )
    assert relative_error(loss, want) < 2e-5
    for got, ref in zip(grads, want_grads, strict=True):
        assert relative_error(got, ref) < 2e-5
