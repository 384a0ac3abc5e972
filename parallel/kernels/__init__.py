"""One attention kernel interface for every strategy: `attention` (differentiable in q, k, v and lse) and, through
`select`, the step-level `forward` / `backward` a ring step calls (whose backward takes the final, merged out and
lse). Behind it: Pallas kernels for GPU (parallel/kernels/pallas.py; interpret mode runs them on CPU), cuDNN flash
attention on packed rows (parallel/kernels/cudnn.py; GPU, Hopper; Pallas for the calls it cannot serve), and the
blockwise kernel (parallel/blockwise.py), the CPU kernel and the reference. `auto` picks by the devices a step
compiles for (see select)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parallel import blockwise
from parallel.kernels import cudnn, pallas

KERNELS = ("auto", "pallas", "blockwise", "cudnn")


class Kernel(NamedTuple):
    """forward(q, k, v, q_seg, kv_seg, q_index, kv_index, *, causal, scale, block_q, block_kv, out_dtype=None) ->
    (out, lse); backward(..., out, lse, dout, dlse, *, causal, scale, block_q, block_kv, grad_dtype=None,
    accumulate=None) -> (dq, dk, dv), or given running sums accumulate=(dq, dk, dv), those sums plus them:
    parallel.blockwise.forward / backward's signatures."""

    name: str
    forward: Callable
    backward: Callable


def select(
    kernel: str = "auto", *, interpret: bool = False, backend: str | None = None, capability: str | None = None
) -> Kernel:
    """The kernel named `kernel` for devices of platform `backend` (default: JAX's) and CUDA compute `capability`
    ("9.0"; default: the first GPU's, see hopper). auto = on GPU cuDNN from Hopper (9.0) on, else
    Pallas; blockwise elsewhere. cudnn runs `general_kernel`'s kernel for the calls it cannot serve
    (cudnn.Unservable): Pallas on GPU. `interpret=True` runs the Pallas kernels in interpret mode (any backend).
    Raises ValueError naming the kernel when it is unknown or cannot run on the backend."""
    backend = backend or jax.default_backend()
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is unknown; choose one of {', '.join(KERNELS)}")
    if kernel == "auto":
        kernel = "blockwise" if backend != "gpu" else "cudnn" if hopper(backend, capability) else "pallas"
    if kernel == "blockwise":
        return BLOCKWISE
    if kernel == "cudnn":
        if backend != "gpu" or not hopper(backend, capability):
            where = backend if backend != "gpu" else f"a GPU of compute capability {capability or 'unknown'}"
            raise ValueError(
                f"attention kernel 'cudnn' runs on GPUs of compute capability 9.0 (Hopper) or newer, not {where}; "
                f"choose pallas (GPU), blockwise or auto"
            )
        general = select(general_kernel("cudnn", backend), interpret=interpret, backend=backend)
        forward = functools.partial(cudnn.forward, general=general.forward)
        backward = functools.partial(cudnn.backward, general=general.backward)
        return Kernel("cudnn", _or(forward, general.forward), _or(backward, general.backward))
    if backend != "gpu" and not interpret:
        raise ValueError(
            f"attention kernel 'pallas' compiles for GPU (Triton), not {backend}; choose blockwise or auto there "
            f"(tests run it with interpret=True)"
        )
    return Kernel(
        "pallas",
        functools.partial(pallas.forward, interpret=interpret),
        functools.partial(pallas.backward, interpret=interpret),
    )


BLOCKWISE = Kernel("blockwise", blockwise.forward, blockwise.backward)


def general_kernel(kernel: str, backend: str | None = None) -> str:
    """The kernel that runs the calls `kernel` cannot serve on devices of platform `backend` (None: JAX's default):
    for cudnn Pallas on GPU (blockwise elsewhere, where only tests run cudnn, on stand-ins); every other kernel
    serves every call itself."""
    if kernel != "cudnn":
        return kernel
    return "pallas" if (backend or jax.default_backend()) == "gpu" else "blockwise"


