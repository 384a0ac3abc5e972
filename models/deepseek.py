"""DeepSeek-V2/V3-like decoder: multi-head latent attention in every block; the first `first_dense_layers`
blocks end in a dense SwiGLU, the others in a mixture of experts (models/mixture.py). With DeepSeek-V3.2's sparse
attention each block also reports its indexer's loss (layers/mla.py), which the decoder adds to training's losses at
`indexer_loss_coef`; `frozen` names the variables `indexer_training` keeps as they are."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from layers.mla import MLA
from models import block
from models.config import FULL, ModelConfig
from models.mixture import MixtureDecoder

INDEXER = "indexer"  # layers.mla.MLA's attribute holding its indexer


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
        index_warmup=config.indexer_training == "warmup",
        rngs=rngs,
        **kw,
    )


class Block(block.Block):
    """A block with latent attention (every layer of `kind` full_attention), ending in a mixture of experts if `moe`,
    else a dense SwiGLU."""

    def __init__(self, config: ModelConfig, kind: str = FULL, *, moe: bool, rngs: nnx.Rngs, **kw):
        del kind  # check_model gives latent attention no sliding layers
        super().__init__(config, latent_attention(config, rngs=rngs, **kw), moe=moe, rngs=rngs, **kw)

    def __call__(self, x, positions, segment_ids):
        """x: [batch, length, embed], positions/segment_ids: [batch, length] -> (x, {the expert statistics of an MoE
        block (layers.moe.MoE), the indexer's report where it runs (layers.mla.MLA.attend)})."""
        attended, report = self.attn.attend(self.attn_norm(x), positions, segment_ids)
        x, stats = self.feed_forward(x + attended)
        return x, (stats or {}) | report


class DeepSeek(MixtureDecoder):
    """`num_dense_layers` dense blocks, then `num_moe_layers` MoE blocks, of latent attention."""

    block = Block

    def aux_losses(self, aux) -> dict:
        """MixtureDecoder's, and {"indexer_loss": (indexer_loss_coef, the indexers' loss [], each layer's mean over
        its queries, summed over the layers)} where the indexers ran (each learns from its own layer's term only)."""
        losses = super().aux_losses(aux)
        if "indexer_loss" in aux:
            per_layer = aux["indexer_loss"].sum(1) / jnp.maximum(aux["indexer_tokens"].sum(1), 1.0)
            losses["indexer_loss"] = (self.config.indexer_loss_coef, per_layer.sum())
        return losses


def frozen(config: ModelConfig, names: tuple[str, ...]) -> bool:
    """Whether training keeps the variable at path `names` (a parameter, or state such as the router bias) as it is:
    the indexers' when model.indexer_training is frozen, every other one in the warm-up."""
    if config.indexer_training == "frozen":
        return INDEXER in names
    return config.indexer_training == "warmup" and INDEXER not in names
