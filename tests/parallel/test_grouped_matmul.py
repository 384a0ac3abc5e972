"""The experts' grouped matmul (parallel/grouped.py): `parallel.grouped_matmul` resolves per device (auto: tokamax on
Hopper where installed, xla elsewhere; tokamax refused in one line where it cannot run), and the tokamax path's own
backward (dx by w transposed, dw per group, each given the mesh axes its primal varies over) equals `ragged_dot`'s
gradient inside a shard_map, through a stand-in with tokamax's signature (JAX >= 0.11, as tokamax;
tests/gpu_compile/test_grouped_matmul.py compiles the real kernels for H100)."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from layers.moe import expert_swiglu
from parallel import settings
from parallel.mesh import MeshError
from parallel.parallelism import Parallelism, use_parallelism
from parallel.settings import make_parallelism
from train.config import ParallelConfig

HOPPER, AMPERE = (types.SimpleNamespace(platform="gpu", compute_capability=c) for c in ("9.0", "8.0"))


@pytest.mark.parametrize("installed", [True, False])
def test_grouped_matmul_by_device(installed, monkeypatch):
    monkeypatch.setattr(settings.tokamax_calls, "installed", lambda: installed)
    assert make_parallelism(ParallelConfig(), {}, HOPPER).grouped_matmul == ("tokamax" if installed else "xla")
    assert make_parallelism(ParallelConfig(), {}, AMPERE).grouped_matmul == "xla"
    assert make_parallelism(ParallelConfig(), {}).grouped_matmul == "xla"
    assert make_parallelism(ParallelConfig(grouped_matmul="xla"), {}, HOPPER).grouped_matmul == "xla"
    with pytest.raises(MeshError, match=r"grouped_matmul=tokamax runs on Hopper or newer GPUs, not on cpu; use auto"):
        make_parallelism(ParallelConfig(grouped_matmul="tokamax"), {})
    with pytest.raises(MeshError, match=r"grouped_matmul='cublas' is not allowed; choose one of auto, xla, tokamax"):
        make_parallelism(ParallelConfig(grouped_matmul="cublas"), {})
    if not installed:
        with pytest.raises(MeshError, match=r"grouped_matmul=tokamax needs tokamax: pip install 'longctx\[tokamax\]'"):
            make_parallelism(ParallelConfig(grouped_matmul="tokamax"), {}, HOPPER)


def stand_in(calls: list) -> types.ModuleType:
    """A module with tokamax's ragged_dot and ragged_dot_general signatures, computed by JAX's, recording each call's
    implementation and JAX's default device while it traces."""

    def record(fn, *args, implementation=None, **kwargs):
        calls.append((fn.__name__, implementation, jax.config.jax_default_device))
        return fn(*args, **kwargs)

    module = types.ModuleType("tokamax")
    module.ragged_dot = functools.partial(record, jax.lax.ragged_dot)
    module.ragged_dot_general = lambda lhs, rhs, group_sizes, dims, implementation=None: record(
        jax.lax.ragged_dot_general, lhs, rhs, group_sizes, dims, implementation=implementation
    )
    return module


@pytest.mark.newest_stack  # tokamax needs JAX >= 0.11, whose types name the axes a value varies over
def test_the_tokamax_path_equals_ragged_dot_in_value_and_gradients_inside_a_shard_map(monkeypatch):
    """8 devices, each with its own rows and groups (varying), the experts' matrices replicated (invariant): dx stays
    per device, dw is summed over the devices as ragged_dot's transpose sums it."""
    calls = []
    monkeypatch.setitem(sys.modules, "tokamax", stand_in(calls))
    devices, rows, embed, mlp, groups = 8, 24, 16, 8, 4
    mesh = jax.make_mesh((devices,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(devices * rows, embed)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(groups, embed, mlp)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(groups, mlp, embed)), jnp.float32)
    sizes = jnp.asarray(rng.multinomial(rows - 3, [1 / groups] * groups, size=devices).reshape(-1), jnp.int32)

    def loss(implementation, x, gate, up, down, sizes):
        parallelism = Parallelism(grouped_matmul=implementation, device=jax.devices()[1])

        def local(x, gate, up, down, sizes):
            with use_parallelism(parallelism):
                out = expert_swiglu(x, gate, up, down, group_sizes=sizes)
            return jax.lax.psum(jnp.sum(jnp.sin(out[: rows - 3])), "x")

        specs = (P("x"), P(), P(), P(), P("x"))
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())(x, gate, up, down, sizes)

    grads = {
        implementation: jax.value_and_grad(functools.partial(loss, implementation), argnums=(0, 1, 2, 3))(
            x, gate, up, down, sizes
        )
        for implementation in ("xla", "tokamax")
    }
    for got, want in zip(jax.tree.leaves(grads["tokamax"]), jax.tree.leaves(grads["xla"]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert {(name, implementation) for name, implementation, _ in calls} == {
        ("ragged_dot", "mosaic_gpu"),
        ("ragged_dot_general", "mosaic_gpu"),
    }
    assert all(device == jax.devices()[1] for _, _, device in calls)
