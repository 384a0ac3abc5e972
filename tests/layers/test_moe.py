"""MoE against a dense NumPy reference (sigmoid and softmax router scores), routing rules, load balancing helpers,
gradients, transformers' DeepSeek-V3 and V2 MoE, Qwen3.5-MoE's gated shared expert and the load-balancing loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.mlp import SwiGLU
from layers.moe import MoE, RouterBias, expert_swiglu, load_balancing_loss, load_imbalance, update_router_bias
from parallel import routed_experts
from tests.layers.aux_loss_reference import deepseek_aux_loss

EMBED, MLP, EXPERTS = 16, 8, 8


def make(num_shared=1, n_group=1, topk_group=1, k=2, **kwargs):
    return MoE(
        EMBED,
        num_experts=EXPERTS,
        experts_per_token=k,
        moe_mlp_dim=MLP,
        num_shared_experts=num_shared,
        n_group=n_group,
        topk_group=topk_group,
        rngs=nnx.Rngs(0),
        **kwargs,
    )


def swiglu(x, gate, up, down):
    pre = x @ gate
    return (pre / (1 + np.exp(-pre)) * (x @ up)) @ down


def reference_route(x, gate, bias, k, n_group, topk_group, norm_topk_prob, scale, score="sigmoid"):
    """NumPy float64 routing: x [tokens, embed] -> (experts [tokens, k], weights [tokens, k]).
    softmax as DeepSeek-V2: no bias, groups scored by their best expert, other groups' scores set to 0."""
    if score == "softmax":
        exp = np.exp(x @ gate - (x @ gate).max(-1, keepdims=True))
        scores = exp / exp.sum(-1, keepdims=True)
        grouped = scores.reshape(len(x), n_group, -1)
        group_scores = grouped.max(-1)
    else:
        scores = 1 / (1 + np.exp(-(x @ gate)))
        grouped = (scores + bias).reshape(len(x), n_group, -1)
        group_scores = np.sort(grouped, -1)[..., -2:].sum(-1) if n_group > 1 else np.zeros((len(x), 1))
    kept = np.zeros(group_scores.shape, bool)
    np.put_along_axis(kept, np.argsort(-group_scores, -1)[:, :topk_group], True, -1)
    choice = np.where(kept[..., None], grouped, 0.0 if score == "softmax" else -np.inf).reshape(len(x), -1)
    experts = np.argsort(-choice, -1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, experts, -1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts, weights * scale


def reference_moe(moe, x, **route):
    """Every expert on every token, combined with a dense [tokens, experts] routing matrix."""
    p = {
        name: np.asarray(getattr(moe, name)[...], np.float64)
        for name in ("router", "bias", "experts_gate", "experts_up", "experts_down")
    }
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    experts, weights = reference_route(tokens, p["router"], p["bias"], **route)
    combine = np.zeros((len(tokens), p["router"].shape[1]))
    np.put_along_axis(combine, experts, weights, -1)
    y = sum(
        combine[:, e : e + 1] * swiglu(tokens, p["experts_gate"][e], p["experts_up"][e], p["experts_down"][e])
        for e in range(combine.shape[1])
    )
    if moe.shared is not None:
        y = y + swiglu(
            tokens, *(np.asarray(v[...], np.float64) for v in (moe.shared.gate, moe.shared.up, moe.shared.down))
        )
    return y.reshape(x.shape), np.bincount(experts.reshape(-1), minlength=combine.shape[1])


def rel_err(a, b):
    return np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b))


@pytest.mark.parametrize(
    "num_shared,n_group,topk_group,k,norm,score",
    [
        (0, 1, 1, 3, True, "sigmoid"),
        (2, 1, 1, 3, False, "sigmoid"),
        (0, 4, 2, 3, True, "sigmoid"),
        (1, 4, 2, 3, True, "sigmoid"),
        (0, 8, 2, 2, True, "softmax"),
    ],
)  # softmax: groups of one expert
def test_equals_dense_reference(num_shared, n_group, topk_group, k, norm, score):
    moe = make(num_shared, n_group, topk_group, k=k, norm_topk_prob=norm, routed_scaling_factor=2.5, router_score=score)
    moe.bias[...] = 0.1 * jax.random.normal(jax.random.key(2), (EXPERTS,))
    x = jax.random.normal(jax.random.key(1), (2, 16, EMBED))
    y, stats = nnx.jit(lambda m, x: m(x))(moe, x)
    counts = stats["counts"]
    expected, expected_counts = reference_moe(
        moe, x, k=k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, scale=2.5, score=score
    )
    assert y.shape == x.shape and y.dtype == jnp.float32 and counts.dtype == jnp.float32
    assert rel_err(y, expected) <= 1e-5
    np.testing.assert_array_equal(np.asarray(counts).sum(0), expected_counts)
    np.testing.assert_array_equal(np.asarray(counts).sum(-1), [16 * k] * 2)  # per row
    assert float(stats["dropped"]) == 0  # one device: dropless


