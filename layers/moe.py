"""DeepSeek-V2/V3 mixture of experts (as Hugging Face `DeepseekV3MoE` / `DeepseekV2Moe`).

Router scores are DeepSeek-V3's sigmoid, with an aux-loss-free selection bias, or DeepSeek-V2's softmax over all
experts, without one; optional group-limited routing; dropless routed experts computed with `jax.lax.ragged_dot`
over token assignments sorted by expert; optional shared experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from layers.mlp import SwiGLU
from layers.params import logical_param

# Fan-in scaled truncated normal; for expert kernels [experts, in, out] the experts axis is a batch axis.
_router_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
_expert_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=(0,))
ROUTER_SCORES = ("sigmoid", "softmax")


class RouterBias(nnx.Variable):
    """Expert-selection bias [experts]; not an `nnx.Param`, so gradients and optimizers skip it."""


def update_router_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: bias [experts] + rate * sign(mean(counts) - counts); under-loaded experts rise."""
    return (bias + rate * jnp.sign(jnp.mean(counts) - counts)).astype(bias.dtype)


def load_imbalance(counts: jax.Array) -> jax.Array:
    """max(counts) / mean(counts) of the expert loads [experts]; 1.0 is a perfect balance."""
    return jnp.max(counts) / jnp.mean(counts)


class MoE(nnx.Module):
    """Routed SwiGLU experts (top-k of `num_experts`) plus optional shared experts.

    Parameters: gate [embed, experts] (router), bias RouterBias [experts] (selection bias of sigmoid routing;
    softmax routing leaves it unused), experts_gate / experts_up
    [experts, embed, moe_mlp], experts_down [experts, moe_mlp, embed], shared SwiGLU(moe_mlp * num_shared) or None.
    Hugging Face: gate = mlp.gate.weight.T, bias = mlp.gate.e_score_correction_bias (V3),
    experts_{gate,up,down}[i] = mlp.experts.{i}.{gate,up,down}_proj.weight.T,
    shared.{gate,up,down} = mlp.shared_experts.{gate,up,down}_proj.weight.T.
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        num_experts: int,
        experts_per_token: int,
        moe_mlp_dim: int,
        num_shared_experts: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        router_score: str = "sigmoid",
        param_dtype: jnp.dtype = jnp.float32,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if router_score not in ROUTER_SCORES:
            raise ValueError(f"router_score={router_score!r} must be one of {', '.join(ROUTER_SCORES)}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"num_experts={num_experts} must be divisible by n_group={n_group} (n_group >= 1)")
        if router_score == "sigmoid" and n_group > 1 and num_experts // n_group < 2:
            raise ValueError(f"group-limited routing scores each group by its top 2 experts; num_experts={num_experts} "
                             f"/ n_group={n_group} leaves {num_experts // n_group}; use at least 2 experts per group")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        selectable = topk_group * (num_experts // n_group)  # experts in the kept groups
        if not 1 <= experts_per_token <= selectable:
            raise ValueError(f"experts_per_token={experts_per_token} must be in [1, {selectable}]: the experts of "
                             f"topk_group={topk_group} of n_group={n_group} groups of num_experts={num_experts}")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts={num_shared_experts} must be >= 0")
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.router_score = router_score
        self.dtype = dtype
        # The router's experts axis stays whole: every token's selection needs all of its scores.
        self.gate = logical_param(_router_init(rngs.params(), (embed_dim, num_experts), param_dtype), ("embed", None))
        self.bias = RouterBias(jnp.zeros((num_experts,), jnp.float32))
        in_shape, in_axes = (num_experts, embed_dim, moe_mlp_dim), ("experts", "embed", "mlp")
        self.experts_gate = logical_param(_expert_init(rngs.params(), in_shape, param_dtype), in_axes)
        self.experts_up = logical_param(_expert_init(rngs.params(), in_shape, param_dtype), in_axes)
        self.experts_down = logical_param(
            _expert_init(rngs.params(), (num_experts, moe_mlp_dim, embed_dim), param_dtype), ("experts", "mlp", "embed")
        )
        self.shared = (
            SwiGLU(embed_dim, moe_mlp_dim * num_shared_experts, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
            if num_shared_experts else None
        )

    def route(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens: [tokens, embed] -> (weights [tokens, k] float32, experts [tokens, k] int32).

        sigmoid (DeepSeek-V3): experts are chosen by sigmoid scores + bias, groups scored by the sum of their
        top 2 choice scores. softmax (DeepSeek-V2): experts are chosen by the softmax over all experts, groups
        scored by their best expert; the bias is not used. Either picks the top experts within the topk_group best
        groups; the weights are the un-biased scores of the chosen experts, renormalised if norm_topk_prob, times
        the scaling factor.
        """
        logits = jnp.dot(tokens.astype(jnp.float32), self.gate[...].astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
        if self.router_score == "softmax":
            scores = choice = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.bias[...].astype(jnp.float32)
        if self.n_group > 1:
            grouped = choice.reshape(choice.shape[0], self.n_group, -1)
            group_scores = (grouped.max(-1) if self.router_score == "softmax"
                            else jax.lax.top_k(grouped, 2)[0].sum(-1))  # [tokens, n_group]
            kept = jax.nn.one_hot(jax.lax.top_k(group_scores, self.topk_group)[1], self.n_group).sum(-2) > 0
            # Other groups' experts are excluded with -inf, as in transformers 5 and DeepSeek-V3's reference code
            # (transformers 4 filled 0.0, which picks them when every kept biased score is negative; DeepSeek-V2
            # fills 0.0 too, the same as -inf for its positive softmax scores).
            choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
        experts = jax.lax.top_k(choice, self.experts_per_token)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts

    def routed_experts(self, tokens: jax.Array, weights: jax.Array, experts: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dropless experts: tokens [tokens, embed], weights / experts [tokens, k] -> ([tokens, embed] in `dtype`,
        assignments per expert [experts] int32). Assignments are sorted by expert and run with `ragged_dot`."""
        num_tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat)
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        x = tokens[order // k].astype(self.dtype)  # [tokens * k, embed], grouped by expert
        gate = jax.lax.ragged_dot(x, self.experts_gate[...].astype(self.dtype), group_sizes)
        up = jax.lax.ragged_dot(x, self.experts_up[...].astype(self.dtype), group_sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.experts_down[...].astype(self.dtype), group_sizes)
        out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
        return unsorted.reshape(num_tokens, k, -1).sum(1).astype(self.dtype), group_sizes

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [batch, length, embed] in the residual stream's layout -> (y [batch, length, embed] in `dtype`, same
        layout, expert loads [experts] float32). The routed experts see every token of the local sequence pieces
        (GSPMD gathers them over `tensor` under scattered tensor parallelism and reduce-scatters the output); the
        shared experts are a SwiGLU with explicit collectives."""
        gathered = parallel.shard(x, ("batch", "length", "embed"))
        tokens = gathered.reshape(-1, x.shape[-1])
        weights, experts = self.route(tokens)
        y, counts = self.routed_experts(tokens, weights, experts)
        y = parallel.residual(y.reshape(x.shape))
        if self.shared is not None:
            y = y + self.shared(x)
        return y, counts.astype(jnp.float32)
