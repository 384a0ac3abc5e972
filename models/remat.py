"""Rematerialisation policies by name, applied to each scanned block."""

from __future__ import annotations

import jax

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_projections": jax.checkpoint_policies.save_only_these_names(
        "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj", "mlp_gate", "mlp_up", "mlp_down"),
}


def remat(fn, policy: str):
    """Wraps `fn` in jax.checkpoint with the named policy ('none' returns fn unchanged)."""
    if policy not in POLICIES:
        raise ValueError(f"remat policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=False)
