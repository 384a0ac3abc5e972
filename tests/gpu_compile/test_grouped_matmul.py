"""The experts' grouped matmul compiled for an H100 (parallel/grouped.py): with tokamax, the SwiGLU experts' forward
and backward are tokamax's Mosaic GPU kernels and no dense matmul, in less memory than XLA's `ragged_dot`, which its
GPU compiler expands into one matmul over every group (groups times the FLOPs); the speed estimate costs tokamax's
kernels at the rows a balanced load fills and XLA's expansion at all it computes; inside a shard_map whose operands
vary over the devices (the ragged dispatch's), the gradient sums nothing over them. Where tokamax is installed
(Python >= 3.12, JAX >= 0.11)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from layers.moe import expert_swiglu
from parallel import grouped, targets, tokamax_calls
from parallel.parallelism import Parallelism, use_parallelism
from parallel.targets import H100_RATES
from train.planning import speed

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
    pytest.mark.skipif(not tokamax_calls.installed(), reason=f"needs tokamax: {tokamax_calls.INSTALL}"),
]
ROWS, EMBED, MLP, GROUPS, FILLED = 4096, 256, 128, 4, 0.25
# the backward's 6 grouped matmuls (dx and dw of gate, up and down) and the forward's gate and up (the loss reads
# only the gradient, so the down projection's forward is dead)
CALLS = 8


SHAPES = ((ROWS, EMBED), (GROUPS, EMBED, MLP), (GROUPS, EMBED, MLP), (GROUPS, MLP, EMBED))


def compiled(implementation: str):
    """The gradient of the SwiGLU experts over ROWS rows in GROUPS groups, compiled for one H100."""
    device = targets.compile_only_devices("h100", 8)[0]
    parallelism = Parallelism(grouped_matmul=implementation, platform="gpu", capability="9.0", device=device)

    def loss(x, gate, up, down, sizes):
        with use_parallelism(parallelism), grouped.filled(FILLED):
            return expert_swiglu(x, gate, up, down, group_sizes=sizes).astype(jnp.float32).sum()

    where = jax.sharding.SingleDeviceSharding(device)
    arguments = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=where) for shape in SHAPES]
    arguments.append(jax.ShapeDtypeStruct((GROUPS,), jnp.int32, sharding=where))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*arguments).compile()


def test_tokamax_compiles_to_its_kernels_in_less_memory_and_is_costed_at_the_filled_rows():
    kernels, dense = compiled("tokamax"), compiled("xla")
    text = kernels.as_text()
    calls = [line for line in text.splitlines() if 'custom_call_target="mosaic_gpu' in line]
    assert len(calls) == CALLS and all("/grouped_matmul/" in line for line in calls)
    assert " dot(" not in text and "gemm_fusion" not in text
    assert kernels.memory_analysis().temp_size_in_bytes < dense.memory_analysis().temp_size_in_bytes / 2
    flops = 2.0 * ROWS * EMBED * MLP
    assert speed.schedule_cost(text, H100_RATES, [0]).flops[speed.MATMULS] == pytest.approx(CALLS * FILLED * flops)
    # XLA's expansion: every row against every group, whatever the load
    assert speed.schedule_cost(dense.as_text(), H100_RATES, [0]).flops[speed.MATMULS] >= CALLS * GROUPS * flops


def test_inside_a_shard_map_the_gradient_sums_nothing_over_the_devices():
    """8 H100s, each with its own rows, groups and experts' matrices, as in the ragged dispatch: no all-reduce of more
    than a scalar (a kernel result typed as the same on every device would have its cotangent summed over them)."""
    devices = targets.compile_only_devices("h100", 8)
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    parallelism = Parallelism(grouped_matmul="tokamax", platform="gpu", capability="9.0", device=devices[0])

    def local(x, gate, up, down, sizes):
        with use_parallelism(parallelism):
            y = expert_swiglu(x, gate, up, down, group_sizes=sizes)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * x), "x")  # weighted by what varies, as the dispatch is

    def loss(*arrays):
        return jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P())(*arrays)

    where = NamedSharding(mesh, P("x"))
    shapes = [(8 * shape[0], *shape[1:]) for shape in (*SHAPES, (GROUPS,))]
    dtypes = [jnp.bfloat16] * 4 + [jnp.int32]
    arguments = [jax.ShapeDtypeStruct(s, d, sharding=where) for s, d in zip(shapes, dtypes, strict=True)]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*arguments).compile().as_text()
    assert 'custom_call_target="mosaic_gpu' in text
    reduced = re.findall(r"= (\S+) all-reduce(?:-start)?\(", text)
    assert all(shape.startswith("f32[]") for shape in reduced), reduced
