"""What Llama-style checkpoints share (Llama; Qwen2, Qwen3, Qwen3-MoE; Mistral, Mixtral): the config.json sizes, the
embedding, each layer's norms and grouped-query attention (q/k/v biases, q/k norms), the dense MLP, routed experts,
the final norm and the output head.

Hugging Face keeps q/k projections in the rotate-half layout (its conversion from Meta's checkpoints permutes
them), which is `layers.rope.apply_rope`'s default, so projections are only transposed and reshaped.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from models.hf.decoder_config import decoder_config_to_hf
from models.hf.rope import rope_from_hf
from models.hf.spec import (
    Placement,
    Tensor,
    check_required,
    check_unquantized,
    heads_in_to_hf,
    heads_out_to_hf,
    placements,
    transpose,
)

# ModelConfig fields of softmax top-k routing over routed experts alone (Qwen3-MoE, Mixtral, GPT-OSS): no shared
# expert, no expert groups, no scaling of the routed output
SOFTMAX_EXPERTS = {"router_score": "softmax", "num_shared_experts": 0, "n_group": 1, "routed_scaling_factor": 1.0}


def config_from_hf(hf: dict, family: str, architecture: str, required: dict, rope_types, **fields) -> ModelConfig:
    """ModelConfig of a config.json whose left-out keys the caller filled with its config class's defaults:
    `required` keys checked, quantized checkpoints refused; `fields` are the family's own ModelConfig fields (the
    rope's too when `rope_types` is None). A head_dim of None is hidden_size / num_attention_heads, as transformers
    reads it."""
    check_required(hf, required, f"{architecture}: config.json has")
    check_unquantized(hf, architecture)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        **(rope_from_hf(hf, architecture, rope_types) if rope_types else {}),
        **fields,
    )


def config_to_hf(config: ModelConfig, architecture: str, model_type: str, rope_types) -> dict:
    """The config.json keys of `config_from_hf`'s sizes and rope (decoder_config_to_hf's and the key/value heads)."""
    return {
        **decoder_config_to_hf(config, architecture, model_type, rope_types),
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
    }


def heads_in(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """q/k/v_proj weight [heads * head_dim, embed] -> kernel [embed, heads, head_dim]."""
    return weight.T.reshape(weight.shape[1], -1, config.head_dim)


def heads_out(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """o_proj weight [embed, heads * head_dim] -> kernel [heads, head_dim, embed]."""
    return weight.T.reshape(-1, config.head_dim, weight.shape[0])


def bias_in(bias: np.ndarray, config: ModelConfig) -> np.ndarray:
    """q/k/v_proj bias [heads * head_dim] -> [heads, head_dim]."""
    return bias.reshape(-1, config.head_dim)


def bias_out(bias: np.ndarray, config: ModelConfig) -> np.ndarray:
    """[heads, head_dim] -> q/k/v_proj bias [heads * head_dim]."""
    del config
    return bias.reshape(-1)


def projections(config: ModelConfig, block: Placement) -> list[Tensor]:
    """The grouped-query attention (self_attn.*) of the layers in our stacked `block`: q/k/v/o projections, q/k/v
    biases when qkv_bias, q/k norms when qk_norm."""
    attn, ours, slices = "model.layers.{layer}.self_attn.", (*block.path, "attn"), block.slices
    table = [Tensor(attn + f"{p}_proj.weight", (*ours, p), heads_in, heads_in_to_hf, slices) for p in "qkv"]
    if config.qkv_bias:
        table += [
            Tensor(attn + f"{p}_proj.bias", (*ours, f"{p}_bias", "bias"), bias_in, bias_out, slices) for p in "qkv"
        ]
    if config.qk_norm:
        table += [Tensor(attn + f"{p}_norm.weight", (*ours, f"{p}_norm", "scale"), slices=slices) for p in "qk"]
    return [*table, Tensor(attn + "o_proj.weight", (*ours, "o"), heads_out, heads_out_to_hf, slices)]


def norms(block: Placement, names: dict[str, str]) -> list[Tensor]:
    """The layer norms `names` ({Hugging Face's <name>.weight: our norm}) of the layers in our stacked `block`."""
    return [
        Tensor(f"model.layers.{{layer}}.{hf}.weight", (*block.path, ours, "scale"), slices=block.slices)
        for hf, ours in names.items()
    ]


def attention(config: ModelConfig, block: Placement) -> list[Tensor]:
    """The pre-norm block's norms (input_layernorm before attention, post_attention_layernorm before the
    feed-forward) and grouped-query attention of the layers in our stacked `block`."""
    return [
        *norms(block, {"input_layernorm": "attn_norm"}),
        *projections(config, block),
        *norms(block, {"post_attention_layernorm": "mlp_norm"}),
    ]


def mlp(block: Placement) -> list[Tensor]:
    """The dense SwiGLU (mlp.{gate,up,down}_proj) of the layers in our stacked `block`."""
    slices, ours = block.slices, (*block.path, "mlp")
    return [
        Tensor("model.layers.{layer}." + f"mlp.{p}_proj.weight", (*ours, p), transpose, transpose, slices)
        for p in ("gate", "up", "down")
    ]


def experts(module: str, names: dict[str, str], block: Placement) -> list[Tensor]:
    """The router (`module`.gate.weight) and routed experts (`module`.experts.{e}.<names[p]>.weight for our p in
    gate / up / down) of the MoE layers in our stacked `block`."""
    prefix, moe = "model.layers.{layer}." + module + ".", (*block.path, "moe")
    return [
        Tensor(prefix + "gate.weight", (*moe, "router"), transpose, transpose, block.slices),
        *(
            Tensor(
                prefix + "experts.{expert}." + f"{names[p]}.weight",
                (*moe, f"experts_{p}"),
                transpose,
                transpose,
                block.expert_slices,
            )
            for p in ("gate", "up", "down")
        ),
    ]


def layers(config: ModelConfig, stack: str, feed_forward) -> list[Tensor]:
    """Attention and `feed_forward(block) -> [Tensor]` of every stacked block of our `stack` (spec.STACKS)."""
    return [tensor for block in placements(config, stack) for tensor in attention(config, block) + feed_forward(block)]


def router_bias(config: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """Our router bias (which softmax routing leaves at zero and the checkpoints do not hold) in each MoE block."""
    return tuple((*block.path, "moe", "bias") for block in placements(config, "moe_layers"))


def checkpoint(config: ModelConfig, layers: list[Tensor]) -> list[Tensor]:
    """The whole table: embedding, `layers`, final norm, and lm_head.weight unless the embeddings are tied."""
    table = [Tensor("model.embed_tokens.weight", ("embed", "embedding")), *layers]
    table.append(Tensor("model.norm.weight", ("final_norm", "scale")))
    if not config.tie_embeddings:
        table.append(Tensor("lm_head.weight", ("head", "kernel"), transpose, transpose))
    return table
