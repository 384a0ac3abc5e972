"""A run config's `parallel` settings: their size checks, the Parallelism they make (`make_parallelism`), the
host-side sequence reorder into its layout.

Knows config-shaped objects only: the run config's `parallel` section, `settings` here (context_strategy,
load_balance, balance_layout, stripe, block_q, block_kv, attention_kernel, scatter_residual, expert_dispatch,
expert_capacity_factor, grouped_matmul, expert_chunk_size), and mesh axis sizes (context, ulysses, tensor).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from parallel import kernels, tokamax_calls
from parallel.experts import DISPATCHES
from parallel.grouped import GROUPED_MATMULS
from parallel.mesh import MeshError
from parallel.parallelism import Parallelism
from parallel.reorder import to_balanced


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise MeshError(message)


def layout_for(settings, context: int) -> str:
    """The sequence layout: the balanced one when load balancing over more than one context device."""
    return settings.balance_layout if settings.load_balance and context > 1 else "contiguous"


def check_tensor(tensor: int, dims: Mapping[str, int]) -> None:
    """Raises MeshError when mesh axis size `tensor` does not divide one of the `dims` that tensor parallelism
    splits (key -> size, e.g. {"model.num_heads": 4}); the message lists the sizes that divide them all."""
    for key, size in dims.items():
        if size % tensor:
            common = math.gcd(*dims.values())
            allowed = [str(n) for n in range(1, common + 1) if common % n == 0]
            raise MeshError(
                f"{key}={size} must be divisible by mesh.tensor={tensor}, over which tensor parallelism splits "
                f"it; choose a mesh.tensor that divides {', '.join(f'{k}={v}' for k, v in dims.items())}: "
                f"{', '.join(allowed)} (mesh.tensor=-1 takes the devices the other mesh axes leave: set it, or them)"
            )


def check_context(settings, sizes: Mapping[str, int], *, seq_len: int, num_heads: int) -> None:
    """Raises MeshError (naming the key, the value and what is allowed) when `parallel.context_strategy` does
    not fit the mesh axis `sizes` (context, ulysses, tensor; absent = 1), `seq_len` or `num_heads`."""
    strategy = settings.context_strategy
    context, ulysses, tensor = (sizes.get(name, 1) for name in ("context", "ulysses", "tensor"))
    _require(
        strategy != "none" or context == 1,
        f"mesh.context={context} splits the sequence but parallel.context_strategy=none; choose "
        f"parallel.context_strategy=ring (or all_gather, ulysses, usp), or set mesh.context=1",
    )
    _require(
        ulysses == 1 or strategy == "usp",
        f"mesh.ulysses={ulysses} needs parallel.context_strategy=usp (got {strategy}); set "
        f"parallel.context_strategy=usp or mesh.ulysses=1",
    )
    shards = f"mesh.context={context}" + (f" x mesh.ulysses={ulysses}" if ulysses > 1 else "")
    _require(seq_len % (context * ulysses) == 0, f"data.seq_len={seq_len} must be divisible by {shards}")
    layout = layout_for(settings, context)
    if layout == "dual_chunk":
        _require(
            seq_len % (2 * context) == 0,
            f"data.seq_len={seq_len} must be divisible by 2 x mesh.context={context} for "
            f"parallel.balance_layout=dual_chunk; choose another data.seq_len or parallel.load_balance=false",
        )
    if layout == "striped":
        _require(
            seq_len % (context * settings.stripe) == 0,
            f"data.seq_len={seq_len} must be divisible by mesh.context={context} x "
            f"parallel.stripe={settings.stripe} for parallel.balance_layout=striped",
        )
    if settings.scatter_residual and tensor > 1:
        _require(
            seq_len % (context * ulysses * tensor) == 0,
            f"data.seq_len={seq_len} must be divisible by {shards} x mesh.tensor={tensor}: "
            f"parallel.scatter_residual=true splits the tokens over mesh.tensor too; choose another "
            f"data.seq_len or parallel.scatter_residual=false",
        )
    split = {"ulysses": ("mesh.context", context), "usp": ("mesh.ulysses", ulysses)}.get(strategy)
    if split:
        key, size = split
        by = f"{key}={size}" + (f" x mesh.tensor={tensor}" if tensor > 1 else "")
        _require(
            num_heads % (size * tensor) == 0,
            f"model.num_heads={num_heads} must be divisible by {by} for parallel.context_strategy={strategy} "
            f"(it splits the heads over {key})",
        )


EXPERT_DISPATCHES = ("auto", *DISPATCHES)


def expert_dispatch(settings, platform: str) -> str:
    """`parallel.expert_dispatch` on devices of `platform` (cpu, gpu, tpu): auto = ragged on GPU/TPU, capacity on
    CPU. Raises MeshError for ragged on CPU, whose compiler has no ragged all-to-all."""
    dispatch = settings.expert_dispatch
    _require(
        dispatch in EXPERT_DISPATCHES,
        f"parallel.expert_dispatch={dispatch!r} is not allowed; choose one of {', '.join(EXPERT_DISPATCHES)}",
    )
    if dispatch == "auto":
        return "capacity" if platform == "cpu" else "ragged"
    _require(
        dispatch != "ragged" or platform != "cpu",
        "parallel.expert_dispatch=ragged needs a GPU or TPU: XLA:CPU cannot compile a ragged all-to-all; use "
        "parallel.expert_dispatch=capacity (or auto) on CPU",
    )
    return dispatch


GROUPED_MATMUL_SETTINGS = ("auto", *GROUPED_MATMULS)


def grouped_matmul(settings, platform: str, capability: str | None = None) -> str:
    """`parallel.grouped_matmul` on devices of `platform` and CUDA compute `capability`: auto = tokamax on Hopper and
    newer GPUs where it is installed (XLA's GPU compiler runs `ragged_dot` dense over every group), else xla. Raises
    MeshError for tokamax where it cannot run."""
    choice = settings.grouped_matmul
    _require(
        choice in GROUPED_MATMUL_SETTINGS,
        f"parallel.grouped_matmul={choice!r} is not allowed; choose one of {', '.join(GROUPED_MATMUL_SETTINGS)}",
    )
    hopper = kernels.hopper(platform, capability)
    if choice == "auto":
        return "tokamax" if hopper and tokamax_calls.installed() else "xla"
    if choice == "tokamax":
        _require(hopper, f"parallel.grouped_matmul=tokamax runs on Hopper or newer GPUs, not on {platform}; use auto")
        _require(tokamax_calls.installed(), f"parallel.grouped_matmul=tokamax needs tokamax: {tokamax_calls.INSTALL}")
    return choice


def attention_kernel(settings, platform: str, capability: str | None = None) -> str:
    """`parallel.attention_kernel` on devices of `platform` and CUDA compute `capability` (auto resolved, see
    parallel.kernels.select); raises MeshError naming the value when it is unknown or cannot run there (pallas and
    cudnn compile for GPU only, cudnn for Hopper and newer)."""
    try:
        return kernels.select(settings.attention_kernel, backend=platform, capability=capability).name
    except ValueError as error:
        raise MeshError(f"parallel.attention_kernel={settings.attention_kernel!r}: {error}") from None


def make_parallelism(settings, sizes: Mapping[str, int], device=None) -> Parallelism:
    """The parallelism for the traced steps on devices like `device` (a jax Device of the mesh; None = a CPU): strategy,
    mesh axis ("context"; usp: ("context", "ulysses")), layout for the context size in `sizes`, stripe, the attention
    kernel and its block sizes, scattered tensor parallelism and the MoE dispatch (`expert_dispatch`), each resolved for
    that device's platform, never for the backend of the machine that compiles. The mesh comes from
    `jax.set_mesh`."""
    strategy = settings.context_strategy
    platform = "cpu" if device is None else device.platform
    capability = getattr(device, "compute_capability", None) if platform == "gpu" else None
    return Parallelism(
        strategy=strategy,
        axis=("context", "ulysses") if strategy == "usp" else "context",
        layout=layout_for(settings, sizes.get("context", 1)),
        stripe=settings.stripe,
        block_q=settings.block_q,
        block_kv=settings.block_kv,
        kernel=attention_kernel(settings, platform, capability),
        platform=platform,
        capability=capability,
        device=device,
        scatter=settings.scatter_residual,
        expert_dispatch=expert_dispatch(settings, platform),
        expert_capacity=math.inf if settings.expert_capacity_factor is None else settings.expert_capacity_factor,
        grouped_matmul=grouped_matmul(settings, platform, capability),
        expert_chunk=settings.expert_chunk_size,
        ring_grad_dtype=settings.ring_grad_dtype,
    )


def to_layout(batch: Mapping[str, np.ndarray], parallelism: Parallelism, context: int) -> dict[str, np.ndarray]:
    """Host batch of [rows, seq_len] numpy arrays in original order -> the same arrays in `parallelism.layout` for
    `context` ring devices (the arrays themselves when the layout is contiguous)."""
    if parallelism.layout == "contiguous":
        return dict(batch)
    return {
        key: np.ascontiguousarray(
            to_balanced(np.asarray(value), context, axis=1, layout=parallelism.layout, stripe=parallelism.stripe)
        )
        for key, value in batch.items()
    }
