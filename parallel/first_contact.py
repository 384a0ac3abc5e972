"""First contact with a device: before a run trusts a fused attention kernel (cuDNN, FlashAttention-3, tokamax,
Pallas, splash) or the ragged expert dispatch, it checks them on its own devices against the reference paths (the
blockwise kernel; the capacity dispatch with room for every assignment) on small packed inputs, forward and backward,
in seconds. A mismatch or an error gives a warning naming the path and the error, and the run goes on on the next
fused kernel that agrees (kernels.NEXT_FUSED: FlashAttention-3 or tokamax, then cuDNN, then Pallas), else the
reference path.

Compile tests prove the GPU programs build, stand-ins and interpret mode prove their semantics on CPU; this is what
only the device itself can show (the numbers its kernels and collectives produce)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parallel import grouped, kernels
from parallel.experts import routed_experts
from parallel.mesh import logical_spec
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import layout_index
from parallel.strategies.common import chosen_kernel

log = logging.getLogger(__name__)

# relative error allowed between a kernel and the blockwise kernel on the same bfloat16 inputs (lse; the rest)
TOLERANCE = {"lse": 1e-2, "out": 3e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2, "y": 3e-2, "dx": 3e-2, "dw": 3e-2}
LENGTH = 512  # tokens of the checked rows: four documents, and a ring step of a 4-device dual_chunk ring
# a context around a wait on the devices for `what` (a run's stall watch: train/process/stall.py)
Waiting = Callable[[str], contextlib.AbstractContextManager]


def relative_error(a, b) -> float:
    """max |a - b| / max |b| over finite entries (0 when b is all zero or not finite)."""
    a, b = (np.asarray(x, np.float32) for x in (a, b))
    finite = np.isfinite(a) & np.isfinite(b)
    scale = np.abs(np.where(finite, b, 0)).max()
    return float(np.abs(np.where(finite, a, 0) - np.where(finite, b, 0)).max() / scale) if scale else 0.0


def _verdict(found: dict) -> str | None:
    """name -> (relative error, NaNs unlike the reference's) -> the first beyond TOLERANCE, described; else None."""
    for name, (error, nan) in found.items():
        if bool(nan):
            return f"{name} has NaNs the reference has not"
        if float(error) > TOLERANCE[name]:
            return f"{name} differs from the reference by {float(error):.3g} (relative; allowed {TOLERANCE[name]})"
    return None


def _mismatch(got: dict, want: dict) -> str | None:
    """_verdict of host arrays `got` against `want` (the same names)."""
    nans = lambda x: np.isnan(np.asarray(x, np.float32))
    found = {
        name: (relative_error(a, want[name]), not np.array_equal(nans(a), nans(want[name]))) for name, a in got.items()
    }
    return _verdict(found)


class Call(NamedTuple):
    """One checked attention call: q [batch, tq, heads, dqk], k / v [batch, tk, kv_heads, dqk / dv] and each side's
    tokens (numpy indices: static, the kernel knows the call's kind at trace time; jax arrays: traced)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_side: kernels.Tokens
    kv_side: kernels.Tokens


def _attention_grads(kernel, blocks: dict, call: Call, waiting: Waiting):
    """{out, lse, dq, dk, dv} of `call` on `kernel` through a loss with cotangents for out and lse; compiled first,
    then run inside `waiting`."""
    q, k, v = call.q, call.k, call.v
    weights = jax.random.normal(jax.random.key(3), (*q.shape[:3], v.shape[-1]), jnp.float32)
    static = isinstance(call.q_side.index, np.ndarray)

    def loss(q, k, v, *traced):
        indices = (call.q_side.index, call.kv_side.index) if static else traced
        sides = (call.q_side._replace(index=indices[0]), call.kv_side._replace(index=indices[1]))
        out, lse = kernels.attention(q, k, v, *sides, kernels.Options(**blocks), kernel=kernel)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(finite), (out, lse)

    args = (q, k, v) if static else (q, k, v, call.q_side.index, call.kv_side.index)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(*args).compile()
    with waiting(f"first contact with attention kernel {kernel.name!r}"):
        (dq, dk, dv), (out, lse) = jax.block_until_ready(grad(*args))
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _calls(dims: tuple[int, int, int, int], dtype) -> dict[str, Call]:
    """name -> Call of the checked calls, on the default device: packed rows (four documents; padding ends the
    second row) of LENGTH tokens on the causal diagonal, indices static; ring steps of a 4-device ring over
    2 x LENGTH tokens: dual_chunk (rank 2's queries, rank 1's first chunk, as the ring calls it: static, all-visible)
    and striped with indices traced (a general call: cuDNN runs its general kernel)."""
    heads, kv_heads, dqk, dv = dims
    rng = np.random.default_rng(0)
    seg = np.repeat(np.arange(1, 5, dtype=np.int32), LENGTH // 2)[None].repeat(2, axis=0)  # [2, 2 x LENGTH]
    seg[1, -LENGTH // 4 :] = 0
    dual, striped = (layout_index(2 * LENGTH, 4, layout, 1).reshape(4, -1) for layout in ("dual_chunk", "striped"))
    calls = {}
    for name, (q_index, kv_index) in {
        "diagonal": (np.arange(LENGTH, dtype=np.int32),) * 2,
        "dual_chunk ring step": (dual[2], dual[1][: LENGTH // 2]),
        "striped ring step": (striped[2], striped[1]),
    }.items():
        q, k, v = (
            jnp.asarray(rng.normal(size=(2, len(index), h, d)), dtype)
            for index, h, d in ((q_index, heads, dqk), (kv_index, kv_heads, dqk), (kv_index, kv_heads, dv))
        )
        if name == "striped ring step":
            q_index, kv_index = jnp.asarray(q_index), jnp.asarray(kv_index)
        sides = (kernels.Tokens(jnp.asarray(seg[:, np.asarray(i)]), i) for i in (q_index, kv_index))
        calls[name] = Call(q, k, v, *sides)
    return calls


def kernel_error(
    kernel: kernels.Kernel, device, dims: tuple[int, int, int, int], dtype, blocks: dict,
    waiting: Waiting = contextlib.nullcontext,
) -> str | None:  # fmt: skip
    """Runs `kernel` and the blockwise kernel on `device` (heads, kv heads, q-k and v head dims `dims`, in `dtype`,
    with `blocks` block_q / block_kv) on the calls of `_calls`, each run (not its compile) inside `waiting(what)`.
    Returns None when they agree, else what differed or the error raised."""
    try:
        with jax.default_device(device):
            for name, call in _calls(dims, dtype).items():
                got = _attention_grads(kernel, blocks, call, waiting)
                problem = _mismatch(got, _attention_grads(kernels.BLOCKWISE, blocks, call, waiting))
                if problem:
                    return f"{name}: {problem}"
    except Exception as error:  # noqa: BLE001  (any failure of an untried kernel sends the run to the reference)
        return _describe(error)
    return None


def _describe(error: Exception) -> str:
    """'Type: first line of the message'."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def _ffn(rows, w, group_sizes=None):
    """Experts as one matrix each: rows [experts, rows, d] batched, or [rows, d] grouped by `group_sizes`."""
    if group_sizes is None:
        return jnp.einsum("erd,edf->erf", rows, w)
    return grouped.ragged_dot(rows, w, group_sizes)


def _route(tokens, router, k: int):
    """Top-k of softmax scores: (weights [n, k] float32, experts [n, k] int32, probabilities [n, experts])."""
    probabilities = jax.nn.softmax(tokens.astype(jnp.float32) @ router)
    weights, experts = jax.lax.top_k(probabilities, k)
    return weights, experts.astype(jnp.int32), probabilities


def dispatch_error(
    parallelism: Parallelism, mesh, num_experts: int, k: int, dtype, waiting: Waiting = contextlib.nullcontext
) -> str | None:
    """Runs the MoE dispatch of `parallelism` and the capacity dispatch (room for every assignment) on `mesh`, forward
    and backward, on a few tokens per device routed to `num_experts` experts (k each), and compares them inside the
    program (every process gets the same replicated errors; the run, not its compile, inside `waiting(what)`). None
    when they agree, else what differed or the error raised."""
    spec = logical_spec(("batch", "length", "embed"), mesh)
    parts = [math.prod(mesh.shape[a] for a in ((p,) if isinstance(p, str) else p or ())) for p in spec[:2]]
    rest = mesh.size // (parts[0] * parts[1])
    shape, embed = (parts[0], parts[1] * rest * 8, 16), 16
    x = jax.random.normal(jax.random.key(1), shape, dtype)
    router = jax.random.normal(jax.random.key(2), (embed, num_experts), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (num_experts, embed, embed), dtype) / 4
    reference = dataclasses.replace(parallelism, expert_dispatch="capacity", expert_capacity=float(num_experts))

    def grads(x, w, dispatch: Parallelism):
        """{y, dx, dw} float32 of `dispatch` (installed while tracing)."""

        def loss(x, w):
            y = routed_experts(x, lambda t, r: _route(t, r, k), (router,), _ffn, (w,), num_experts=num_experts).y
            y = y.astype(jnp.float32)
            return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

        with use_parallelism(dispatch):
            (dx, dw), y = jax.grad(loss, argnums=(0, 1), has_aux=True)(x, w)
        return dict(y=y, dx=dx.astype(jnp.float32), dw=dw.astype(jnp.float32))

    def errors(x, w):
        """name -> (relative error, NaNs where the reference has none) as replicated scalars."""
        got, want = grads(x, w, parallelism), grads(x, w, reference)
        return {
            name: (
                jnp.max(jnp.abs(got[name] - want[name])) / jnp.maximum(jnp.max(jnp.abs(want[name])), 1e-30),
                jnp.any(jnp.isnan(got[name]) & ~jnp.isnan(want[name])),
            )
            for name in got
        }

    try:
        with jax.set_mesh(mesh):
            args = (jax.device_put(x, jax.NamedSharding(mesh, spec)), w)
            compiled = jax.jit(errors).lower(*args).compile()
            with waiting("first contact with the ragged expert dispatch"):
                found = jax.block_until_ready(compiled(*args))
        return _verdict(found)
    except Exception as error:  # noqa: BLE001  (any failure of an untried dispatch sends the run to the reference)
        return _describe(error)


def _anywhere(problem: str | None) -> str | None:
    """`problem`, or on a run of several processes the words for one that another process found: every process must
    take the same path (they compile one program)."""
    if jax.process_count() == 1:
        return problem
    from jax.experimental import multihost_utils

    failed = multihost_utils.process_allgather(np.int32(problem is not None))
    return problem or ("found on another process" if np.any(failed) else None)


def checked(
    parallelism: Parallelism, mesh, *, dims: tuple[int, int, int, int], experts: tuple[int, int], dtype,
    waiting: Waiting = contextlib.nullcontext,
) -> Parallelism:  # fmt: skip
    """`parallelism`, with the next fused kernel that agrees with the blockwise kernel (else the blockwise kernel) in
    place of one that disagrees, and the ragged dispatch with XLA's grouped matmul (after tokamax's), else the capacity
    dispatch, in place of a ragged dispatch that disagrees with the capacity dispatch (the kernels on each process's
    first device of `mesh`, the dispatch on `mesh`; a warning for each says which and why). The model's attention `dims`
    (heads, kv heads, q-k and v head dims; the check uses at most 2 kv heads of 2 query heads each), its `experts`
    (routed experts, experts per token) and compute `dtype` shape the checks; the kernel runs at the parallelism's
    blocks. Each check's run is inside `waiting(what)` (a run's stall watch: a hang on the device stops the run with a
    line naming the check)."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    heads, kv_heads, dqk, dv = dims
    kv = min(kv_heads, 2)
    checked_dims = (kv * min(heads // kv_heads, 2), kv, dqk, dv)
    blocks = dict(block_q=parallelism.block_q, block_kv=parallelism.block_kv)
    tried = _fused_kernels(parallelism)
    for name, after in zip(tried, [*tried[1:], "blockwise"], strict=False):  # the last tried: blockwise after
        candidate = dataclasses.replace(parallelism, kernel=name)
        problem = _anywhere(kernel_error(chosen_kernel(candidate), device, checked_dims, dtype, blocks, waiting))
        if not problem:
            log.info("attention kernel %r checked against the blockwise kernel on %s", name, device.device_kind)
            parallelism = candidate
            break
        log.warning(
            "attention kernel %r disagrees with the blockwise kernel on %s (%s): %s", name, device.device_kind,
            problem, "this run uses the blockwise kernel" if after == "blockwise" else f"trying {after!r}",
        )  # fmt: skip
    else:
        parallelism = dataclasses.replace(parallelism, kernel="blockwise")
    if experts[0] and parallelism.expert_dispatch == "ragged" and mesh.size > 1:
        parallelism = _checked_dispatch(parallelism, mesh, experts, dtype, waiting, device.device_kind)
    return parallelism


def _checked_dispatch(parallelism: Parallelism, mesh, experts, dtype, waiting: Waiting, kind: str) -> Parallelism:
    """The first that agrees with the capacity dispatch of: `parallelism`'s ragged dispatch; the same with XLA's
    grouped matmul (where it had tokamax's); else the capacity dispatch itself. A warning for each that does not."""
    tried = [parallelism]
    if parallelism.grouped_matmul != "xla":
        tried.append(dataclasses.replace(parallelism, grouped_matmul="xla"))
    for candidate, after in zip(tried, [*tried[1:], None], strict=True):
        what = f"ragged expert dispatch ({candidate.grouped_matmul} grouped matmul)"
        problem = dispatch_error(candidate, mesh, *experts, dtype, waiting)
        if not problem:
            log.info("%s checked against the capacity dispatch on %s", what, kind)
            return candidate
        then = "this run uses the capacity dispatch" if after is None else "trying the xla grouped matmul"
        log.warning("%s disagrees with the capacity dispatch on %s (%s): %s", what, kind, problem, then)
    return dataclasses.replace(parallelism, expert_dispatch="capacity")


def _fused_kernels(parallelism: Parallelism) -> list[str]:
    """The parallelism's kernel (auto resolved), then each fused kernel after it (kernels.NEXT_FUSED) that its devices
    can run; none for the blockwise kernel."""
    names, name = [], chosen_kernel(parallelism).name
    while name is not None and name != "blockwise":
        try:
            chosen_kernel(dataclasses.replace(parallelism, kernel=name))
            names.append(name)
        except ValueError:  # not on these devices (cuDNN before Hopper, FlashAttention-3 not installed)
            pass
        name = kernels.NEXT_FUSED.get(name)
    return names
