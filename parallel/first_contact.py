"""First contact with a device: before a run trusts a fused attention kernel (cuDNN, Pallas) or the ragged expert
dispatch, it checks them on its own devices against the reference paths (the blockwise kernel; the capacity
dispatch with room for every assignment) on small packed inputs, forward and backward, in seconds. A mismatch or
an error gives a warning naming the path and the error, and the run goes on on the reference path.

Compile tests prove the GPU programs build, stand-ins and interpret mode prove their semantics on CPU; this is what
only the device itself can show (the numbers its kernels and collectives produce)."""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from parallel import kernels
from parallel import plan as plans
from parallel.experts import routed_experts
from parallel.mesh import logical_spec
from parallel.reorder import layout_index

log = logging.getLogger(__name__)

# relative error allowed between a kernel and the blockwise kernel on the same bfloat16 inputs (lse; the rest)
TOLERANCE = {"lse": 1e-2, "out": 3e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2, "y": 3e-2, "dx": 3e-2, "dw": 3e-2}
LENGTH = 512  # tokens of the checked rows: four documents, and a ring step of a 4-device dual_chunk ring


def relative_error(a, b) -> float:
    """max |a - b| / max |b| over finite entries (0 when b is all zero or not finite)."""
    a, b = (np.asarray(x, np.float32) for x in (a, b))
    finite = np.isfinite(a) & np.isfinite(b)
    scale = np.abs(np.where(finite, b, 0)).max()
    return float(np.abs(np.where(finite, a - b, 0)).max() / scale) if scale else 0.0


def _mismatch(got: dict, want: dict) -> str | None:
    """The first quantity whose relative error exceeds TOLERANCE, described; None when all agree."""
    for name, value in got.items():
        if not np.array_equal(np.isnan(np.asarray(value, np.float32)), np.isnan(np.asarray(want[name], np.float32))):
            return f"{name} has NaNs the reference has not"
        error = relative_error(value, want[name])
        if error > TOLERANCE[name]:
            return f"{name} differs from the reference by {error:.3g} (relative; allowed {TOLERANCE[name]})"
    return None


