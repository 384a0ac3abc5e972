"""Llama model: shapes, packed-sequence isolation, padding gets no loss, remat policies agree."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import models
from models.config import ComputeConfig
from tests.tiny_models import TINY_LLAMA
from train.step import loss_sums

CONFIG = dataclasses.replace(TINY_LLAMA, num_layers=2)
COMPUTE = ComputeConfig(remat_policy="none")


def packed_row():
    """One row of 24 tokens: document 1 (10 tokens), document 2 (9 tokens), 5 padding."""
    segment_ids = np.array([[1] * 10 + [2] * 9 + [0] * 5], np.int32)
    positions = np.array([list(range(10)) + list(range(9)) + [0] * 5], np.int32)
    tokens = np.random.default_rng(0).integers(1, 64, size=(1, 24)).astype(np.int32)
    return tokens, positions, segment_ids


def test_logits_shape_and_param_count():
    model = models.build(CONFIG, COMPUTE, rngs=nnx.Rngs(0))
    tokens, positions, segment_ids = packed_row()
    assert model(tokens, positions, segment_ids).shape == (1, 24, 64)
    stacked = jax.tree.leaves(nnx.state(model.layers, nnx.Param))
    assert all(leaf.shape[0] == CONFIG.num_layers for leaf in stacked)


def test_changing_document_one_leaves_document_two_unchanged():
    model = models.build(CONFIG, COMPUTE, rngs=nnx.Rngs(0))
    tokens, positions, segment_ids = packed_row()
    changed = tokens.copy()
    changed[0, :10] = (changed[0, :10] + 7) % 64
    before = model(tokens, positions, segment_ids)
    after = model(changed, positions, segment_ids)
    np.testing.assert_array_equal(np.asarray(before[0, 10:19]), np.asarray(after[0, 10:19]))
    assert not np.allclose(before[0, :10], after[0, :10])


def test_document_two_in_a_row_equals_document_two_alone():
    model = models.build(CONFIG, COMPUTE, rngs=nnx.Rngs(0))
    tokens, positions, segment_ids = packed_row()
    alone = model(tokens[:, 10:19], positions[:, 10:19], np.ones((1, 9), np.int32))
    np.testing.assert_allclose(model(tokens, positions, segment_ids)[0, 10:19], alone[0], rtol=1e-5, atol=1e-5)


def test_padding_and_masked_targets_get_no_loss():
    model = models.build(CONFIG, COMPUTE, rngs=nnx.Rngs(0))
    tokens, positions, segment_ids = packed_row()
    mask = (segment_ids > 0).astype(np.float32)
    targets = np.roll(tokens, -1, axis=1)
    batch = dict(tokens=tokens, positions=positions, segment_ids=segment_ids, targets=targets, loss_mask=mask)
    loss, count, _ = loss_sums(model, batch, chunk_size=8)
    other = dict(batch, targets=np.where(segment_ids > 0, targets, 5), tokens=np.where(segment_ids > 0, tokens, 9))
    loss2, _, _ = loss_sums(model, other, chunk_size=8)
    assert float(count) == 19 and float(loss) == pytest.approx(float(loss2), rel=1e-6)


def loss_gradients(policy: str):
    """Gradients of the packed row's loss for CONFIG with `policy`."""
    tokens, positions, segment_ids = packed_row()
    batch = dict(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        targets=np.roll(tokens, -1, 1),
        loss_mask=(segment_ids > 0).astype(np.float32),
    )
    graphdef, params = nnx.split(models.build(CONFIG, ComputeConfig(remat_policy=policy), rngs=nnx.Rngs(0)))
    return jax.jit(jax.grad(lambda p: loss_sums(nnx.merge(graphdef, p), batch, 8)[0]))(params)


@pytest.fixture(scope="module")
def no_remat_gradients():
    return loss_gradients("none")


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_projections"])
def test_remat_policies_give_the_same_loss_and_gradients(policy, no_remat_gradients):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), no_remat_gradients, loss_gradients(policy)
    )


def test_tied_embeddings_have_no_head():
    model = models.build(dataclasses.replace(CONFIG, tie_embeddings=True), COMPUTE, rngs=nnx.Rngs(0))
    assert model.head is None
    np.testing.assert_array_equal(model.output_kernel(), model.embed.embedding[...].T)


def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match=r"model\.family='gpt'.*llama"):
        models.build(dataclasses.replace(CONFIG, family="gpt"), COMPUTE, rngs=nnx.Rngs(0))
