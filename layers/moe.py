"""DeepSeek-V2/V3 mixture of experts (as Hugging Face `DeepseekV3MoE` / `DeepseekV2Moe`); with softmax scores,
one group and no shared experts it is Qwen3-MoE's and Mixtral's (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`).

Router scores are DeepSeek-V3's sigmoid, with an aux-loss-free selection bias, or DeepSeek-V2's softmax over all
experts, without one; optional group-limited routing; an optional learned bias of the router's logits (GPT-OSS,
whose softmax over the top-k logits is the renormalised softmax over all); routed SwiGLU experts, or GPT-OSS's
clamped SwiGLU experts with biases (layers/clamped_swiglu.py), run where `parallel.routed_experts` sends the tokens
(dropless on one device; under expert parallelism a capacity per expert that the installed Parallelism sets); optional
shared experts, their output scaled by a sigmoid gate in Qwen3-Next and Qwen3.5-MoE (`shared_gate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from layers.clamped_swiglu import expert_clamped_swiglu
from layers.mlp import SwiGLU
from layers.params import logical_param

# Fan-in scaled truncated normal; for expert matrices [experts, in, out] the experts axis is a batch axis.
_router_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
_expert_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=(0,))
ROUTER_SCORES = ("sigmoid", "softmax")
EXPERT_MLPS = ("swiglu", "clamped_swiglu")  # the routed experts' feed-forward: SwiGLU, or GPT-OSS's clamped one


class RouterBias(nnx.Variable):
    """Expert-selection bias [experts]; not an `nnx.Param`, so gradients and optimizers skip it."""


def update_router_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: bias [experts] + rate * sign(mean(counts) - counts); under-loaded experts rise."""
    return (bias + rate * jnp.sign(jnp.mean(counts) - counts)).astype(bias.dtype)


def expert_swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, group_sizes=None) -> jax.Array:
    """SwiGLU experts, matrices gate / up [experts, embed, mlp], down [experts, mlp, embed]. Batched: x [experts,
    rows, embed] -> [experts, rows, embed]; grouped: x [rows, embed] sorted by expert with group_sizes [experts]
    rows each -> [rows, embed] (rows past the groups are padding)."""
    if group_sizes is None:
        hidden = jax.nn.silu(jnp.einsum("erd,edf->erf", x, gate)) * jnp.einsum("erd,edf->erf", x, up)
        return jnp.einsum("erf,efd->erd", hidden, down)
    hidden = jax.nn.silu(parallel.ragged_dot(x, gate, group_sizes)) * parallel.ragged_dot(x, up, group_sizes)
    return parallel.ragged_dot(hidden, down, group_sizes)


AUX_LOSS_SCOPES = ("pooled", "layer", "sequence")


def load_balancing_loss(counts: jax.Array, probabilities: jax.Array, k: int, scope: str = "pooled") -> jax.Array:
    """Switch Transformer's load-balancing loss E x sum_e f_e x P_e, f_e the share of routed assignments and P_e the
    mean router probability of expert e over a set of tokens, 1 per set when balanced. counts / probabilities: per
    MoE layer, row and expert, summed over the row's tokens [layers, rows, experts] (a row holds counts.sum(-1) / k
    tokens) -> [] float32; gradients flow through probabilities. The sets, by `scope`:
    - pooled: every layer's tokens together, times k (transformers' load_balancing_loss_func; k when balanced);
    - layer: each layer's tokens, summed over layers (DeepSeek's aux_loss_alpha with seq_aux false);
    - sequence: each layer's tokens of each row, the mean over rows summed over layers (DeepSeek's seq_aux)."""
    if scope not in AUX_LOSS_SCOPES:
        raise ValueError(f"load-balancing loss scope {scope!r} is unknown; available: {', '.join(AUX_LOSS_SCOPES)}")
    experts = counts.shape[-1]
    if scope == "pooled":
        counts, probabilities = counts.sum((0, 1))[None, None], probabilities.sum((0, 1))[None, None]
    elif scope == "layer":
        counts, probabilities = counts.sum(1, keepdims=True), probabilities.sum(1, keepdims=True)
    tokens = jnp.maximum(counts.sum(-1) / k, 1.0)  # [sets of layers, sets of rows]
    per_set = experts / k * jnp.sum(counts * probabilities, -1) / (tokens * tokens)
    return jnp.sum(jnp.mean(per_set, -1)) * (k if scope == "pooled" else 1)


def load_imbalance(counts: jax.Array) -> jax.Array:
    """max(counts) / mean(counts) of the expert loads [experts]; 1.0 is a perfect balance."""
    return jnp.max(counts) / jnp.mean(counts)


