"""Rematerialisation policies by name (`compute.remat_policy`), applied to each scanned block.

What a block keeps from its forward pass for the backward pass:

- none: everything (no recomputation; the most memory)
- full: only its input; everything else is recomputed (the least memory)
- save_dots: every matmul (dot_general) output without batch dimensions
- save_projections: the outputs named in PROJECTIONS (tagged with `jax.ad_checkpoint.checkpoint_name`)
- offload_projections: the same outputs, moved to pinned host memory in the forward pass and brought back
  for the backward pass; needs a backend with host offload (GPU, TPU)
- save_attention: each attention call's output and log-sum-exp (parallel/kernels/saved.py): the backward
  recomputes the block's projections and MLP but not its attention, the costliest part at long context, for
  tokens x heads x (head width in the compute dtype + 4 bytes) a layer
"""

from __future__ import annotations

import jax

from parallel.kernels import saved
from parallel.parallelism import current_parallelism

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj", "mlp_gate", "mlp_up", "mlp_down")

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_projections": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS),
    "save_attention": jax.checkpoint_policies.save_only_these_names(*saved.NAMES),
    "offload_projections": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=PROJECTIONS,
        offload_src="device",
        offload_dst="pinned_host",
    ),
}
HOST_OFFLOAD = ("offload_projections",)


class RematError(ValueError):
    """A remat policy that is unknown, or that the backend cannot run."""


def check_policy(policy: str, platform: str) -> None:
    """Raises RematError for an unknown policy, or a host-offload policy on a backend without host offload.

    The CPU backend has no memory apart from the host: XLA drops the offload there, so the saved projections
    would stay where they are and memory numbers would silently be those of save_projections."""
    if policy not in POLICIES:
        raise RematError(f"compute.remat_policy={policy!r} is unknown; choose one of {', '.join(POLICIES)}")
    if policy in HOST_OFFLOAD and platform == "cpu":
        raise RematError(
            f"compute.remat_policy={policy!r} offloads to pinned host memory, which the cpu backend "
            f"does not have apart from device memory; run it on GPU or TPU, or choose save_projections "
            f"(same activations kept on device) or full (nothing kept)"
        )


def remat(fn, policy: str):
    """Wraps `fn` in jax.checkpoint with the named policy ('none' returns fn unchanged), checked for the platform
    the traced step compiles for (the installed Parallelism's; JAX's default backend without one)."""
    check_policy(policy, current_parallelism().platform or jax.default_backend())
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=POLICIES[policy], prevent_cse=False)
