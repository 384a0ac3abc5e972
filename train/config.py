"""Typed run configuration: YAML files with `base:` inheritance, dotted overrides, validation.

Everything is checked here, before JAX compiles anything: an unknown key, a wrong type or an
inconsistent value raises `ConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
import typing
from dataclasses import dataclass, field

import yaml

from layers.moe import ROUTER_SCORES
from models.remat import NAMES as REMAT_POLICIES
from parallel.context import EXPERT_DISPATCHES, check_context
from parallel.mesh import MeshError


class ConfigError(ValueError):
    """A configuration key has a value that is not allowed."""


@dataclass(frozen=True)
class RopeScalingConfig:
    """Rotary-embedding context extension; `type` none, llama3 or yarn (fields as in Hugging Face)."""

    type: str = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn
    mscale_all_dim: float = 0.0  # yarn


@dataclass(frozen=True)
class ModelConfig:
    """Architecture. Features are chosen by these fields, never by a model's name."""

    family: str = "llama"
    vocab_size: int = 512
    embed_dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    mlp_dim: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    dtype: str = "auto"  # compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU
    remat_policy: str = "full"  # a name in models/remat.py: what each scanned block keeps for the backward pass
    loss_chunk_size: int = 1024
    # Multi-head latent attention (deepseek; Hugging Face names in comments)
    q_lora_rank: int = 0  # q_lora_rank; 0 = full-rank query projection
    kv_lora_rank: int = 0  # kv_lora_rank
    qk_nope_head_dim: int = 0  # qk_nope_head_dim
    qk_rope_head_dim: int = 0  # qk_rope_head_dim (one rotary key shared by all heads)
    v_head_dim: int = 0  # v_head_dim
    # Mixture of experts (deepseek); num_experts 0 = dense MLP everywhere
    num_experts: int = 0  # n_routed_experts
    experts_per_token: int = 0  # num_experts_per_tok
    moe_mlp_dim: int = 0  # moe_intermediate_size
    num_shared_experts: int = 0  # n_shared_experts
    first_dense_layers: int = 0  # first_k_dense_replace
    n_group: int = 1  # n_group (group-limited routing; 1 = off)
    topk_group: int = 1  # topk_group
    norm_topk_prob: bool = True  # norm_topk_prob
    routed_scaling_factor: float = 1.0  # routed_scaling_factor
    router_bias_rate: float = 0.001  # aux-loss-free balancing: bias step per update (0 = frozen bias)
    router_score: str = "sigmoid"  # scoring_func: sigmoid (V3, biased selection) | softmax (V2, no bias)
    expert_capacity_factor: float = 1.25  # expert parallelism: buffer rows per expert / its balanced load


# ModelConfig fields a run chooses, free to change between restarts; the rest is the architecture
RUNTIME_FIELDS = ("dtype", "remat_policy", "loss_chunk_size", "expert_capacity_factor")


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes packed rows of `seq_len` tokens."""

    source: str = "stdlib"  # "stdlib", a text file, a folder, a .jsonl or a .parquet file
    format: str = "auto"  # auto | text | jsonl | parquet
    text_field: str = "text"
    file_pattern: str = "*"  # glob for folders
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    seq_len: int = 256
    packing: str = "concat"  # concat (split documents across rows) | first_fit (pad rows)
    shuffle: bool = True
    seed: int = 0
    eval_fraction: float = 0.02
    max_documents: int = 0  # 0 = all
    add_bos: bool = True
    add_eos: bool = True


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay to `min_lr_ratio * learning_rate`."""

    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int = 0  # 0 = train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 = no clipping


