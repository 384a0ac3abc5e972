"""Expert-parallel MoE dispatch (parallel/experts.py) against the partitioner-placed MoE it replaced.

One DeepSeek-V2-Lite MoE block (64 experts, 6 per token, bfloat16), forward + backward, the sequence split over
context=8 simulated CPU devices:
- per-device temporaries (`memory_analysis`, abstract shapes) at T = 16K and 128K: all-to-all dispatch (capacity
  1.25, the local tokens at once and in 4 chunks) vs the baseline, which gathers the tokens, sorts all T x k
  assignments and runs `ragged_dot` over every expert, as the partitioner places it;
- bytes one device sends per token: the all-to-alls vs the baseline's gathers and reductions;
- time of the block on real arrays at a quarter of V2-Lite's widths (T = 4K; quick: 512);
- the `--plan` totals per device of configs/finetune-128k-deepseek-v2-lite.yaml (8 devices) and
  configs/finetune-128k-deepseek-v3.yaml (256 devices) against 80 GiB (left out with --quick).

    PYTHONPATH=. python bench/moe_dispatch.py [--quick]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

import parallel
from bench.report import ratio
from bench.timing import best_time
from bench.tp_collectives import BYTES, _group_size, _prod, moved_bytes
from layers.moe import MoE, expert_swiglu
from parallel.mesh import make_mesh, state_shardings
from parallel.parallelism import Parallelism, use_parallelism
from parallel.tensor import residual_spec
from train.config import MeshConfig, load_config
from train.planning.memory import CPU_OPTIONS

CONTEXT = 8
V2_LITE = load_config("configs/models/deepseek-v2-lite.yaml").model
NARROW = dataclasses.replace(V2_LITE, embed_dim=512, moe_mlp_dim=352)  # for timing on CPU


def partitioner_placed(moe: MoE, x: jax.Array):
    """The baseline: the MoE as the partitioner placed it before parallel/experts.py (all tokens gathered, a sort
    over every assignment, dropless `ragged_dot` over all experts)."""
    tokens = parallel.shard(x, ("batch", "length", "embed")).reshape(-1, x.shape[-1])
    weights, experts = moe.route(tokens)
    n, k = experts.shape
    order = jnp.argsort(experts.reshape(-1))
    sizes = jnp.bincount(experts.reshape(-1), length=moe.num_experts).astype(jnp.int32)
    kernels = (moe.experts_gate[...], moe.experts_up[...], moe.experts_down[...])
    out = expert_swiglu(
        tokens[order // k].astype(moe.dtype), *(w.astype(moe.dtype) for w in kernels), group_sizes=sizes
    )
    out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    y = jnp.zeros_like(out).at[order].set(out, unique_indices=True).reshape(n, k, -1).sum(1).astype(moe.dtype)
    return parallel.residual(y.reshape(x.shape)) + moe.shared(x), {"dropped": jnp.zeros(())}


def dispatched(moe: MoE, x: jax.Array):
    return moe(x)


def block_step(config, impl, length: int, chunk: int = 0):
    """(jitted forward + backward of one MoE block under the mesh and parallelism, its abstract (state, x), mesh,
    parallelism)."""
    moe = nnx.eval_shape(
        lambda: MoE(
            config.embed_dim,
            num_experts=config.num_experts,
            experts_per_token=config.experts_per_token,
            moe_mlp_dim=config.moe_mlp_dim,
            num_shared_experts=config.num_shared_experts,
            norm_topk_prob=False,
            router_score=config.router_score,
            dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, state = nnx.split(moe)
    mesh = make_mesh(MeshConfig(fsdp=-1, context=CONTEXT))
    parallelism = Parallelism(expert_chunk=chunk)

    def loss(state, x):
        y, stats = impl(nnx.merge(graphdef, state), x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + stats["dropped"]

    with jax.set_mesh(mesh), use_parallelism(parallelism):
        shardings = nnx.state(state_shardings(state, mesh))
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)
        x = jax.ShapeDtypeStruct(
            (1, length, config.embed_dim), jnp.bfloat16, sharding=NamedSharding(mesh, residual_spec())
        )
    return jax.jit(jax.grad(loss, argnums=(0, 1))), (state, x), mesh, parallelism


def compiled(config, impl, length: int, chunk: int = 0):
    step, args, mesh, parallelism = block_step(config, impl, length, chunk)
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        return step.lower(*args).compile(CPU_OPTIONS)


def all_to_all_bytes(hlo: str) -> float:
    """Bytes one device sends in the compiled all-to-alls: (group - 1) / group of each buffer."""
    total = 0.0
    for line in hlo.splitlines():
        match = re.search(r"= (\(.*?\)|\S+) all-to-all\(", line)
        if match:
            size = _group_size(line)
            arrays = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
            total += sum(BYTES.get(dtype, 4) * _prod(dims) for dtype, dims in arrays) * (size - 1) / size
    return total


def seconds(config, impl, length: int, repeats: int) -> float:
    """Best wall time of the block's forward + backward on real (random) arrays."""
    step, (state, x), mesh, parallelism = block_step(config, impl, length)
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        real = jax.tree.map(
            lambda a: jax.device_put(
                0.02 * jax.random.normal(jax.random.key(0), a.shape, a.dtype)
                if a.dtype != jnp.int32
                else jnp.zeros(a.shape, a.dtype),
                a.sharding,
            ),
            (state, x),
        )
        return best_time(step, real, repeats)


