"""Mixtral, Qwen3-MoE and GPT-OSS: Llama-style blocks (grouped-query attention; q/k norms for Qwen3-MoE; q/k/v/o
biases, sinks and sliding layers for GPT-OSS) ending in a mixture of experts routed by a softmax top-k without shared
experts (GPT-OSS: a router logit bias and clamped SwiGLU experts with biases); the first `first_dense_layers` blocks
dense (Qwen3-MoE's mlp_only_layers), see models/mixture.py."""

from __future__ import annotations

from models import llama
from models.mixture import MixtureDecoder


class Mixtral(MixtureDecoder):
    """`num_dense_layers` dense blocks, then `num_moe_layers` MoE blocks, of grouped-query attention."""

    block = llama.Block
