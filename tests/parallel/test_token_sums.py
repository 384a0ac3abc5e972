"""The loss computed per device (parallel.token_sums) equals the plain chunked loss in value and gradients on every
mesh, and its compiled program has no collective inside the chunk loop and no gather of the sequence."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from layers.loss import chunked_cross_entropy
from parallel.token_sums import token_sums

BATCH, LENGTH, EMBED, VOCAB, CHUNK = 4, 256, 16, 64, 16
COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def inputs():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(BATCH, LENGTH, EMBED)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(EMBED, VOCAB)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, VOCAB, (BATCH, LENGTH)), jnp.int32)
    weights = jnp.asarray(rng.random((BATCH, LENGTH, 2)) < 0.7, jnp.float32)  # two weightings, as the eval step
    return hidden, kernel, targets, weights


def loss(hidden, kernel, targets, weights, per_device: bool):
    """(a scalar of both weightings' loss sums, the weight sums [2]), per device or plainly."""
    sums = lambda h, t, w, k: chunked_cross_entropy(h, k, t, w, chunk_size=CHUNK)
    tokens = (hidden, targets, weights)
    total, count = token_sums(sums, tokens, (kernel,)) if per_device else sums(*tokens, kernel)
    return total[0] + 0.5 * total[1], count


def mesh_of(shape: dict[str, int]):
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def placed(mesh, hidden, kernel, targets, weights):
    """The arrays as a training step holds them: batch over data/fsdp, length over context, the kernel over
    fsdp (embed) and tensor (vocab)."""
    names = mesh.axis_names
    batch = tuple(a for a in ("data", "fsdp") if a in names) or None
    rows = PartitionSpec(batch, "context" if "context" in names else None)
    kernel_spec = PartitionSpec("fsdp" if "fsdp" in names else None, "tensor" if "tensor" in names else None)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    return put(hidden, rows), put(kernel, kernel_spec), put(targets, rows), put(weights, rows)


MESHES = [{"context": 8}, {"data": 2, "context": 4}, {"fsdp": 2, "context": 2, "tensor": 2}, {"data": 4, "tensor": 2}]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_per_device_loss_equals_the_plain_loss_with_its_gradients(shape):
    args = inputs()
    grad = jax.value_and_grad(lambda h, k, t, w, d: loss(h, k, t, w, d)[0], argnums=(0, 1))
    expected_loss, (expected_dh, expected_dk) = jax.jit(grad, static_argnums=4)(*args, False)
    mesh = mesh_of(shape)
    with jax.set_mesh(mesh):
        value, (dh, dk) = jax.jit(grad, static_argnums=4)(*placed(mesh, *args), True)
        count = jax.jit(lambda *a: loss(*a, True)[1])(*placed(mesh, *args))
    np.testing.assert_allclose(value, expected_loss, rtol=1e-5)
    np.testing.assert_allclose(count, args[3].sum((0, 1)), rtol=0)
    np.testing.assert_allclose(dh, expected_dh, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dk, expected_dk, rtol=1e-4, atol=1e-5)


def _loop_bodies(text: str) -> list[str]:
    """The computations a compiled module runs as while-loop bodies."""
    names = {name.lstrip("%") for name in re.findall(r"body=(%?[\w.\-]+)", text)}
    blocks = re.split(r"\n(?=\S)", text)
    return [block for block in blocks if (m := re.match(r"%?([\w.\-]+)", block)) and m.group(1) in names]


@pytest.mark.parametrize("per_device", [True, False])
def test_no_collective_inside_the_chunk_loop_under_context_8(per_device):
    mesh = mesh_of({"context": 8})
    grad = jax.grad(lambda h, k, t, w: loss(h, k, t, w, per_device)[0], argnums=(0, 1))
    with jax.set_mesh(mesh):
        text = jax.jit(grad).lower(*placed(mesh, *inputs())).compile().as_text()
    in_loops = [line for body in _loop_bodies(text) for line in body.splitlines() if COLLECTIVE.search(line)]
    gathers = [line for line in text.splitlines() if " all-gather(" in line or " all-gather-start(" in line]
    if per_device:
        assert in_loops == [] and gathers == [], in_loops + gathers
        assert any("all-reduce" in line for line in text.splitlines())  # the sums and dK, once
    else:  # the plain loss gathers the whole sequence onto every device: what token_sums exists to avoid
        assert gathers
