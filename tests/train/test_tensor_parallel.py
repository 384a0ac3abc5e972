"""Tensor parallelism, scattered by default: a train step over tensor in {2, 4} (also with context, fsdp and
expert) gives the loss and gradients of one device for Llama (GQA) and DeepSeek (MLA + MoE, with the per-sequence
load-balancing loss over rows split by context); the compiled block
moves activations with reduce-scatters and all-gathers only, and MLA gathers q_lora + kv_lora + rope features."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import models.deepseek
import models.llama
from parallel.mesh import make_mesh, state_shardings
from parallel.parallelism import Parallelism, use_parallelism
from parallel.tensor import residual_spec
from tests.tiny_models import TINY_LLAMA
from tests.train.step_reference import assert_same_step, first_step, initial_state
from train.config import MeshConfig, ModelConfig, ParallelConfig

LLAMA = dataclasses.replace(TINY_LLAMA, num_heads=8)
DEEPSEEK = ModelConfig(
    family="deepseek",
    vocab_size=64,
    embed_dim=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=24,
    mlp_dim=64,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=8,
    experts_per_token=2,
    moe_mlp_dim=16,
    num_shared_experts=1,
    first_dense_layers=1,
    # DeepSeek-V3's sequence-wise balance loss, large enough that a row summed over the wrong devices shows
    router_aux_loss_coef=0.1,
    router_aux_loss_scope="sequence",
)
# the default dispatch: expert parallelism drops nothing
RING = ParallelConfig(context_strategy="ring", block_q=8, block_kv=8)
PLAIN = ParallelConfig(block_q=8, block_kv=8)


@pytest.fixture(scope="module")
def references():
    """model name -> (host state, one-device step result), computed on first use."""
    cache = {}

    def get(model):
        if model.family not in cache:
            host_state = initial_state(model)
            cache[model.family] = (
                host_state,
                first_step(host_state, model, MeshConfig(fsdp=1), PLAIN, jax.devices()[:1]),
            )
        return cache[model.family]

    return get


@pytest.mark.parametrize(
    "model, mesh_config, parallel_config",
    [
        (LLAMA, MeshConfig(fsdp=2, tensor=4), PLAIN),  # 2 key/value heads repeated for 4 tensor ranks
        (LLAMA, MeshConfig(fsdp=2, tensor=4), ParallelConfig(block_q=8, block_kv=8, scatter_residual=False)),
        pytest.param(  # experts over expert x context (on the newest stack: tests/models/test_deepseek.py)
            DEEPSEEK, MeshConfig(fsdp=1, expert=2, context=4), RING, marks=pytest.mark.slow
        ),
        pytest.param(  # experts over context x tensor (scattered)
            DEEPSEEK, MeshConfig(fsdp=1, context=2, tensor=4), RING, marks=pytest.mark.slow
        ),
    ],
    ids=[
        "llama-tensor4-fsdp2",
        "llama-tensor4-fsdp2-all_reduce",
        "deepseek-expert2-context4",
        "deepseek-context2-tensor4",
    ],
)
def test_tensor_parallel_step_equals_one_device(references, model, mesh_config, parallel_config):
    host_state, reference = references(model)
    assert_same_step(first_step(host_state, model, mesh_config, parallel_config, jax.devices()), reference)


# Activation shapes carry B x T (or T / tp scattered, or B * T flattened) tokens; no weight dimension equals them.
B, T, TP = 2, 72, 4
TOKEN_DIMS = {T, T // TP, B * T, B * T // TP}


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, shape) of every array moved by an all-reduce / reduce-scatter / all-gather in compiled HLO text
    (one entry per element of a tuple result), leaving out those whose replica groups are single devices."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter|all-gather)\(", line)
        if not match or re.search(r"replica_groups=\{(\{\d+\},?)+\}", line):
            continue
        for dims in re.findall(r"\w+\[([\d,]*)\]", match.group(1)):
            found.append((match.group(2), tuple(int(d) for d in dims.split(",") if d)))
    return found


def compiled_block(block, grad: bool, mesh_config: MeshConfig | None = None) -> str:
    """Compiled HLO of `block` on a data 2 x tensor 4 mesh (or `mesh_config`'s) with the residual stream scattered;
    forward or forward+backward."""
    mesh = make_mesh(mesh_config or MeshConfig(fsdp=1, data=2, tensor=TP))
    graphdef, state = nnx.split(block)
    x = jnp.ones((B, T, 32), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(state, x):
        out = nnx.merge(graphdef, state)(x, positions, None)
        return jnp.sum((out[0] if isinstance(out, tuple) else out) ** 2)

    with jax.set_mesh(mesh):
        shardings = nnx.state(state_shardings(state, mesh))
        x_sharding = NamedSharding(mesh, residual_spec())
        fn = jax.grad(loss, argnums=(0, 1)) if grad else loss
        return jax.jit(fn, in_shardings=(shardings, x_sharding)).lower(state, x).compile().as_text()


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_block_moves_activations_by_reduce_scatter_and_all_gather(family):
    config = LLAMA if family == "llama" else DEEPSEEK
    block = (
        models.llama.Block(config, rngs=nnx.Rngs(0))
        if family == "llama"
        else models.deepseek.Block(config, moe=False, rngs=nnx.Rngs(0))
    )
    found = collectives(compiled_block(block, grad=True))
    activations = [(kind, shape) for kind, shape in found if TOKEN_DIMS & set(shape)]
    assert not [a for a in activations if a[0] == "all-reduce"], activations
    assert {"reduce-scatter", "all-gather"} <= {kind for kind, _ in activations}, found


def test_mla_gathers_only_the_low_rank_outputs():
    attention = models.deepseek.Block(DEEPSEEK, moe=False, rngs=nnx.Rngs(0)).attn
    gathered = [
        shape
        for kind, shape in collectives(compiled_block(attention, grad=False))
        if kind == "all-gather" and TOKEN_DIMS & set(shape)
    ]
    assert [shape[-1] for shape in gathered] == [
        DEEPSEEK.q_lora_rank + DEEPSEEK.kv_lora_rank + DEEPSEEK.qk_rope_head_dim
    ]


def test_mla_rotates_its_latent_on_the_ring():
    """Under ring over context 4 with tensor 2 scattered, every collective-permute of MLA's forward and backward
    carries the latent rows (kv_lora + rope features of a piece's tokens, forward) or their gradient, never K/V."""
    attention = models.deepseek.Block(DEEPSEEK, moe=False, rngs=nnx.Rngs(0)).attn
    with use_parallelism(Parallelism(strategy="ring", layout="dual_chunk", block_q=8, block_kv=8)):
        text = compiled_block(attention, grad=True, mesh_config=MeshConfig(fsdp=1, context=4, tensor=2))
    moved = {
        tuple(int(d) for d in dims.split(","))
        for result in re.findall(r"= (\(.*?\)|\S+) collective-permute(?:-start)?\(", text)
        for dims in re.findall(r"f32\[([\d,]+)\]", result)
    }
    assert moved == {(B, T // 4, DEEPSEEK.kv_lora_rank + DEEPSEEK.qk_rope_head_dim)}, moved
