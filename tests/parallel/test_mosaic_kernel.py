"""The Mosaic GPU attention kernels (parallel/kernels/mosaic.py), run on CPU by JAX's Mosaic GPU interpreter (JAX
0.12; the floor has none), equal the blockwise kernel: out, lse, and dq / dk / dv given out and lse cotangents, on
packed rows with padding, GQA, MLA's widths (192 / 128), a ring step's pieces (query indices past the keys'), a
sliding window, full attention on unequal lengths, and a row no query of which sees a key at 256 / 256 (dk and dv
as two kernels), with the interpreter's race detector on (a race between the kernel's threads raises). Their H100
compiles are in tests/gpu_compile/test_pallas_kernels.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from parallel.kernels import Options, Tokens, blockwise, mosaic
from tests.parallel.attention_reference import relative_error

pytestmark = [
    pytest.mark.newest_stack,
    pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"), reason="JAX's Mosaic GPU interpreter (JAX 0.12)"),
]


def rows(batch: int, length: int, cut: int) -> np.ndarray:
    """[batch, length] segment ids: row 0 two documents split at `cut` and 3 padding tokens, row 1 one document, a
    third row (when batch is 3) all padding."""
    seg = np.ones((batch, length), np.int32)
    seg[0, cut:], seg[0, -3:] = 2, 0
    seg[2:] = 0
    return seg


CASES = {  # tq, tk, heads, kv heads, dqk, dv, window, causal, query offset, batch, float32 gradients
    "mla-gqa-window-ring-piece": (128, 192, 4, 2, 192, 128, 50, True, 64, 2, True),
    "full-unequal-lengths": (130, 70, 2, 2, 64, 64, None, False, 0, 2, False),
    "row-sees-nothing-256-wide": (64, 64, 2, 1, 256, 256, None, True, 0, 3, False),  # dk and dv: two kernels
}
DEFAULT = ("mla-gqa-window-ring-piece", "row-sees-nothing-256-wide")


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[] if c in DEFAULT else [pytest.mark.slow]) for c in CASES]
)  # fmt: skip
def test_mosaic_equals_blockwise(case):
    tq, tk, heads, kv_heads, dqk, dv, window, causal, offset, batch, float32 = CASES[case]
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    q, k, v = normal(batch, tq, heads, dqk), normal(batch, tk, kv_heads, dqk), normal(batch, tk, kv_heads, dv)
    seg = rows(batch, max(tq + offset, tk), cut=37)
    q_tokens = Tokens(jnp.asarray(seg[:, offset : offset + tq]), np.arange(offset, offset + tq, dtype=np.int32))
    kv_tokens = Tokens(jnp.asarray(seg[:, :tk]), np.arange(tk, dtype=np.int32))
    options = Options(causal=causal, window=window, scale=dqk**-0.5)
    interpret = plgpu.InterpretGPUParams(detect_races=True)  # a race between the kernel's threads raises

    out, lse = mosaic.forward(q, k, v, q_tokens, kv_tokens, options=options, interpret=interpret)
    want_out, want_lse = blockwise.forward(q, k, v, q_tokens, kv_tokens, options=options)
    seen = np.isfinite(np.asarray(want_lse))
    assert not seen.all() and np.all(np.asarray(lse)[~seen] == -np.inf)
    assert relative_error(out.astype(jnp.float32), want_out.astype(jnp.float32)) < 1e-2
    assert np.abs(np.asarray(lse)[seen] - np.asarray(want_lse)[seen]).max() < 1e-3

    dout, dlse = normal(*out.shape), jnp.asarray(rng.normal(size=lse.shape), jnp.float32)
    saved = (want_out, want_lse, dout, dlse)
    grad_dtype = jnp.float32 if float32 else None
    grads = mosaic.backward(q, k, v, q_tokens, kv_tokens, *saved, options=options, interpret=interpret,
                            grad_dtype=grad_dtype)  # fmt: skip
    wanted = blockwise.backward(q, k, v, q_tokens, kv_tokens, *saved, options=options)
    for got, want, x in zip(grads, wanted, (q, k, v), strict=True):
        assert got.dtype == (grad_dtype or x.dtype) and got.shape == x.shape
        assert relative_error(got.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2
