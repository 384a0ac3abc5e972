"""What a model is (`ModelConfig`, the fields of a Hugging Face config.json) and how it computes
(`ComputeConfig`: dtype, remat policy, loss chunk; free to change between restarts of a run).

`check_model` raises `ConfigError` naming the key, the value and what is allowed; the run config
(train/config/validate.py) calls it before anything compiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from layers.rope import RopeScalingConfig, stretch_scaling

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
LAYER_TYPES = (FULL, SLIDING, LINEAR)  # Hugging Face's layer_types names (linear: Gated DeltaNet)


class ConfigError(ValueError):
    """A configuration key has a value that is not allowed."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture. Features are chosen by these fields, never by a model's name."""

    # llama | qwen2 | qwen3 | mistral | qwen3_moe | mixtral | gemma3 | gpt_oss | qwen3_5 | qwen3_5_moe | qwen3_next |
    # deepseek: the Hugging Face family, which names the tensors an import / export maps
    family: str = "llama"
    vocab_size: int = 512  # token ids the embedding and head cover (at least the tokenizer's vocabulary)
    embed_dim: int = 256  # hidden_size: the residual stream's width
    num_layers: int = 4  # num_hidden_layers: the blocks
    num_heads: int = 4  # num_attention_heads: query heads
    num_kv_heads: int = 4  # num_key_value_heads: key / value heads (grouped-query attention when fewer)
    head_dim: int = 64  # each attention head's width
    mlp_dim: int = 768  # intermediate_size: the dense (SwiGLU / GeGLU) MLP's hidden width
    norm_eps: float = 1e-5  # rms_norm_eps: the RMSNorm epsilon
    rope_theta: float = 10000.0  # the rotary embedding's base
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # context extension of the rope
    # positions the model covers, Hugging Face's max_position_embeddings (an import's comes from its config.json);
    # 0 = not stated (a yarn rope then covers factor x original_max_position_embeddings)
    max_position_embeddings: int = 0
    # positions to extend the model to, its rope scaling stretched from its own when it covers fewer; 0 = keep its
    # rope (see extend_context)
    context_length: int = 0
    tie_embeddings: bool = False  # tie_word_embeddings: the head is the embedding table
    param_dtype: str = "float32"  # float32 | bfloat16: the parameters' (and AdamW's moments') dtype
    # Grouped-query attention (every family but deepseek; Hugging Face names in comments)
    qkv_bias: bool = False  # q/k/v_proj bias (Qwen2; no o_proj bias, unlike Llama's attention_bias)
    qk_norm: bool = False  # q_norm / k_norm (Qwen3): RMSNorm over each head's head_dim of q and k before rope
    # sliding_window: a sliding_attention layer's query at i sees keys i - W < j <= i; 0 = no window
    sliding_window: int = 0
    # layer_types: each layer's attention (LAYER_TYPES); () = every layer sliding when sliding_window > 0, else full
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float = 0.0  # rope_local_base_freq (Gemma 3): sliding layers' unscaled rope; 0 = as full ones
    query_pre_attn_scalar: int = 0  # query_pre_attn_scalar (Gemma): softmax scale its ** -0.5; 0 = head_dim's
    # Multi-head latent attention (deepseek; Hugging Face names in comments)
    q_lora_rank: int = 0  # q_lora_rank; 0 = full-rank query projection
    kv_lora_rank: int = 0  # kv_lora_rank: the compressed key / value latent's width (> 0: latent attention)
    qk_nope_head_dim: int = 0  # qk_nope_head_dim: each query / key head's features without rope
    qk_rope_head_dim: int = 0  # qk_rope_head_dim (one rotary key shared by all heads)
    v_head_dim: int = 0  # v_head_dim: each value head's width
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): an indexer picks each query's index_topk keys; 0 = dense MLA
    index_topk: int = 0  # index_topk: keys each query attends (a row no longer attends densely)
    index_heads: int = 0  # index_n_heads: the indexer's query heads
    index_head_dim: int = 0  # index_head_dim: the indexer's query / key width (its first qk_rope_head_dim rotated)
    index_rope_interleaved: bool = False  # the indexer's rotary pairs: half-split (V3.2) or interleaved (GLM-5)
    # how the indexer trains (INDEXER_TRAINING): sparse (its KL loss over its selection, beside the model), frozen (not
    # at all; the loss is logged), warmup (dense attention; the model frozen, the indexer learns the KL against it)
    indexer_training: str = "sparse"
    indexer_loss_coef: float = 1.0  # the indexer's KL loss weight (its gradient reaches the indexer alone)
    # Mixture of experts (families in EXPERT_FAMILIES); num_experts 0 = dense MLP everywhere
    num_experts: int = 0  # n_routed_experts; num_experts (Qwen3-MoE); num_local_experts (Mixtral)
    experts_per_token: int = 0  # num_experts_per_tok: routed experts each token goes to
    moe_mlp_dim: int = 0  # moe_intermediate_size; intermediate_size (Mixtral): each expert's hidden width
    num_shared_experts: int = 0  # n_shared_experts (0: no shared expert, as Qwen3-MoE and Mixtral)
    # shared_expert_intermediate_size (Qwen3-Next, Qwen3.5-MoE): the shared experts' MLP; 0 = moe_mlp_dim x their number
    shared_expert_mlp_dim: int = 0
    shared_expert_gate: bool = False  # shared_expert_gate: the shared experts' output times sigmoid(x @ w)
    first_dense_layers: int = 0  # first_k_dense_replace; Qwen3-MoE's mlp_only_layers [0, ..., k - 1]
    n_group: int = 1  # n_group (group-limited routing; 1 = off)
    topk_group: int = 1  # topk_group: expert groups a token may route to
    norm_topk_prob: bool = True  # norm_topk_prob: the top-k routing weights renormalised to sum to one
    routed_scaling_factor: float = 1.0  # routed_scaling_factor: the routed experts' output scale
    router_bias_rate: float = 0.001  # aux-loss-free balancing: bias step per update (0 = frozen bias)
    router_score: str = "sigmoid"  # scoring_func: sigmoid (V3, biased selection) | softmax (all others, no bias)
    # router_aux_loss_coef: weight of the load-balancing loss (aux_loss_alpha: DeepSeek's, per layer)
    router_aux_loss_coef: float = 0.0
    # the tokens it balances (layers/moe.py): pooled (transformers' load_balancing_loss_func) | layer (DeepSeek with
    # seq_aux false) | sequence (seq_aux: each row; with sigmoid routing DeepSeek-V3's complementary sequence-wise loss)
    router_aux_loss_scope: str = "pooled"
    # GPT-OSS (gpt_oss; Hugging Face names in comments): attention_bias = qkv_bias and o_bias
    o_bias: bool = False  # o_proj bias
    attention_sinks: bool = False  # self_attn.sinks: a learned logit per head joining every softmax
    router_logit_bias: bool = False  # mlp.router.bias, added to the router's logits
    expert_mlp: str = "swiglu"  # swiglu | clamped_swiglu (gate_up_proj and down_proj with biases, clamped SwiGLU)
    swiglu_alpha: float = 1.702  # swiglu_alpha: clamped_swiglu's sigmoid gain
    swiglu_limit: float = 7.0  # swiglu_limit: clamped_swiglu's gate clamp (above) and up clamp (both sides)
    # Qwen3.5 / Qwen3-Next (qwen3_5, qwen3_5_moe, qwen3_next; Hugging Face names in comments): gated full attention,
    # Gated DeltaNet layers
    partial_rotary_factor: float = 1.0  # partial_rotary_factor: rope turns this share of each head's features
    attention_output_gate: bool = False  # q_proj's second half per head: attention output times sigmoid(gate)
    linear_key_heads: int = 0  # linear_num_key_heads: a linear_attention layer's query/key heads
    linear_heads: int = 0  # linear_num_value_heads: its value heads (a multiple of the key heads)
    linear_key_dim: int = 0  # linear_key_head_dim: a Gated DeltaNet key head's width
    linear_value_dim: int = 0  # linear_value_head_dim: a Gated DeltaNet value head's width
    linear_conv_taps: int = 4  # linear_conv_kernel_dim: the causal convolution's taps before the recurrence

    @property
    def num_dense_layers(self) -> int:
        """Blocks that end in a dense MLP: the first `first_dense_layers`, or all of them without experts."""
        return self.first_dense_layers if self.num_experts else self.num_layers

    @property
    def num_moe_layers(self) -> int:
        """Blocks that end in a mixture of experts (the ones after the dense blocks)."""
        return self.num_layers - self.num_dense_layers

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention, one of LAYER_TYPES: `layer_types`, or the same for every layer when it is ()."""
        if self.layer_types:
            return self.layer_types
        return (SLIDING if self.sliding_window else FULL,) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        """Features of each query / key head that rope turns: head_dim x partial_rotary_factor."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_dims(self) -> tuple[int, int, int, int]:
        """What one attention call sees: (query heads, key/value heads, query-key head dim, value head dim); latent
        attention (kv_lora_rank > 0) expands its keys and values to every head."""
        if self.kv_lora_rank:
            return self.num_heads, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim


