"""GPT-OSS's mixture of experts (router logit bias, clamped SwiGLU experts with biases, gate and up interleaved)
equals transformers' GptOssMLP on the same weights, with the clamps biting; the clamped SwiGLU against its formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.clamped_swiglu import clamped_swiglu
from layers.moe import MoE

EMBED, MLP, EXPERTS, K = 16, 8, 8, 3
ALPHA, LIMIT = 1.702, 0.6  # a small limit, so that random pre-activations are clamped


def make_moe() -> MoE:
    """A GPT-OSS MoE with every bias random."""
    moe = MoE(
        EMBED,
        num_experts=EXPERTS,
        experts_per_token=K,
        moe_mlp_dim=MLP,
        num_shared_experts=0,
        router_score="softmax",
        router_logit_bias=True,
        expert_mlp="clamped_swiglu",
        swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT,
        rngs=nnx.Rngs(0),
    )
    keys = jax.random.split(jax.random.key(3), 3)
    for key, name in zip(keys, ("router_bias", "experts_gate_up_bias", "experts_down_bias"), strict=True):
        param = getattr(moe, name)
        param[...] = 0.5 * jax.random.normal(key, param.shape)
    return moe


def test_clamped_swiglu_formula():
    gate_up = np.array([[-9.0, 9.0, 2.0, -0.5, 8.0, -8.0]], np.float32)  # (gate, up) pairs
    gate = np.minimum(gate_up[:, ::2], 7.0)
    up = np.clip(gate_up[:, 1::2], -7.0, 7.0)
    expected = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    np.testing.assert_allclose(np.asarray(clamped_swiglu(jnp.asarray(gate_up), 1.702, 7.0)), expected, rtol=1e-6)


def test_equals_transformers():
    torch = pytest.importorskip("torch")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    moe = make_moe()
    config = GptOssConfig(
        hidden_size=EMBED,
        intermediate_size=MLP,
        num_local_experts=EXPERTS,
        num_experts_per_tok=K,
        swiglu_limit=LIMIT,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_hidden_layers=1,
    )
    hf = GptOssMLP(config)

    def t(param):
        return torch.from_numpy(np.array(param[...]))

    with torch.no_grad():
        hf.router.weight.copy_(t(moe.router).T)
        hf.router.bias.copy_(t(moe.router_bias))
        hf.experts.gate_up_proj.copy_(t(moe.experts_gate_up))
        hf.experts.gate_up_proj_bias.copy_(t(moe.experts_gate_up_bias))
        hf.experts.down_proj.copy_(t(moe.experts_down))
        hf.experts.down_proj_bias.copy_(t(moe.experts_down_bias))
        x = np.array(jax.random.normal(jax.random.key(6), (2, 16, EMBED)))
        expected = hf(torch.from_numpy(x))[0].numpy()
        gate_up = torch.from_numpy(x).reshape(-1, EMBED) @ hf.experts.gate_up_proj[0]
        assert (gate_up[..., ::2] > LIMIT).any() and (gate_up[..., 1::2].abs() > LIMIT).any()  # clamps bite
    y, stats = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    assert float(stats["counts"].sum()) == 2 * 16 * K
