"""The decoder every family shares: embedding -> the family's blocks -> final norm -> output head.

A family subclasses `Decoder`: its `__init__` calls `super().__init__(config, compute, rngs=rngs)` and builds its
stacks of blocks; it defines `blocks(x, positions, segment_ids) -> (x, aux)` and, when its blocks report something
to train on (a load-balancing loss) or to act on after an optimizer step (expert loads), `aux_losses(aux)` and
`balance(aux)`; models/mixture.py does these for the families with expert blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from layers.embed import Embed, OutputHead
from layers.loss import logits
from layers.norm import RMSNorm
from models.config import ComputeConfig, ModelConfig
from models.dtypes import compute_dtype, param_dtype


def default_positions(tokens, positions):
    """positions [batch, length], or 0..length-1 in every row when None."""
    if positions is not None:
        return positions
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


class Hidden(NamedTuple):
    """What `Decoder.hidden` returns."""

    states: jax.Array  # final-normed hidden states [batch, length, embed]
    aux: dict  # what the blocks report beside them, e.g. expert loads (see the family's `blocks`)


class Decoder(nnx.Module):
    """tokens [batch, length] -> hidden [batch, length, embed] -> logits [batch, length, vocab].

    Parameters: embed, final_norm, head (None when the embeddings are tied) and the family's stacks. A family may set
    `norm_offset` (the final norm's, layers.norm.RMSNorm) and `scale_embeddings` (embeddings times sqrt(embed_dim))
    as Gemma does."""

    norm_offset: float = 0.0
    scale_embeddings: bool = False

    def __init__(self, config: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        self.config, self.compute = config, compute
        kw = self.dtypes()
        scale = config.embed_dim**0.5 if self.scale_embeddings else 1.0
        self.embed = Embed(config.vocab_size, config.embed_dim, scale=scale, rngs=rngs, **kw)
        self.final_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, offset=self.norm_offset, rngs=rngs, **kw)
        self.head = (
            None
            if config.tie_embeddings
            else OutputHead(config.embed_dim, config.vocab_size, rngs=rngs, param_dtype=kw["param_dtype"])
        )

    def dtypes(self) -> dict:
        """{param_dtype, dtype} keyword arguments for the layers of this model."""
        return dict(param_dtype=param_dtype(self.config), dtype=compute_dtype(self.compute))

    def blocks(self, x, positions, segment_ids) -> tuple[jax.Array, dict]:
        """x [batch, length, embed] through the family's blocks -> (x, aux)."""
        raise NotImplementedError(f"{type(self).__name__} must define blocks()")

    def hidden(self, tokens, positions=None, segment_ids=None) -> Hidden:
        """tokens/positions/segment_ids: [batch, length] -> Hidden(states [batch, length, embed], aux)."""
        positions = default_positions(tokens, positions)
        x, aux = self.blocks(parallel.residual(self.embed(tokens)), positions, segment_ids)
        return Hidden(parallel.shard(self.final_norm(x), ("batch", "length", "embed")), aux)

    def output_kernel(self) -> jax.Array:
        """[embed, vocab] matrix mapping hidden states to logits."""
        return self.embed.as_output_kernel() if self.head is None else self.head.output_kernel()

    def __call__(self, tokens, positions=None, segment_ids=None) -> jax.Array:
        """-> logits [batch, length, vocab] in float32 (sampling and reference checks; training uses the chunked
        loss on `hidden` and `output_kernel`)."""
        states = self.hidden(tokens, positions, segment_ids).states
        return logits(states, self.output_kernel(), compute_dtype(self.compute))

    def aux_losses(self, aux: dict) -> dict:
        """name -> (coefficient, loss []) that training adds to the mean token loss, from the blocks' aux; none
        here."""
        return {}

    def balance(self, aux: dict) -> dict:
        """After an optimizer step: updates what the blocks' aux calls for; returns metrics (none here)."""
        return {}
