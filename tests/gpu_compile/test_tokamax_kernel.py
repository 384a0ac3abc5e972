"""tokamax's flash attention (parallel/kernels/tokamax_attention.py) compiles for an H100 through XLA's GPU compiler,
with no GPU (parallel/targets.py), where tokamax is installed (the tokamax extra, Python >= 3.12): the gradient of a
packed causal call with static indices is tokamax's Mosaic GPU kernels alone (no run-time branch, no general kernel),
for GQA and MLA head widths, the lse cotangent's two value columns only where the loss reads the lse. The ring and its
steps compile with it in tests/gpu_compile/test_train_step.py.

    python -m pytest -q tests/gpu_compile/test_tokamax_kernel.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels, targets
from parallel.kernels import Tokens, tokamax_attention
from parallel.parallelism import Parallelism, use_parallelism

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.newest_stack,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
    pytest.mark.skipif(bool(tokamax_attention.missing()), reason=tokamax_attention.missing() or ""),
]

LENGTH = 1024
CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


@pytest.mark.parametrize(
    "heads, reads_lse",
    [((8, 2, 128, 128), False), pytest.param((8, 8, 192, 128), True, marks=pytest.mark.slow)],
    ids=["gqa", "mla-lse"],
)
def test_a_packed_call_compiles_to_tokamax_kernels_alone(heads, reads_lse):
    h, kv_heads, dqk, dv = heads
    device = targets.compile_only_devices("h100", 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    shapes = [(2, LENGTH, h, dqk), (2, LENGTH, kv_heads, dqk), (2, LENGTH, kv_heads, dv)]
    qkv = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
    seg = jax.ShapeDtypeStruct((2, LENGTH), jnp.int32, sharding=sharding)
    kernel = kernels.select("tokamax", backend="gpu", capability="9.0")

    def loss(q, k, v, seg):
        tokens = Tokens(seg, np.arange(LENGTH))
        out, lse = kernels.attention(q, k, v, tokens, tokens, kernel=kernel)
        read = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) if reads_lse else 0.0
        return jnp.sum(out.astype(jnp.float32)) + read

    parallelism = Parallelism(device=device, platform="gpu", capability="9.0")
    with use_parallelism(parallelism), jax.set_mesh(targets.target_mesh([device])):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*qkv, seg).lower().compile()
    text = compiled.as_text()
    calls = CUSTOM_CALL.findall(text)
    assert calls and set(calls) == {"mosaic_gpu_v2"}, sorted(set(calls))
    assert len(calls) == 3  # the forward; the backward's dq kernel and its dk / dv kernel
    assert "conditional" not in text and "attention_pallas" not in text
    widths = {int(w) for w in re.findall(r"bf16\[2,1024,\d+,(\d+)\]", text)}
    assert (dv + 2 in widths) == reads_lse, sorted(widths)
