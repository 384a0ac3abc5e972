"""DeepSeek sparse attention split over context devices equals one device: outputs and gradients of q, the latent
rows and kv_b, on packed and unpacked rows, for each strategy and layout; the devices gather the row's latents and
index keys (no K/V and no [T, T] array), and a bad plan is named."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from parallel.plan import Plan, use_plan
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
    index = (
        positive(BATCH, LENGTH, INDEX_HEADS, INDEX_DIM),
        positive(BATCH, LENGTH, INDEX_DIM),
        positive(BATCH, LENGTH, INDEX_HEADS),
    )
    return q, rows, kv_b, index, normal(BATCH, LENGTH, HEADS, DV)


def attend(q, rows, kv_b, index, seg):
    return parallel.sparse_attention(
        q, parallel.Latent(Tokens(rows[None]), kv_b, NOPE), index=parallel.Index(*index), count=COUNT, segment_ids=seg,
        scale=0.3,
    )  # fmt: skip


def one_device(q, rows, kv_b, index, seg, w):
    out, pull = jax.vjp(lambda *x: attend(*x, index, seg), q, rows, kv_b)
    return out, pull(w)


@pytest.mark.parametrize(
    "strategy, ring, ulysses, layout",
    [
        ("ring", 4, 1, "dual_chunk"),
        ("usp", 2, 2, "striped"),
        pytest.param("ring", 8, 1, "dual_chunk", marks=pytest.mark.slow),
        pytest.param("all_gather", 2, 1, "contiguous", marks=pytest.mark.slow),
        pytest.param("ulysses", 4, 1, "striped", marks=pytest.mark.slow),
    ],
)
def test_context_split_matches_one_device(strategy, ring, ulysses, layout):
    devices = np.array(jax.devices()[: ring * ulysses])
    if strategy == "usp":
        mesh, axis = Mesh(devices.reshape(ring, ulysses), ("context", "ulysses")), ("context", "ulysses")
    else:
        mesh, axis = Mesh(devices, ("context",)), "context"
    shards = ring * ulysses
    order = dict(layout=layout, stripe=2, axis=1)
    q, rows, kv_b, index, w = inputs()

    def run(q, rows, kv_b, index, seg):
        laid = lambda x: to_balanced(x, shards, **order)

        def split(q, rows, kv_b):
            out = attend(laid(q), laid(rows), kv_b, [laid(x) for x in index], laid(seg))
            return from_balanced(out, shards, **order)

        out, pull = jax.vjp(split, q, rows, kv_b)
        return out, pull(w)

    packed = jnp.asarray(packed_segments(BATCH, LENGTH, seed=ring))
    plan = Plan(strategy=strategy, axis=axis, layout=layout, stripe=2)
    with jax.set_mesh(mesh), use_plan(plan):
        lowered = jax.jit(run, in_shardings=NamedSharding(mesh, PartitionSpec())).lower(q, rows, kv_b, index, packed)
        program, compiled = lowered.as_text(), lowered.compile()
        results = [(seg, compiled(q, rows, kv_b, index, seg)) for seg in (packed, jnp.ones((BATCH, LENGTH), jnp.int32))]
    gathered = set(re.findall(r"all_gather.*-> (tensor<[^>]*>)", program))
    whole = f"tensor<{BATCH}x{LENGTH}x"
    assert gathered == {f"{whole}{LORA + ROPE}xf32>", f"{whole}{INDEX_DIM}xf32>", f"{whole[:-1]}xi32>"}, gathered
    for seg, (out, grads) in results:
        want, want_grads = one_device(q, rows, kv_b, index, seg, w)
        label = f"{strategy} {ring}x{ulysses} {layout} packed={seg is packed}"
        assert relative_error(out, want) < 2e-5, label
        for name, got, ref in zip(("q", "rows", "kv_b"), grads, want_grads, strict=True):
            assert relative_error(got, ref) < 2e-5, f"{label}: d{name}"