class MoE(nnx.Module):
    """Routed SwiGLU experts (top-k of `num_experts`) plus optional shared experts.

    Parameters: router [embed, experts], bias RouterBias [experts] (selection bias of sigmoid routing;
    softmax routing leaves it unused), with `router_logit_bias` router_bias [experts] (added to the router's logits),
    experts_gate / experts_up [experts, embed, moe_mlp], experts_down [experts, moe_mlp, embed], shared
    SwiGLU(moe_mlp * num_shared) or None. With expert_mlp "clamped_swiglu" the experts are experts_gate_up [experts,
    embed, 2 * moe_mlp] (gate and up interleaved), experts_gate_up_bias [experts, 2 * moe_mlp], experts_down and
    experts_down_bias [experts, embed] (GPT-OSS: mlp.router.weight.T / .bias and mlp.experts.gate_up_proj,
    gate_up_proj_bias, down_proj, down_proj_bias as they are). The shared experts are one SwiGLU of `shared_mlp_dim`
    (0: moe_mlp x num_shared); with `shared_gate` their output is scaled by sigmoid(x @ shared_gate [embed, 1])
    (mlp.shared_expert_gate.weight.T).
    Hugging Face: router = mlp.gate.weight.T, bias = mlp.gate.e_score_correction_bias (V3),
    experts_{gate,up,down}[i] = mlp.experts.{i}.{gate,up,down}_proj.weight.T,
    shared.{gate,up,down} = mlp.shared_experts.{gate,up,down}_proj.weight.T (Mixtral: block_sparse_moe.gate and
    block_sparse_moe.experts.{i}.w1 / w3 / w2 for gate / up / down).
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
        router_logit_bias: bool = False,
        expert_mlp: str = "swiglu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_mlp_dim: int = 0,
        shared_gate: bool = False,
        param_dtype: jnp.dtype = jnp.float32,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if router_score not in ROUTER_SCORES:
            raise ValueError(f"router_score={router_score!r} must be one of {', '.join(ROUTER_SCORES)}")
        if expert_mlp not in EXPERT_MLPS:
            raise ValueError(f"expert_mlp={expert_mlp!r} must be one of {', '.join(EXPERT_MLPS)}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"num_experts={num_experts} must be divisible by n_group={n_group} (n_group >= 1)")
        if router_score == "sigmoid" and n_group > 1 and num_experts // n_group < 2:
            raise ValueError(
                f"group-limited routing scores each group by its top 2 experts; num_experts={num_experts} "
                f"/ n_group={n_group} leaves {num_experts // n_group}; use at least 2 experts per group"
            )
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        selectable = topk_group * (num_experts // n_group)  # experts in the kept groups
        if not 1 <= experts_per_token <= selectable:
            raise ValueError(
                f"experts_per_token={experts_per_token} must be in [1, {selectable}]: the experts of "
                f"topk_group={topk_group} of n_group={n_group} groups of num_experts={num_experts}"
            )
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
        self.router = logical_param(_router_init(rngs.params(), (embed_dim, num_experts), param_dtype), ("embed", None))
        self.bias = RouterBias(jnp.zeros((num_experts,), jnp.float32))
        self.router_bias = logical_param(jnp.zeros((num_experts,), param_dtype), (None,)) if router_logit_bias else None
        self.expert_mlp = expert_mlp
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        in_axes = ("experts", "embed", "mlp")
        if expert_mlp == "clamped_swiglu":
            self.experts_gate_up = logical_param(
                _expert_init(rngs.params(), (num_experts, embed_dim, 2 * moe_mlp_dim), param_dtype), in_axes
            )
            self.experts_gate_up_bias = logical_param(
                jnp.zeros((num_experts, 2 * moe_mlp_dim), param_dtype), ("experts", "mlp")
            )
            self.experts_down_bias = logical_param(
                jnp.zeros((num_experts, embed_dim), param_dtype), ("experts", "embed")
            )
        else:
            in_shape = (num_experts, embed_dim, moe_mlp_dim)
            self.experts_gate = logical_param(_expert_init(rngs.params(), in_shape, param_dtype), in_axes)
            self.experts_up = logical_param(_expert_init(rngs.params(), in_shape, param_dtype), in_axes)
        self.experts_down = logical_param(
            _expert_init(rngs.params(), (num_experts, moe_mlp_dim, embed_dim), param_dtype), ("experts", "mlp", "embed")
        )
        self.shared = (
            SwiGLU(
                embed_dim,
                shared_mlp_dim or moe_mlp_dim * num_shared_experts,
                param_dtype=param_dtype,
                dtype=dtype,
                rngs=rngs,
            )
            if num_shared_experts
            else None
        )
        self.shared_gate = (
            logical_param(_router_init(rngs.params(), (embed_dim, 1), param_dtype), ("embed", None))
            if num_shared_experts and shared_gate
            else None
        )

    def route(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens: [tokens, embed] -> (weights [tokens, k] float32, experts [tokens, k] int32), see `_route`."""
        return self._route(tokens, *self._route_params())[:2]

    def _route_params(self) -> tuple[jax.Array, ...]:
        """(router, selection bias, and the router's logit bias when there is one)."""
        logit_bias = () if self.router_bias is None else (self.router_bias[...],)
        return (self.router[...], self.bias[...], *logit_bias)

    def _route(
        self, tokens: jax.Array, router: jax.Array, bias: jax.Array, logit_bias: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """tokens: [tokens, embed], router [embed, experts], bias [experts], logit_bias [experts] or None ->
        (weights [tokens, k] float32, experts [tokens, k] int32, probabilities [tokens, experts] float32).

        sigmoid (DeepSeek-V3): experts are chosen by sigmoid scores + bias, groups scored by the sum of their
        top 2 choice scores. softmax (DeepSeek-V2): experts are chosen by the softmax over all experts, groups
        scored by their best expert; the bias is not used. Either picks the top experts within the topk_group best
        groups; the weights are the un-biased scores of the chosen experts, renormalised if norm_topk_prob, times
        the scaling factor. The probabilities (what a load-balancing loss reads) are the softmax over all experts, or
        the sigmoid scores normalised to sum to 1.
        """
        logits = jnp.dot(tokens.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        if logit_bias is not None:
            logits = logits + logit_bias.astype(jnp.float32)
        if self.router_score == "softmax":
            scores = choice = probabilities = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
            choice = scores + bias.astype(jnp.float32)
            probabilities = scores / scores.sum(-1, keepdims=True)
        if self.n_group > 1:
            grouped = choice.reshape(choice.shape[0], self.n_group, -1)
            group_scores = (
                grouped.max(-1) if self.router_score == "softmax" else jax.lax.top_k(grouped, 2)[0].sum(-1)
            )  # [tokens, n_group]
            kept = jax.nn.one_hot(jax.lax.top_k(group_scores, self.topk_group)[1], self.n_group).sum(-2) > 0
            # Other groups' experts are excluded with -inf, as in transformers 5 and DeepSeek-V3's reference code
            # (transformers 4 filled 0.0, which picks them when every kept biased score is negative; DeepSeek-V2
            # fills 0.0 too, the same as -inf for its positive softmax scores).
            choice = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)
        experts = jax.lax.top_k(choice, self.experts_per_token)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts, probabilities

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """x: [batch, length, embed] in the residual stream's layout -> (y [batch, length, embed] in `dtype`, same
        layout, {"counts": routed assignments [batch, experts], "dropped": assignments past the dispatch capacity [],
        "probabilities": the router's probabilities [batch, experts]}, float32, summed over each row's tokens (counts,
        probabilities) or every token (dropped)). The routed experts go through `parallel.routed_experts` (tokens
        move to the experts' devices); the shared experts are a SwiGLU with explicit collectives."""
        routed = parallel.routed_experts(
            x.astype(self.dtype),
            self._route,
            self._route_params(),
            self._ffn(),
            tuple(m[...].astype(self.dtype) for m in self._expert_arrays()),
            num_experts=self.num_experts,
        )
        y = routed.y
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                gate = jnp.einsum("bld,dg->blg", x.astype(self.dtype), self.shared_gate[...].astype(self.dtype))
                shared = jax.nn.sigmoid(gate) * shared
            y = y + shared
        return y, {"counts": routed.counts, "dropped": routed.dropped, "probabilities": routed.probabilities}

    def _ffn(self):
        """The routed experts' feed-forward (rows, *expert arrays, group_sizes=None) -> rows."""
        if self.expert_mlp == "clamped_swiglu":
            return functools.partial(expert_clamped_swiglu, alpha=self.swiglu_alpha, limit=self.swiglu_limit)
        return expert_swiglu

    def _expert_arrays(self) -> tuple[nnx.Param, ...]:
        """The routed experts' parameters [experts, ...], in the order `_ffn()` takes them."""
        if self.expert_mlp == "clamped_swiglu":
            return self.experts_gate_up, self.experts_gate_up_bias, self.experts_down, self.experts_down_bias
        return self.experts_gate, self.experts_up, self.experts_down