def test_annotations_shapes_and_dtype():
    moe = make(num_shared=2, dtype=jnp.bfloat16)
    assert moe.router[...].shape == (EMBED, EXPERTS) and moe.bias[...].shape == (EXPERTS,)
    assert isinstance(moe.bias, RouterBias) and not isinstance(moe.bias, nnx.Param)
    assert moe.experts_gate[...].shape == moe.experts_up[...].shape == (EXPERTS, EMBED, MLP)
    assert moe.experts_down[...].shape == (EXPERTS, MLP, EMBED)
    assert moe.experts_gate.get_metadata()["out_sharding"] == ("experts", "embed", "mlp")
    assert moe.experts_down.get_metadata()["out_sharding"] == ("experts", "mlp", "embed")
    assert isinstance(moe.shared, SwiGLU) and moe.shared.up[...].shape == (EMBED, 2 * MLP)
    assert make(num_shared=0).shared is None
    y, stats = nnx.jit(lambda m, x: m(x))(moe, jnp.ones((1, 4, EMBED)))
    assert (
        y.dtype == jnp.bfloat16
        and stats["counts"].dtype == stats["dropped"].dtype == jnp.float32
        and moe.experts_up[...].dtype == jnp.float32
    )


def routed(logits, bias=None, **kwargs):
    """Routes one-hot tokens so that the router logits are exactly `logits` [tokens <= EMBED, experts]."""
    moe = make(**kwargs)
    moe.router[...] = jnp.zeros((EMBED, EXPERTS)).at[: len(logits)].set(jnp.asarray(logits, jnp.float32))
    if bias is not None:
        moe.bias[...] = jnp.asarray(bias, jnp.float32)
    weights, experts = nnx.jit(lambda m, t: m.route(t))(moe, jnp.eye(EMBED)[: len(logits)])
    return np.asarray(weights), np.sort(np.asarray(experts), -1)


