"""The config.json keys every decoder family writes the same way (sizes, norm, embeddings, rope); a family adds
its own (attention heads, experts, ...) around them."""

from __future__ import annotations

from models.config import ModelConfig
from models.hf.rope import rope_to_hf


def decoder_config_to_hf(config: ModelConfig, architecture: str, model_type: str, rope_types) -> dict:
    """ModelConfig -> the shared config.json keys. max_position_embeddings (unused by our model) is the model's
    when stated (an import's, or the context a fine-tune extended it to), else the rope scaling's factor x
    original_max_position_embeddings."""
    rope = config.rope_scaling
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position_embeddings
        or int(rope.factor * rope.original_max_position_embeddings),
        **rope_to_hf(config, architecture, rope_types),
    }
