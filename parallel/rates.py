"""What a device sustains, as the speed estimate costs a compiled step (train/planning/speed.py): the rates of each
GPU target (parallel/targets.py) and TPU generation (parallel/tpu_targets.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one device of a target sustains, for the speed estimate (train/planning/speed.py); for GPUs measured on a
    GPU where bench/README.md "On one GPU" has it (an H200, 2026-11-26), else from the data sheet as said; for TPUs
    from the data sheets (parallel/tpu_targets.py says how).

    matmul: FLOP/s of large bfloat16 matmuls. attention: FLOP/s of each fused attention kernel (the first: the
    default), forward + backward; on GPUs FLOPs counted once per visible (query, key) pair and a backward as 2.5
    forwards (bench/gpu_attention.py's count), on TPUs the matmuls each splash kernel computes. memory: bytes/s read
    + written by memory-bound kernels. nvlink / network: bytes/s one device sends in a collective within its host /
    to other hosts (on a TPU slice both its ICI). kernel: seconds a kernel takes at the least (launch and tail).
    collective: seconds a collective takes at the least (its latency). platform: the devices' ("gpu", "tpu")."""

    matmul: float
    attention: dict
    memory: float
    nvlink: float
    network: float
    kernel: float = 3e-6
    collective: float = 15e-6
    platform: str = "gpu"
