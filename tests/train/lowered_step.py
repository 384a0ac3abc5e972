"""The train step a run builds for a config on some devices (train/loop.py: its state, batch and parallelism), lowered
and not compiled: the module a memory plan compiles, and what the tests read off it before any backend sees it."""

import jax

from parallel.mesh import make_mesh
from parallel.settings import make_parallelism
from train.optimizer import make_optimizer
from train.planning.memory import abstract_batch
from train.state import TrainState, abstract_state
from train.step import configured_train_step


def lowered_step(config, devices) -> jax.stages.Lowered:
    """The train step of `config` (as `for_accelerator` leaves it) over a mesh of `devices`, lowered on abstract
    state and batch."""
    mesh = make_mesh(config.mesh, devices)
    graphdef, state, shardings = abstract_state(
        config.model, make_optimizer(config.optimizer, config.train.steps), mesh, compute=config.compute
    )
    parallelism = make_parallelism(config.parallel, mesh.shape, mesh.devices.flat[0])
    with jax.set_mesh(mesh):
        step = configured_train_step(TrainState(graphdef, state, shardings), mesh, config, parallelism)  # the trainer's
        return step.lower(state, abstract_batch(config, mesh))
