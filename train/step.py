"""The jitted training and evaluation steps: segment-masked chunked loss, gradient accumulation, update.

Each step traces its body under `use_parallelism(parallelism)` (parallel/parallelism.py), so `parallel.attention` in the
model runs the configured context strategy on batches already in the parallelism's sequence layout."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from layers.loss import chunked_cross_entropy
from models import frozen
from models.config import ModelConfig
from models.dtypes import compute_dtype
from parallel.mesh import batch_sharding
from parallel.parallelism import Parallelism, use_parallelism
from parallel.token_sums import token_sums
from train.data.batch import BATCH_FIELDS
from train.optimizer import parameter_names


def frozen_mask(model: ModelConfig):
    """model state -> True for the variables training keeps as they are (models.frozen: e.g. the indexer's while
    model.indexer_training is frozen; in its warm-up every other one, the router bias included)."""
    return lambda state: jax.tree_util.tree_map_with_path(lambda path, _: frozen(model, parameter_names(path)), state)


def loss_sums(model, batch, chunk_size: int, weights=None):
    """(sum of token losses, number of loss tokens, model aux) over a batch of [batch, length] arrays.

    The loss is computed where the tokens are (parallel.token_sums). The mask is the data's loss_mask (0 on padding
    and where the target belongs to another document), or `weights` [batch, length, groups] (sums per group); aux
    is what the model reports beside its hidden states (e.g. expert counts), summed over micro-batches."""
    hidden, aux = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
    mask = batch["loss_mask"] if weights is None else weights
    dtype = compute_dtype(model.compute)

    def sums(hidden, targets, mask, kernel):
        return chunked_cross_entropy(hidden, kernel, targets, mask, chunk_size=chunk_size, dtype=dtype)

    # per device: each chunk holds local tokens only, and the sums cross devices once
    loss, count = token_sums(sums, (hidden, batch["targets"], mask), (model.output_kernel(),))
    return loss, count, aux


def accumulated_grads(model, batch, chunk_size: int, accum_steps: int, frozen):
    """Gradients of the token-mean loss plus the model's aux losses (each times its coefficient) over `accum_steps`
    micro-batches (zero where `frozen`, frozen_mask of the model's Params, is True), scanned one after another ->
    (grads, mean token loss, loss tokens, aux summed over micro-batches, {aux loss name: its token-weighted mean over
    micro-batches})."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # row i goes to micro-batch i % accum_steps, so every micro-batch stays spread over the batch shards
    micro = jax.tree.map(
        lambda x: x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1), batch
    )

    def loss_of(p, micro_batch):
        """(the token loss sum plus n x each aux loss times its coefficient, (token loss sum, n, aux, {name: aux
        loss x n})): the gradient over all tokens divided by their number is the mean loss's plus the aux losses'
        token-weighted mean. Frozen parameters get no gradient (none is computed for them)."""
        p = jax.tree.map(lambda x, keep: jax.lax.stop_gradient(x) if keep else x, p, frozen)
        model = nnx.merge(graphdef, p, rest)
        loss, n, aux = loss_sums(model, micro_batch, chunk_size)
        losses = model.aux_losses(aux)
        weighted = {name: value * jax.lax.stop_gradient(n) for name, (_, value) in losses.items()}
        objective = loss + sum(coefficient * weighted[name] for name, (coefficient, _) in losses.items())
        return objective, (loss, n, aux, weighted)

    def micro_step(carry, micro_batch):
        grads_sum, loss_sum, count = carry
        (_, (loss, n, aux, weighted)), grads = jax.value_and_grad(loss_of, has_aux=True)(params, micro_batch)
        return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss, count + n), (aux, weighted)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss_sum, count), (aux, weighted) = jax.lax.scan(micro_step, (zeros, 0.0, 0.0), micro)
    denominator = jnp.maximum(count, 1.0)
    return (
        jax.tree.map(lambda g: (g / denominator).astype(g.dtype), grads),
        loss_sum / denominator,
        count,
        jax.tree.map(lambda a: a.sum(0), aux),
        {name: value.sum(0) / denominator for name, value in weighted.items()},
    )


