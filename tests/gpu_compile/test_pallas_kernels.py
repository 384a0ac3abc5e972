"""The Pallas attention kernels (parallel/kernels/pallas.py) compile for an H100 through XLA's GPU compiler with no GPU
(parallel/targets.py): forward, dk / dv and dq in one program a case, at every head dim the project ships (64, 128,
256, and latent attention's 192 for queries and keys with 128 for values), in bfloat16 (the GPU training dtype) and
float32, GQA, causal and not, with a sliding window, on a length of whole blocks and one that is neither whole
blocks nor a power of two once padded. The config's blocks (256) are asked for, so the kernels' own clamp decides
the tiles. XLA raises when a kernel needs more shared memory than the H100 gives a block (RESOURCE_EXHAUSTED), so a
test fails when a kernel's tiles stop fitting; each also checks that all three kernels are Triton calls (JAX 0.10.2
lowers a kernel that does not name Triton to Mosaic GPU).

    python -m pytest -q tests/gpu_compile/test_pallas_kernels.py
"""

import re

import jax
import jax.numpy as jnp
import pytest

from parallel import targets
from parallel.kernels import Options, Tokens, pallas

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]

HEAD_DIMS = {"64": (64, 64), "128": (128, 128), "256": (256, 256), "mla": (192, 128)}  # dqk, dv
HEADS, KV_HEADS = 8, 2  # GQA: 4 query heads a key-value head
# 256: whole blocks of every size; 300: padded to 3 or 5 blocks (384 or 320 tokens, not a power of two)
LENGTHS = {"whole_blocks": 256, "ragged": 300}
BLOCK = 256  # the config's default block_q / block_kv
KERNELS = ["attention_dkdv", "attention_dq", "attention_forward"]


def compile_for_h100(dqk: int, dv: int, length: int, dtype, causal: bool, window: int | None = None) -> str:
    """The compiled HLO text of pallas.forward and pallas.backward (given the forward's out and lse as cotangents;
    only shapes matter) for one H100, batch 1."""
    device = targets.compile_only_devices("h100", 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    args = (
        spec(1, length, HEADS, dqk),
        spec(1, length, KV_HEADS, dqk),
        spec(1, length, KV_HEADS, dv),
        spec(1, length, dtype=jnp.int32),  # segment ids
        spec(length, dtype=jnp.int32),  # global indices
    )
    options = Options(causal=causal, scale=dqk**-0.5, block_q=BLOCK, block_kv=BLOCK, window=window)

    def step(q, k, v, seg, index):
        tokens = Tokens(seg, index)
        out, lse = pallas.forward(q, k, v, tokens, tokens, options=options)
        return pallas.backward(q, k, v, tokens, tokens, out, lse, out, lse, options=options)

    with jax.set_mesh(targets.target_mesh([device])):
        return jax.jit(step).trace(*args).lower().compile().as_text()


def triton_kernels(text: str) -> list[str]:
    """Names of the Triton custom calls in compiled HLO text."""
    calls = [line for line in text.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line]
    return sorted(name for line in calls for name in re.findall(r'name = "(\w+)"', line))


def on_the_newest_stack(*cases, floor=None) -> list:
    """`cases` (tuples of arguments) as parameters, each but `floor` marked newest_stack (the floor stack compiles
    that one, and Pallas behind cuDNN in test_train_step.py)."""
    return [pytest.param(*case, marks=[] if case == floor else [pytest.mark.newest_stack]) for case in cases]


BFLOAT16 = on_the_newest_stack(*((h, n) for h in HEAD_DIMS for n in LENGTHS), floor=("128", "whole_blocks"))


@pytest.mark.parametrize("head_dims, length", BFLOAT16)
def test_kernels_fit_an_h100_in_bfloat16(head_dims, length):
    """Causal (the training call)."""
    text = compile_for_h100(*HEAD_DIMS[head_dims], LENGTHS[length], jnp.bfloat16, causal=True)
    assert triton_kernels(text) == KERNELS


@pytest.mark.parametrize("head_dims", on_the_newest_stack(("mla",), ("256",)))
def test_kernels_fit_an_h100_in_float32(head_dims):
    """The widest rows (float32 at the largest head dims: the smallest tiles), not causal, ragged length."""
    text = compile_for_h100(*HEAD_DIMS[head_dims], LENGTHS["ragged"], jnp.float32, causal=False)
    assert triton_kernels(text) == KERNELS


@pytest.mark.parametrize("head_dims", on_the_newest_stack(("128",), ("mla",)))
def test_windowed_kernels_fit_an_h100(head_dims):
    """A sliding window (its bounds in each block-skip test and mask) in bfloat16 on the ragged length."""
    text = compile_for_h100(*HEAD_DIMS[head_dims], LENGTHS["ragged"], jnp.bfloat16, causal=True, window=100)
    assert triton_kernels(text) == KERNELS
