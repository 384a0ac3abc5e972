"""Sliding-window attention under context parallelism: what the ring sends, what it keeps and what it costs with a
window of W tokens (halo exchange, parallel/strategies/halo.py) against the full causal ring, and whether a windowed
model needs the load-balanced layout.

1. Bytes and memory, compiled (not run) for 8 H100s (`--target h100`, the default when XLA's GPU compiler is
   installed: the kernel a GPU run would use) or 8 simulated CPU devices (`--target cpu`; XLA's CPU compiler carries
   bfloat16 permutes as float32) at T = `--length` (131072): one layer's attention forward + backward under the
   ring, dual_chunk and contiguous, for W = 4096 (Mistral), W = 128 (GPT-OSS) and no window, at Mistral-7B's
   attention shape (32 heads, 8 key/value heads, head_dim 128, bfloat16, batch 1). Bytes are what one device sends
   through collective permutes over the program, each loop body counted by its trip count (bench/collectives.py);
   temp is `memory_analysis().temp_size_in_bytes` per device.
2. Time, run on 8 simulated CPU devices at T = `--time-length` (32768; 4 heads, 1 key/value head, head_dim 64,
   float32): forward + backward with a window against the causal ring without one, next to the work ratio (visible
   query-key pairs with the window over those without): equal ratios say the skipped steps and blocks really are
   skipped. (A window of at least the row cuts nothing and is no window: the same program as causal.) With 8
   devices on 2 cores the total work decides.
3. Load balance, counted exactly: visible (query, key) pairs on the busiest device over the mean, per layout.
4. Block size with a window: the blockwise kernel on one device (T = `--time-length` / 4, W = 128) in blocks of
   256 and 512 against the max(64, W // 2) the strategies cap a windowed call's blocks to.

    PYTHONPATH=. .venv/bin/python bench/window.py
    PYTHONPATH=. .venv/bin/python bench/window.py --quick   # T = 16384 compiled, 8192 timed
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from bench.collectives import total_bytes
from bench.report import ratio
from bench.timing import best_time
from parallel import kernels, targets
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import layout_index

CP, GIB, MIB = 8, 2**30, 2**20
WINDOWS = (("W=4096 (Mistral)", 4096), ("W=128 (GPT-OSS)", 128))


def gradient(window, layout: str, mesh):
    """jit of (q, k, v) -> (dq, dk, dv) of sum(attention) under the ring."""

    def loss(q, k, v):
        out = parallel.attention(q, k, v, window=window, strategy="ring", axis="context", layout=layout, mesh=mesh)
        return jnp.sum(out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def shapes(length: int, heads: int, kv_heads: int, dim: int, dtype, mesh):
    """Abstract q, k, v [1, length, heads | kv_heads, dim] sharded over the context axis."""
    sharding = NamedSharding(mesh, PartitionSpec(None, "context", None, None))
    q = jax.ShapeDtypeStruct((1, length, heads, dim), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, length, kv_heads, dim), dtype, sharding=sharding)
    return q, kv, kv


def compiled_costs(args) -> None:
    """Part 1: bytes sent and temp per device for each window and layout against the full causal ring."""
    if args.target == "h100":
        mesh = Mesh(np.array(targets.compile_only_devices("h100", CP)), ("context",))
        parallelism = Parallelism(platform="gpu", capability="9.0")
    else:
        mesh, parallelism = Mesh(np.array(jax.devices()[:CP]), ("context",)), Parallelism()
    print(f"\n## Ring on {CP} {args.target} devices, T = {args.length}, one layer forward + backward (Mistral-7B "
          f"attention, bfloat16)\n")  # fmt: skip
    print("| layout | window | sent per device (MiB) | vs full ring | temp per device (MiB) | vs full ring |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layout in ("dual_chunk", "contiguous"):
        rows = {}
        for name, window in (("no window (full causal ring)", None), *WINDOWS):
            with use_parallelism(parallelism):
                compiled = gradient(window, layout, mesh).lower(*shapes(args.length, 32, 8, 128, jnp.bfloat16, mesh))
                compiled = compiled.compile()
            rows[name] = (total_bytes(compiled.as_text()), compiled.memory_analysis().temp_size_in_bytes)
        full_sent, full_temp = rows["no window (full causal ring)"]
        for name, (sent, temp) in rows.items():
            print(f"| {layout} | {name} | {sent / MIB:.1f} | {sent / full_sent:.4f} | {temp / MIB:.1f} | "
                  f"{temp / full_temp:.3f} |")  # fmt: skip
            if name != "no window (full causal ring)":
                ratio(f"ring bytes sent, {args.target}, {layout}, {name}, T={args.length}", "full causal ring",
                      sent / full_sent)  # fmt: skip
                ratio(f"ring temp, {args.target}, {layout}, {name}, T={args.length}", "full causal ring",
                      temp / full_temp)  # fmt: skip
    print(f"\n(goal: bytes within 2 / (cp - 1) = {2 / (CP - 1):.3f} of the full ring)")


def timed_costs(args, mesh) -> None:
    """Part 2: forward + backward time with each window against the causal ring without one."""
    length = args.time_length
    rng = np.random.default_rng(0)
    sharding = NamedSharding(mesh, PartitionSpec(None, "context", None, None))
    q, k, v = (
        jax.device_put(jnp.asarray(rng.normal(size=(1, length, h, 64)), jnp.float32), sharding) for h in (4, 1, 1)
    )
    print(f"\n## Time, T = {length}, cp = {CP}, dual_chunk, forward + backward (8 simulated devices, 2 cores)\n")
    print("| window | seconds | vs causal ring | work vs causal |")
    print("| --- | --- | --- | --- |")
    with use_parallelism(Parallelism()):  # blocks of 256; with a window at most max(64, W // 2)
        causal = best_time(gradient(None, "dual_chunk", mesh), (q, k, v), args.repeats)
        print(f"| none (causal ring) | {causal:.3f} | 1 | 1 |")
        for name, window in ((f"W={length // 2} (half the row)", length // 2), *WINDOWS):
            seconds = best_time(gradient(window, "dual_chunk", mesh), (q, k, v), args.repeats)
            work = visible_pairs(length, "dual_chunk", window).sum() / visible_pairs(length, "dual_chunk", None).sum()
            print(f"| {name} | {seconds:.3f} | {seconds / causal:.3f} | {work:.3f} |")
            ratio(f"ring time, dual_chunk, {name}, T={length}", "causal ring", seconds / causal)
            ratio(f"ring time / work, dual_chunk, {name}, T={length}", "causal ring", seconds / causal / work)


def visible_pairs(length: int, layout: str, window: int | None) -> np.ndarray:
    """[CP] visible (query, key) pairs of one document on each device: a query at i sees min(W, i + 1) keys."""
    index = layout_index(length, CP, layout).reshape(CP, -1).astype(np.int64)
    return np.minimum(index + 1, window or length).sum(axis=1)


def load_balance(args) -> None:
    """Part 3: the busiest device's share of the work with and without the load-balanced layout."""
    print(f"\n## Load balance, T = {args.length}, cp = {CP}: busiest device's visible pairs / mean\n")
    print("| window | contiguous | dual_chunk |")
    print("| --- | --- | --- |")
    for name, window in (("none (causal)", None), *WINDOWS):
        cells = []
        for layout in ("contiguous", "dual_chunk"):
            pairs = visible_pairs(args.length, layout, window)
            cells.append(pairs.max() / pairs.mean())
            ratio(f"busiest device's attention work, {layout}, {name}", "mean device", cells[-1])
        print(f"| {name} | {cells[0]:.4f} | {cells[1]:.4f} |")