def hopper(backend: str, capability: str | None) -> bool:
    """Whether GPU compute `capability` (None: the first GPU's, when JAX has a GPU backend) is 9.0 or newer."""
    if backend != "gpu":
        return False
    if capability is None:
        try:
            capability = jax.devices("gpu")[0].compute_capability
        except RuntimeError:  # no GPU backend in this process
            return False
    return tuple(int(x) for x in capability.split(".")[:2]) >= (9, 0)


def _or(kernel: Callable, fallback: Callable) -> Callable:
    """`kernel`, or `fallback` (the same arguments) for a call it raises cudnn.Unservable on."""

    @functools.wraps(kernel)
    def call(*args, **kwargs):
        """kernel(*args, **kwargs), else fallback(*args, **kwargs)."""
        try:
            return kernel(*args, **kwargs)
        except cudnn.Unservable:
            return fallback(*args, **kwargs)

    return call


def attention(
    q,
    k,
    v,
    *,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_index=None,
    kv_index=None,
    causal=True,
    scale=None,
    kernel: str | Kernel = "auto",
    interpret=False,
    backend=None,
    block_q=256,
    block_kv=256,
):
    """q: [batch, tq, heads, dqk], k: [batch, tk, kv_heads, dqk], v: [batch, tk, kv_heads, dv] ->
    (out [batch, tq, heads, dv] in q's dtype, lse [batch, tq, heads] float32, natural log).

    segment_ids: [batch, t] int32 (0 = padding; None = one document); index: [t] int32 global token index
    (None = 0..t-1). A query with no visible key gets zeros and lse = -inf. `kernel`: a Kernel, or one of KERNELS
    selected for devices of platform `backend` (None: JAX's default; see select).
    """
    batch, tq, heads, dqk = q.shape
    tk, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of key/value heads {kv_heads}")
    if k.shape[-1] != dqk or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    q_segment_ids = jnp.ones((batch, tq), jnp.int32) if q_segment_ids is None else q_segment_ids
    kv_segment_ids = jnp.ones((batch, tk), jnp.int32) if kv_segment_ids is None else kv_segment_ids
    indices = (np.arange(tq) if q_index is None else q_index, np.arange(tk) if kv_index is None else kv_index)
    known = tuple(cudnn.known_at_trace_time(index) for index in indices)
    static = dict(causal=causal, scale=float(dqk**-0.5 if scale is None else scale), block_q=block_q, block_kv=block_kv)
    segment_ids = (q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32))
    impl = kernel if isinstance(kernel, Kernel) else select(kernel, interpret=interpret, backend=backend)
    if all(index is not None for index in known):
        return _attention(impl, static, tuple(index.astype(np.int32) for index in known), q, k, v, *segment_ids)
    return _attention(impl, static, None, q, k, v, *segment_ids, *(jnp.asarray(i, jnp.int32) for i in indices))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(impl: Kernel, static: dict, known, q, k, v, q_seg, kv_seg, *indices):
    """known: (q_index, kv_index) numpy when fixed at trace time (so the kernel sees them static; `indices` is then
    empty), else None and `indices` holds them traced."""
    return impl.forward(q, k, v, q_seg, kv_seg, *(known or indices), **static)


def _attention_fwd(impl, static, known, q, k, v, q_seg, kv_seg, *indices):
    out, lse = impl.forward(q, k, v, q_seg, kv_seg, *(known or indices), **static)
    return (out, lse), (q, k, v, q_seg, kv_seg, indices, out, lse)


def _attention_bwd(impl, static, known, residuals, cotangents):
    q, k, v, q_seg, kv_seg, indices, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv = impl.backward(q, k, v, q_seg, kv_seg, *(known or indices), out, lse, dout, dlse, **static)
    return dq, dk, dv, None, None, *(None for _ in indices)


_attention.defvjp(_attention_fwd, _attention_bwd)
