"""Scattered vs all-reduce tensor parallelism for one DeepSeek-V3-sized block at tensor=8, from compiled HLO.

For the dense block (MLA + SwiGLU) and the MoE block, compiles forward + backward on 8 simulated CPU devices with
abstract shapes (nothing is allocated or run) and reads off, per device: the bytes each collective moves (ring
algorithm: an all-gather or reduce-scatter moves (tp - 1) / tp of its full array, an all-reduce twice that),
the FLOPs (`cost_analysis`) and the temporary memory (`memory_analysis`); and the compiled FLOPs of the norm and
MLA down-projections alone (on T / tp tokens when scattered). Prints the ratios scattered / all-reduce.

    PYTHONPATH=. python bench/tp_collectives.py [--quick]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from bench.collectives import BYTES
from bench.report import ratio
from models.deepseek import Block
from parallel.mesh import make_mesh, state_shardings
from parallel.parallelism import Parallelism, use_parallelism
from parallel.tensor import residual_spec
from train.config import MeshConfig, ModelConfig, RopeScalingConfig

TP = 8
# DeepSeek-V3's block sizes (configs/models/deepseek-v3.yaml), bfloat16 compute.
V3 = ModelConfig(
    family="deepseek",
    vocab_size=129280,
    embed_dim=7168,
    num_layers=2,
    num_heads=128,
    num_kv_heads=128,
    head_dim=192,
    mlp_dim=18432,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    experts_per_token=8,
    moe_mlp_dim=2048,
    num_shared_experts=1,
    first_dense_layers=1,
    n_group=8,
    topk_group=4,
    param_dtype="bfloat16",
    rope_scaling=RopeScalingConfig(type="yarn", factor=40.0, original_max_position_embeddings=4096),
)
# A smaller block of the same shape for --quick.
QUICK = dataclasses.replace(
    V3,
    embed_dim=1024,
    num_heads=16,
    num_kv_heads=16,
    mlp_dim=2048,
    q_lora_rank=384,
    kv_lora_rank=128,
    num_experts=16,
    n_group=4,
    topk_group=2,
    moe_mlp_dim=256,
)
FACTOR = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}


def moved_bytes(hlo: str) -> dict[str, float]:
    """Collective kind -> bytes one device sends (ring algorithm) over the compiled program, all groups of > 1."""
    moved = dict.fromkeys(FACTOR, 0.0)
    for line in hlo.splitlines():
        match = re.search(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter|all-gather)\(", line)
        if not match:
            continue
        size = _group_size(line)
        if size <= 1:
            continue
        arrays = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
        total = sum(BYTES.get(dtype, 4) * _prod(dims) for dtype, dims in arrays)
        if match.group(2) == "reduce-scatter":
            total *= size  # the result is one shard; the ring moves (size - 1) shards of it
        moved[match.group(2)] += FACTOR[match.group(2)] * total * (size - 1) / size
    return moved


def _group_size(line: str) -> int:
    """Devices per replica group of one collective line (iota form `[groups,size]<=...` or explicit lists)."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return _prod(",".join(sizes[name] for name in re.findall(r"'(\w+)'", mesh.group(2))))
    return 1


def _prod(dims: str) -> int:
    """Product of a comma-separated list of sizes ("" -> 1)."""
    return math.prod(int(d) for d in dims.split(",") if d)


def compile_on_block(config: ModelConfig, fn, *, moe: bool, scatter: bool, tokens: int, grad: bool):
    """`fn(block, x)` compiled for one abstract block and x [1, tokens, embed] bfloat16 on a tensor=8 mesh, with
    the residual stream scattered or not; `grad`: its gradient with respect to the block's state and x."""
    mesh = make_mesh(MeshConfig(fsdp=1, tensor=TP))
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: Block(config, moe=moe, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16))
    )
    x = jax.ShapeDtypeStruct((1, tokens, config.embed_dim), jnp.bfloat16)

    def on_state(state, x):
        return fn(nnx.merge(graphdef, state), x)

    parallelism = Parallelism(scatter=scatter, block_q=1024, block_kv=1024)
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        shardings = (nnx.state(state_shardings(state, mesh)), NamedSharding(mesh, residual_spec()))
        compiled_fn = jax.grad(on_state, argnums=(0, 1)) if grad else on_state
        return jax.jit(compiled_fn, in_shardings=shardings).lower(state, x).compile()


