"""DeepSeek sparse attention (parallel/deepseek_sparse.py) against dense latent attention, in the same run: one layer's
forward + backward (sparse: with the indexer's loss and its gradient, as training runs it) on one CPU device
(DeepSeek-V3.2's index_topk 2048, latent 512 + 64, indexer keys 128 wide with 64 index heads; 16 query heads to fit a
CPU), timed at the shorter lengths and compiled at all, with the compiled temporaries of each and their slope with
length (log-log: 1 is T, 2 is T^2); then what a split over 8 context devices gathers per device and layer at the longest
length (from the compiled all-gathers) against what a ring rotating the latent moves.

    PYTHONPATH=. python bench/dsa.py           # 8K run, 32K and 128K compiled only (about 12 minutes on 2 cores)
    PYTHONPATH=. python bench/dsa.py --quick   # 4K and 8K run, index_topk 512 (about 6 minutes)
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from bench.report import ratio
from bench.timing import best_time
from parallel.latent import expand
from parallel.parallelism import Parallelism, use_parallelism
from parallel.tensor import Tokens

HEADS, LORA, ROPE, NOPE, DV, INDEX_HEADS, INDEX_DIM = 16, 512, 64, 128, 128, 64, 128
MIB = 2**20


def arguments(length: int):
    """Abstract operands: q, latent rows, kv_b, the indexer's queries, keys and weights, the output's cotangent."""
    shapes = [
        (1, length, HEADS, NOPE + ROPE), (1, length, LORA + ROPE), (LORA, HEADS, NOPE + DV),
        (1, length, INDEX_HEADS, INDEX_DIM), (1, length, INDEX_DIM), (1, length, INDEX_HEADS), (1, length, HEADS, DV),
    ]  # fmt: skip
    return [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]


def layer(sparse: bool, count: int):
    """grad of sum(out * w) in q, the rows and kv_b for one attention layer, sparse (plus its indexer's loss, whose
    gradient reaches the indexer's queries, keys and weights) or dense."""

    def loss(q, rows, kv_b, indexer_q, indexer_k, weights, w):
        latent = parallel.Latent(Tokens(rows[None]), kv_b, NOPE)
        if sparse:
            indexer_out = parallel.IndexerOutput(indexer_q, indexer_k, weights)
            out, indexer_loss = parallel.sparse_attention(q, latent, indexer_out=indexer_out, count=count)
            return jnp.sum(out * w) + jnp.sum(indexer_loss)
        out = parallel.attention(q, *expand(kv_b, rows, NOPE), causal=True, latent=latent)
        return jnp.sum(out * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def measure(length: int, count: int, run: bool) -> dict:
    """{kind: (seconds or None, temporaries in bytes)} of the sparse and the dense layer at `length`."""
    found = {}
    for kind in ("sparse", "dense"):
        compiled = layer(kind == "sparse", count).lower(*arguments(length)).compile()
        seconds = None
        if run:
            rng = np.random.default_rng(0)
            values = [jnp.asarray(rng.normal(size=a.shape) * 0.1, jnp.float32) for a in arguments(length)]
            seconds = best_time(compiled, values, repeats=1)  # after one warm-up call
        found[kind] = (seconds, compiled.memory_analysis().temp_size_in_bytes)
    return found


def gathered_bytes(length: int, count: int, shards: int) -> int:
    """Bytes one device receives from the all-gathers of one sparse layer's forward over a ring of `shards`."""
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "context"))
    args = [  # kv_b whole on every device, the rest split on length
        jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=None if a.shape[0] == LORA else sharding)
        for a in arguments(length)
    ]

    def forward(q, rows, kv_b, indexer_q, indexer_k, weights, w):
        latent = parallel.Latent(Tokens(rows[None]), kv_b, NOPE)
        return parallel.sparse_attention(
            q, latent, indexer_out=parallel.IndexerOutput(indexer_q, indexer_k, weights), count=count
        )[0]

    with jax.set_mesh(mesh), use_parallelism(Parallelism(strategy="ring", layout="dual_chunk", mesh=mesh)):
        text = jax.jit(forward).lower(*args).as_text()
    sizes = {"bf16": 2, "f32": 4, "i32": 4}
    total = 0
    for shape, dtype in re.findall(r"all_gather.*-> tensor<([\dx]+)x(bf16|f32|i32)>", text):
        total += sizes[dtype] * math.prod(int(d) for d in shape.split("x"))
    return total * (shards - 1) // shards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4K and 8K, index_topk 512")
    args = parser.parse_args()
    count, lengths = (512, (4096, 8192)) if args.quick else (2048, (8192, 32768, 131072))
    print(f"one layer, forward + backward, float32 on CPU: {HEADS} heads, latent {LORA} + {ROPE}, index_topk {count}, "
          f"{INDEX_HEADS} index heads of {INDEX_DIM}\n")  # fmt: skip
    print("| tokens | sparse (s) | dense (s) | sparse temporaries (MiB) | dense temporaries (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    results = {}
    for length in lengths:
        results[length] = measure(length, count, run=length <= 8192)
        (s_time, s_mem), (d_time, d_mem) = results[length]["sparse"], results[length]["dense"]
        show = lambda t: "compiled only" if t is None else f"{t:.2f}"
        print(f"| {length:,} | {show(s_time)} | {show(d_time)} | {s_mem / MIB:,.0f} | {d_mem / MIB:,.0f} |")
    first, last = lengths[0], lengths[-1]
    ran = [length for length in lengths if results[length]["sparse"][0] is not None]
    slope = lambda kind, part, a, b: math.log(results[b][kind][part] / results[a][kind][part]) / math.log(b / a)
    print(f"\nslope of temporaries with length, {first:,} to {last:,}: sparse {slope('sparse', 1, first, last):.2f}, "
          f"dense {slope('dense', 1, first, last):.2f}")  # fmt: skip
    if len(ran) > 1:  # the indexer scores every pair: its share of the sparse time grows as T^2
        print(f"slope of time, {ran[0]:,} to {ran[-1]:,}: sparse {slope('sparse', 0, ran[0], ran[-1]):.2f}, "
              f"dense {slope('dense', 0, ran[0], ran[-1]):.2f}")  # fmt: skip
    ratio(
        f"sparse layer temporaries at {last:,} tokens", "dense", results[last]["sparse"][1] / results[last]["dense"][1]
    )
    ratio(
        f"sparse layer time at {ran[-1]:,} tokens",
        "dense",
        results[ran[-1]]["sparse"][0] / results[ran[-1]]["dense"][0],
    )
    shards, length = 8, lengths[-1]
    sparse = gathered_bytes(length, count, shards)
    ring = (shards - 1) * (length // shards) * (LORA + ROPE) * 2  # bfloat16 latent rows, one piece per step
    print(f"\n{length:,} tokens over {shards} context devices, bfloat16, forward: sparse attention gathers "
          f"{sparse / MIB:,.1f} MiB a device and layer (latent rows, indexer keys, segment ids); a ring rotating the "
          f"latent moves {ring / MIB:,.1f} MiB")  # fmt: skip
    ratio(f"bytes per device and layer at {length:,} over {shards}, sparse", "ring (latent)", sparse / ring)


if __name__ == "__main__":
    main()