def configured_train_step(train_state, mesh, config, parallelism: Parallelism):
    """The train step a run of `config` compiles: the trainer's (train/trainer.py), and what the memory plan compiles
    (train/planning/memory.py)."""
    return make_train_step(
        train_state,
        mesh,
        chunk_size=config.compute.loss_chunk_size,
        accum_steps=config.train.grad_accum_steps,
        parallelism=parallelism,
    )


def make_train_step(train_state, mesh, *, chunk_size: int, accum_steps: int, parallelism: Parallelism = Parallelism()):
    """jit(state, batch) -> (state, metrics) with explicit in/out shardings; the state buffer is donated.
    Batch arrays [batch, length] are in `parallelism.layout` order. The variables the model keeps frozen (models.frozen)
    come out as they went in; the optimizer's state keeps their moments, so its shape does not depend on what is
    frozen."""
    graphdef = train_state.graphdef

    def step(state, batch):
        with use_parallelism(parallelism):  # inside: jit traces on the first call
            model, optimizer = nnx.merge(graphdef, state)
            before = jax.tree.map(lambda x: x, nnx.state(model))  # the values, not the variables
            frozen = frozen_mask(model.config)(before)
            grads, loss, count, aux, aux_losses = accumulated_grads(
                model, batch, chunk_size, accum_steps, nnx.filter_state(frozen, nnx.Param)
            )
            optimizer.update(model, grads)
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "loss_tokens": count, **aux_losses}
            metrics |= model.balance(aux)  # e.g. aux-loss-free expert balancing, outside the gradient
            if any(jax.tree.leaves(frozen)):  # back as they were: weight decay and balancing would move them
                kept = jax.tree.map(lambda old, new, keep: old if keep else new, before, nnx.state(model), frozen)
                nnx.update(model, kept)
            return nnx.split((model, optimizer))[1], metrics

    data = {key: batch_sharding(mesh) for key in BATCH_FIELDS}
    return jax.jit(
        step, in_shardings=(train_state.shardings, data), out_shardings=(train_state.shardings, None), donate_argnums=0
    )


def position_buckets(boundaries: tuple[int, ...], seq_len: int) -> tuple[tuple[int, int], ...]:
    """train.eval_position_buckets [b1, ..., bn] -> ((0, b1), (b1, b2), ..., (bn, seq_len)), boundaries at or past
    seq_len left out (a shorter run of the same recipe); () when none."""
    if not boundaries:
        return ()
    edges = (0, *(b for b in boundaries if b < seq_len), seq_len)
    return tuple(itertools.pairwise(edges))


def position_weights(batch, buckets) -> jax.Array:
    """[batch, length, 1 + len(buckets)] float32: the loss mask, then the loss mask of the tokens whose position in
    their document lies in each (start, end) of `buckets`."""
    mask, positions = batch["loss_mask"], batch["positions"]
    inside = [(positions >= start) & (positions < end) for start, end in buckets]
    return jnp.stack([mask, *(mask * bucket for bucket in inside)], axis=-1).astype(jnp.float32)


def make_eval_step(train_state, mesh, *, chunk_size: int, parallelism: Parallelism = Parallelism(), buckets=()):
    """jit(state, batch) -> (loss sums, token counts), each [1 + len(buckets)] float32, on held-out data in
    `parallelism.layout` order: all loss tokens, then those at document positions in each (start, end) of `buckets`."""
    graphdef = train_state.graphdef

    def step(state, batch):
        with use_parallelism(parallelism):
            model, _ = nnx.merge(graphdef, state)
            return loss_sums(model, batch, chunk_size, position_weights(batch, buckets))[:2]

    data = {key: batch_sharding(mesh) for key in BATCH_FIELDS}
    return jax.jit(step, in_shardings=(train_state.shardings, data))
