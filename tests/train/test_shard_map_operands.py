"""No shard_map of a train step takes a zero-size operand, under any context strategy or layout. XLA 0.11.2's GPU
compiler (Shardy's pattern that drops a shard_map's unused inputs) crashes the process on one: the ring's full-row
updates once scattered by a zero-length index constant, and with two ring shards a scan of no steps stacked empty
residuals. The steps are lowered on CPU, so every stack checks what only 0.11.2's GPU compiler would crash on (the
GPU compiles themselves: tests/gpu_compile/test_train_step.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.lowered_step import lowered_step
from tests.train.tiny_run import REPO, TINY
from train.config import load_config
from train.planning.memory import for_accelerator

# a shard_map's body arguments: `manual_axes={...} (%arg1: tensor<...>, ...) {`
BODY_ARGUMENTS = re.compile(r"sdy\.manual_computation\(.*?manual_axes=\{[^}]*\} \((.*?)\) \{")
ZERO_SIZE = re.compile(r"tensor<(?:\d+x)*0(?:x[^>]*)?>")
LLAMA = [
    "model.num_layers=1",
    "compute.remat_policy=full",  # remat splits the forward's loops into known and unknown parts
    "parallel.attention_kernel=blockwise",
]


def zero_size_operands(text: str) -> list[str]:
    """The zero-size types among the body arguments of every shard_map in a lowered module's text."""
    return [found for body in BODY_ARGUMENTS.findall(text) for found in ZERO_SIZE.findall(body)]


def test_the_check_finds_a_zero_size_constant():
    mesh = jax.make_mesh((8,), ("context",))
    local = lambda x: x + jnp.asarray(np.zeros(0, np.int32)).sum()  # a constant the shard_map takes as an operand
    spec = jax.sharding.PartitionSpec("context")
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, spec))
    lowered = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)).lower(x)
    assert zero_size_operands(lowered.as_text()) == ["tensor<0xi32>"]


@pytest.mark.parametrize(
    "config, overrides",
    [
        (TINY, [*LLAMA, "mesh.fsdp=2", "mesh.context=4", "parallel.context_strategy=ring"]),
        (TINY, [*LLAMA, "mesh.context=8", "parallel.context_strategy=ring", "parallel.balance_layout=striped"]),
        (TINY, [*LLAMA, "mesh.context=8", "parallel.context_strategy=ring", "model.sliding_window=48"]),
        (TINY, [*LLAMA, "mesh.fsdp=2", "mesh.context=2", "mesh.ulysses=2", "parallel.context_strategy=usp"]),
        (TINY, [*LLAMA, "mesh.fsdp=2", "mesh.context=4", "parallel.context_strategy=all_gather"]),
        (TINY, [*LLAMA, "mesh.fsdp=2", "mesh.context=4", "parallel.context_strategy=ulysses"]),
        (REPO / "configs/deepseek-tiny.yaml", ["mesh.expert=2", "mesh.context=2", "parallel.context_strategy=ring"]),
    ],
    ids=["ring", "ring-striped", "ring-window", "usp-ring-2", "all_gather", "ulysses", "deepseek-latent-ring"],
)
def test_no_shard_map_takes_a_zero_size_operand(config, overrides):
    text = lowered_step(for_accelerator(load_config(config, overrides)), jax.devices()).as_text()
    assert "sdy.manual_computation" in text
    assert zero_size_operands(text) == []