@dataclass(frozen=True)
class ComputeConfig:
    """How the model computes, not what it is: a run may change these between restarts."""

    dtype: str = "auto"  # compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU
    # full | none | save_dots | save_projections | save_attention | offload_projections (models/remat.py): what each
    # scanned block keeps for the backward pass
    remat_policy: str = "full"
    loss_chunk_size: int = 1024  # at most this many tokens per device per cross-entropy chunk (no [length, vocab])


def require(ok: bool, message: str) -> None:
    """Raises ConfigError(message) unless `ok`."""
    if not ok:
        raise ConfigError(message)


def check_model(m: ModelConfig) -> None:
    """Ranges and relations between the architecture's fields (choices are checked with the run config)."""
    for key in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
        require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)!r} must be > 0")
    for key in ("max_position_embeddings", "context_length", "local_rope_theta", "query_pre_attn_scalar"):
        require(getattr(m, key) >= 0, f"model.{key}={getattr(m, key)!r} must be >= 0")
    for key in ("norm_eps", "rope_theta"):
        require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)!r} must be > 0")
    require(
        m.num_heads % m.num_kv_heads == 0,
        f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads}",
    )
    require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    scaling = m.rope_scaling
    if scaling.type != "none":
        require(scaling.factor >= 1, f"model.rope_scaling.factor={scaling.factor} must be >= 1 for {scaling.type}")
    if scaling.type == "llama3":
        require(
            scaling.high_freq_factor > scaling.low_freq_factor,
            f"model.rope_scaling.high_freq_factor={scaling.high_freq_factor} must exceed "
            f"low_freq_factor={scaling.low_freq_factor}",
        )
    _check_layer_types(m)
    if m.family == "deepseek":
        _check_latent(m)
    else:
        require(
            not m.index_topk,
            f"model.index_topk={m.index_topk}: sparse attention's indexer reads latent attention's query latent; "
            f"model.family={m.family} has none: set model.index_topk=0",
        )
    _check_indexer_training(m)
    _check_experts(m)


