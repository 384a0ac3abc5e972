"""Model registry: `model.family` in the config names the class that builds the model; `frozen` names the
parameters a model's config keeps out of training."""

from __future__ import annotations

from flax import nnx

from models.config import ComputeConfig, ModelConfig
from models.deepseek import DeepSeek
from models.deepseek import frozen as frozen
from models.gemma3 import Gemma3
from models.llama import Llama
from models.mixtral import Mixtral
from models.qwen3_5 import Qwen3_5, Qwen3_5Moe

# model.family -> the decoder that builds it; families whose differences are config fields share one
REGISTRY = {
    "llama": Llama,
    "qwen2": Llama,
    "qwen3": Llama,
    "mistral": Llama,
    "deepseek": DeepSeek,
    "qwen3_moe": Mixtral,
    "mixtral": Mixtral,
    "gemma3": Gemma3,
    "gpt_oss": Mixtral,
    "qwen3_5": Qwen3_5,
    "qwen3_5_moe": Qwen3_5Moe,
    "qwen3_next": Qwen3_5Moe,
}


def build(config: ModelConfig, compute: ComputeConfig = ComputeConfig(), *, rngs: nnx.Rngs) -> nnx.Module:
    """Builds the model of `config.family` with fresh parameters, computing as `compute` says."""
    if config.family not in REGISTRY:
        raise ValueError(f"model.family={config.family!r} is unknown; registered: {', '.join(REGISTRY)}")
    return REGISTRY[config.family](config, compute, rngs=rngs)
