"""The ring under cuDNN compiles for H100s only the kinds its steps can be (parallel/strategies/ring_steps.py), through
XLA's GPU compiler with no GPU (parallel/targets.py): per direction one causal call (the step against our own piece)
and, at each of the two places a later step is traced (the scan's body and the peeled last step), the two half
steps' all-visible calls; no float32 scatter assembles partial outputs or gradients. GQA's K / V keep their own
heads in the compiled calls where JAX's binding allows it (parallel.compat.cudnn_packed_gqa), else are repeated to
the query heads.

    python -m pytest -q tests/gpu_compile/test_ring_cudnn.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import parallel
from parallel import compat, targets
from parallel.parallelism import Parallelism, use_parallelism

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]

SHARDS, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 4, 1024, 8, 2, 128
CALL = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)".*?"mask_type":\s*"(\w+)"')


def operands(line: str) -> list[tuple[int, ...]]:
    """The operand shapes of a compiled custom call (its operand layout constraints), in order."""
    constraints = line.split("operand_layout_constraints={", 1)[1].split("}}", 1)[0]
    return [tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"\w+\[([\d,]+)\]", constraints)]


def test_ring_compiles_only_the_kinds_its_steps_can_be():
    devices = np.array(targets.compile_only_devices("h100", SHARDS))
    mesh = Mesh(devices, ("context",))
    rows = NamedSharding(mesh, P(None, "context"))
    spec = lambda heads: jax.ShapeDtypeStruct((1, LENGTH, heads, HEAD_DIM), jnp.bfloat16, sharding=rows)
    segment_ids = jax.ShapeDtypeStruct((1, LENGTH), jnp.int32, sharding=rows)
    parallelism = Parallelism(kernel="cudnn", platform="gpu", capability="9.0", layout="dual_chunk")

    def loss(q, k, v, segment_ids):
        out = parallel.attention(q, k, v, segment_ids=segment_ids, mesh=mesh, strategy="ring")
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh), use_parallelism(parallelism):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        text = grad.trace(spec(HEADS), spec(KV_HEADS), spec(KV_HEADS), segment_ids).lower().compile().as_text()
    calls = [(name, mask, line) for line in text.splitlines() for name, mask in CALL.findall(line)]
    for name in ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"):
        masks = sorted(mask for called, mask, _ in calls if called == name)
        assert masks == ["PADDING"] * 4 + ["PADDING_CAUSAL"], f"{name}: {masks}"
    n, kv_heads = LENGTH // SHARDS, KV_HEADS if compat.cudnn_packed_gqa() else HEADS
    shapes = {tuple(operands(line)[:3]) for _, _, line in calls}
    # the diagonal, then a half step's: all queries x the first half of the arriving piece, our second half x all of it
    wanted = {(n, n), (n, n // 2), (n // 2, n)}
    assert shapes == {((1, tq, HEADS, HEAD_DIM), *[(1, tk, kv_heads, HEAD_DIM)] * 2) for tq, tk in wanted}, shapes
    # (cuDNN's statistics [slots, heads, tq] are scattered from the lse; outputs and gradients never are)
    scatters = re.findall(rf"= f32\[1,\d+,{HEADS},{HEAD_DIM}\][^=]*? scatter\(", text)
    assert not scatters, f"float32 scatters of partial results around the ring's steps: {scatters[:3]}"
