"""Structural claims on traced and compiled programs: ring moves K and V, one permute of each per step (no stacked
copy);
Ulysses has exactly two all-to-alls in the forward pass; the gradients of the K / V gathers are reduce-scatters."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import parallel

BATCH, LENGTH, HEADS, KV_HEADS, DQK, DV = 2, 64, 8, 2, 24, 16


def attention_fn(strategy, mesh):
    return lambda q, k, v, seg: parallel.attention(
        q, k, v, segment_ids=seg, mesh=mesh, strategy=strategy, layout="dual_chunk"
    )


def args():
    return (
        jnp.zeros((BATCH, LENGTH, HEADS, DQK)),
        jnp.zeros((BATCH, LENGTH, KV_HEADS, DQK)),
        jnp.zeros((BATCH, LENGTH, KV_HEADS, DV)),
        jnp.ones((BATCH, LENGTH), jnp.int32),
    )


def dynamic_count(jaxpr, primitive: str) -> int:
    """How many times `primitive` executes: scan bodies count `length` times, cond the costliest branch."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            total += 1
        if eqn.primitive.name == "scan":
            total += eqn.params["length"] * dynamic_count(eqn.params["jaxpr"].jaxpr, primitive)
        elif eqn.primitive.name == "cond":
            total += max(dynamic_count(branch.jaxpr, primitive) for branch in eqn.params["branches"])
        else:
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    total += dynamic_count(inner, primitive)
    return total


def compiled_ops(fn, mesh, op: str) -> list[str]:
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(*args()).compile().as_text()
    return [line for line in text.splitlines() if " = " in line and re.search(rf"\s{op}\(", line)]


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_ring_permutes_k_and_v_once_per_step(shards):
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    fn = attention_fn("ring", mesh)
    with jax.set_mesh(mesh):
        assert dynamic_count(jax.make_jaxpr(fn)(*args()).jaxpr, "ppermute") == 2 * (shards - 1)
    permutes = compiled_ops(fn, mesh, "collective-permute")
    pieces = [f"f32[{BATCH},{LENGTH // shards},{KV_HEADS},{d}]" for d in (DQK, DV)]
    assert permutes and all(any(piece in line for piece in pieces) for line in permutes), permutes


@pytest.mark.parametrize("shards", [2, 8])
def test_ulysses_two_all_to_alls(shards):
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    fn = attention_fn("ulysses", mesh)
    with jax.set_mesh(mesh):
        assert dynamic_count(jax.make_jaxpr(fn)(*args()).jaxpr, "all_to_all") == 2
    assert len(compiled_ops(fn, mesh, "all-to-all")) == 2


def test_all_gather_backward_reduce_scatters():
    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    fn = attention_fn("all_gather", mesh)
    grad = lambda q, k, v, seg: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg)), argnums=(1, 2))(q, k, v)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(grad)(*args()).jaxpr
    assert dynamic_count(jaxpr, "reduce_scatter") == 2  # dK and dV
