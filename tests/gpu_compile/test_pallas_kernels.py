"""The Pallas attention kernels (parallel/kernels/pallas.py) compile for an H100 through XLA's GPU compiler with no GPU
(parallel/targets.py): forward, dk / dv and dq in one program a case, at every head dim the project ships (64, 128, 256,
and latent attention's 192 for queries and keys with 128 for values), in bfloat16 (the GPU training dtype) and float32,
GQA, causal and not, with a sliding window, on a length of whole blocks and one that is neither whole blocks nor a power
of two once padded. The config's blocks (256) are asked for, so the kernels' own clamp decides the tiles. XLA raises
when a kernel needs more shared memory than the H100 gives a block (RESOURCE_EXHAUSTED), so a test fails when a kernel's
tiles stop fitting; each also checks that all three kernels are Triton calls (JAX 0.10.2 lowers a kernel that does not
name Triton to Mosaic GPU). On Hopper (`hopper=True`, as kernels.select passes for compute capability 9.0) the Mosaic
GPU kernels (parallel/kernels/mosaic.py) take the 16-bit calls at every head dim (dk and dv as two kernels at 256),
float32 gradients (the ring's running sums) included, without JAX 0.12's warning that Pallas' Triton backend is
deprecated, and the speed estimate costs them as the Triton ones.

    python -m pytest -q tests/gpu_compile/test_pallas_kernels.py
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from parallel import targets
from parallel.kernels import Options, Tokens, mosaic, pallas
from train.planning import speed

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


def compile_for_h100(
    dqk: int, dv: int, length: int, dtype, causal: bool, window: int | None = None, hopper=False, grad_dtype=None
) -> str:  # fmt: skip
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
        out, lse = pallas.forward(q, k, v, tokens, tokens, options=options, hopper=hopper)
        saved = (out, lse, out, lse)
        return pallas.backward(q, k, v, tokens, tokens, *saved, options=options, hopper=hopper, grad_dtype=grad_dtype)

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


# on the newest stack the bfloat16 cases Hopper runs on Mosaic GPU's kernels (below) are slow here
BFLOAT16 = [
    case if case.values in (("128", "whole_blocks"), ("mla", "ragged"), ("256", "ragged")) else
    pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow])
    for case in on_the_newest_stack(*((h, n) for h in HEAD_DIMS for n in LENGTHS), floor=("128", "whole_blocks"))
]  # fmt: skip


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


def mosaic_kernels(text: str) -> list[str]:
    """The scopes of the Mosaic GPU custom calls in compiled HLO text (the kernels' names)."""
    calls = [line for line in text.splitlines() if 'custom_call_target="mosaic_gpu' in line]
    return sorted(name for line in calls for name in re.findall(r"(attention_\w+)/", line))


MOSAIC = on_the_newest_stack(("128", "whole_blocks", None), ("mla", "ragged", jnp.float32), ("64", "ragged", None),
                             ("256", "whole_blocks", jnp.float32), floor=("128", "whole_blocks", None))  # fmt: skip
# at 256 / 256 dk and dv run as two kernels (their accumulators would not fit one warpgroup's registers together)
SPLIT = ["attention_dk", "attention_dq", "attention_dv", "attention_forward"]


@pytest.mark.parametrize("head_dims, length, grad_dtype", MOSAIC)
def test_mosaic_kernels_take_hoppers_calls(head_dims, length, grad_dtype):
    """Causal with a window (its bounds in the block ranges and masks); the speed estimate counts the kernels' FLOPs
    (forward 1, dk / dv 1.5 or dk 1 and dv 0.5, dq 1: train/planning/speed.py) on the whole padded grid, as the Triton
    kernels'."""
    dqk, dv = HEAD_DIMS[head_dims]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = compile_for_h100(dqk, dv, LENGTHS[length], jnp.bfloat16, True, window=100, hopper=True,
                                grad_dtype=grad_dtype)  # fmt: skip
    assert mosaic_kernels(text) == (SPLIT if head_dims == "256" else KERNELS) and not triton_kernels(text)
    assert not [w for w in caught if "Triton backend is deprecated" in str(w.message)]  # JAX 0.12's warning
    tally = speed.schedule_cost(text, targets.TARGETS["h100"].rates, [0])
    padded = -(-LENGTHS[length] // mosaic.BLOCK) * mosaic.BLOCK
    forward = 2 * HEADS * padded**2 * (dqk + dv)
    assert tally.flops[speed.ATTENTION] == pytest.approx(3.5 * forward)


@pytest.mark.newest_stack
def test_hopper_runs_triton_on_float32():
    """Float32 operands (a warpgroup multiply takes no float32 operand from registers) keep the Triton kernels."""
    text = compile_for_h100(*HEAD_DIMS["128"], LENGTHS["whole_blocks"], jnp.float32, causal=True, hopper=True)
    assert triton_kernels(text) == KERNELS and not mosaic_kernels(text)
