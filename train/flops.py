"""Model FLOPs per token (for MFU) and the peak FLOP rate of the devices."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# dense bf16 peak FLOP/s per device by `device_kind` prefix
PEAK_FLOPS = {
    "NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12, "NVIDIA L4": 121e12,
    "NVIDIA B200": 2250e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}


def matmul_params(config) -> int:
    """Parameters used in matmuls per token: attention and MLP projections of all layers, and the output head."""
    attn = config.embed_dim * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * config.embed_dim * config.mlp_dim
    return config.num_layers * (attn + mlp) + config.embed_dim * config.vocab_size


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params + causal attention (counted once, i.e. half of T^2)."""
    attention = 6 * config.num_layers * config.num_heads * config.head_dim * seq_len
    return 6.0 * matmul_params(config) + attention


def peak_flops_per_device(override_tflops: float = 0.0) -> float:
    """From the config override, the table above, or (CPU) a quick float32 matmul measurement."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for prefix, flops in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return flops
    return _measure_matmul_flops()


def _measure_matmul_flops(n: int = 1024, repeats: int = 10) -> float:
    """Per-device rate of float32 [n, n] matmuls run on all local devices at once (best of `repeats`), so
    simulated devices sharing the host's cores are measured sharing them."""
    devices = jax.local_devices()
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ("d",)), jax.sharding.PartitionSpec("d"))
    a = jax.device_put(jnp.ones((len(devices), n, n), jnp.float32), sharding)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
