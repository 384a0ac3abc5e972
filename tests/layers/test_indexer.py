"""The lightning indexer with the blockwise top-k picks transformers' keys: DeepSeek-V3.2's `DeepseekV32Indexer`
(half-split rotary pairs) and GLM-5's `GlmMoeDsaIndexer` (interleaved), on packed rows (documents and padding in
the mask), the same set for every query whose k-th and (k+1)-th best scores differ (ties aside)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV32Config, GlmMoeDsaConfig
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, DeepseekV32RotaryEmbedding
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

from layers.indexer import Indexer
from layers.norm import LayerNorm
from layers.rope import inverse_frequencies
from parallel.kernels import Options, Tokens
from parallel.kernels.top_k import index_scores, top_k
from parallel.segments import visible_pairs

EMBED, Q_LORA, HEADS, DIM, ROPE, TOPK, LENGTH = 32, 16, 4, 16, 8, 5, 24
KINDS = {  # name -> (config class, indexer class, rotary class, interleaved)
    "deepseek-v3.2": (DeepseekV32Config, DeepseekV32Indexer, DeepseekV32RotaryEmbedding, False),
    "glm-5": (GlmMoeDsaConfig, GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding, True),
}


def torch_indexer(kind: str):
    config_class, indexer_class, rotary_class, _ = KINDS[kind]
    config = config_class(
        hidden_size=EMBED, q_lora_rank=Q_LORA, index_n_heads=HEADS, index_head_dim=DIM, qk_rope_head_dim=ROPE,
        index_topk=TOPK, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    indexer = indexer_class(config, 0).eval()
    with torch.no_grad():
        for param in indexer.parameters():
            param.normal_(0.0, 0.3)
        indexer.k_norm.weight.add_(1.0)
    return indexer, rotary_class(config)


def ours(indexer, interleaved: bool) -> Indexer:
    """Our indexer holding `indexer`'s weights."""
    layer = Indexer(EMBED, Q_LORA, heads=HEADS, head_dim=DIM, rope_dim=ROPE, interleaved=interleaved, rngs=nnx.Rngs(0))
    weight = lambda linear: jnp.asarray(linear.weight.detach().numpy().T)
    layer.wq_b[...] = weight(indexer.wq_b).reshape(Q_LORA, HEADS, DIM)
    layer.wk[...], layer.weights[...] = weight(indexer.wk), weight(indexer.weights_proj)
    layer.k_norm.scale[...] = jnp.asarray(indexer.k_norm.weight.detach().numpy())
    layer.k_norm.bias[...] = jnp.asarray(indexer.k_norm.bias.detach().numpy())
    return layer


@pytest.mark.parametrize("kind", KINDS)
def test_top_k_matches_transformers(kind):
    indexer, rotary = torch_indexer(kind)
    rng = np.random.default_rng(1)
    x, q_latent = rng.normal(size=(2, LENGTH, EMBED)), rng.normal(size=(2, LENGTH, Q_LORA))
    segment_ids = np.array([[1] * 9 + [2] * 13 + [0] * 2, [1] * LENGTH], np.int32)
    positions = np.broadcast_to(np.arange(LENGTH), (2, LENGTH))
    tokens = Tokens(jnp.asarray(segment_ids), jnp.arange(LENGTH, dtype=jnp.int32))
    side = lambda axis: Tokens(jnp.expand_dims(tokens.segment_ids, axis), jnp.expand_dims(tokens.index, axis - 1))
    visible = np.asarray(visible_pairs(side(2), side(1), causal=True))
    with torch.no_grad():
        x_t, position_ids = torch.from_numpy(x).float(), torch.from_numpy(positions.copy()).long()
        mask = torch.from_numpy(np.where(visible, 0.0, -np.inf)).float()
        expected = indexer(x_t, torch.from_numpy(q_latent).float(), rotary(x_t, position_ids), mask, position_ids)
    inv_freq, factor = inverse_frequencies(ROPE, rotary.config.rope_parameters["rope_theta"])
    indexer_out = ours(indexer, KINDS[kind][3])(jnp.asarray(q_latent, jnp.float32), jnp.asarray(x, jnp.float32),
                                         jnp.asarray(positions), inv_freq, factor)  # fmt: skip
    options = Options(causal=True, block_q=8, block_kv=8)
    selection = top_k(
        indexer_out.queries, indexer_out.weights, indexer_out.keys, tokens, tokens, count=TOPK, options=options
    )
    dense = np.where(
        visible, np.asarray(index_scores(indexer_out.queries, indexer_out.weights, indexer_out.keys)), -np.inf
    )
    ranked = -np.sort(-dense, -1)
    compared = 0
    for b in range(2):
        for s in range(LENGTH):
            if np.isfinite(ranked[b, s, TOPK]) and ranked[b, s, TOPK - 1] - ranked[b, s, TOPK] < 1e-5:
                continue  # a tie at the boundary: either key is right
            theirs = {int(t) for t in expected[b, s].numpy() if visible[b, s, t]}  # masked keys fill short rows
            valid = np.asarray(selection.valid[b, s])
            assert set(np.asarray(selection.selected[b, s])[valid].tolist()) == theirs, (b, s)
            compared += 1
    assert compared > 0.8 * 2 * LENGTH


def test_layer_norm_is_torchs():
    x = np.random.default_rng(0).normal(size=(3, DIM)).astype(np.float32)
    norm = LayerNorm(DIM, eps=1e-6, rngs=nnx.Rngs(0))
    norm.scale[...], norm.bias[...] = jnp.linspace(0.5, 1.5, DIM), jnp.linspace(-1, 1, DIM)
    reference = torch.nn.LayerNorm(DIM, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.linspace(0.5, 1.5, DIM))
        reference.bias.copy_(torch.linspace(-1, 1, DIM))
        expected = reference(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(norm(jnp.asarray(x)), expected, atol=1e-6)
