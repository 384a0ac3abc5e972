"""Hugging Face `DeepseekV3ForCausalLM` and `DeepseekV2ForCausalLM` <-> our `deepseek` family.

DeepSeek-V3 routes with sigmoid scores, the selection bias `mlp.gate.e_score_correction_bias` and group-limited
top-k (router_score sigmoid). DeepSeek-V2 routes with a softmax over all experts and no bias (router_score softmax,
router_bias_rate 0; our zero router bias is not stored): topk_method greedy is plain top-k (n_group 1),
group_limited_greedy keeps the topk_group groups holding the best experts. transformers' DeepseekV2 never
renormalises the chosen weights while DeepSeek's own code does when norm_topk_prob is true, so a V2 config.json
must have norm_topk_prob false. A V2 trains with the load-balancing loss DeepSeek's code adds: aux_loss_alpha per MoE
layer, over each sequence (row) when seq_aux, else over the batch (router_aux_loss_scope sequence / layer); V3's
(sigmoid, the router bias balancing) is not read. Export picks the architecture by router_score.

Hugging Face layer i < first_k_dense_replace is slice i of `dense_layers`, layer first_k_dense_replace + j slice j
of `moe_layers`. Checkpoints hold the routed experts one by one (`mlp.experts.{e}.{gate,up,down}_proj.weight`;
transformers 5 fuses them when loading and splits them again when saving); each is slice [j, e] of our stacked
expert kernels. DeepSeek checkpoints lay the rotary columns of q and kv_a out in interleaved pairs, as our MLA
rotates them (DeepSeek-V2 always); a V3 checkpoint with rope_interleave false (pairs i, i + rope / 2) has them
reordered on reading, and exports are always interleaved.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from models.hf.decoder_config import decoder_config_to_hf
from models.hf.rope import rope_from_hf
from models.hf.spec import (
    Family,
    Tensor,
    aux_loss_coef,
    check_required,
    check_unquantized,
    dense_layers,
    heads_in_to_hf,
    heads_out_to_hf,
    moe_experts,
    moe_layers,
    same,
    transpose,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"
V2_ARCHITECTURE = "DeepseekV2ForCausalLM"
ROPE_TYPES = ("default", "yarn")
# config.json keys whose other values our model cannot represent -> the value it needs (written on export)
REQUIRED = {"hidden_act": "silu", "attention_bias": False}
V2_REQUIRED = {**REQUIRED, "mlp_bias": False, "norm_topk_prob": False}
# keys only DeepSeek's own modelling code reads (transformers ignores them) -> the value our routing computes
DEEPSEEK_REQUIRED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
V2_DEEPSEEK_REQUIRED = {"scoring_func": "softmax", "moe_layer_freq": 1}
# DeepSeek-V2 topk_method -> whether it routes within groups (n_group, topk_group)
V2_TOPK_METHODS = {"greedy": False, "group_limited_greedy": True}
SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
# DeepseekV3Config's / DeepseekV2Config's values for the other keys a config.json may leave out
DEFAULTS = {
    "q_lora_rank": 1536,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
}
# (aux_loss_alpha and seq_aux: DeepSeek's own DeepseekV2Config's, which transformers' lacks)
V2_DEFAULTS = {
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "q_lora_rank": 1536,
    "n_shared_experts": 2,
    "first_k_dense_replace": 0,
    "n_group": None,
    "topk_group": None,
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
BIAS = ("moe_layers", "moe", "bias")  # our router bias: DeepSeek-V3's selection bias, absent from DeepSeek-V2


def _check(hf: dict, architecture: str, required: dict) -> None:
    """ValueError for a config.json our model cannot represent, naming the key and the value it needs."""
    check_required(hf, required, f"{architecture}: config.json has")
    check_unquantized(hf, architecture)
    missing = [key for key in SIZES if hf.get(key) is None]
    if missing:
        raise ValueError(f"{architecture}: config.json lacks {', '.join(missing)}")


def _model_config(hf: dict, architecture: str, **routing) -> ModelConfig:
    """ModelConfig of a checked config.json with its defaults filled in; `routing` gives the router's fields."""
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    return ModelConfig(
        family="deepseek",
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        q_lora_rank=hf["q_lora_rank"] or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        num_experts=hf["n_routed_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        moe_mlp_dim=hf["moe_intermediate_size"],
        num_shared_experts=hf["n_shared_experts"] or 0,
        first_dense_layers=min(hf["first_k_dense_replace"] or 0, layers),
        routed_scaling_factor=float(hf["routed_scaling_factor"]),
        **routing,
        **rope_from_hf(hf, architecture, ROPE_TYPES),
    )


def config_from_hf(hf: dict, architecture: str = ARCHITECTURE) -> ModelConfig:
    """config.json of a DeepseekV3ForCausalLM (or an `architecture` that routes and attends as it does) ->
    ModelConfig (runtime fields left at their defaults)."""
    _check(hf, architecture, {**REQUIRED, **DEEPSEEK_REQUIRED})
    hf = {**DEFAULTS, **hf}
    return _model_config(
        hf,
        architecture,
        n_group=hf["n_group"] or 1,
        topk_group=hf["topk_group"] or 1,
        norm_topk_prob=bool(hf["norm_topk_prob"]),
    )


def v2_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a DeepseekV2ForCausalLM -> ModelConfig with a softmax router and a frozen (zero) router
    bias (runtime fields left at their defaults)."""
    _check(hf, V2_ARCHITECTURE, {**V2_REQUIRED, **V2_DEEPSEEK_REQUIRED})
    hf = {**V2_DEFAULTS, **hf}
    if hf["topk_method"] not in V2_TOPK_METHODS:
        raise ValueError(
            f"{V2_ARCHITECTURE}: config.json has topk_method={hf['topk_method']!r}; supported "
            f"topk methods: {', '.join(V2_TOPK_METHODS)}"
        )
    grouped = V2_TOPK_METHODS[hf["topk_method"]]
    return _model_config(
        hf,
        V2_ARCHITECTURE,
        n_group=(grouped and hf["n_group"]) or 1,
        topk_group=(grouped and hf["topk_group"]) or 1,
        norm_topk_prob=False,
        router_score="softmax",
        router_bias_rate=0.0,
        router_aux_loss_coef=float(hf["aux_loss_alpha"]),
        router_aux_loss_scope="sequence" if hf["seq_aux"] else "layer",
    )


def is_v3(config: ModelConfig) -> bool:
    """Whether `config` routes as DeepSeek-V3 (sigmoid scores) and attends densely."""
    return config.router_score == "sigmoid" and not config.index_topk


def is_v2(config: ModelConfig) -> bool:
    """Whether `config` routes as DeepSeek-V2 (softmax scores) and attends densely."""
    return config.router_score == "softmax" and not config.index_topk


def hf_config(config: ModelConfig, architecture: str, model_type: str) -> dict:
    """The config.json keys both architectures share: decoder_config_to_hf's, latent attention and experts."""
    return {
        **decoder_config_to_hf(config, architecture, model_type, ROPE_TYPES),
        "num_key_value_heads": config.num_heads,
        "q_lora_rank": config.q_lora_rank or None,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "moe_intermediate_size": config.moe_mlp_dim,
        "n_shared_experts": config.num_shared_experts,
        "first_k_dense_replace": config.num_dense_layers,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
    }


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig with a sigmoid router -> config.json of a DeepseekV3ForCausalLM (no multi-token-prediction
    layers)."""
    if not is_v3(config):
        raise ValueError(
            f"{ARCHITECTURE}: model.router_score={config.router_score!r}, model.index_topk={config.index_topk}; "
            f"DeepSeek-V3 routes with 'sigmoid' and attends densely"
        )
    return {
        **hf_config(config, ARCHITECTURE, "deepseek_v3"),
        "norm_topk_prob": config.norm_topk_prob,
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
        **REQUIRED,
    }


def v2_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig with a softmax router and norm_topk_prob false -> config.json of a DeepseekV2ForCausalLM;
    topk_method greedy when n_group is 1, else group_limited_greedy."""
    if not is_v2(config) or config.norm_topk_prob:
        raise ValueError(
            f"{V2_ARCHITECTURE}: model.router_score={config.router_score!r}, model.norm_topk_prob="
            f"{config.norm_topk_prob}; DeepSeek-V2 routes with 'softmax' and norm_topk_prob false"
        )
    topk_method = "group_limited_greedy" if config.n_group > 1 else "greedy"
    return {
        **hf_config(config, V2_ARCHITECTURE, "deepseek_v2"),
        "topk_method": topk_method,
        "aux_loss_alpha": aux_loss_coef(config, V2_ARCHITECTURE, ("sequence", "layer")),
        "seq_aux": config.router_aux_loss_scope != "layer",
        **V2_REQUIRED,
        **V2_DEEPSEEK_REQUIRED,
    }


def heads_in(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """q/q_b/kv_b_proj weight [heads * head_dim, in] -> kernel [in, heads, head_dim]."""
    return weight.T.reshape(weight.shape[1], config.num_heads, -1)


def heads_out(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """o_proj weight [embed, heads * v_head_dim] -> kernel [heads, v_head_dim, embed]."""
    return weight.T.reshape(config.num_heads, -1, weight.shape[0])


def _interleaving(rope: int) -> np.ndarray:
    """Column order taking rotary pairs (i, i + rope / 2) to (2i, 2i + 1): [0, rope / 2, 1, rope / 2 + 1, ...]."""
    return np.arange(rope).reshape(2, -1).T.reshape(-1)


def _reorder_rope(array: np.ndarray, rope: int, order: np.ndarray) -> np.ndarray:
    return np.concatenate([array[..., :-rope], array[..., -rope:][..., order]], axis=-1)


def rope_to_interleaved(kernel: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Kernel [..., out] whose last qk_rope_head_dim outputs are rotary columns paired (i, i + rope / 2) -> the
    same kernel with them paired (2i, 2i + 1)."""
    rope = config.qk_rope_head_dim
    return _reorder_rope(kernel, rope, _interleaving(rope))


def rope_to_half(kernel: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Inverse of rope_to_interleaved."""
    rope = config.qk_rope_head_dim
    return _reorder_rope(kernel, rope, np.argsort(_interleaving(rope)))


def _then(first, second):
    """The transform `second(first(array))`."""
    return lambda array, config: second(first(array, config), config)


def _attention(stack: str, slices, config: ModelConfig, interleaved: bool) -> list[Tensor]:
    """Norms and latent attention of the layers of `stack`; rotary columns reordered unless `interleaved`."""
    rope_in, rope_out = (same, same) if interleaved else (rope_to_interleaved, rope_to_half)
    layer, attn = "model.layers.{layer}.", "model.layers.{layer}.self_attn."
    ours = (stack, "attn")
    q_in, q_out = _then(heads_in, rope_in), _then(rope_out, heads_in_to_hf)
    if config.q_lora_rank:
        query = [
            Tensor(attn + "q_a_proj.weight", (*ours, "q_a"), transpose, transpose, slices),
            Tensor(attn + "q_a_layernorm.weight", (*ours, "q_a_norm", "scale"), slices=slices),
            Tensor(attn + "q_b_proj.weight", (*ours, "q_b"), q_in, q_out, slices),
        ]
    else:
        query = [Tensor(attn + "q_proj.weight", (*ours, "q"), q_in, q_out, slices)]
    return [
        Tensor(layer + "input_layernorm.weight", (stack, "attn_norm", "scale"), slices=slices),
        *query,
        Tensor(
            attn + "kv_a_proj_with_mqa.weight",
            (*ours, "kv_a"),
            _then(transpose, rope_in),
            _then(rope_out, transpose),
            slices,
        ),
        Tensor(attn + "kv_a_layernorm.weight", (*ours, "kv_a_norm", "scale"), slices=slices),
        Tensor(attn + "kv_b_proj.weight", (*ours, "kv_b"), heads_in, heads_in_to_hf, slices),
        Tensor(attn + "o_proj.weight", (*ours, "o"), heads_out, heads_out_to_hf, slices),
        Tensor(layer + "post_attention_layernorm.weight", (stack, "mlp_norm", "scale"), slices=slices),
    ]


def _experts(config: ModelConfig, selection_bias: bool) -> list[Tensor]:
    """Router, selection bias (if `selection_bias`), routed and shared experts of the MoE stack."""
    mlp = "model.layers.{layer}.mlp."
    table = [Tensor(mlp + "gate.weight", ("moe_layers", "moe", "router"), transpose, transpose, moe_layers)]
    if selection_bias:
        table.append(Tensor(mlp + "gate.e_score_correction_bias", BIAS, slices=moe_layers))
    table += [
        Tensor(
            mlp + "experts.{expert}." + f"{name}_proj.weight",
            ("moe_layers", "moe", f"experts_{name}"),
            transpose,
            transpose,
            moe_experts,
        )
        for name in ("gate", "up", "down")
    ]
    if config.num_shared_experts:
        table += [
            Tensor(
                mlp + f"shared_experts.{name}_proj.weight",
                ("moe_layers", "moe", "shared", name),
                transpose,
                transpose,
                moe_layers,
            )
            for name in ("gate", "up", "down")
        ]
    return table


def table(config: ModelConfig, interleaved: bool, selection_bias: bool, indexer=None) -> list[Tensor]:
    """Every tensor of a DeepSeek checkpoint; `indexer(stack, slices)`: each stack's sparse-attention indexer
    tensors (DeepSeek-V3.2), after its attention's."""
    more = indexer or (lambda stack, slices: [])
    found = [Tensor("model.embed_tokens.weight", ("embed", "embedding"))]
    if config.num_dense_layers:
        found += _attention("dense_layers", dense_layers, config, interleaved) + more("dense_layers", dense_layers)
        found += [
            Tensor(
                "model.layers.{layer}." + f"mlp.{name}_proj.weight",
                ("dense_layers", "mlp", name),
                transpose,
                transpose,
                dense_layers,
            )
            for name in ("gate", "up", "down")
        ]
    if config.num_moe_layers:
        found += _attention("moe_layers", moe_layers, config, interleaved) + more("moe_layers", moe_layers)
        found += _experts(config, selection_bias)
    found.append(Tensor("model.norm.weight", ("final_norm", "scale")))
    if not config.tie_embeddings:
        found.append(Tensor("lm_head.weight", ("head", "kernel"), transpose, transpose))
    return found


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a DeepseekV3ForCausalLM checkpoint as written (interleaved rotary columns);
    lm_head.weight only when embeddings are untied, shared experts only when there are some."""
    return table(config, interleaved=True, selection_bias=True)


def read_tensors(config: ModelConfig, hf: dict) -> list[Tensor]:
    """The tensors of a checkpoint with config.json `hf`, whose rope_interleave chooses the rotary column order."""
    return table(config, interleaved=bool(hf.get("rope_interleave", DEFAULTS["rope_interleave"])), selection_bias=True)


def v2_tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a DeepseekV2ForCausalLM checkpoint: DeepSeek-V3's without the selection bias."""
    return table(config, interleaved=True, selection_bias=False)


def v2_zeros(config: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """Our router bias, which DeepSeek-V2 checkpoints do not hold (when there are MoE layers)."""
    return (BIAS,) if config.num_moe_layers else ()


FAMILY = Family(ARCHITECTURE, "deepseek", config_from_hf, config_to_hf, tensors, read_tensors, exports=is_v3)
V2_FAMILY = Family(
    V2_ARCHITECTURE, "deepseek", v2_config_from_hf, v2_config_to_hf, v2_tensors, exports=is_v2, zeros=v2_zeros
)
