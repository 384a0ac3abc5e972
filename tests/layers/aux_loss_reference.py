"""DeepSeek's load-balancing loss as its own modelling code defines it, the reference of layers.moe's per-layer and
per-sequence scopes (transformers has none)."""

import numpy as np


def deepseek_aux_loss(experts: np.ndarray, scores: np.ndarray, sequence: bool) -> float:
    """DeepSeek's own MoEGate aux loss (alpha 1) summed over layers, written from its definition with a loop per layer
    and row: experts [layers, rows, length, k] chosen, scores [layers, rows, length, experts] the router's softmax;
    per row when `sequence` (seq_aux), else over the batch."""
    num_experts, total = scores.shape[-1], 0.0
    for chosen, score in zip(experts, scores, strict=True):
        _, length, k = chosen.shape
        if sequence:
            counts = np.stack([np.bincount(row.ravel(), minlength=num_experts) for row in chosen])
            total += np.mean(np.sum(counts / (length * k / num_experts) * score.mean(1), -1))
        else:
            f = np.bincount(chosen.ravel(), minlength=num_experts) / chosen.size * num_experts
            total += np.sum(f * score.reshape(-1, num_experts).mean(0))
    return total