def block_sizes(args) -> None:
    """Part 4: one device's windowed kernel forward + backward in long blocks against blocks capped to the window."""
    length, window = args.time_length // 4, 128
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, h, 64)), jnp.float32) for h in (4, 1, 1))

    def timed(block: int) -> float:
        options = kernels.Options(window=window, block_q=block, block_kv=block)
        loss = lambda q, k, v: jnp.sum(kernels.attention(q, k, v, options=options, kernel="blockwise")[0])
        return best_time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), args.repeats)

    capped = max(64, window // 2)
    base = timed(capped)
    print(f"\n## Blocks with W = {window}, one device, T = {length}, forward + backward\n")
    print("| blocks | seconds | vs capped |")
    print("| --- | --- | --- |")
    print(f"| {capped} (the cap) | {base:.3f} | 1 |")
    for block in (256, 512):
        seconds = timed(block)
        print(f"| {block} | {seconds:.3f} | {seconds / base:.2f} |")
        ratio(f"windowed kernel time, W={window}, blocks of {block}", f"blocks of {capped}", seconds / base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--time-length", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="T = 16384 compiled, 8192 timed, one timed call")
    parser.add_argument("--target", choices=("h100", "cpu"), default="h100" if targets.plugin_installed() else "cpu")
    args = parser.parse_args()
    if args.quick:
        args.length, args.time_length, args.repeats = 16384, 8192, 1
    compiled_costs(args)
    timed_costs(args, Mesh(np.array(jax.devices()[:CP]), ("context",)))
    load_balance(args)
    block_sizes(args)


if __name__ == "__main__":
    main()