def plan_total(config_path: str, devices: int) -> float:
    """The `--plan` total per device in GiB (a subprocess: the plan simulates its own device count)."""
    done = subprocess.run(
        [sys.executable, "-m", "train", config_path, "--plan", "--devices", str(devices)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(re.search(r"total\s+([\d.]+) GiB", done.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16K only, timing at 512 tokens, no --plan totals")
    args = parser.parse_args()
    lengths = (16384,) if args.quick else (16384, 131072)
    print(f"V2-Lite MoE block, forward + backward, context={CONTEXT}; per device")
    print("| tokens | dispatch | temp MiB | sent KiB / token |")
    print("|---|---|---|---|")
    for length in lengths:
        rows = {}
        quarter = length // CONTEXT // 4
        for name, impl, chunk in (
            ("partitioner (baseline)", partitioner_placed, 0),
            ("all-to-all", dispatched, 0),
            (f"all-to-all, chunks of {quarter}", dispatched, quarter),
        ):
            result = compiled(V2_LITE, impl, length, chunk)
            hlo = result.as_text()
            sent = all_to_all_bytes(hlo) + sum(moved_bytes(hlo).values())
            rows[name] = result.memory_analysis().temp_size_in_bytes, sent / (length / CONTEXT)
            per_token = "(in a loop)" if chunk else f"{rows[name][1] / 2**10:,.1f}"  # HLO text shows one iteration
            print(f"| {length} | {name} | {rows[name][0] / 2**20:,.0f} | {per_token} |")
        base_temp, base_sent = rows["partitioner (baseline)"]
        ratio(
            f"MoE block temporaries per device, T={length}, all-to-all",
            "partitioner-placed",
            rows["all-to-all"][0] / base_temp,
        )
        ratio(
            f"MoE block temporaries per device, T={length}, all-to-all in {quarter}-token chunks",
            "partitioner-placed",
            rows[f"all-to-all, chunks of {quarter}"][0] / base_temp,
        )
        ratio(f"bytes sent per token, T={length}, all-to-all", "partitioner-placed", rows["all-to-all"][1] / base_sent)
    length = 512 if args.quick else 4096
    fast, slow = (seconds(NARROW, impl, length, 2) for impl in (dispatched, partitioner_placed))
    print(
        f"time, forward + backward, widths {NARROW.embed_dim}/{NARROW.moe_mlp_dim}, T={length}: all-to-all "
        f"{fast:.2f} s, partitioner-placed {slow:.2f} s"
    )
    ratio(f"MoE block time, T={length}, quarter widths, all-to-all", "partitioner-placed", fast / slow)
    if not args.quick:
        for path, devices in (
            ("configs/finetune-128k-deepseek-v2-lite.yaml", 8),
            ("configs/finetune-128k-deepseek-v3.yaml", 256),
        ):
            total = plan_total(path, devices)
            print(f"--plan {path} --devices {devices}: {total:.2f} GiB per device")
            ratio(f"--plan total per device, {path.split('/')[-1]} on {devices} devices", "80 GiB", total / 80)


if __name__ == "__main__":
    main()
