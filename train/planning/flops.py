"""Model FLOPs (for MFU): per token, or of a packed batch from its segment ids; and the peak FLOP rate of the
devices."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from models.config import SLIDING

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
    "TPU v5": 459e12,  # v5p (after "TPU v5 lite")
    "TPU7x": 2307e12 / 2,  # Ironwood: one of a chip's two devices
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


def _attention_coefficient(config) -> float:
    """Training FLOPs of one layer's causal attention per squared document length: the forward pass's QK^T and PV
    over half of the [len, len] square (2 FLOPs per multiply-add, over the query-key plus value head dims, every
    head), x3 with the backward pass."""
    if config.kv_lora_rank:
        head_dims = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    else:
        head_dims = 2 * config.head_dim
    return 3.0 * config.num_heads * head_dims


def _capped_squares(lengths: np.ndarray, keys: int) -> float:
    """The (query, key) pairs of causal documents of `lengths` when each query sees at most `keys` keys, as squares
    (2 x pairs): len^2 up to `keys`, 2 len keys - keys^2 beyond."""
    return float(np.sum(np.where(lengths <= keys, lengths**2, 2 * lengths * keys - float(keys) ** 2)))


def _attention_flops(config, lengths: np.ndarray) -> float:
    """Training FLOPs of causal attention within documents of `lengths` in every layer: len^2 squares in full
    layers; in sliding ones (window W) the pairs a window keeps; with sparse attention (index_topk k) the k keys
    each query attends, plus the indexer's scores of every visible pair forward (2 FLOPs per multiply-add over its
    heads x head dim; the selection has no gradient) and, when the indexer trains, its loss's backward over the
    selected pairs. The dense warm-up runs dense attention forward only (the model is frozen) and the indexer's
    scores of every pair forward and backward."""
    lengths = np.asarray(lengths, np.float64)
    if config.index_topk:
        scores = config.index_heads * config.index_head_dim
        if config.indexer_training == "warmup":
            return config.num_layers * (_attention_coefficient(config) / 3 + 3 * scores) * float(np.sum(lengths**2))
        selected = _capped_squares(lengths, config.index_topk)
        backward = 2 * scores * selected if config.indexer_training == "sparse" else 0.0
        attended = _attention_coefficient(config) * selected
        return config.num_layers * (attended + scores * float(np.sum(lengths**2)) + backward)
    sliding = config.layer_kinds.count(SLIDING)
    squares = (config.num_layers - sliding) * np.sum(lengths**2)
    return _attention_coefficient(config) * float(squares + sliding * _capped_squares(lengths, config.sliding_window))


def _indexer_params(config) -> int:
    """The sparse-attention indexer's projection parameters per layer (wq_b, wk, weights; 0 without one)."""
    if not config.index_topk:
        return 0
    return config.q_lora_rank * config.index_heads * config.index_head_dim + config.embed_dim * (
        config.index_head_dim + config.index_heads
    )


def _projection_flops(config) -> float:
    """Training FLOPs per token of the matmuls: 6 x matmul params (2 x, forward only, in the indexer's dense warm-up,
    which freezes them), and the indexer's 4 x when it trains (its inputs take no gradient), 2 x when frozen."""
    model = 2.0 if config.indexer_training == "warmup" else 6.0
    indexer = 2.0 if config.indexer_training == "frozen" else 4.0
    return model * matmul_params(config) + indexer * config.num_layers * _indexer_params(config)


def flops_per_token(config, doc_len: int) -> float:
    """Training FLOPs per token of rows made of `doc_len`-token documents: the matmuls + causal attention within
    each document (half of doc_len^2 per document, as MaxText and torchtitan count it; a sliding layer's window or
    sparse attention's index_topk caps it)."""
    return _projection_flops(config) + _attention_flops(config, np.array([doc_len])) / doc_len


def document_lengths(segment_ids) -> np.ndarray:
    """[batch, length] segment ids (0: padding; a document's tokens share an id within their row) -> [batch, ids]
    int64: the tokens of each id in each row, id 0 left out (0 where a row lacks an id)."""
    segment_ids = np.asarray(segment_ids, np.int64)
    rows, ids = segment_ids.shape[0], int(segment_ids.max(initial=0)) + 1
    offsets = np.arange(rows)[:, None] * ids
    return np.bincount((segment_ids + offsets).ravel(), minlength=rows * ids).reshape(rows, ids)[:, 1:]


def batch_flops(config, segment_ids) -> float:
    """Training FLOPs of a batch given its [batch, length] segment ids: the matmuls per position (padding included:
    they run on it) + causal attention within each document (a row's documents never attend to each other), the sum
    over documents of len^2 at flops_per_token's rate (a sliding layer's window or index_topk caps it)."""
    attention = _attention_flops(config, document_lengths(segment_ids).ravel())
    return _projection_flops(config) * np.size(segment_ids) + attention


class Peak:
    """The peak FLOP/s of all devices, the denominator of MFU. A rate that steps' model FLOPs reached is a lower
    bound of the true peak, so a faster one raises `flops` (a CPU rate measured while the machine was busy, or a
    train.peak_tflops_per_device below the devices' peak) and MFU never exceeds 1."""

    def __init__(self, flops: float):
        self.flops = flops

    def mfu(self, model_flops_per_sec: float, warn: Callable[[str], None]) -> float:
        """model FLOP/s / peak, after raising the peak to `model_flops_per_sec` (saying so through `warn`)."""
        if model_flops_per_sec > self.flops:
            warn(
                f"MFU: steps ran {model_flops_per_sec / 1e12:.4g} model TFLOP/s, above the peak of "
                f"{self.flops / 1e12:.4g} TFLOP/s; the peak is raised to that rate (set "
                f"train.peak_tflops_per_device to the devices' peak per device)"
            )
            self.flops = model_flops_per_sec
        return model_flops_per_sec / self.flops


def peak_flops_per_device(override_tflops: float = 0.0, dtype=np.float32) -> float:
    """From the config override, the table above, or (CPU) measured: the faster of float32 and `dtype` (the compute
    dtype) matmuls."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind
    for prefix, flops in PEAK_FLOPS.items():
        if kind.startswith(prefix):
            return flops
    return max(_measure_matmul_flops(np.dtype(np.float32)), _measure_matmul_flops(np.dtype(dtype)))


@functools.cache  # once per process and dtype: the devices are the process's for its lifetime
def _measure_matmul_flops(dtype: np.dtype, n: int = 1024, repeats: int = 10) -> float:
    """Per-device rate of [n, n] matmuls run on all local devices at once (best of `repeats`), so simulated devices
    sharing the host's cores are measured sharing them (a per-device rate x the devices = the host's rate)."""
    local = jax.sharding.Mesh(jax.local_devices(), ("d",))  # this process's devices, whatever mesh is set
    a = jax.device_put(np.ones((local.size, n, n), dtype), jax.sharding.NamedSharding(local, P("d")))
    matmul = jax.jit(lambda x: x @ x)
    best = float("inf")
    with jax.set_mesh(local):
        matmul(a).block_until_ready()
        for _ in range(repeats):
            start = time.perf_counter()
            matmul(a).block_until_ready()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
