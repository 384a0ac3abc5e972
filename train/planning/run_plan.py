"""The parallel plan a run (training or evaluation) traces with: made from the config for the mesh's devices, then
its fused attention kernel and ragged expert dispatch checked on those devices (parallel/first_contact.py)."""

from __future__ import annotations

import logging

from models.dtypes import compute_dtype
from parallel import first_contact
from parallel.plan import Plan
from parallel.planning import make_plan
from train.config import Config
from train.planning.compiling import compiling

log = logging.getLogger(__name__)


def run_plan(config: Config, mesh) -> Plan:
    """The checked plan for `config` on `mesh`; logs what it compiles before anything does, then which attention
    kernel (and expert dispatch) the run uses."""
    m = config.model
    plan = make_plan(config.parallel, mesh.shape, mesh.devices.flat[0])
    log.info(compiling(plan, mesh))  # first contact compiles the kernels, the step the model
    plan = first_contact.checked(
        plan,
        mesh,
        dims=m.attention_dims,
        experts=(m.num_experts, m.experts_per_token),
        dtype=compute_dtype(config.compute),
    )
    log.info("attention kernel %s%s", plan.kernel, f", expert dispatch {plan.expert_dispatch}" * bool(m.num_experts))
    return plan
