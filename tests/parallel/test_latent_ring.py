"""MLA's latent on the ring (parallel/latent.py): ring and usp rotating the latent rows in place of K/V equal fp32
attention on the expanded K/V, outputs and gradients of q, the latent rows and kv_b, on packed and unpacked rows, for
each layout; the collective-permutes carry the latent rows and no K/V."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from parallel.latent import expand
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced, to_balanced
from parallel.tensor import Tokens
from tests.parallel.attention_reference import packed_segments, reference, relative_error

BATCH, LENGTH, HEADS, LORA, ROPE, NOPE, DV = 2, 64, 4, 12, 4, 8, 16


def inputs():
    """q [batch, length, heads, nope + rope], latent rows [batch, length, lora + rope], kv_b [lora, heads, nope + dv],
    output cotangent [batch, length, heads, dv]."""
    rng = np.random.default_rng(0)
    shapes = [(BATCH, LENGTH, HEADS, NOPE + ROPE), (BATCH, LENGTH, LORA + ROPE), (LORA, HEADS, NOPE + DV)]
    q, rows, kv_b = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
    return q, rows, kv_b / 4, jnp.asarray(rng.normal(size=(BATCH, LENGTH, HEADS, DV)), jnp.float32)


# The floor runs the striped ring, the newest stack usp; the dual_chunk ring 8 is DeepSeek's ring 8 step
# (tests/models/test_families.py, slow) and the model's permutes (tests/train/test_tensor_parallel.py)
@pytest.mark.parametrize(
    "strategy, ring, ulysses, layout",
    [
        ("ring", 4, 1, "striped"),
        pytest.param("ring", 8, 1, "dual_chunk", marks=pytest.mark.slow),
        pytest.param("usp", 4, 2, "dual_chunk", marks=pytest.mark.newest_stack),
        pytest.param("ring", 2, 1, "dual_chunk", marks=pytest.mark.slow),
        pytest.param("ring", 4, 1, "contiguous", marks=pytest.mark.slow),
        pytest.param("usp", 2, 2, "striped", marks=pytest.mark.slow),
    ],
)
def test_latent_ring_matches_reference(strategy, ring, ulysses, layout):
    devices = np.array(jax.devices()[: ring * ulysses])
    if strategy == "usp":
        mesh, axis = Mesh(devices.reshape(ring, ulysses), ("context", "ulysses")), ("context", "ulysses")
    else:
        mesh, axis = Mesh(devices, ("context",)), "context"
    order = dict(layout=layout, stripe=2, axis=1)
    q, rows, kv_b, w = inputs()

    def attend(q, rows, kv_b, seg):
        k, v = expand(kv_b, rows, NOPE)
        laid = [to_balanced(x, ring, **order) for x in (q, k, v, seg, rows)]
        out = parallel.attention(
            *laid[:3], segment_ids=laid[3], causal=True, mesh=mesh, strategy=strategy, axis=axis, layout=layout,
            stripe=2, latent=parallel.Latent(Tokens(laid[4][None]), kv_b, NOPE),
        )  # fmt: skip
        return from_balanced(out, ring, **order)

    def run(q, rows, kv_b, seg):
        out, pull = jax.vjp(lambda *x: attend(*x, seg), q, rows, kv_b)
        return out, pull(w)

    packed = jnp.asarray(packed_segments(BATCH, LENGTH, seed=ring))
    with jax.set_mesh(mesh), use_parallelism(Parallelism(block_q=8, block_kv=8)):
        lowered = jax.jit(run, in_shardings=NamedSharding(mesh, PartitionSpec())).lower(q, rows, kv_b, packed)
        program, compiled = lowered.as_text(), lowered.compile()
        results = [(seg, compiled(q, rows, kv_b, seg)) for seg in (packed, jnp.ones((BATCH, LENGTH), jnp.int32))]
    moved = set(re.findall(r"collective_permute.*-> (tensor<[^>]*>)", program))
    assert moved == {f"tensor<{BATCH}x{LENGTH // ring}x{LORA + ROPE}xf32>"}, moved  # the rows and their gradient
    for seg, (out, grads) in results:

        def dense(q, rows, kv_b):
            return reference(q, *expand(kv_b, rows, NOPE), segment_ids=seg, causal=True)[0]

        want, pull = jax.vjp(dense, q, rows, kv_b)
        label = f"{strategy} {ring}x{ulysses} {layout} packed={seg is packed}"
        assert relative_error(out, want) < 2e-5, label
        for name, got, ref in zip(("q", "rows", "kv_b"), grads, pull(w), strict=True):
            assert relative_error(got, ref) < 2e-5, f"{label}: d{name}"


def test_a_latent_that_makes_other_heads_is_refused():
    q, rows, kv_b, _ = inputs()
    k, v = expand(kv_b, rows, NOPE)
    latent = parallel.Latent(Tokens(rows[None]), kv_b[:, :2], NOPE)
    with pytest.raises(ValueError, match=r"it must make 4 heads of values 16 wide"):
        parallel.attention(q, k, v, latent=latent)
