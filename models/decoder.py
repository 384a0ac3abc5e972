"""What every model family shares around its blocks: default positions, the output kernel and logits.

A family subclasses `Decoder`, sets `embed` and `head` (None when the embeddings are tied) and defines
`hidden(tokens, positions, segment_ids) -> (hidden [batch, length, embed], aux dict)`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


def default_positions(tokens, positions):
    """positions [batch, length], or 0..length-1 in every row when None."""
    if positions is not None:
        return positions
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


class Decoder(nnx.Module):
    """Base of the model families: logits from `hidden` and the (tied or own) output kernel."""

    def output_kernel(self):
        """[embed, vocab] matrix mapping hidden states to logits."""
        return self.embed.as_output_kernel() if self.head is None else self.head.output_kernel()

    def __call__(self, tokens, positions=None, segment_ids=None):
        """-> logits [batch, length, vocab] in float32 (for sampling and reference checks, not the loss)."""
        hidden, _ = self.hidden(tokens, positions, segment_ids)
        return jnp.einsum("bte,ev->btv", hidden, self.output_kernel().astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
