"""Sliding windows and attention sinks compile for H100s under every context strategy (parallel.attention, forward
and backward, bfloat16, GQA, packed rows, 4 compile-only devices, dual_chunk): with a window every call goes to the
Pallas kernel (cuDNN leaves windows to its general kernel), and with sinks alone the cuDNN path keeps its cuDNN
calls, the sinks' lse cotangent included. By default the ring (and usp's ring, windowed under cuDNN) on the newest
stack; the other strategies are slow.

    python -m pytest -q tests/gpu_compile/test_window_sinks.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallel
from parallel import targets
from parallel.parallelism import Parallelism, use_parallelism

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]

LENGTH, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 2048, 8, 2, 128, 128
STRATEGIES = ("none", "all_gather", "ring", "ulysses", "usp")


def custom_calls(strategy: str, kernel: str, window: int | None) -> set[str]:
    """The custom-call targets of the compiled gradient of a sum of parallel.attention's output (q, k, v, sinks)."""
    devices = np.array(targets.compile_only_devices("h100", 4))
    if strategy == "usp":
        mesh, axis = Mesh(devices.reshape(2, 2), ("context", "ulysses")), ("context", "ulysses")
    else:
        mesh, axis = Mesh(devices, ("context",)), "context"
    rows = NamedSharding(mesh, P(None, axis))
    spec = lambda heads: jax.ShapeDtypeStruct((1, LENGTH, heads, HEAD_DIM), jnp.bfloat16, sharding=rows)
    segment_ids = jax.ShapeDtypeStruct((1, LENGTH), jnp.int32, sharding=rows)
    sinks = jax.ShapeDtypeStruct((HEADS,), jnp.float32, sharding=NamedSharding(mesh, P()))
    layout = "contiguous" if strategy == "none" else "dual_chunk"
    parallelism = Parallelism(kernel=kernel, platform="gpu", capability="9.0", layout=layout)

    def loss(q, k, v, sinks, segment_ids):
        out = parallel.attention(
            q, k, v, segment_ids=segment_ids, window=window, sinks=sinks, mesh=mesh, strategy=strategy, axis=axis
        )
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh), use_parallelism(parallelism):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        text = grad.trace(spec(HEADS), spec(KV_HEADS), spec(KV_HEADS), sinks, segment_ids).lower().compile().as_text()
    return set(re.findall(r'custom_call_target="([^"]+)"', text))


def cases(*default) -> list:
    """(strategy, kernel) of every strategy and kernel: `default` on the newest stack (the floor compiles the ring's
    cuDNN calls in test_ring_cudnn.py), the others slow."""
    return [
        pytest.param(s, k, marks=pytest.mark.newest_stack if (s, k) in default else pytest.mark.slow)
        for s in STRATEGIES
        for k in ("pallas", "cudnn")
    ]


@pytest.mark.parametrize("strategy, kernel", cases(("ring", "pallas"), ("ring", "cudnn"), ("usp", "cudnn")))
def test_a_window_with_sinks_compiles_to_the_pallas_kernel(strategy, kernel):
    calls = custom_calls(strategy, kernel, WINDOW)
    # Pallas on an H100: Mosaic GPU's kernels (parallel/kernels/mosaic.py)
    assert any(call.startswith("mosaic_gpu") for call in calls), calls
    assert not any(call.startswith(("__cudnn", "__gpu$xla.gpu.triton")) for call in calls), calls


@pytest.mark.parametrize("strategy, kernel", [p for p in cases(("ring", "cudnn")) if p.values[1] == "cudnn"])
def test_sinks_alone_keep_the_cudnn_calls(strategy, kernel):
    calls = custom_calls(strategy, kernel, None)
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"} <= calls, calls
