"""The cuDNN kernel binds JAX's private cuDNN primitives (jax._src.cudnn.fused_attention_stablehlo) as this JAX
version defines them: tracing it checks their names, parameters and shapes (any machine); compiling it for an H100
(no GPU: parallel/targets.py) checks that XLA's GPU compiler accepts the cuDNN calls, forward and backward, for
MHA, GQA and latent attention's head dims, with static and traced indices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels, targets
from parallel.kernels import Tokens, cudnn

HEADS = {"mha": (4, 4, 64, 64), "gqa": (8, 2, 128, 128), "mla": (4, 4, 192, 128)}  # heads, kv heads, dqk, dv
LENGTH = 256
# the blockwise kernel for calls cuDNN cannot serve: Pallas is compiled by its own tests
CUDNN = kernels.Kernel("cudnn", cudnn.forward, cudnn.backward)


def grads(q, k, v, seg, q_index, kv_index):
    """(dq, dk, dv) of a loss through out and lse of one cuDNN kernel call."""

    def loss(q, k, v):
        out, lse = kernels.attention(q, k, v, Tokens(seg, q_index), Tokens(seg, kv_index), kernel=CUDNN)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def arguments(heads: str, sharding=None):
    """ShapeDtypeStructs of q, k, v (bfloat16) and segment ids [2, LENGTH]."""
    h, hkv, dqk, dv = HEADS[heads]
    shapes = [(2, LENGTH, h, dqk), (2, LENGTH, hkv, dqk), (2, LENGTH, hkv, dv)]
    qkv = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
    return [*qkv, jax.ShapeDtypeStruct((2, LENGTH), jnp.int32, sharding=sharding)]


@pytest.mark.parametrize("heads", list(HEADS))
def test_primitives_bind_as_the_kernel_binds_them(heads):
    """Abstract evaluation of every bind (static diagonal: forward and backward) on any machine."""
    index = np.arange(LENGTH, dtype=np.int32)
    dq, dk, dv = jax.eval_shape(functools.partial(grads, q_index=index, kv_index=index), *arguments(heads))
    assert (dq.shape, dk.shape, dv.shape) == tuple(a.shape for a in arguments(heads)[:3])


# MHA compiles on both stacks, MLA (padded head widths) on the newest; GQA (K / V repeated) is slow
MARKS = {"mha": [], "mla": [pytest.mark.newest_stack], "gqa": [pytest.mark.slow]}


@pytest.mark.gpu_compile
@pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}")
@pytest.mark.parametrize("heads", [pytest.param(h, marks=MARKS[h]) for h in HEADS])
def test_kernel_compiles_for_h100(heads):
    """Static indices (the causal diagonal) and traced ones (every kind a call may turn out to be)."""
    sharding = jax.sharding.SingleDeviceSharding(targets.compile_only_devices("h100", 1)[0])
    static = np.arange(LENGTH, dtype=np.int32)
    traced = jax.ShapeDtypeStruct((LENGTH,), jnp.int32, sharding=sharding)
    for indices in ((static, static), (traced, traced)):
        known = [i for i in indices if isinstance(i, np.ndarray)]
        fn = functools.partial(grads, **dict(zip(("q_index", "kv_index"), known, strict=False)))
        args = [*arguments(heads, sharding), *(i for i in indices if not isinstance(i, np.ndarray))]
        text = jax.jit(fn).trace(*args).lower().compile().as_text()
        for call in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"):
            assert f'custom_call_target="{call}"' in text, f"{heads}: no {call} compiled"