def _check_indexer_training(m: ModelConfig) -> None:
    """How the indexer trains: a known way, a weight >= 0, and only a model with an indexer trains one otherwise than
    the default."""
    require(
        m.indexer_training in INDEXER_TRAINING,
        f"model.indexer_training={m.indexer_training!r}: choose one of {', '.join(INDEXER_TRAINING)}",
    )
    require(m.indexer_loss_coef >= 0, f"model.indexer_loss_coef={m.indexer_loss_coef} must be >= 0")
    require(
        m.index_topk or not (m.index_heads or m.index_head_dim),
        f"model.index_topk=0 turns sparse attention's indexer off, yet model.index_heads={m.index_heads} and "
        f"model.index_head_dim={m.index_head_dim} describe one: set both to 0 for dense attention, or index_topk > 0",
    )
    require(
        m.index_topk or m.indexer_training == "sparse",
        f"model.indexer_training={m.indexer_training!r} trains sparse attention's indexer; this model has none "
        f"(model.index_topk=0): leave it at sparse",
    )


# how sparse attention's indexer may train (model.indexer_training; models/deepseek.py's `frozen`)
INDEXER_TRAINING = ("sparse", "frozen", "warmup")
# families whose blocks may be Gated DeltaNet (linear_attention) layers
LINEAR_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# families whose decoder has mixture-of-experts blocks (models/mixture.py); the others' blocks are all dense
EXPERT_FAMILIES = ("deepseek", "qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe", "qwen3_next")
# the rope scaling an unscaled model is stretched with, by family: a type its Hugging Face architecture reads
# (the others: yarn, as Qwen and Mistral document for long context; Gemma 3 stretches its full layers linearly)
STRETCH_SCALING = {"llama": "llama3", "deepseek": "yarn", "gemma3": "linear"}


