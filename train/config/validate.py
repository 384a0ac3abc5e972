"""Checks a run config before anything compiles: each choice against the registry that implements it, ranges,
and the relations between sections. A bad value raises ConfigError naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib

from jax.sharding import Mesh

import models
from layers.moe import AUX_LOSS_SCOPES, EXPERT_MLPS, ROUTER_SCORES
from layers.rope import SCALINGS
from models.config import ConfigError, check_model, covered_context, require
from models.dtypes import COMPUTE_DTYPES, PARAM_DTYPES
from models.remat import POLICIES
from parallel.kernels import KERNELS
from parallel.mesh import MeshError, check_batch
from parallel.parallelism import RING_GRAD_DTYPES
from parallel.reorder import LAYOUTS
from parallel.settings import EXPERT_DISPATCHES, GROUPED_MATMUL_SETTINGS, check_context, check_tensor
from parallel.strategies import STRATEGIES
from train.config.schema import FORMATS, MU_DTYPES, ON_CHANGE, PACKINGS, Config, MeshConfig

# key -> the names its registry implements
CHOICES = {
    "model.family": tuple(models.REGISTRY),
    "model.rope_scaling.type": SCALINGS,
    "model.param_dtype": PARAM_DTYPES,
    "model.router_score": ROUTER_SCORES,
    "model.router_aux_loss_scope": AUX_LOSS_SCOPES,
    "model.expert_mlp": EXPERT_MLPS,
    "compute.dtype": COMPUTE_DTYPES,
    "optimizer.mu_dtype": MU_DTYPES,
    "compute.remat_policy": tuple(POLICIES),
    "data.format": FORMATS,
    "data.packing": PACKINGS,
    "data.on_change": ON_CHANGE,
    "parallel.context_strategy": tuple(STRATEGIES),
    "parallel.balance_layout": tuple(layout for layout in LAYOUTS if layout != "contiguous"),
    "parallel.expert_dispatch": EXPERT_DISPATCHES,
    "parallel.grouped_matmul": GROUPED_MATMUL_SETTINGS,
    "parallel.attention_kernel": KERNELS,
    "parallel.ring_grad_dtype": RING_GRAD_DTYPES,
}
POSITIVE = (
    "compute.loss_chunk_size",
    "data.seq_len",
    "train.steps",
    "train.batch_size",
    "train.grad_accum_steps",
    "train.log_every_steps",
    "checkpoint.every_steps",
    "checkpoint.keep",
    "optimizer.learning_rate",
    "parallel.expert_capacity_factor",  # when set
    "parallel.stripe",
    "parallel.block_q",
    "parallel.block_kv",
)
NON_NEGATIVE = (
    "optimizer.warmup_steps",
    "data.long_document_bytes",
    "data.long_document_weight",
    "optimizer.decay_steps",
    "optimizer.weight_decay",
    "optimizer.clip_norm",
    "train.eval_every_steps",
    "train.eval_batches",
    "train.needle_samples",
    "train.sample_tokens",
    "data.max_documents",
    "train.sample_temperature",
    "train.peak_tflops_per_device",
    "parallel.expert_chunk_size",
)


def get(config: Config, key: str):
    """The value at dotted `key`, e.g. get(config, "train.steps")."""
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate(config: Config) -> None:
    """Checks choices, ranges and the relations between values."""
    for key, allowed in CHOICES.items():
        value = get(config, key)
        require(value in allowed, f"{key}={value!r} is not allowed; choose one of {', '.join(allowed)}")
    for key in POSITIVE:
        require(get(config, key) is None or get(config, key) > 0, f"{key}={get(config, key)!r} must be > 0")
    for key in NON_NEGATIVE:
        require(get(config, key) >= 0, f"{key}={get(config, key)!r} must be >= 0")
    check_model(config.model)
    d, t, o, c = config.data, config.train, config.optimizer, config.checkpoint
    context = config.model.context_length
    require(
        not context or d.seq_len <= context,
        f"data.seq_len={d.seq_len} is longer than model.context_length={context}, the positions the model is "
        f"extended to; allowed: data.seq_len <= model.context_length",
    )
    require(0 <= o.min_lr_ratio <= 1, f"optimizer.min_lr_ratio={o.min_lr_ratio!r} must be in [0, 1]")
    require(0 <= d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction!r} must be in [0, 1)")
    require(
        d.eval_fraction > 0 or t.eval_batches == 0,
        f"data.eval_fraction=0 holds out no documents, so train.eval_batches={t.eval_batches} must be 0",
    )
    require(
        all(n > 0 for n in t.needle_lengths) and all(0 <= d <= 1 for d in t.needle_depths),
        f"train.needle_lengths={list(t.needle_lengths)} must be positive token counts and train.needle_depths="
        f"{list(t.needle_depths)} fractions in [0, 1]",
    )
    require(
        not t.needle_lengths or t.eval_batches > 0,
        "train.needle_lengths runs at each evaluation: set train.eval_batches > 0 (and data.eval_fraction > 0)",
    )
    for i, component in enumerate(d.mixture):
        key = f"data.mixture[{i}]"
        require(0 < component.weight < float("inf"), f"{key}.weight={component.weight!r} must be a positive number")
        require(
            component.format in (None, *FORMATS),
            f"{key}.format={component.format!r} is not allowed; choose one of {', '.join(FORMATS)}",
        )
        require((component.max_documents or 0) >= 0, f"{key}.max_documents={component.max_documents!r} must be >= 0")
    buckets = t.eval_position_buckets
    require(
        all(a < b for a, b in itertools.pairwise((0, *buckets))),
        f"train.eval_position_buckets={list(buckets)} must be increasing positive token positions, e.g. [1024, 4096]",
    )
    require(
        t.batch_size % t.grad_accum_steps == 0,
        f"train.batch_size={t.batch_size} must be divisible by train.grad_accum_steps={t.grad_accum_steps}",
    )
    _check_mesh(config)
    require(bool(t.output_dir), "train.output_dir must not be empty")
    require(
        c.init_from == "" or pathlib.Path(c.init_from).exists(), f"checkpoint.init_from={c.init_from!r} does not exist"
    )


def tensor_split_dims(config: Config) -> dict[str, int]:
    """The model sizes tensor parallelism splits (key -> size): mesh.tensor must divide each."""
    keys = ("model.num_heads", "model.mlp_dim") + (("model.moe_mlp_dim",) if config.model.num_experts else ())
    return {key: get(config, key) for key in keys}


def check_built_mesh(config: Config, mesh: Mesh) -> None:
    """Raises MeshError when the batch, the sequence or the model does not divide the built mesh (its -1 axis
    resolved): the checks `validate` leaves for when the device count is known."""
    check_batch(config.train.batch_size, config.train.grad_accum_steps, mesh)
    check_tensor(mesh.shape["tensor"], tensor_split_dims(config))
    check_context(config.parallel, mesh.shape, seq_len=config.data.seq_len, num_heads=config.model.num_heads)


def _check_mesh(config: Config) -> None:
    """Mesh sizes, and what the model and sequence must divide by them (when known before the mesh is built)."""
    m, mesh = config.model, config.mesh
    sizes = {f.name: getattr(mesh, f.name) for f in dataclasses.fields(MeshConfig)}
    for name, size in sizes.items():
        require(size == -1 or size >= 1, f"mesh.{name}={size} must be >= 1 or -1 (fill)")
    fills = [name for name, size in sizes.items() if size == -1]
    require(len(fills) <= 1, f"only one mesh axis may be -1, got {', '.join('mesh.' + f for f in fills)}")
    if mesh.tensor > 1:
        try:
            check_tensor(mesh.tensor, tensor_split_dims(config))
        except MeshError as error:
            raise ConfigError(str(error)) from None
    if m.num_experts and mesh.expert > 1:
        require(
            m.num_experts % mesh.expert == 0,
            f"model.num_experts={m.num_experts} must be divisible by mesh.expert={mesh.expert}",
        )
    if not {"context", "ulysses", "tensor"} & set(fills):  # else known once the mesh is built, checked there
        try:
            check_context(config.parallel, sizes, seq_len=config.data.seq_len, num_heads=m.num_heads)
        except MeshError as error:
            raise ConfigError(str(error)) from None


def check_positions(config: Config) -> None:
    """A run's rows fit the positions its model covers (once model.context_length has stretched them); a config read
    for its model alone (an import's model.yaml) is not a run and is not checked."""
    covered, seq_len = covered_context(config.model), config.data.seq_len
    require(
        not covered or seq_len <= covered,
        f"data.seq_len={seq_len} is longer than the {covered} positions the model covers "
        f"(model.max_position_embeddings, or its yarn rope's); set model.context_length={seq_len} to stretch its "
        f"rope, or data.seq_len <= {covered}",
    )
