"""Text generation from a trained model: greedy or temperature sampling over a fixed-size buffer.

The whole buffer is re-run each step (no KV cache): one compiled program, fine for a short sample. Every process
of a multi-process run calls `generate` (each step is a global program) and gets the same text. Under expert
parallelism the MoE dispatch has room for every token: a sample never drops one."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from parallel.mesh import batch_shards, length_shards
from parallel.parallelism import Parallelism, use_parallelism
from parallel.rounding import round_up

DROPLESS = Parallelism(expert_dispatch="capacity", expert_capacity=math.inf)  # contiguous, no context strategy


def generate(
    train_state, mesh, tokenizer, prompt: str, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> str:
    """Continues `prompt` by up to `max_new_tokens` tokens (stops at EOS); returns the new text."""
    ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)
    needed = len(ids) + max_new_tokens
    length = round_up(needed, length_shards(mesh))  # padded: the sequence may be split
    rows = batch_shards(mesh)  # one row per batch shard: the batch axis must split over the mesh
    graphdef = train_state.graphdef

    @jax.jit
    def next_token(state, tokens, index, key):
        model, _ = nnx.merge(graphdef, state)
        segment_ids = (jnp.arange(length) <= index).astype(jnp.int32)[None].repeat(rows, 0)
        logits = model(tokens, segment_ids=segment_ids)[0, index]
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    tokens = np.full((rows, length), tokenizer.pad_id, np.int32)
    tokens[:, : len(ids)] = ids
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.random.key(seed)
    new = []
    with jax.set_mesh(mesh), use_parallelism(DROPLESS):
        for index in range(len(ids) - 1, needed - 1):
            key, sub = jax.random.split(key)
            token = int(next_token(train_state.state, jax.device_put(tokens, replicated), index, sub))
            if token == tokenizer.eos_id:
                break
            tokens[:, index + 1] = token
            new.append(token)
    return tokenizer.decode(new)
