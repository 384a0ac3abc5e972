"""One attention kernel interface for every strategy: `attention` (differentiable in q, k, v and lse) and, through
`select`, the step-level `forward` / `backward` a ring step calls (whose backward takes the final, merged out and lse).
Every kernel takes q, k, v, each side's `Tokens` (segment ids and global indices) and the call's `Options`
(parallel/kernels/arguments.py). Behind it: Pallas kernels for GPU (parallel/kernels/pallas.py, Triton, and on Hopper
Mosaic GPU's, mosaic.py; interpret mode runs them on CPU), cuDNN flash attention and FlashAttention-3 on packed rows
(parallel/kernels/cudnn.py, flash3.py and what they share, packed.py; GPU, Hopper, FlashAttention-3 an optional extra;
Pallas for the calls they cannot serve), tokamax's Hopper flash attention over ranges of keys
(parallel/kernels/tokamax_attention.py, an optional extra; Pallas for the calls it cannot serve), JAX's Pallas TPU
splash attention (parallel/kernels/splash.py; the blockwise kernel for the calls it cannot serve), and the blockwise
kernel (parallel/kernels/blockwise.py), the CPU kernel and the reference. `auto` picks by the devices a step compiles
for (see select)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from parallel.kernels import blockwise, cudnn, flash3, packed, pallas, saved, splash, tokamax_attention, visible
from parallel.kernels import sinks as attention_sinks
from parallel.kernels.arguments import Options, Tokens

KERNELS = ("auto", "pallas", "blockwise", "cudnn", "flash3", "tokamax", "splash")
PACKED = ("cudnn", "flash3")  # kernels on packed rows: documents as runs in original order (parallel/kernels/packed.py)
# kernels that serve keys in increasing global order (the packed ones, and tokamax's ranges of keys), the rest by Pallas
ORDERED = (*PACKED, "tokamax")
FIXED_MASKS = ("splash",)  # masks fixed at trace time: keys' indices static (parallel/kernels/splash.py)


class FusedGpu(NamedTuple):
    """A fused GPU kernel: its module (forward / backward, and `missing()` where an extra brings it), the devices it
    runs on in words, and as a test of (major, minor) compute capability."""

    module: object
    devices: str
    runs_on: Callable


FUSED_GPU = {
    "cudnn": FusedGpu(cudnn, "GPUs of compute capability 9.0 (Hopper) or newer", lambda version: version >= (9, 0)),
    "flash3": FusedGpu(
        flash3, "Hopper GPUs (compute capability 9.0, FlashAttention-3's sm90a code)", lambda version: version[0] == 9
    ),
    "tokamax": FusedGpu(
        tokamax_attention, "GPUs of compute capability 9.0 (Hopper) or newer (Mosaic GPU)", lambda v: v >= (9, 0)
    ),
}
# the fused kernel a run tries next when one disagrees with the blockwise kernel on its devices (first contact)
NEXT_FUSED = {"flash3": "cudnn", "tokamax": "cudnn", "cudnn": "pallas"}
log = logging.getLogger(__name__)


class Kernel(NamedTuple):
    """forward(q, k, v, q_tokens, kv_tokens, *, options, out_dtype=None) -> (out, lse); backward(q, k, v, q_tokens,
    kv_tokens, out, lse, dout, dlse, *, options, grad_dtype=None, accumulate=None) -> (dq, dk, dv), or given running
    sums accumulate=(dq, dk, dv), those sums plus them: parallel.kernels.blockwise.forward / backward's signatures,
    with Tokens and Options all given. `takes_delta`: whether backward also takes `delta=` [batch, tq, heads], the
    rows' rowsum(dout * out) - dlse, in place of out and dlse (a ring computes it once and keeps no out): blockwise,
    Pallas and splash do; the kernels on packed rows read out itself."""

    name: str
    forward: Callable
    backward: Callable
    takes_delta: bool = False


def select(
    kernel: str = "auto", *, interpret: bool = False, backend: str | None = None, capability: str | None = None
) -> Kernel:
    """The kernel named `kernel` for devices of platform `backend` (default: JAX's) and CUDA compute `capability`
    ("9.0"; default: the first GPU's, see hopper). auto = on GPU cuDNN from Hopper (9.0) on, else Pallas; splash on TPU;
    blockwise elsewhere. cudnn, flash3 (Hopper alone, with its wheel installed) and tokamax (Hopper and newer,
    installed) run `general_kernel`'s kernel for the calls they cannot serve (packed.Unservable): Pallas on GPU; splash
    the blockwise kernel. `interpret=True` runs the Pallas kernels in interpret mode (any backend). Raises ValueError
    naming the kernel when it is unknown or cannot run on the backend."""
    backend = backend or jax.default_backend()
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is unknown; choose one of {', '.join(KERNELS)}")
    if kernel == "auto":
        gpu = "cudnn" if hopper(backend, capability) else "pallas"
        kernel = {"gpu": gpu, "tpu": "splash"}.get(backend, "blockwise")
    if kernel == "blockwise":
        return BLOCKWISE
    if kernel == "splash":
        if backend != "tpu" and not interpret:
            raise ValueError(
                f"attention kernel 'splash' compiles for TPU (Pallas Mosaic TPU), not {backend}; choose "
                f"{'cudnn, pallas, ' if backend == 'gpu' else ''}blockwise or auto there (tests run it with "
                f"interpret=True)"
            )
        forward = functools.partial(splash.forward, interpret=interpret)
        backward = functools.partial(splash.backward, interpret=interpret)
        return _named("splash", _or(forward, BLOCKWISE), _or(backward, BLOCKWISE, "backward"), takes_delta=True)
    if kernel in FUSED_GPU:
        fused = FUSED_GPU[kernel]
        if not fused.runs_on(compute_capability(backend, capability)):
            where = backend if backend != "gpu" else f"a GPU of compute capability {capability or 'unknown'}"
            others = [name for name in ("cudnn", "pallas") if backend == "gpu" and name != kernel]
            raise ValueError(
                f"attention kernel {kernel!r} runs on {fused.devices}, not {where}; choose "
                f"{', '.join([*others, 'blockwise'])} or auto"
            )
        if problem := getattr(fused.module, "missing", lambda: None)():
            raise ValueError(problem)
        return _packed(kernel, fused.module, backend, capability, interpret)
    if backend != "gpu" and not interpret:
        raise ValueError(
            f"attention kernel 'pallas' compiles for GPU (Triton), not {backend}; choose blockwise or auto there "
            f"(tests run it with interpret=True)"
        )
    on_hopper = compute_capability(backend, capability)[0] == 9  # Mosaic GPU's kernels: sm90a code
    return _named(
        "pallas",
        functools.partial(pallas.forward, interpret=interpret, hopper=on_hopper),
        functools.partial(pallas.backward, interpret=interpret, hopper=on_hopper),
        takes_delta=True,
    )


def _packed(name: str, module, backend: str, capability: str | None, interpret: bool) -> Kernel:
    """The kernel `name` of ORDERED (its module's forward / backward), with the general kernel for the calls it cannot
    serve."""
    general = select(general_kernel(name, backend), interpret=interpret, backend=backend, capability=capability)
    forward = functools.partial(module.forward, general=visible.fallback(general.forward))
    backward = functools.partial(module.backward, general=visible.fallback(general.backward))
    return _named(name, _or(forward, general), _or(backward, general, "backward"))


def _named(name: str, forward: Callable, backward: Callable, takes_delta: bool = False) -> Kernel:
    """The Kernel `name`, each call run in the scope naming it and its visible share (parallel/kernels/visible.py)."""
    return Kernel(name, visible.named(name, forward), visible.named(name, backward), takes_delta)


BLOCKWISE = _named("blockwise", blockwise.forward, blockwise.backward, takes_delta=True)


def general_kernel(kernel: str, backend: str | None = None) -> str:
    """The kernel that runs the calls `kernel` cannot serve on devices of platform `backend` (None: JAX's default):
    for cudnn, flash3 and tokamax Pallas on GPU (blockwise elsewhere, where only tests run them, on stand-ins); every
    other kernel serves every call itself."""
    if kernel not in ORDERED:
        return kernel
    return "pallas" if (backend or jax.default_backend()) == "gpu" else "blockwise"


def hopper(backend: str, capability: str | None) -> bool:
    """Whether GPU compute `capability` (None: the first GPU's, when JAX has a GPU backend) is 9.0 or newer."""
    return compute_capability(backend, capability) >= (9, 0)


def compute_capability(backend: str, capability: str | None) -> tuple[int, int]:
    """(major, minor) of GPU compute `capability` ("9.0"; None: the first GPU's, when JAX has a GPU backend); (0, 0)
    off GPU."""
    if backend != "gpu":
        return (0, 0)
    if capability is None:
        try:
            capability = jax.devices("gpu")[0].compute_capability
        except RuntimeError:  # no GPU backend in this process
            return (0, 0)
    major, minor = (int(x) for x in capability.split(".")[:2])
    return major, minor


def _or(kernel: Callable, general: Kernel, part: str = "forward") -> Callable:
    """`kernel` (a forward or backward: `part`), or the `general` kernel's same part for a call it raises
    packed.Unservable on; each reason logged the first time (a trace-time choice: the plan's log names it)."""
    fallback = getattr(general, part)

    @functools.wraps(kernel)
    def call(*args, **kwargs):
        """kernel(*args, **kwargs), else fallback(*args, **kwargs)."""
        try:
            return kernel(*args, **kwargs)
        except packed.Unservable as unservable:
            if str(unservable) not in _UNSERVED:
                _UNSERVED.add(str(unservable))
                log.info("attention: %s; the %s kernel runs such calls", unservable, general.name)
            return fallback(*args, **kwargs)

    return call


_UNSERVED: set[str] = set()  # the reasons logged


def attention(
    q, k, v, q_tokens: Tokens | None = None, kv_tokens: Tokens | None = None, options: Options | None = None, *,
    sinks=None, kernel: str | Kernel = "auto", interpret=False, backend=None,
):  # fmt: skip
    """q: [batch, tq, heads, dqk], k: [batch, tk, kv_heads, dqk], v: [batch, tk, kv_heads, dv] ->
    (out [batch, tq, heads, dv] in q's dtype, lse [batch, tq, heads] float32, natural log).

    q_tokens / kv_tokens: each side's segment ids [batch, t] (0 = padding) and global indices [t]; None (the side or
    a field) = one document, indices 0..t-1. options: None = Options() (causal, blocks of 256, no window); scale None
    = dqk ** -0.5. sinks [heads] (None: none): per-head logits joining each softmax as a key of value zero (see
    parallel.kernels.sinks); the lse stays the keys' only. A query with no visible key gets zeros and lse = -inf.
    `kernel`: a Kernel, or one of KERNELS selected for devices of platform `backend` (None: JAX's default; see
    select).
    """
    batch, tq, heads, dqk = q.shape
    tk, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of key/value heads {kv_heads}")
    if k.shape[-1] != dqk or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    options = Options() if options is None else options
    options = dataclasses.replace(options, scale=float(dqk**-0.5 if options.scale is None else options.scale))
    sides = (_filled(q_tokens, batch, tq), _filled(kv_tokens, batch, tk))
    known = tuple(packed.known_at_trace_time(side.index) for side in sides)
    impl = kernel if isinstance(kernel, Kernel) else select(kernel, interpret=interpret, backend=backend)
    static = tuple(None if index is None else index.astype(np.int32) for index in known)
    given = (
        side._replace(index=None if fixed is not None else jnp.asarray(side.index, jnp.int32))
        for side, fixed in zip(sides, static, strict=True)
    )
    out, lse = _attention(impl, options, static, q, k, v, *given)
    return attention_sinks.apply(out, lse, sinks), lse


def _filled(tokens: Tokens | None, batch: int, length: int) -> Tokens:
    """`tokens` of a side of `length` with None filled in: segment ids int32 (one document), indices 0..length-1
    (numpy; given ones as they are)."""
    tokens = Tokens() if tokens is None else tokens
    seg = jnp.ones((batch, length), jnp.int32) if tokens.segment_ids is None else tokens.segment_ids
    return Tokens(seg.astype(jnp.int32), np.arange(length) if tokens.index is None else tokens.index)


def _sides(static, q_tokens: Tokens, kv_tokens: Tokens) -> tuple[Tokens, Tokens]:
    """The two sides as the kernel takes them: each side's static index (of (q_index, kv_index)) in place when not
    None."""
    return tuple(
        side if fixed is None else side._replace(index=fixed)
        for side, fixed in zip((q_tokens, kv_tokens), static, strict=True)
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(impl: Kernel, options: Options, static, q, k, v, q_tokens: Tokens, kv_tokens: Tokens):
    """static: (q_index, kv_index), each numpy when fixed at trace time (the kernel sees it static; that side's
    own index is then None), else None and that side holds it traced."""
    return impl.forward(q, k, v, *_sides(static, q_tokens, kv_tokens), options=options)


class Residuals(NamedTuple):
    """What the forward keeps for the backward: its inputs and (out, lse)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_tokens: Tokens
    kv_tokens: Tokens
    out: jax.Array
    lse: jax.Array


def _attention_fwd(impl, options, static, *args):
    """The forward given each input as JAX's CustomVJPPrimal (symbolic zeros are on: see _attention_bwd)."""
    q, k, v, q_tokens, kv_tokens = jax.tree.map(lambda x: x.value, args, is_leaf=_primal)
    out, lse = saved.named(*impl.forward(q, k, v, *_sides(static, q_tokens, kv_tokens), options=options))
    return (out, lse), Residuals(q, k, v, q_tokens, kv_tokens, out, lse)


def _attention_bwd(impl, options, static, saved: Residuals, cotangents):
    """An lse nothing reads has a symbolic zero cotangent: the kernel then gets dlse None (the packed kernels carry
    a dlse in two extra value columns, which can take FlashAttention-3 to a wider head's kernel)."""
    dout, dlse = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    dout = jnp.zeros_like(saved.out) if dout is None else dout
    sides = _sides(static, saved.q_tokens, saved.kv_tokens)
    dq, dk, dv = impl.backward(saved.q, saved.k, saved.v, *sides, saved.out, saved.lse, dout, dlse, options=options)
    return dq, dk, dv, None, None


def _primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
