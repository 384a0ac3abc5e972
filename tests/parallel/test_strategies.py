"""Every context strategy equals explicit-mask fp32 attention on un-reordered inputs, outputs and gradients:
{causal, full} x {MHA, GQA, MLA head dims} in one compile per (strategy, shards), run on packed rows with padding
(one row all padding) and on unpacked rows; balanced (dual_chunk) order; contiguous and striped separately."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import parallel
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced, to_balanced
from tests.parallel.attention_reference import packed_segments, reference, relative_error
from tests.parallel.cudnn_standin import serve_cudnn_with_standin

HEADS = {"mha": (8, 8, 16, 16), "gqa": (8, 2, 16, 16), "mla": (8, 8, 24, 16)}  # heads, kv heads, dqk, dv
BATCH, LENGTH = 2, 64


def mesh_for(strategy: str, shards: int):
    """(mesh, axis, layout shards): usp splits shards into ring x ulysses."""
    devices = np.array(jax.devices()[:shards])
    if strategy == "usp":
        ring = {1: 1, 2: 2, 4: 2, 8: 4}[shards]
        return Mesh(devices.reshape(ring, shards // ring), ("context", "ulysses")), ("context", "ulysses"), ring
    return Mesh(devices, ("context",)), "context", shards


def cases():
    return [(heads, causal) for heads in HEADS for causal in (True, False)]


def inputs(heads, seed):
    h, hkv, dqk, dv = HEADS[heads]
    rng = np.random.default_rng(seed)
    shapes = [(BATCH, LENGTH, h, dqk), (BATCH, LENGTH, hkv, dqk), (BATCH, LENGTH, hkv, dv), (BATCH, LENGTH, h, dv)]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def check_strategy(
    strategy, shards, layout="dual_chunk", stripe=1, case_list=None, unpacked_as_none=False, kernel="blockwise"
):
    """Compiles all cases once; runs them on packed segment ids and on unpacked rows (all ones, or None).
    kernel="pallas" or "splash" runs the Pallas kernels in interpret mode."""
    mesh, axis, layout_shards = mesh_for(strategy, shards)
    case_list = case_list or cases()
    data = [inputs(heads, seed) for seed, (heads, _) in enumerate(case_list)]
    order = dict(layout=layout, stripe=stripe, axis=1)
    to_layout = lambda x: None if x is None else to_balanced(x, layout_shards, **order)

    def run_all(data, seg):
        results = []
        for (_heads, causal), (q, k, v, w) in zip(case_list, data, strict=True):

            def f(q, k, v):
                out = parallel.attention(
                    to_layout(q),
                    to_layout(k),
                    to_layout(v),
                    segment_ids=to_layout(seg),
                    causal=causal,
                    mesh=mesh,
                    strategy=strategy,
                    axis=axis,
                    layout=layout,
                    stripe=stripe,
                )
                return from_balanced(out, layout_shards, **order)

            out, vjp = jax.vjp(f, q, k, v)
            results.append((out, vjp(w)))
        return results

    packed = jnp.asarray(packed_segments(BATCH, LENGTH, seed=shards))
    unpacked = None if unpacked_as_none else jnp.ones((BATCH, LENGTH), jnp.int32)
    parallelism = Parallelism(block_q=8, block_kv=8, kernel=kernel, interpret=kernel in ("pallas", "splash"))
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        run = jax.jit(run_all)
        runs = [(seg, run(data, seg)) for seg in (packed, unpacked)]
    for seg, results in runs:
        for (heads, causal), (q, k, v, w), (out, grads) in zip(case_list, data, results, strict=True):
            ref = lambda q, k, v: reference(q, k, v, segment_ids=seg, causal=causal)[0]
            ref_out, ref_vjp = jax.vjp(ref, q, k, v)
            label = f"{strategy} shards={shards} {layout} {heads} causal={causal} packed={seg is packed}"
            assert relative_error(out, ref_out) < 2e-5, label
            for name, g, r in zip("qkv", grads, ref_vjp(w), strict=True):
                assert not np.isnan(np.asarray(g)).any(), f"{label}: NaN in d{name}"
                assert relative_error(g, r) < 2e-5, f"{label}: d{name}"


# Every strategy at 8 devices (ring and usp: a scan of several ring steps; ulysses: GQA KV heads repeated), plus
# the edges where the code branches: 1 device (none: no reorder; ring: no permute), 2 devices (ring: first and
# last step only, no scan; ulysses: KV heads not repeated; usp: a ulysses axis of 1; all_gather: the smallest
# split). 4 devices take no path that these do not; the other layouts run at 4: test_other_layouts.
@pytest.mark.parametrize(
    "strategy, shards",
    [
        ("none", 1),
        pytest.param("none", 8, marks=pytest.mark.newest_stack),
        pytest.param("all_gather", 2, marks=pytest.mark.newest_stack),
        ("all_gather", 8),
        pytest.param("ring", 1, marks=pytest.mark.newest_stack),
        pytest.param("ring", 2, marks=pytest.mark.newest_stack),
        ("ring", 8),
        pytest.param("ulysses", 2, marks=pytest.mark.newest_stack),
        ("ulysses", 8),
        pytest.param("usp", 2, marks=pytest.mark.newest_stack),
        pytest.param("usp", 8, marks=pytest.mark.slow),  # usp's ring and ulysses: the 2-device case, cuDNN's usp 4
    ],
)
def test_strategy_matches_reference(strategy, shards):
    check_strategy(strategy, shards)


@pytest.mark.parametrize(
    "strategy,layout,stripe",
    [
        pytest.param(
            "ring", "contiguous", 1, marks=pytest.mark.slow
        ),  # the ring's steps: tests/parallel/test_ring_steps.py
        ("ring", "striped", 2),
        pytest.param("all_gather", "striped", 1, marks=pytest.mark.slow),
        ("ulysses", "contiguous", 1),
        pytest.param("usp", "striped", 2, marks=pytest.mark.slow),
    ],
)
def test_other_layouts(strategy, layout, stripe):
    check_strategy(strategy, 4, layout, stripe, case_list=[("gqa", True), ("mla", False)], unpacked_as_none=True)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_strategy_with_the_pallas_kernel(strategy):
    """The Pallas kernels (interpret mode) behind a strategy: each ring step's forward / backward (adding into the
    ring's running gradient sums) and the differentiable kernel all_gather calls."""
    check_strategy(strategy, 4, case_list=[("gqa", True), ("mla", False)], kernel="pallas")


