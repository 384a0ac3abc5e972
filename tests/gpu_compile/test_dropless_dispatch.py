"""The dropless ragged dispatch compiled for 8 H100s (parallel/experts.py, with no GPU: parallel/targets.py): its
usual receive buffer holds 2 x the balanced load and the worst case sits in a run-time branch in the `fallback` scope,
so the speed estimate (train/planning/speed.py) costs a dropless block as it costs a 2x capacity factor's, not as the
worst-case buffer's; that branch sends the tokens in passes whose buffers are no larger than the usual one, so a
dropless block's memory is a 2x capacity factor's too.

    python -m pytest -q tests/gpu_compile/test_dropless_dispatch.py
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from layers.moe import MoE
from parallel import experts, targets
from parallel.mesh import make_mesh, state_shardings
from parallel.parallelism import Parallelism, use_parallelism
from parallel.targets import H100_RATES
from parallel.tensor import residual_spec
from train.config import MeshConfig
from train.planning import speed

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]

EMBED, MLP, EXPERTS, K, TOKENS = 256, 128, 32, 4, 8192
SOURCES, LOCAL = 8, 4  # expert 2 x context 4: 8 expert devices of 4 experts each
BALANCED = TOKENS // SOURCES * K  # rows a device receives under a balanced load


def compiled(factor: float) -> jax.stages.Compiled:
    """The compiled MoE block's gradient on [2, TOKENS / 2] bfloat16 tokens over 8 H100s, the ragged
    dispatch at capacity `factor` (inf: dropless)."""
    devices = targets.compile_only_devices("h100", 8)
    mesh = make_mesh(MeshConfig(fsdp=1, expert=2, context=4), devices)
    moe = nnx.eval_shape(
        lambda: MoE(
            EMBED, num_experts=EXPERTS, experts_per_token=K, moe_mlp_dim=MLP, num_shared_experts=0, rngs=nnx.Rngs(0)
        )
    )
    graphdef, state = nnx.split(moe)
    parallelism = Parallelism(
        expert_dispatch="ragged", expert_capacity=factor, platform="gpu", capability="9.0", device=devices[0]
    )

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(mesh), use_parallelism(parallelism):
        shardings = nnx.state(state_shardings(state, mesh))
        abstract = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=sh), state, shardings
        )
        x = jax.ShapeDtypeStruct((2, TOKENS // 2, EMBED), jnp.bfloat16, sharding=NamedSharding(mesh, residual_spec()))
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(abstract, x).compile()


def receive_buffers(text: str) -> set[int]:
    """The row counts of the ragged all-to-alls' results: the receive buffers (and the rows sent home)."""
    return {int(rows) for rows in re.findall(r"= \w+\[(\d+),\d+\]\S* ragged-all-to-all(?:-done)?\(", text)}


def seconds(text: str) -> float:
    return speed.schedule_cost(text, H100_RATES, list(range(8))).seconds


def temporaries(program: jax.stages.Compiled) -> int:
    return program.memory_analysis().temp_size_in_bytes


def test_dropless_costs_the_usual_buffer_and_keeps_the_worst_case_in_a_fallback_branch(monkeypatch):
    programs = {"dropless": compiled(math.inf), "2x": compiled(experts.COMMON_LOAD)}
    dropless = programs["dropless"].as_text()
    common, worst = int(experts.COMMON_LOAD * BALANCED), SOURCES * (TOKENS // SOURCES) * min(K, LOCAL)
    # the fallback's passes: 4 pieces of 256 tokens a device, each piece's worst case 8 x 256 x 4 rows
    assert receive_buffers(dropless) == {common, worst // 4, TOKENS // SOURCES * K, TOKENS // SOURCES // 4 * K}
    assert " conditional(" in dropless and "/fallback/" in dropless  # the worst case: a run-time fallback branch
    monkeypatch.setattr(experts, "COMMON_LOAD", math.inf)  # dropless in the worst-case buffer alone
    programs["worst"] = compiled(math.inf)
    assert worst in receive_buffers(programs["worst"].as_text())
    assert " conditional(" not in programs["worst"].as_text()
    costs = {name: seconds(program.as_text()) for name, program in programs.items()}
    assert costs["dropless"] < 1.2 * costs["2x"] and costs["worst"] > 2 * costs["dropless"], costs
    memory = {name: temporaries(program) for name, program in programs.items()}
    assert memory["dropless"] < 1.2 * memory["2x"] and memory["worst"] > 1.5 * memory["dropless"], memory
