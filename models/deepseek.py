"""DeepSeek-V2/V3-like decoder: multi-head latent attention in every block; the first `first_dense_layers`
blocks end in a dense SwiGLU, the others in a mixture of experts (models/mixture.py)."""

from __future__ import annotations

from flax import nnx

from layers.mla import MLA
from models import block
from models.config import FULL, ModelConfig
from models.mixture import MixtureDecoder


def latent_attention(config: ModelConfig, *, rngs: nnx.Rngs, **kw) -> MLA:
    """The multi-head latent attention of `config`."""
    return MLA(
        config.embed_dim,
        config.num_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        index_topk=config.index_topk,
        index_heads=config.index_heads,
        index_head_dim=config.index_head_dim,
        index_rope_interleaved=config.index_rope_interleaved,
        rngs=rngs,
        **kw,
    )


class Block(block.Block):
    """A block with latent attention (every layer of `kind` full_attention), ending in a mixture of experts if `moe`,
    else a dense SwiGLU."""

    def __init__(self, config: ModelConfig, kind: str = FULL, *, moe: bool, rngs: nnx.Rngs, **kw):
        del kind  # check_model gives latent attention no sliding layers
        super().__init__(config, latent_attention(config, rngs=rngs, **kw), moe=moe, rngs=rngs, **kw)


class DeepSeek(MixtureDecoder):
    """`num_dense_layers` dense blocks, then `num_moe_layers` MoE blocks, of latent attention."""

    block = Block