def covered_context(m: ModelConfig) -> int:
    """Positions the model covers: model.max_position_embeddings, else factor x original_max_position_embeddings of a
    yarn rope; 0 when neither says (what a llama3 rope or none covers is a fact of its training)."""
    scaling = m.rope_scaling
    if m.max_position_embeddings or scaling.type != "yarn":
        return m.max_position_embeddings
    return round(scaling.factor * scaling.original_max_position_embeddings)


def extend_context(m: ModelConfig) -> tuple[ModelConfig, str]:
    """`m` made to cover model.context_length positions, and one line that says how ("" when context_length is 0).

    A model that covers fewer gets its rope stretched from its own (layers.rope.stretch_scaling: the factor times
    context_length / what it covers, which for yarn and an unscaled rope is context_length / the original context; an
    unscaled rope becomes STRETCH_SCALING[family]) and max_position_embeddings = context_length; one that covers them
    keeps its rope. ConfigError when context_length is below the context the model was trained at, or what the model
    covers is not stated."""
    target, scaling = m.context_length, m.rope_scaling
    if not target:
        return m, ""
    covered = covered_context(m)
    require(
        covered > 0,
        f"model.context_length={target} stretches the rope from the positions the model covers, which its "
        f"rope_scaling {_describe(scaling)} does not say: set model.max_position_embeddings (an import's comes from "
        f"its config.json)",
    )
    trained = covered if scaling.type == "none" else scaling.original_max_position_embeddings
    require(
        target >= trained,
        f"model.context_length={target} is shorter than the {trained} positions the model was trained at; allowed: "
        f"0 (keep the model's rope) or at least {trained}",
    )
    if target <= covered:
        kept = replace(m, max_position_embeddings=covered)
        return kept, f"model.context_length={target}: the model's rope ({_describe(scaling)}) covers {covered}; kept"
    stretched = stretch_scaling(scaling, covered, target, STRETCH_SCALING.get(m.family, "yarn"))
    return (
        replace(m, rope_scaling=stretched, max_position_embeddings=target),
        f"model.context_length={target}: rope scaling {_describe(stretched)}, derived from the model's "
        f"{_describe(scaling)} covering {covered} positions",
    )


def _describe(scaling: RopeScalingConfig) -> str:
    """'none', or e.g. 'llama3 factor 8 over 8192' (the factor over original_max_position_embeddings)."""
    if scaling.type == "none":
        return "none"
    return f"{scaling.type} factor {scaling.factor:g} over {scaling.original_max_position_embeddings}"


def _check_layer_types(m: ModelConfig) -> None:
    """sliding_window and layer_types: one known type per layer, a window wherever a layer slides."""
    require(m.sliding_window >= 0, f"model.sliding_window={m.sliding_window} must be >= 0 (0 = no window)")
    require(
        not m.layer_types or len(m.layer_types) == m.num_layers,
        f"model.layer_types has {len(m.layer_types)} entries; it needs one per layer (model.num_layers="
        f"{m.num_layers}) or none",
    )
    unknown = sorted(set(m.layer_types) - set(LAYER_TYPES))
    require(not unknown, f"model.layer_types has {unknown}; allowed: {', '.join(LAYER_TYPES)}")
    require(
        m.sliding_window > 0 or SLIDING not in m.layer_types,
        f"model.layer_types has {SLIDING} layers but model.sliding_window=0; set the window (> 0)",
    )
    require(
        0 < m.partial_rotary_factor <= 1 and m.rotary_dim % 2 == 0 and m.rotary_dim > 0,
        f"model.partial_rotary_factor={m.partial_rotary_factor} must be in (0, 1] and turn an even number of "
        f"features (model.head_dim={m.head_dim} x it = {m.head_dim * m.partial_rotary_factor:g})",
    )
    if LINEAR in m.layer_types:
        require(
            m.family in LINEAR_FAMILIES,
            f"model.layer_types has {LINEAR} layers, which model.family={m.family} does not build; families with "
            f"them: {', '.join(LINEAR_FAMILIES)}",
        )
        for key in ("linear_key_heads", "linear_heads", "linear_key_dim", "linear_value_dim", "linear_conv_taps"):
            require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 with {LINEAR} layers")
        require(
            m.linear_heads % m.linear_key_heads == 0,
            f"model.linear_heads={m.linear_heads} must be a multiple of model.linear_key_heads={m.linear_key_heads}",
        )


