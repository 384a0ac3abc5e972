"""Model + optimizer state, initialised directly into its shardings (no full copy on one device)."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

import models
from models.config import ComputeConfig, ModelConfig
from parallel.mesh import state_shardings


@dataclasses.dataclass
class TrainState:
    """`graphdef` rebuilds (model, optimizer) from `state` (an nnx.State pair); `shardings` mirrors `state`."""

    graphdef: nnx.GraphDef
    state: nnx.State
    shardings: nnx.State


def _build(model_config: ModelConfig, compute: ComputeConfig, tx, seed: int):
    model = models.build(model_config, compute, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _abstract(build, mesh: Mesh):
    """(graphdef, abstract state with shardings, shardings) of what `build()` makes, without allocating it."""
    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return graphdef, abstract, shardings


def abstract_state(
    model_config: ModelConfig, tx: optax.GradientTransformation, mesh: Mesh, *, compute: ComputeConfig = ComputeConfig()
):
    """(graphdef, abstract state with shardings, shardings) of (model, optimizer) without allocating any parameter."""
    return _abstract(lambda: _build(model_config, compute, tx, 0), mesh)


def abstract_model(model_config: ModelConfig, mesh: Mesh, *, compute: ComputeConfig = ComputeConfig()):
    """(graphdef, abstract state with shardings) of the model alone, without allocating it: what evaluation of a
    checkpoint's parameters needs (no optimizer state)."""
    return _abstract(lambda: models.build(model_config, compute, rngs=nnx.Rngs(0)), mesh)[:2]


def create_state(
    model_config: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    seed: int,
    *,
    compute: ComputeConfig = ComputeConfig(),
) -> TrainState:
    """Fresh parameters from `seed`, each created on the devices that own its shards."""
    graphdef, _, shardings = abstract_state(model_config, tx, mesh, compute=compute)
    init = jax.jit(lambda: nnx.split(_build(model_config, compute, tx, seed))[1], out_shardings=shardings)
    return TrainState(graphdef, init(), shardings)