def test_group_limited_routing_stays_in_the_best_groups():
    # Expert 0 has the best score, but group 1 (experts 2, 3) has the best top-2 sum.
    logits = [[3.0, -3.0, 1.0, 1.0, -2.0, -2.0, -2.5, -2.5]]
    assert routed(logits, n_group=1, topk_group=1)[1].tolist() == [[0, 2]]
    assert routed(logits, n_group=4, topk_group=1)[1].tolist() == [[2, 3]]
    assert routed(logits, n_group=4, topk_group=2, k=3)[1].tolist() == [[0, 2, 3]]
    # Biased scores all negative: the kept group's experts are still the only candidates (masked with -inf).
    assert routed(logits, bias=[-5.0] * EXPERTS, n_group=4, topk_group=1)[1].tolist() == [[2, 3]]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(EMBED, EXPERTS))
    bias = rng.normal(size=EXPERTS)
    _, experts = routed(logits, bias=bias, n_group=4, topk_group=2, k=3)
    assert np.all(np.array([len(set(row // 2)) for row in experts]) <= 2)
    expected, _ = reference_route(
        logits, np.eye(EXPERTS), bias, k=3, n_group=4, topk_group=2, norm_topk_prob=True, scale=1.0
    )
    np.testing.assert_array_equal(experts, np.sort(expected, -1))


def test_bias_selects_but_weights_come_from_unbiased_scores():
    logits = np.array([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])
    scores = 1 / (1 + np.exp(-logits[0]))
    weights, experts = routed(logits, norm_topk_prob=False)
    assert experts.tolist() == [[0, 1]]
    bias = np.zeros(EXPERTS)
    bias[6] = 10.0
    weights, experts = routed(logits, bias=bias, norm_topk_prob=False)
    assert experts.tolist() == [[0, 6]]
    np.testing.assert_allclose(np.sort(weights[0]), np.sort(scores[[0, 6]]), rtol=1e-6)


def test_softmax_routing_ignores_the_bias_and_keeps_probabilities():
    logits = np.array([[2.0, 1.0, 0.5, -1.0, -2.0, -3.0, -4.0, -5.0]])
    probabilities = np.exp(logits[0]) / np.exp(logits[0]).sum()
    bias = np.zeros(EXPERTS)
    bias[6] = 10.0
    weights, experts = routed(
        logits, bias=bias, norm_topk_prob=False, routed_scaling_factor=1.5, router_score="softmax"
    )
    assert experts.tolist() == [[0, 1]]
    np.testing.assert_allclose(np.sort(weights[0]), 1.5 * np.sort(probabilities[[0, 1]]), rtol=1e-6)
    # group-limited: groups of 2 scored by their best expert; the best group (0, 1) and then (2, 3) are kept
    _, experts = routed(logits, n_group=4, topk_group=2, k=3, norm_topk_prob=False, router_score="softmax")
    assert experts.tolist() == [[0, 1, 2]]


def test_norm_topk_prob_and_routed_scaling_factor():
    logits = np.random.default_rng(1).normal(size=(8, EXPERTS))
    scores = 1 / (1 + np.exp(-logits))
    weights, experts = routed(logits, k=3, norm_topk_prob=True, routed_scaling_factor=2.5)
    np.testing.assert_allclose(weights.sum(-1), 2.5, rtol=1e-6)
    raw, raw_experts = routed(logits, k=3, norm_topk_prob=False, routed_scaling_factor=2.5)
    np.testing.assert_array_equal(experts, raw_experts)
    np.testing.assert_allclose(np.sort(raw, -1), 2.5 * np.sort(np.take_along_axis(scores, experts, -1), -1), rtol=1e-6)


def test_dropless_experts_equal_per_expert_loop():
    moe = make(num_shared=0, k=3)
    tokens = jax.random.normal(jax.random.key(3), (12, EMBED))
    # Unbalanced assignments: experts 1 and 5 get nothing, expert 0 most.
    experts = jnp.asarray(np.random.default_rng(2).choice([0, 0, 0, 2, 3, 4, 6, 7], size=(12, 3)), jnp.int32)
    weights = jax.random.uniform(jax.random.key(4), (12, 3))
    kernels = (moe.experts_gate[...], moe.experts_up[...], moe.experts_down[...])
    y, counts, dropped = jax.jit(
        lambda t: routed_experts(
            t.reshape(2, 6, EMBED),
            lambda _: (weights, experts, jnp.zeros((12, EXPERTS))),
            (),
            expert_swiglu,
            kernels,
            num_experts=EXPERTS,
        )[:3]
    )(tokens)
    y = y.reshape(tokens.shape)
    expected = jnp.zeros_like(tokens)
    for e in range(EXPERTS):
        out = jax.nn.silu(tokens @ moe.experts_gate[e]) * (tokens @ moe.experts_up[e]) @ moe.experts_down[e]
        expected += jnp.sum(jnp.where(experts == e, weights, 0.0), -1, keepdims=True) * out
    assert rel_err(y, np.asarray(expected, np.float64)) <= 1e-5
    per_row = [np.bincount(np.asarray(experts[r * 6 : r * 6 + 6]).ravel(), minlength=EXPERTS) for r in range(2)]
    np.testing.assert_array_equal(np.asarray(counts), per_row)
    assert float(dropped) == 0


def test_update_router_bias_and_load_imbalance():
    counts = jnp.array([1.0, 3.0, 2.0, 2.0])
    bias = jnp.array([0.5, 0.5, 0.0, -1.0])
    np.testing.assert_allclose(update_router_bias(bias, counts, 0.01), [0.51, 0.49, 0.0, -1.0], rtol=1e-6)
    assert float(load_imbalance(counts)) == pytest.approx(1.5)
    assert float(load_imbalance(jnp.full((4,), 7.0))) == 1.0


def test_gradients_reach_params_but_not_the_router_bias():
    moe = make(num_shared=1, n_group=4, topk_group=2)
    x = jax.random.normal(jax.random.key(5), (2, 8, EMBED))

    def loss(model):
        return jnp.mean(model(x)[0] ** 2)

    grads = nnx.jit(nnx.grad(loss))(moe)
    assert not jax.tree.leaves(nnx.state(grads, RouterBias))
    for path in (
        ("router",),
        ("experts_gate",),
        ("experts_up",),
        ("experts_down",),
        ("shared", "gate"),
        ("shared", "up"),
        ("shared", "down"),
    ):
        g = np.asarray(grads[path[0]][path[1]][...] if len(path) == 2 else grads[path[0]][...])
        assert np.all(np.isfinite(g)) and np.any(g != 0), path
    _, params, rest = nnx.split(moe, nnx.Param, ...)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert "bias" not in params and list(rest) == ["bias"] and isinstance(rest["bias"], RouterBias)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(n_group=3), "divisible by n_group=3"),
        (dict(n_group=4, topk_group=5), "topk_group=5"),
        (dict(k=9), "experts_per_token=9"),
        (dict(n_group=4, topk_group=1, k=3), "experts_per_token=3 must be in \\[1, 2\\]"),
        (dict(n_group=8, topk_group=1), "at least 2 experts per group"),
        (dict(num_shared=-1), "num_shared_experts=-1"),
        (dict(router_score="tanh"), "router_score='tanh' must be one of sigmoid, softmax"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_equals_transformers(version):
    """V3: sigmoid, biased, group-limited; V2: softmax, group_limited_greedy, weights not renormalised."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip(f"transformers.models.deepseek_{version}.modeling_deepseek_{version}")
    common = dict(
        hidden_size=EMBED,
        num_attention_heads=2,
        moe_intermediate_size=MLP,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=3,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    if version == "v3":
        hf = modeling.DeepseekV3MoE(modeling.DeepseekV3Config(norm_topk_prob=True, **common))
        moe = make(num_shared=2, n_group=4, topk_group=2, k=3, routed_scaling_factor=2.5)
        moe.bias[...] = jnp.linspace(-1.5, -0.5, EXPERTS)  # negative biased scores: the group mask value matters
    else:
        hf = modeling.DeepseekV2Moe(modeling.DeepseekV2Config(topk_method="group_limited_greedy", **common))
        moe = make(
            num_shared=2,
            n_group=4,
            topk_group=2,
            k=3,
            routed_scaling_factor=2.5,
            norm_topk_prob=False,
            router_score="softmax",
        )

    def t(v):
        return torch.from_numpy(np.array(v[...]).T.copy())

    with torch.no_grad():
        hf.gate.weight.copy_(t(moe.router))
        if version == "v3":
            hf.gate.e_score_correction_bias.copy_(torch.from_numpy(np.array(moe.bias[...])))
        hf.experts.gate_up_proj.copy_(
            torch.cat(
                [torch.from_numpy(np.array(moe.experts_gate[...])), torch.from_numpy(np.array(moe.experts_up[...]))], -1
            ).transpose(1, 2)
        )
        hf.experts.down_proj.copy_(torch.from_numpy(np.array(moe.experts_down[...])).transpose(1, 2))
        for name in ("gate", "up", "down"):
            getattr(hf.shared_experts, f"{name}_proj").weight.copy_(t(getattr(moe.shared, name)))
        x = np.array(jax.random.normal(jax.random.key(6), (2, 16, EMBED)))
        expected = hf(torch.from_numpy(x)).numpy()
    y, _ = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_gated_shared_expert_equals_qwen3_5_moe():
    """Softmax top-k renormalised, one shared expert of its own width behind sigmoid(x @ shared_expert_gate)."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    config = modeling.Qwen3_5MoeTextConfig(
        hidden_size=EMBED,
        num_experts=EXPERTS,
        num_experts_per_tok=3,
        moe_intermediate_size=MLP,
        shared_expert_intermediate_size=12,
    )
    hf = modeling.Qwen3_5MoeSparseMoeBlock(config)
    moe = make(k=3, router_score="softmax", shared_mlp_dim=12, shared_gate=True)

    def t(v):
        return torch.from_numpy(np.array(v[...]).T.copy())

    with torch.no_grad():
        hf.gate.weight.copy_(t(moe.router))
        gate_up = np.concatenate([np.array(moe.experts_gate[...]), np.array(moe.experts_up[...])], -1)
        hf.experts.gate_up_proj.copy_(torch.from_numpy(gate_up).transpose(1, 2))
        hf.experts.down_proj.copy_(torch.from_numpy(np.array(moe.experts_down[...])).transpose(1, 2))
        for name in ("gate", "up", "down"):
            getattr(hf.shared_expert, f"{name}_proj").weight.copy_(t(getattr(moe.shared, name)))
        hf.shared_expert_gate.weight.copy_(t(moe.shared_gate))
        x = np.array(jax.random.normal(jax.random.key(6), (2, 16, EMBED)))
        expected = hf(torch.from_numpy(x)).numpy()
    y, _ = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)


def test_load_balancing_loss_equals_transformers():
    """Three layers' router logits: the value and its gradient in the logits as transformers' loss (pooled over
    layers; the counts carry no gradient)."""
    torch = pytest.importorskip("torch")
    modeling = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    k = 3
    logits = np.array(jax.random.normal(jax.random.key(4), (3, 20, EXPERTS)), np.float64)

    def ours(logits):
        probabilities = jax.nn.softmax(logits, -1)
        picked = jax.nn.one_hot(jax.lax.top_k(probabilities, k)[1], EXPERTS).sum((1, 2))
        return load_balancing_loss(jax.lax.stop_gradient(picked)[:, None], probabilities.sum(1)[:, None], k)

    value, grad = jax.value_and_grad(ours)(jnp.asarray(logits, jnp.float32))
    torch_logits = torch.tensor(logits, requires_grad=True)
    expected = modeling.load_balancing_loss_func(tuple(torch_logits), EXPERTS, k)
    expected.backward()
    np.testing.assert_allclose(float(value), float(expected.detach()), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), torch_logits.grad.numpy(), rtol=1e-4, atol=1e-7)
    balanced = jnp.full((1, 1, EXPERTS), 6.0), jnp.full((1, 1, EXPERTS), 16 / EXPERTS)  # 16 tokens, k = 3
    np.testing.assert_allclose(float(load_balancing_loss(*balanced, 3)), 3.0, rtol=1e-6)


@pytest.mark.parametrize("scope", ["layer", "sequence"])
def test_load_balancing_loss_per_layer_and_sequence_equal_deepseeks(scope):
    """Two layers of three rows: the value DeepSeek's MoEGate adds per layer (seq_aux or not), summed over layers; its
    gradient in the scores is that of the same formula (f held); 1 per layer when balanced."""
    k = 2
    logits = jax.random.normal(jax.random.key(5), (2, 3, 10, EXPERTS)) * jnp.arange(1.0, 4.0)[:, None, None]
    scores = jax.nn.softmax(logits, -1)
    experts = jax.lax.top_k(scores, k)[1]
    counts = jax.nn.one_hot(experts, EXPERTS).sum((2, 3))  # [layers, rows, experts]

    def ours(scores):
        return load_balancing_loss(counts, scores.sum(2), k, scope)

    value, grad = jax.value_and_grad(ours)(scores)
    expected = deepseek_aux_loss(np.asarray(experts), np.asarray(scores, np.float64), scope == "sequence")
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    f = np.asarray(counts) / (10 * k / EXPERTS)  # d loss / d score[l, r, t, e] = f[l, r, e] / (length x rows)
    if scope == "layer":
        f = np.broadcast_to(f.sum(1, keepdims=True) / 3, f.shape)
    np.testing.assert_allclose(np.asarray(grad), np.broadcast_to(f[:, :, None] / 30, grad.shape), rtol=1e-5)
    balanced = jnp.full((2, 3, EXPERTS), 10 * k / EXPERTS), jnp.full((2, 3, EXPERTS), 10 / EXPERTS)
    np.testing.assert_allclose(float(load_balancing_loss(*balanced, k, scope)), 2.0, rtol=1e-6)
    with pytest.raises(ValueError, match="scope 'row' is unknown; available: pooled, layer, sequence"):
        load_balancing_loss(*balanced, k, "row")
