"""Attention with an output gate, partial rotary embeddings and Gemma-style q/k norms equals Hugging Face's Qwen3.5
full-attention layer (float32, causal, one document a row)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.attention import Attention
from tests.parallel.attention_reference import relative_error

EMBED, HEADS, KV_HEADS, HEAD_DIM, ROTARY = 32, 4, 2, 16, 0.25


def test_equals_transformers_qwen3_5_attention():
    torch = pytest.importorskip("torch")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        hidden_size=EMBED,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROTARY},
    )
    config._attn_implementation = "eager"
    theirs = qwen3_5.Qwen3_5Attention(config, layer_idx=0).eval()
    ours = Attention(
        EMBED,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        rope_theta=10000.0,
        qk_norm=True,
        norm_offset=1.0,
        norm_eps=config.rms_norm_eps,
        rotary_dim=int(HEAD_DIM * ROTARY),
        output_gate=True,
        rngs=nnx.Rngs(0),
    )
    rng = np.random.default_rng(0)
    ours.q_norm.scale[...] = jnp.asarray(rng.normal(0, 0.2, HEAD_DIM), jnp.float32)
    ours.k_norm.scale[...] = jnp.asarray(rng.normal(0, 0.2, HEAD_DIM), jnp.float32)
    t = lambda x: torch.tensor(np.asarray(x, np.float32))
    with torch.no_grad():  # q_proj rows: per head [query | gate]
        query_gate = jnp.concatenate([ours.q[...], ours.gate[...]], axis=-1)  # [embed, heads, 2 * head_dim]
        theirs.q_proj.weight.copy_(t(query_gate.reshape(EMBED, -1).T))
        theirs.k_proj.weight.copy_(t(ours.k[...].reshape(EMBED, -1).T))
        theirs.v_proj.weight.copy_(t(ours.v[...].reshape(EMBED, -1).T))
        theirs.o_proj.weight.copy_(t(ours.o[...].reshape(-1, EMBED).T))
        theirs.q_norm.weight.copy_(t(ours.q_norm.scale[...]))
        theirs.k_norm.weight.copy_(t(ours.k_norm.scale[...]))
    batch, length = 2, 24
    x = rng.normal(size=(batch, length, EMBED)).astype(np.float32)
    positions = np.broadcast_to(np.arange(length), (batch, length))
    rotary = qwen3_5.Qwen3_5TextRotaryEmbedding(config)
    cos_sin = rotary(torch.tensor(x), torch.tensor(positions)[None].expand(3, -1, -1))
    mask = torch.triu(torch.full((length, length), float("-inf")), 1)[None, None]
    expected = theirs(torch.tensor(x), cos_sin, mask)[0].detach().numpy()
    actual = ours(jnp.asarray(x), jnp.asarray(positions), None)
    assert relative_error(actual, expected) <= 1e-5
