"""FlashAttention-3's calls compile for an H100 through XLA's GPU compiler, with no GPU (parallel/targets.py), where its
binding is installed (the flash3 extras, JAX 0.11.2 on): one packed call per side of the row, Q, K and V of one
padded width (MLA's V padded to its 192), K / V with their own heads, and the lse cotangent's two extra value columns
only where the loss reads the lse (a symbolic zero otherwise: no wider kernel for nothing). The strategies' flash3
steps compile in tests/gpu_compile/test_train_step.py.

    python -m pytest -q tests/gpu_compile/test_flash3_kernel.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels, targets
from parallel.kernels import Tokens, flash3
from train.planning import speed

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.newest_stack,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
    pytest.mark.skipif(bool(flash3.missing()), reason=flash3.missing() or ""),
]

LENGTH = 512
CALL = re.compile(r'custom_call_target="(dew_flash3_mha_varlen_\w+)", operand_layout_constraints=\{(.*?)\}\}')


def compiled_calls(heads, kv_heads, dqk, dv, reads_lse: bool) -> tuple[dict[str, list[tuple[int, ...]]], str]:
    """({target: operand shapes}, the program's text) of the compiled grad of one flash3 call on two packed rows."""
    devices = targets.compile_only_devices("h100", 1)
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    shapes = [(2, LENGTH, heads, dqk), (2, LENGTH, kv_heads, dqk), (2, LENGTH, kv_heads, dv)]
    qkv = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
    seg = jax.ShapeDtypeStruct((2, LENGTH), jnp.int32, sharding=sharding)
    kernel = kernels.select("flash3", backend="gpu", capability="9.0")

    def loss(q, k, v, seg):
        tokens = Tokens(seg, np.arange(LENGTH))
        out, lse = kernels.attention(q, k, v, tokens, tokens, kernel=kernel)
        read = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)) if reads_lse else 0.0
        return jnp.sum(out.astype(jnp.float32)) + read

    with jax.set_mesh(targets.target_mesh(devices)):  # the Pallas fallback's GPU
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*qkv, seg).lower().compile().as_text()
    calls = {}
    for target, constraints in CALL.findall(text):
        calls[target] = [tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"\w+\[([\d,]+)\]", constraints)]
    return calls, text


@pytest.mark.parametrize("reads_lse", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gqa_calls_carry_dlse_columns_only_where_the_lse_is_read(reads_lse):
    calls, text = compiled_calls(8, 2, 128, 128, reads_lse)
    assert set(calls) == set(flash3.TARGETS)
    sequences = 2 * (2 * flash3.MAX_SEGMENTS + 1) + 1
    assert calls[flash3.TARGETS[0]] == [(1024, 8, 128), (1024, 2, 128), (1024, 2, 128), (sequences,), (sequences,)]
    width = 136 if reads_lse else 128
    dout, q, k, v, out, lse = calls[flash3.TARGETS[1]][:6]
    assert (dout, q, k, v, out, lse) == ((1024, 8, width), (1024, 8, width), (1024, 2, width), (1024, 2, width),
                                         (1024, 8, width), (8, 1024))  # fmt: skip
    # the speed estimate costs the flattened calls as their 2 rows' causal pairs (train/planning/speed.py; the visible
    # share to 4 digits), the Pallas fallback not at all: a forward of width 128, a backward of 2.5 forwards of its
    # width
    tally = speed.schedule_cost(text, targets.TARGETS["h100"].rates, [0])
    pairs = 2 * 8 * LENGTH * (LENGTH + 1) / 2
    wanted = 2 * pairs * 2 * 128 + 2.5 * 2 * pairs * 2 * width
    assert tally.flops[speed.ATTENTION] == pytest.approx(wanted, rel=1e-3)


@pytest.mark.slow
def test_mlas_value_is_padded_to_the_query_width():
    calls, _ = compiled_calls(4, 4, 192, 128, reads_lse=True)
    assert calls[flash3.TARGETS[0]][:3] == [(1024, 4, 192)] * 3