def compile_block(config: ModelConfig, *, moe: bool, scatter: bool, tokens: int):
    """Compiled forward + backward of one block (sum of squares of its output)."""

    def loss(block, x):
        out, _ = block(x, jnp.arange(tokens)[None], None)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return compile_on_block(config, loss, moe=moe, scatter=scatter, tokens=tokens, grad=True)


def norm_and_down_flops(config: ModelConfig, *, scatter: bool, tokens: int) -> float:
    """Compiled FLOPs per device (forward) of the block's attention norm, MLA down-projections and latent norms:
    on T / tp tokens when scattered, on all T when the residual stream is replicated over tensor."""

    def down(block, x):
        h = block.attn_norm(x)
        q_low = block.attn.q_a_norm(h @ block.attn.q_a[...])
        kv_low = h @ block.attn.kv_a[...]
        return q_low, block.attn.kv_a_norm(kv_low[..., : config.kv_lora_rank]), kv_low[..., config.kv_lora_rank :]

    compiled = compile_on_block(config, down, moe=False, scatter=scatter, tokens=tokens, grad=False)
    return compiled.cost_analysis().get("flops", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1024-wide block at 2048 tokens instead of V3's")
    parser.add_argument("--tokens", type=int, default=None, help="sequence length (default 4096, quick 2048)")
    args = parser.parse_args()
    config = QUICK if args.quick else V3
    tokens = args.tokens or (2048 if args.quick else 4096)
    print(
        f"block: embed {config.embed_dim}, heads {config.num_heads}, q_lora {config.q_lora_rank}, kv_lora "
        f"{config.kv_lora_rank}, rope {config.qk_rope_head_dim}; {tokens} tokens; tensor={TP}; forward + backward"
    )
    print("| block | TP | all-gather MiB | reduce-scatter MiB | all-reduce MiB | total MiB | GFLOP | temp MiB |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for moe in (False, True):
        for scatter in (True, False):
            compiled = compile_block(config, moe=moe, scatter=scatter, tokens=tokens)
            moved = moved_bytes(compiled.as_text())
            flops = compiled.cost_analysis().get("flops", 0.0)
            temp = compiled.memory_analysis().temp_size_in_bytes
            results[moe, scatter] = sum(moved.values()), flops, temp
            name, mode = "MoE" if moe else "dense", "scattered" if scatter else "all-reduce"
            print(
                f"| {name} | {mode} | "
                + " | ".join(f"{moved[k] / 2**20:.1f}" for k in FACTOR)
                + f" | {sum(moved.values()) / 2**20:.1f} | {flops / 1e9:.1f} | {temp / 2**20:.1f} |"
            )
    down = {scatter: norm_and_down_flops(config, scatter=scatter, tokens=tokens) for scatter in (True, False)}
    print(
        f"attention norm + MLA down-projections + latent norms, forward, per device: all-reduce "
        f"{down[False] / 1e9:.2f} GFLOP, scattered {down[True] / 1e9:.2f} GFLOP"
    )
    for moe in (False, True):
        name = "MoE" if moe else "dense"
        (bytes_s, flops_s, temp_s), (bytes_a, flops_a, temp_a) = results[moe, True], results[moe, False]
        ratio(f"collective bytes, {name} block, scattered TP=8", "all-reduce TP=8", bytes_s / bytes_a)
        ratio(f"FLOPs per device, {name} block, scattered TP=8", "all-reduce TP=8", flops_s / flops_a)
        ratio(f"temp memory, {name} block, scattered TP=8", "all-reduce TP=8", temp_s / temp_a)
    ratio("norm + MLA down-projection FLOPs, scattered TP=8", "all-reduce TP=8", down[True] / down[False])


if __name__ == "__main__":
    main()
