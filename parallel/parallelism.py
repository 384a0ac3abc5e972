"""How the code traced inside `use_parallelism(parallelism)` is parallelised: attention strategy, mesh axis and sequence
layout, whether the residual stream is scattered over `tensor` (parallel/tensor.py), and how MoE tokens reach their
experts (parallel/experts.py).

The training step installs the parallelism from the run config while tracing, so models call `parallel.attention`
without knowing about meshes; explicit arguments to `parallel.attention` override the parallelism.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

from jax import Device
from jax.sharding import Mesh

RING_GRAD_DTYPES = ("float32", "compute")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """strategy: a name in parallel.strategies.STRATEGIES; axis: mesh axis the sequence is sharded over (usp:
    (ring axis, ulysses axis)); layout: order of the sequence (contiguous, dual_chunk, striped, see
    parallel.reorder) with `stripe` tokens per stripe; mesh: None = the mesh set by `jax.set_mesh`; block_q /
    block_kv: attention kernel block sizes; kernel: the attention kernel (parallel.kernels.KERNELS), interpret:
    its Pallas kernels in interpret mode (tests on CPU); platform / capability: the devices the step compiles for
    (cpu, gpu, tpu; CUDA compute capability "9.0"), None = JAX's default backend and its devices; device: one of
    them, where a kernel picks its tiles for JAX's default device (tokamax's: parallel/grouped.py); scatter:
    scattered tensor parallelism, the residual stream sharded on length over mesh axis `tensor`;
    expert_dispatch: capacity or ragged (parallel/experts.py); expert_capacity: dispatch buffer rows per expert /
    its balanced load (inf: dropless); grouped_matmul: the experts' grouped matmul of the ragged dispatch
    (parallel/grouped.py: xla or tokamax); expert_chunk: at most this many tokens per device pass through an MoE
    block at once (0 = all); ring_grad_dtype: the dtype the ring accumulates and sends dK/dV in (RING_GRAD_DTYPES:
    float32, or compute = K/V's own dtype, half the bytes in bfloat16)."""

    strategy: str = "none"
    axis: str | tuple[str, str] = "context"
    layout: str = "contiguous"
    stripe: int = 1
    mesh: Mesh | None = None
    block_q: int = 256
    block_kv: int = 256
    kernel: str = "blockwise"
    interpret: bool = False
    platform: str | None = None
    capability: str | None = None
    device: Device | None = None
    scatter: bool = True
    expert_dispatch: str = "capacity"
    expert_capacity: float = math.inf
    grouped_matmul: str = "xla"
    expert_chunk: int = 0
    ring_grad_dtype: str = "float32"


_CURRENT = contextvars.ContextVar("parallelism", default=Parallelism())


def current_parallelism() -> Parallelism:
    """The parallelism installed by the innermost `use_parallelism`, else the default (single-device, contiguous)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_parallelism(parallelism: Parallelism):
    """Installs `parallelism` for attention calls traced inside the block."""
    token = _CURRENT.set(parallelism)
    try:
        yield parallelism
    finally:
        _CURRENT.reset(token)