def _check_latent(m: ModelConfig) -> None:
    """Latent attention fields of a deepseek model."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 for model.family=deepseek")
    require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even")
    require(m.q_lora_rank >= 0, f"model.q_lora_rank={m.q_lora_rank} must be >= 0 (0 = full-rank query)")
    require(m.index_topk >= 0, f"model.index_topk={m.index_topk} must be >= 0 (0 = dense latent attention)")
    if m.index_topk:
        require(
            m.q_lora_rank > 0,
            f"model.index_topk={m.index_topk}: the indexer reads the query latent, so "
            f"model.q_lora_rank={m.q_lora_rank} must be > 0",
        )
        require(m.index_heads > 0, f"model.index_heads={m.index_heads} must be > 0 with model.index_topk > 0")
        require(
            m.index_head_dim >= m.qk_rope_head_dim,
            f"model.index_head_dim={m.index_head_dim} must hold the qk_rope_head_dim={m.qk_rope_head_dim} rotated "
            f"features",
        )
    require(
        SLIDING not in m.layer_kinds,
        f"model.sliding_window={m.sliding_window} is a grouped-query attention feature; latent attention "
        f"(model.family=deepseek) has none: set model.sliding_window=0 and model.layer_types=[]",
    )
    for key in ("local_rope_theta", "query_pre_attn_scalar"):
        require(
            not getattr(m, key),
            f"model.{key}={getattr(m, key)} is a grouped-query attention feature; latent attention "
            f"(model.family=deepseek) has none: set model.{key}=0",
        )
    for key in ("qkv_bias", "qk_norm", "o_bias", "attention_sinks"):
        require(
            not getattr(m, key),
            f"model.{key}=true is a grouped-query attention feature; latent attention (model.family=deepseek) has "
            f"none: set model.{key}=false",
        )


def _check_experts(m: ModelConfig) -> None:
    """Mixture-of-experts fields: only a family in EXPERT_FAMILIES has expert blocks."""
    require(
        m.num_experts == 0 or m.family in EXPERT_FAMILIES,
        f"model.num_experts={m.num_experts} needs a family with expert blocks ({', '.join(EXPERT_FAMILIES)}); "
        f"model.family={m.family} has dense blocks only: set model.num_experts=0",
    )
    require(
        0 <= m.first_dense_layers <= m.num_layers,
        f"model.first_dense_layers={m.first_dense_layers} must be in [0, model.num_layers={m.num_layers}]",
    )
    require(m.router_bias_rate >= 0, f"model.router_bias_rate={m.router_bias_rate} must be >= 0")
    require(m.router_aux_loss_coef >= 0, f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be >= 0")
    require(
        m.router_score == "softmax" or m.router_aux_loss_coef == 0 or m.router_aux_loss_scope == "sequence",
        f"model.router_aux_loss_coef={m.router_aux_loss_coef} with model.router_score={m.router_score!r}: sigmoid "
        f"routing balances by its router bias, with at most DeepSeek-V3's sequence-wise loss beside it; set "
        f"model.router_aux_loss_scope=sequence or model.router_aux_loss_coef=0",
    )
    require(m.shared_expert_mlp_dim >= 0, f"model.shared_expert_mlp_dim={m.shared_expert_mlp_dim} must be >= 0")
    require(
        m.router_score == "sigmoid" or m.router_bias_rate == 0,
        f"model.router_score={m.router_score!r} selects experts without the router bias; set "
        f"model.router_bias_rate=0 (it is {m.router_bias_rate})",
    )
    if m.expert_mlp == "clamped_swiglu":
        for key in ("swiglu_alpha", "swiglu_limit"):
            require(
                getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 for model.expert_mlp=clamped_swiglu"
            )
    if m.num_experts == 0:
        return
    for key in ("experts_per_token", "moe_mlp_dim"):
        require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 when model.num_experts > 0")
    require(
        m.experts_per_token <= m.num_experts,
        f"model.experts_per_token={m.experts_per_token} must be <= model.num_experts={m.num_experts}",
    )
    require(
        m.num_experts % m.n_group == 0,
        f"model.num_experts={m.num_experts} must be divisible by model.n_group={m.n_group}",
    )
    require(
        1 <= m.topk_group <= m.n_group, f"model.topk_group={m.topk_group} must be in [1, model.n_group={m.n_group}]"
    )
