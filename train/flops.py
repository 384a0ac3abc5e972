"""Model FLOPs per token (for MFU) and the peak FLOP rate of the devices."""

from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

# dense bf16 peak FLOP/s per device by `device_kind` prefix
PEAK_FLOPS = {
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
    "NVIDIA B200": 2250e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def _attention_params(config) -> int:
    """Projection parameters of one attention block: GQA, or latent attention when kv_lora_rank > 0."""
    if not config.kv_lora_rank:
        return config.embed_dim * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.q_lora_rank:
        query = config.embed_dim * config.q_lora_rank + config.q_lora_rank * config.num_heads * qk
    else:
        query = config.embed_dim * config.num_heads * qk
    kv = config.embed_dim * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * config.num_heads * (
        config.qk_nope_head_dim + config.v_head_dim
    )
    return query + kv + config.num_heads * config.v_head_dim * config.embed_dim


def matmul_params(config) -> int:
    """Parameters used in matmuls per token: attention, the MLP or the active experts (top-k routed plus shared,
    and the router) of all layers, and the output head."""
    dense = 3 * config.embed_dim * config.mlp_dim
    moe = (
        3 * config.embed_dim * config.moe_mlp_dim * (config.experts_per_token + config.num_shared_experts)
        + config.embed_dim * config.num_experts
    )
    return (
        config.num_layers * _attention_params(config)
        + config.num_dense_layers * dense
        + config.num_moe_layers * moe
        + config.embed_dim * config.vocab_size
    )


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params + causal attention (counted once, i.e. half of T^2)."""
    if config.kv_lora_rank:
        head_dims = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    else:
        head_dims = 2 * config.head_dim
    attention = 3 * config.num_layers * config.num_heads * head_dims * seq_len
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
    local = jax.sharding.Mesh(jax.local_devices(), ("d",))  # this process's devices, whatever mesh is set
    a = jax.device_put(np.ones((local.size, n, n), np.float32), jax.sharding.NamedSharding(local, P("d")))
    matmul = jax.jit(lambda x: x @ x)
    best = float("inf")
    with jax.set_mesh(local):
        matmul(a).block_until_ready()
        for _ in range(repeats):
            start = time.perf_counter()
            matmul(a).block_until_ready()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
