"""What an attention kernel is given besides q, k and v, in two named bundles (as flex-attention's BlockMask bundles
its mask): `Tokens`, one side's segment ids and global token indices, which together say what a query may see; and
`Options`, the static rest of a call (causality, sliding window, softmax scale, block sizes)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np


class Tokens(NamedTuple):
    """The tokens of one side of a call (the queries or the keys) as the mask sees them. A query sees a key of its
    own non-zero segment id, and when causal one whose global index is not above its own. A pytree: jit and
    custom_vjp trace its arrays; a None field is an empty leaf.

    `kernels.attention` fills in None: one document, indices 0..t-1. A kernel's forward / backward take both given,
    int32, the index numpy when fixed at trace time (the cuDNN kernel then knows the call's kind statically)."""

    segment_ids: jax.Array | None = None  # [batch, t] int32, 0 = padding
    index: jax.Array | np.ndarray | None = None  # [t] int32 global token index (the original order's position)


@dataclasses.dataclass(frozen=True)
class Options:
    """The static part of a call (hashable: a trace-time constant). window W (causal only): a query of global index i
    sees keys j with i - W < j <= i (W keys including itself, Hugging Face's `sliding_window`); None = no window.
    block_q / block_kv are upper bounds on the query / key tokens a kernel block holds (each kernel rounds them to
    its own tiles). scale None is dqk ** -0.5, which `kernels.attention` fills in; a kernel's forward / backward take
    it given."""

    causal: bool = True
    scale: float | None = None
    block_q: int = 256
    block_kv: int = 256
    window: int | None = None

    def __post_init__(self):
        if self.window is not None and (not self.causal or int(self.window) != self.window or self.window < 1):
            raise ValueError(
                f"attention window {self.window!r} (causal={self.causal}): give an int >= 1 with causal=True"
            )
