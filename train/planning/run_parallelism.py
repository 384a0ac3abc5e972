"""The parallelism a run (training or evaluation) traces with: made from the config for the mesh's devices, then
its fused attention kernel and ragged expert dispatch checked on those devices (parallel/first_contact.py)."""

from __future__ import annotations

import contextlib
import logging

from models.dtypes import compute_dtype
from parallel import first_contact
from parallel.parallelism import Parallelism
from parallel.settings import make_parallelism
from train.config import Config
from train.planning.compiling import compiling

log = logging.getLogger(__name__)


def run_parallelism(config: Config, mesh, waiting: first_contact.Waiting = contextlib.nullcontext) -> Parallelism:
    """The checked parallelism for `config` on `mesh`; logs what it compiles before anything does, then which attention
    kernel (and expert dispatch) the run uses. `waiting`: the run's stall watch, around each check's run."""
    m = config.model
    parallelism = make_parallelism(config.parallel, mesh.shape, mesh.devices.flat[0])
    log.info(compiling(parallelism, mesh))  # first contact compiles the kernels, the step the model
    parallelism = first_contact.checked(
        parallelism,
        mesh,
        dims=m.attention_dims,
        experts=(m.num_experts, m.experts_per_token),
        dtype=compute_dtype(config.compute),
        waiting=waiting,
    )
    dispatch = f", expert dispatch {parallelism.expert_dispatch}" if m.num_experts else ""
    if m.num_experts and parallelism.expert_dispatch == "ragged":
        dispatch += f" ({parallelism.grouped_matmul} grouped matmul)"
    log.info("attention kernel %s%s", parallelism.kernel, dispatch)
    return parallelism
