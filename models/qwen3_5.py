"""Qwen3.5 text decoders, dense (Qwen3_5) and mixture-of-experts (Qwen3_5Moe: Qwen3.5-MoE and Qwen3-Next, their
feed-forward as models/mixture.py's, a gated shared expert beside the routed ones): three Gated DeltaNet layers to
one gated full-attention layer as layer_types says, scanned in groups of its period. Full attention: grouped-query
with q/k norms, rope on a share of each head's features (partial_rotary_factor) and the output gated by sigmoid of a
second query-sized projection; every norm is Qwen3.5's 1 + weight. Linear layers: layers/gated_deltanet.py, their
convolution and recurrence over the whole (possibly split) sequence through `parallel`."""

from __future__ import annotations

from flax import nnx

from layers.gated_deltanet import GatedDeltaNet
from models import block, llama
from models.config import FULL, LINEAR, ModelConfig
from models.mixture import MixtureDecoder

NORM_OFFSET = 1.0  # Qwen3.5's RMSNorm scales by 1 + weight (its gated norm inside Gated DeltaNet by the weight)


def mixer(config: ModelConfig, kind: str, *, rngs: nnx.Rngs, **kw) -> nnx.Module:
    """A layer's token mixer: Gated DeltaNet in a linear_attention layer, else the gated full attention."""
    if kind == LINEAR:
        return GatedDeltaNet(
            config.embed_dim,
            key_heads=config.linear_key_heads,
            heads=config.linear_heads,
            key_dim=config.linear_key_dim,
            value_dim=config.linear_value_dim,
            taps=config.linear_conv_taps,
            norm_eps=config.norm_eps,
            rngs=rngs,
            **kw,
        )
    return llama.attention(config, kind, norm_offset=NORM_OFFSET, rngs=rngs, **kw)


class Block(block.Block):
    """A pre-norm block (norms of 1 + weight) around the mixer of `kind` and a SwiGLU."""

    norm_offset = NORM_OFFSET

    def __init__(self, config: ModelConfig, kind: str = FULL, *, moe: bool = False, rngs: nnx.Rngs, **kw):
        super().__init__(config, mixer(config, kind, rngs=rngs, **kw), moe=moe, rngs=rngs, **kw)


class Qwen3_5(llama.Llama):
    """Llama's stack of Qwen3.5 blocks of the config's layer kinds, behind a final norm of 1 + weight."""

    block = Block
    norm_offset = NORM_OFFSET


class Qwen3_5Moe(MixtureDecoder):
    """The dense blocks (`first_dense_layers`) then the mixture-of-experts blocks of Qwen3.5's layer kinds, behind a
    final norm of 1 + weight."""

    block = Block
    norm_offset = NORM_OFFSET
