"""Compile guards on the DeepSeek-V2-Lite MoE block at 128K tokens on 8 devices (context=8, abstract shapes): no sort
over the global tokens x k, no involuntary full rematerialization, and temporaries set by the local tokens only."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from layers.moe import MoE
from parallel.mesh import make_mesh, state_shardings
from parallel.parallelism import Parallelism, use_parallelism
from parallel.tensor import residual_spec
from train.config import MeshConfig, load_config
from train.planning.memory import CPU_OPTIONS

V2_LITE = load_config("configs/models/deepseek-v2-lite.yaml").model


def compile_block(length: int, context: int, chunk: int = 0):
    """Compiled forward + backward of one V2-Lite MoE block on [1, length] bf16 tokens, length split over
    `context` devices -> (HLO text, temporaries in bytes per device)."""
    m = V2_LITE
    moe = nnx.eval_shape(
        lambda: MoE(
            m.embed_dim,
            num_experts=m.num_experts,
            experts_per_token=m.experts_per_token,
            moe_mlp_dim=m.moe_mlp_dim,
            num_shared_experts=m.num_shared_experts,
            norm_topk_prob=m.norm_topk_prob,
            router_score=m.router_score,
            dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, state = nnx.split(moe)
    mesh = make_mesh(MeshConfig(fsdp=1, context=context), jax.devices()[:context])

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32)) + stats["dropped"]

    with jax.set_mesh(mesh), use_parallelism(Parallelism(expert_chunk=chunk)):
        x = jax.ShapeDtypeStruct((1, length, m.embed_dim), jnp.bfloat16, sharding=NamedSharding(mesh, residual_spec()))
        shardings = nnx.state(state_shardings(state, mesh))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).compile(CPU_OPTIONS)
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


def test_compiled_block_is_local(capfd):
    """No sort over the global tokens x k, no involuntary full rematerialization in the compile log, and the
    temporaries of 128K tokens over context=8 equal those of 64K over context=4 (the same 16K tokens per device)."""
    capfd.readouterr()
    hlo, temp_128k = compile_block(131072, context=8)
    log = capfd.readouterr().err
    global_assignments = 131072 * V2_LITE.experts_per_token
    sorts = [line for line in hlo.splitlines() if " sort(" in line]
    assert sorts, "the dispatch sorts each device's own assignments"
    assert not [line for line in sorts if str(global_assignments) in line], sorts
    assert "involuntary full rematerialization" not in log.lower(), log
    _, temp_64k = compile_block(65536, context=4)
    assert 0.9 <= temp_128k / temp_64k <= 1.1, (temp_128k, temp_64k)