def _attention_grads(kernel, q, k, v, q_seg, kv_seg, q_index, kv_index):
    """{out, lse, dq, dk, dv} of one call of `kernel` through a loss with cotangents for out and lse."""
    weights = jax.random.normal(jax.random.key(3), (*q.shape[:3], v.shape[-1]), jnp.float32)

    def loss(q, k, v, q_index, kv_index):
        out, lse = kernels.attention(
            q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_index=q_index, kv_index=kv_index, kernel=kernel,
            block_q=128, block_kv=128,
        )  # fmt: skip
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(finite), (out, lse)

    (dq, dk, dv), (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, q_index, kv_index)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _calls(dims: tuple[int, int, int, int], dtype) -> dict:
    """name -> (q, k, v, q_seg, kv_seg, q_index, kv_index) of the checked calls, on the default device: packed rows
    of LENGTH tokens (four documents; padding ends the second row) on the causal diagonal, and a dual_chunk ring step
    (rank 2's queries, rank 1's keys of a 4-device ring over 2 x LENGTH tokens), indices traced."""
    heads, kv_heads, dqk, dv = dims
    rng = np.random.default_rng(0)
    seg = np.repeat(np.arange(1, 5, dtype=np.int32), LENGTH // 2)[None].repeat(2, axis=0)  # [2, 2 x LENGTH]
    seg[1, -LENGTH // 4 :] = 0
    index = layout_index(2 * LENGTH, 4, "dual_chunk", 1).reshape(4, -1)  # pieces of LENGTH / 2 tokens
    calls = {}
    for name, (tokens, q_index, kv_index) in {
        "diagonal": (LENGTH, np.arange(LENGTH), np.arange(LENGTH)),
        "ring step": (LENGTH // 2, index[2], index[1]),
    }.items():
        q, k, v = (
            jnp.asarray(rng.normal(size=(2, tokens, h, d)), dtype)
            for h, d in ((heads, dqk), (kv_heads, dqk), (kv_heads, dv))
        )
        segments = (jnp.asarray(seg[:, q_index]), jnp.asarray(seg[:, kv_index]))
        calls[name] = (q, k, v, *segments, jnp.asarray(q_index, jnp.int32), jnp.asarray(kv_index, jnp.int32))
    return calls


def kernel_error(kernel: kernels.Kernel, device, dims: tuple[int, int, int, int], dtype) -> str | None:
    """Runs `kernel` and the blockwise kernel on `device` (heads, kv heads, q-k and v head dims `dims`, in `dtype`)
    on the calls of `_calls`. Returns None when they agree, else what differed or the error raised."""
    try:
        with jax.default_device(device):
            for name, args in _calls(dims, dtype).items():
                problem = _mismatch(_attention_grads(kernel, *args), _attention_grads(kernels.BLOCKWISE, *args))
                if problem:
                    return f"{name}: {problem}"
    except Exception as error:  # noqa: BLE001  (any failure of an untried kernel sends the run to the reference)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def _ffn(rows, w, group_sizes=None):
    """Experts as one matrix each: rows [experts, rows, d] batched, or [rows, d] grouped by `group_sizes`."""
    if group_sizes is None:
        return jnp.einsum("erd,edf->erf", rows, w)
    return jax.lax.ragged_dot(rows, w, group_sizes)


def _route(tokens, router, k: int):
    """Top-k of softmax scores: (weights [n, k] float32, experts [n, k] int32)."""
    weights, experts = jax.lax.top_k(jax.nn.softmax(tokens.astype(jnp.float32) @ router), k)
    return weights, experts.astype(jnp.int32)


def dispatch_error(plan: plans.Plan, mesh, num_experts: int, k: int, dtype) -> str | None:
    """Runs the MoE dispatch of `plan` and the capacity dispatch (room for every assignment) on `mesh`, forward and
    backward, on a few tokens per device routed to `num_experts` experts (k each). None when they agree, else what
    differed or the error raised."""
    spec = logical_spec(("batch", "length", "embed"), mesh)
    parts = [math.prod(mesh.shape[a] for a in ((p,) if isinstance(p, str) else p or ())) for p in spec[:2]]
    rest = mesh.size // (parts[0] * parts[1])
    shape, embed = (parts[0], parts[1] * rest * 8, 16), 16
    x = jax.random.normal(jax.random.key(1), shape, dtype)
    router = jax.random.normal(jax.random.key(2), (embed, num_experts), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (num_experts, embed, embed), dtype) / 4

    def run(dispatch: plans.Plan):
        def loss(x, w):
            y, _, _ = routed_experts(x, lambda t, r: _route(t, r, k), (router,), _ffn, (w,), num_experts=num_experts)
            return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

        with plans.use(dispatch), jax.set_mesh(mesh):
            placed = jax.device_put(x, jax.NamedSharding(mesh, spec))
            (dx, dw), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(placed, w)
        return dict(y=y, dx=dx, dw=dw)

    try:
        got = run(plan)
        want = run(dataclasses.replace(plan, expert_dispatch="capacity", expert_capacity=float(num_experts)))
        return _mismatch(got, want)
    except Exception as error:  # noqa: BLE001  (any failure of an untried dispatch sends the run to the reference)
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def checked(plan: plans.Plan, mesh, *, dims: tuple[int, int, int, int], experts: tuple[int, int], dtype) -> plans.Plan:
    """`plan`, with the blockwise kernel / capacity dispatch in place of a fused kernel / the ragged dispatch that
    disagrees with it on this process's first device of `mesh` (a warning says which and why). The model's attention
    `dims` (heads, kv heads, q-k and v head dims; the check uses at most 2 kv heads of 2 query heads each), its
    `experts` (routed experts, experts per token) and compute `dtype` shape the checks."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    if plan.kernel != "blockwise":
        kernel = kernels.select(
            plan.kernel, interpret=plan.interpret, backend=plan.platform, capability=plan.capability
        )
        heads, kv_heads, dqk, dv = dims
        kv = min(kv_heads, 2)
        problem = kernel_error(kernel, device, (kv * min(heads // kv_heads, 2), kv, dqk, dv), dtype)
        if problem:
            log.warning(
                "attention kernel %r disagrees with the blockwise kernel on %s (%s): this run uses the blockwise "
                "kernel", plan.kernel, device.device_kind, problem,
            )  # fmt: skip
            plan = dataclasses.replace(plan, kernel="blockwise")
        else:
            log.info("attention kernel %r checked against the blockwise kernel on %s", plan.kernel, device.device_kind)
    if experts[0] and plan.expert_dispatch == "ragged" and mesh.size > 1:
        problem = dispatch_error(plan, mesh, *experts, dtype)
        if problem:
            log.warning(
                "ragged expert dispatch disagrees with the capacity dispatch on %s (%s): this run uses the capacity "
                "dispatch", device.device_kind, problem,
            )  # fmt: skip
            plan = dataclasses.replace(plan, expert_dispatch="capacity")
        else:
            log.info("ragged expert dispatch checked against the capacity dispatch on %s", device.device_kind)
    return plan