@pytest.mark.parametrize(
    "strategy, shards, layout",
    [
        pytest.param("none", 1, "contiguous", marks=pytest.mark.slow),  # the kernel alone: tests/parallel/test_cudnn.py
        pytest.param("ring", 2, "dual_chunk", marks=pytest.mark.both_stacks),  # GQA as JAX's binding takes it
        ("all_gather", 4, "dual_chunk"),
        pytest.param("all_gather", 2, "contiguous", marks=pytest.mark.slow),
        ("all_gather", 4, "striped"),
        ("ulysses", 4, "dual_chunk"),
        ("ulysses", 2, "striped"),
        pytest.param("usp", 4, "dual_chunk", marks=pytest.mark.both_stacks),
    ],
)
def test_strategy_with_the_cudnn_kernel(strategy, shards, layout, monkeypatch):
    """cuDNN (the dense stand-in of its primitives) serves every attention call of these strategies and layouts,
    packed and unpacked (the ring's and usp's steps causal only, to keep their compile short): the blockwise kernel
    behind it returns NaN, yet outputs and gradients equal the reference. (A striped all_gather, which cuDNN cannot
    serve, runs the blockwise kernel itself.)"""
    serve_cudnn_with_standin(monkeypatch)
    case_list = [("gqa", True)] if strategy in ("ring", "usp") else [("gqa", True), ("mla", False)]
    check_strategy(strategy, shards, layout, case_list=case_list, kernel="cudnn")


def test_ring_sends_dkv_in_the_compute_dtype():
    """ring_grad_dtype=compute with bfloat16 K/V: no dK / dV collective-permute of the backward carries float32 (the
    default's do), and the gradients equal the float32-accumulating ring's to bfloat16 precision. The lowered
    program is checked: XLA:CPU itself widens every bfloat16 collective to float32, GPU compilers do not."""
    shards, (_, kv_heads, dqk, dv) = 4, HEADS["gqa"]
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    q, k, v, w = (x.astype(jnp.bfloat16) for x in inputs("gqa", seed=0))
    seg = jnp.asarray(packed_segments(BATCH, LENGTH, seed=1))

    def grads(q, k, v):
        out = parallel.attention(q, k, v, segment_ids=seg, causal=True, mesh=mesh, strategy="ring", layout="dual_chunk")
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

    grads_f32 = [f"tensor<{BATCH}x{LENGTH // shards}x{kv_heads}x{d}xf32>" for d in (dqk, dv)]
    results = {}
    for dtype in ("float32", "compute"):
        parallelism = Parallelism(block_q=8, block_kv=8, ring_grad_dtype=dtype)
        with jax.set_mesh(mesh), use_parallelism(parallelism):
            fn = jax.jit(jax.grad(grads, argnums=(0, 1, 2)))
            program = fn.lower(q, k, v).as_text()
            results[dtype] = fn(q, k, v)
        permutes = [line for line in program.splitlines() if "collective_permute" in line]
        assert any(t in line for line in permutes for t in grads_f32) == (dtype == "float32"), dtype
    for name, got, want in zip("qkv", results["compute"], results["float32"], strict=True):
        assert got.dtype == jnp.bfloat16
        assert relative_error(got.astype(jnp.float32), want.astype(jnp.float32)) < 2e-2, f"d{name}"


def test_ring_under_cudnn_in_a_rematerialised_layer_scan_keeps_nothing_per_step(monkeypatch):
    """Attention in a scan of layers, each rematerialised with nothing saved (compute.remat_policy=full): the grad's
    lowered program stacks nothing of the ring's steps at the size of a piece's heads (cuDNN's token masks and the
    constants its branches return were kept per step and per layer, hoisted out of the layer scan by JAX)."""
    serve_cudnn_with_standin(monkeypatch)
    shards, (heads, _, dqk, dv) = 8, HEADS["mla"]
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    q, k, v, _ = inputs("mla", seed=0)
    seg = jnp.asarray(packed_segments(BATCH, LENGTH, seed=1))

    def loss(q, k, v):
        def layer(x, _):
            attend = lambda x: parallel.attention(x, x * k, x[..., :dv] * v, segment_ids=seg, strategy="ring")
            out = jax.checkpoint(attend, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)(x)
            return x + jnp.pad(out, [(0, 0)] * 3 + [(0, dqk - dv)]), None

        return jnp.sum(jax.lax.scan(layer, q, None, length=2)[0])

    parallelism = Parallelism(block_q=8, block_kv=8, kernel="cudnn", layout="dual_chunk")
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        program = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    steps = shards - 2  # the ring's scan: the first and the last step are peeled off
    stacked = re.findall(rf"tensor<{steps}x{BATCH}x\d+x{heads}x\d+x\w+>", program)
    assert not stacked, f"per-step residuals: {sorted(set(stacked))}"
