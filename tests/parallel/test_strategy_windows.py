"""Every context strategy with a sliding window and attention sinks equals the dense reference (window mask, a sink
as one more logit column of value zero): out and the gradients of q, k, v and the sinks, on a row holding one
document and a packed row with padding, GQA, at 2, 4 and 8 devices, dual_chunk and contiguous (and the ring's
fallback to every step in striped). One compile per case runs its windows: one token, five, sixteen, a device's
piece L, L + 3, 3L and more than the row. Sinks alone under cuDNN (its stand-in), which leaves windows to its
general kernel. The 2-device cases and the ring's windows under Pallas (interpret mode) are slow."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced, to_balanced
from tests.parallel.attention_reference import packed_segments, reference, relative_error
from tests.parallel.cudnn_standin import serve_cudnn_with_standin
from tests.parallel.test_strategies import BATCH, LENGTH, inputs, mesh_for

HEADS = 8


def check_windows(strategy, shards, layout, kernel="blockwise", windows=None):
    """All `windows` (None: 1, 5, a piece, a piece + 3, more than the row) of one (strategy, shards, layout), each
    against the reference."""
    mesh, axis, layout_shards = mesh_for(strategy, shards)
    piece = LENGTH // layout_shards
    windows = windows or tuple(dict.fromkeys((1, 5, 16, piece, piece + 3, 3 * piece, LENGTH + 1)))
    q, k, v, w = inputs("gqa", seed=shards)
    s = jnp.asarray(np.random.default_rng(7).normal(size=(HEADS,)), jnp.float32)
    packed = packed_segments(BATCH, LENGTH, seed=shards + 1)[0]
    seg = jnp.asarray(np.stack([np.ones(LENGTH, np.int32), packed]))  # one document per row, then a packed row
    order = dict(layout=layout, stripe=2, axis=1)
    to_layout = lambda x: to_balanced(x, layout_shards, **order)

    def grads(window, q, k, v, s):
        def loss(q, k, v, s):
            out = parallel.attention(
                *(to_layout(x) for x in (q, k, v)), segment_ids=to_layout(seg), window=window, sinks=s, mesh=mesh,
                strategy=strategy, axis=axis, layout=layout, stripe=2,
            )  # fmt: skip
            out = from_balanced(out, layout_shards, **order)
            return jnp.sum(out * w), out

        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, s)

    def ref_grads(window, q, k, v, s):
        def loss(q, k, v, s):
            out = reference(q, k, v, segment_ids=seg, window=window, sinks=s)[0]
            return jnp.sum(out * w), out

        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, s)

    # One compile for all windows, or on JAX 0.10 one per window: XLA:CPU runs a program's independent parts at
    # once, and there two windows' rings in one program could exchange their pieces (wrong gradients, now and then).
    parallelism = Parallelism(block_q=8, block_kv=8, kernel=kernel, interpret=kernel in ("pallas", "splash"))
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        if jax.__version_info__ < (0, 11):
            results = [jax.jit(functools.partial(grads, window))(q, k, v, s) for window in windows]
        else:
            results = jax.jit(lambda *a: [grads(window, *a) for window in windows])(q, k, v, s)
    expected = jax.jit(lambda *a: [ref_grads(window, *a) for window in windows])(q, k, v, s)
    for window, (got, out), (want, ref_out) in zip(windows, results, expected, strict=True):
        label = f"{strategy} shards={shards} {layout} window={window}"
        assert relative_error(out, ref_out) < 2e-5, label
        for name, g, r in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
            assert not np.isnan(np.asarray(g)).any(), f"{label}: NaN in {name}"
            assert relative_error(g, r) < 2e-5, f"{label}: {name}"


FLOOR_CASES = {  # what the floor stack runs: none and the dual_chunk ring (the striped ring's windows are slow)
    ("none", 1, "contiguous"),
    ("ring", 4, "dual_chunk"),
}
NEWEST_CASES = {  # what the newest stack adds: usp, contiguous pieces, 4 and 8 devices; the 2-device cases are slow
    ("all_gather", 4, "contiguous"),
    ("ring", 4, "contiguous"),
    ("ring", 8, "dual_chunk"),
    ("ulysses", 4, "dual_chunk"),
    ("usp", 4, "dual_chunk"),
}


def marks(case) -> list:
    """The case's marks: none on the floor, newest_stack, or slow (FLOOR_CASES, NEWEST_CASES)."""
    if case in FLOOR_CASES:
        return []
    return [pytest.mark.newest_stack] if case in NEWEST_CASES else [pytest.mark.slow]


@pytest.mark.parametrize(
    "strategy, shards, layout",
    [
        pytest.param(*case, marks=marks(case))
        for case in [
            ("none", 1, "contiguous"),
            ("all_gather", 2, "dual_chunk"),
            ("all_gather", 4, "contiguous"),
            ("all_gather", 8, "dual_chunk"),
            ("ring", 2, "contiguous"),
            ("ring", 2, "dual_chunk"),
            ("ring", 4, "contiguous"),
            ("ring", 4, "dual_chunk"),
            ("ring", 4, "striped"),
            ("ring", 8, "contiguous"),
            ("ring", 8, "dual_chunk"),
            ("ulysses", 2, "contiguous"),
            ("ulysses", 4, "dual_chunk"),
            ("ulysses", 8, "dual_chunk"),
            ("usp", 2, "dual_chunk"),
            ("usp", 4, "dual_chunk"),
            ("usp", 8, "dual_chunk"),
        ]
    ],
)
def test_windows_and_sinks_match_reference(strategy, shards, layout):
    check_windows(strategy, shards, layout)


@pytest.mark.slow
def test_ring_windows_with_the_pallas_kernel():
    """Each ring step's Pallas forward / backward (interpret mode) with the window, the merged lse's cotangent from
    the sinks joining every step's backward."""
    check_windows("ring", 2, "dual_chunk", kernel="pallas")


@pytest.mark.parametrize(
    "strategy, shards, layout",
    [("all_gather", 4, "dual_chunk"), ("ring", 2, "dual_chunk"), ("ulysses", 2, "contiguous")],
)
def test_sinks_with_the_cudnn_kernel(strategy, shards, layout, monkeypatch):
    """Sinks without a window under cuDNN (its dense stand-in, the general kernel behind it poisoned): every call is
    served, all_gather's split calls merge their lse, and the lse cotangent reaches cuDNN's backward."""
    serve_cudnn_with_standin(monkeypatch)
    check_windows(strategy, shards, layout, kernel="cudnn", windows=(None,))