@dataclass(frozen=True)
class TrainConfig:
    """The loop: how long, how big a batch, where outputs go, how often to log and evaluate."""

    steps: int = 1000
    batch_size: int = 8  # global, in rows of data.seq_len tokens
    grad_accum_steps: int = 1
    output_dir: str = "runs/default"
    log_every_steps: int = 10
    eval_every_steps: int = 0  # 0 = only at the end
    eval_batches: int = 4  # 0 = no evaluation
    seed: int = 0
    progress_bar: bool = True
    sample_tokens: int = 120
    sample_prompt: str = "def "
    sample_temperature: float = 0.8  # 0 = greedy
    peak_tflops_per_device: float = 0.0  # 0 = look up, or measure on CPU


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under OUTPUT_DIR/checkpoints; `init_from` seeds params only."""

    enabled: bool = True
    every_steps: int = 500
    keep: int = 3
    async_save: bool = True
    init_from: str = ""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; one -1 takes the remaining devices."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    ulysses: int = 1  # usp only: heads split over this axis, inside the context (ring) axis
    tensor: int = 1


@dataclass(frozen=True)
class ParallelConfig:
    """How attention runs when the sequence is split over mesh.context (and mesh.ulysses), and whether tensor
    parallelism scatters the residual stream."""

    context_strategy: str = "none"  # none | all_gather | ring | ulysses | usp
    load_balance: bool = True  # reorder the sequence when mesh.context > 1 so causal work is even
    balance_layout: str = "dual_chunk"  # dual_chunk | striped
    stripe: int = 1  # tokens per stripe for the striped layout
    block_q: int = 512  # blockwise attention kernel block sizes
    block_kv: int = 512
    fused_attention: bool = True  # cuDNN flash attention on GPU where it has the same semantics
    scatter_residual: bool = True  # mesh.tensor > 1: residual stream sharded on length over tensor (reduce-scatter)
    expert_dispatch: str = "auto"  # capacity | ragged (GPU/TPU) | auto: how MoE tokens travel to expert devices
    expert_chunk_size: int = 0  # at most this many tokens per device through an MoE block at once; 0 = all

@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


CHOICES = {
    "model.family": ("llama", "deepseek"),
    "model.rope_scaling.type": ("none", "llama3", "yarn"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.remat_policy": REMAT_POLICIES,
    "model.router_score": ROUTER_SCORES,
    "data.format": ("auto", "text", "jsonl", "parquet"),
    "data.packing": ("concat", "first_fit"),
    "parallel.context_strategy": ("none", "all_gather", "ring", "ulysses", "usp"),
    "parallel.balance_layout": ("dual_chunk", "striped"),
    "parallel.expert_dispatch": EXPERT_DISPATCHES,
}


def _validate_deepseek(m: ModelConfig, mesh: MeshConfig) -> None:
    """Latent attention and mixture-of-experts fields of a deepseek model."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 for model.family=deepseek")
    _require(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even")
    _require(m.q_lora_rank >= 0, f"model.q_lora_rank={m.q_lora_rank} must be >= 0 (0 = full-rank query)")
    _require(0 <= m.first_dense_layers <= m.num_layers,
             f"model.first_dense_layers={m.first_dense_layers} must be in [0, model.num_layers={m.num_layers}]")
    _require(m.router_bias_rate >= 0, f"model.router_bias_rate={m.router_bias_rate} must be >= 0")
    _require(m.router_score == "sigmoid" or m.router_bias_rate == 0,
             f"model.router_score={m.router_score!r} selects experts without the router bias; set "
             f"model.router_bias_rate=0 (it is {m.router_bias_rate})")
    if m.num_experts == 0:
        return
    _require(m.expert_capacity_factor > 0, f"model.expert_capacity_factor={m.expert_capacity_factor} must be > 0")
    for key in ("experts_per_token", "moe_mlp_dim"):
        _require(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be > 0 when model.num_experts > 0")
    _require(m.experts_per_token <= m.num_experts,
             f"model.experts_per_token={m.experts_per_token} must be <= model.num_experts={m.num_experts}")
    _require(m.num_experts % m.n_group == 0,
             f"model.num_experts={m.num_experts} must be divisible by model.n_group={m.n_group}")
    _require(1 <= m.topk_group <= m.n_group, f"model.topk_group={m.topk_group} must be in [1, model.n_group={m.n_group}]")
    _require(mesh.expert == -1 or m.num_experts % mesh.expert == 0,
             f"model.num_experts={m.num_experts} must be divisible by mesh.expert={mesh.expert}")
    _require(mesh.tensor == -1 or m.moe_mlp_dim % mesh.tensor == 0,
             f"model.moe_mlp_dim={m.moe_mlp_dim} must be divisible by mesh.tensor={mesh.tensor}")


# ---------------------------------------------------------------- loading


def _read_yaml(path: pathlib.Path, seen: tuple[pathlib.Path, ...] = ()) -> dict:
    """Reads one YAML file and merges it over its `base:` files (a path or a list, relative to it)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"config {path}: `base:` cycle through {[str(p) for p in seen]}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(raw).__name__}")
    bases = raw.pop("base", [])
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        _merge(merged, _read_yaml(path.parent / base, seen + (path,)))
    _merge(merged, raw)
    return merged


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def parse_override(text: str) -> tuple[list[str], typing.Any]:
    """`train.steps=100` -> (["train", "steps"], 100); the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, value = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(value) if value else ""


def load_config(path: str | pathlib.Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Reads a YAML config (or the defaults when path is None), applies overrides, validates."""
    raw = _read_yaml(pathlib.Path(path)) if path else {}
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {key} is not a section")
        node[keys[-1]] = value
    config = from_dict(Config, raw, "")
    validate(config)
    return config


def from_dict(cls, raw: typing.Any, prefix: str):
    """Builds dataclass `cls` from a mapping, checking every key and type."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"unknown key '{prefix}{key}'; allowed keys in {where}: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(hint, value, key: str):
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, key + ".")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _coerce(option, value, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[-1])
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is type(None) and value is None:
        return None
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; expected {name}")


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def get(config: Config, key: str):
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


# ---------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    """Checks choices, ranges and the relations between values."""
    for key, allowed in CHOICES.items():
        value = get(config, key)
        _require(value in allowed, f"{key}={value!r} is not allowed; choose one of {', '.join(allowed)}")
    m, d, t, o, c = config.model, config.data, config.train, config.optimizer, config.checkpoint
    positive = [
        "model.vocab_size", "model.embed_dim", "model.num_layers", "model.num_heads", "model.num_kv_heads",
        "model.head_dim", "model.mlp_dim", "model.loss_chunk_size", "data.seq_len", "train.steps",
        "train.batch_size", "train.grad_accum_steps", "train.log_every_steps", "checkpoint.every_steps",
        "checkpoint.keep",
    ]
    for key in positive:
        _require(get(config, key) > 0, f"{key}={get(config, key)!r} must be > 0")
    for key in ["model.norm_eps", "model.rope_theta", "optimizer.learning_rate"]:
        _require(get(config, key) > 0, f"{key}={get(config, key)!r} must be > 0")
    for key in ["optimizer.warmup_steps", "optimizer.decay_steps", "optimizer.weight_decay",
                "optimizer.clip_norm", "train.eval_every_steps", "train.eval_batches", "train.sample_tokens",
                "data.max_documents", "train.sample_temperature", "train.peak_tflops_per_device"]:
        _require(get(config, key) >= 0, f"{key}={get(config, key)!r} must be >= 0")
    _require(0 <= o.min_lr_ratio <= 1, f"optimizer.min_lr_ratio={o.min_lr_ratio!r} must be in [0, 1]")
    _require(0 <= d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction!r} must be in [0, 1)")
    _require(d.eval_fraction > 0 or t.eval_batches == 0,
             f"data.eval_fraction=0 holds out no documents, so train.eval_batches={t.eval_batches} must be 0")
    _require(m.num_heads % m.num_kv_heads == 0,
             f"model.num_heads={m.num_heads} must be divisible by model.num_kv_heads={m.num_kv_heads}")
    _require(m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    _require(t.batch_size % t.grad_accum_steps == 0,
             f"train.batch_size={t.batch_size} must be divisible by train.grad_accum_steps={t.grad_accum_steps}")
    _require(d.seq_len % min(m.loss_chunk_size, d.seq_len) == 0,
             f"data.seq_len={d.seq_len} must be divisible by model.loss_chunk_size={m.loss_chunk_size} "
             f"(or shorter than it)")
    if m.rope_scaling.type != "none":
        _require(m.rope_scaling.factor >= 1,
                 f"model.rope_scaling.factor={m.rope_scaling.factor} must be >= 1 for {m.rope_scaling.type}")
    if m.rope_scaling.type == "llama3":
        _require(m.rope_scaling.high_freq_factor > m.rope_scaling.low_freq_factor,
                 f"model.rope_scaling.high_freq_factor={m.rope_scaling.high_freq_factor} must exceed "
                 f"low_freq_factor={m.rope_scaling.low_freq_factor}")
    sizes = {f.name: getattr(config.mesh, f.name) for f in dataclasses.fields(MeshConfig)}
    for name, size in sizes.items():
        _require(size == -1 or size >= 1, f"mesh.{name}={size} must be >= 1 or -1 (fill)")
    fills = [name for name, size in sizes.items() if size == -1]
    _require(len(fills) <= 1, f"only one mesh axis may be -1, got {', '.join('mesh.' + f for f in fills)}")
    _require(config.parallel.expert_chunk_size >= 0,
             f"parallel.expert_chunk_size={config.parallel.expert_chunk_size} must be >= 0 (0 = all local tokens)")
    for key in ("parallel.stripe", "parallel.block_q", "parallel.block_kv"):
        _require(get(config, key) >= 1, f"{key}={get(config, key)!r} must be >= 1")
    if config.mesh.tensor > 1:
        for key in ("model.num_heads", "model.mlp_dim"):
            _require(get(config, key) % config.mesh.tensor == 0,
                     f"{key}={get(config, key)} must be divisible by mesh.tensor={config.mesh.tensor}")
    if not {"context", "ulysses", "tensor"} & set(fills):  # else known once the mesh is built, checked there
        try:
            check_context(config.parallel, sizes, seq_len=d.seq_len, num_heads=m.num_heads)
        except MeshError as error:
            raise ConfigError(str(error)) from None
    if m.family == "deepseek":
        _validate_deepseek(m, config.mesh)
    _require(bool(t.output_dir), "train.output_dir must not be empty")
    _require(c.init_from == "" or pathlib.Path(c.init_from).exists(),
             f"checkpoint.init_from={c.init_from!r} does not exist")
