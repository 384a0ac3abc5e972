"""Context strategies on 8 simulated CPU devices: ring load balance (FLOP counts) and per-device memory.

1. Ring load balance, counted, not run: for causal attention over `--length` tokens and each cp, the
   (query block, key block) pairs each device computes over the cp ring steps, from
   `parallel.segments.block_summary` / `visible_blocks` on the exact query and key pieces of every step
   (global indices from `parallel.reorder.layout_index`), times 4·bq·bk·heads·head_dim forward FLOPs:
   every step all local Q x all of the KV block, causal by global index, the kernel skipping invisible block
   pairs (what `ring` runs), in the dual_chunk (the ring's), striped (stripe 1) and contiguous (the
   unbalanced baseline) layouts.
   Reports busiest device / mean, the ring's critical path (sum over steps of the busiest device's work
   in that step, since every step ends in a ppermute all devices wait for) and total work against the
   ideal causal T²/2 pairs.
2. Per-device memory: forward+backward (grad of the output's sum w.r.t. q, k, v) compiled, not run, under
   jit with the dual_chunk layout for strategies ring, all_gather and ulysses on a cp-device mesh, and
   strategy none (the kernel alone) on one device over the whole sequence and over one device's share.
   Sizes from `compiled.memory_analysis()`: on the simulated CPU mesh these are per device (the SPMD
   program of one device); the script checks that the argument size is exactly the global q, k, v bytes
   / cp, and compares all_gather's per-device footprint with a single-device compile of the same local
   work (T/cp queries against all T keys). It also checks ring's temp against none(T)'s temp / cp plus a
   block-sized term, the intercept of the single-device temp fitted through the compiles at T/cp and T.
   Defaults: T = 65536, cp 4 and 8, batch 1, 8 heads x head_dim 128, block 512, float32. With bfloat16
   the CPU backend adds float32 copies of the whole q, k and v around the kernel's matmuls, so CPU
   bfloat16 memory overstates what a GPU would use.

    cd /work/main && PYTHONPATH=. .venv/bin/python bench/context.py
    PYTHONPATH=. .venv/bin/python bench/context.py --length 32768 --cps 2,4,8 --dtype bfloat16
    PYTHONPATH=. .venv/bin/python bench/context.py --quick    # --length 16384 --cps 8
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from bench.report import ratio
from parallel import kernels
from parallel.parallelism import current_parallelism, use_parallelism
from parallel.reorder import layout_index
from parallel.segments import block_summary, visible_blocks

MIB = 2**20
STRATEGIES = ("ring", "all_gather", "ulysses")


# ---- 1. ring load balance ---------------------------------------------------------------------------------


def pairs(q_index: np.ndarray, kv_index: np.ndarray, block: int, causal: bool) -> int:
    """Block pairs the kernel visits for one document with these global query / key indices."""

    def summary(index):
        return block_summary(jnp.ones((1, index.shape[0]), jnp.int32), jnp.asarray(index), block)

    return int(visible_blocks(summary(q_index), summary(kv_index), causal=causal).sum())


def step_pairs(length: int, cp: int, block: int, layout: str) -> np.ndarray:
    """[cp steps, cp devices] visited block pairs of every device at every ring step (device r receives
    the KV block of source (r - step) mod cp at that step, as in parallel/strategies/ring.py)."""
    pieces = layout_index(length, cp, layout).reshape(cp, -1)
    counts = np.zeros((cp, cp), np.int64)
    for step in range(cp):
        for rank in range(cp):
            counts[step, rank] = pairs(pieces[rank], pieces[(rank - step) % cp], block, causal=True)
    return counts


def balance(args: argparse.Namespace) -> tuple[str, list[tuple[str, str, float]]]:
    """(markdown table, ratios: busiest device / mean of the ring's layout and of the unbalanced one)."""
    flops_per_pair = 4 * args.block**2 * args.heads * args.head_dim
    ideal_pairs = (args.length / args.block) ** 2 / 2
    rows = (
        ("dual_chunk (ring)", "dual_chunk"),
        ("striped (stripe 1)", "striped"),
        ("contiguous (unbalanced)", "contiguous"),
    )
    lines = [
        "| cp | layout | busiest device (TFLOP) | mean (TFLOP) | busiest / mean | critical path / ideal "
        "per device | total / ideal T²/2 |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for cp in args.cps:
        for name, layout in rows:
            counts = step_pairs(args.length, cp, args.block, layout)
            per_device = counts.sum(0)
            critical = counts.max(1).sum()
            lines.append(
                f"| {cp} | {name} | {per_device.max() * flops_per_pair / 1e12:.2f} "
                f"| {per_device.mean() * flops_per_pair / 1e12:.2f} "
                f"| {per_device.max() / per_device.mean():.3f} "
                f"| {critical / (ideal_pairs / cp):.3f} | {counts.sum() / ideal_pairs:.3f} |"
            )
            if name.startswith(("dual_chunk", "contiguous")):
                ratios.append(
                    (
                        f"ring FLOPs of the busiest device, cp={cp}, {name}",
                        "mean device",
                        per_device.max() / per_device.mean(),
                    )
                )
    return "\n".join(lines), ratios


# ---- 2. per-device memory ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Memory:
    name: str
    devices: int
    argument: int
    output: int
    temp: int

    @property
    def total(self) -> int:
        return self.argument + self.output + self.temp


def memory_of(name: str, devices: int, compiled) -> Memory:
    stats = compiled.memory_analysis()
    return Memory(name, devices, stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.temp_size_in_bytes)


def loss_grad(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))


def single_device(length: int, args: argparse.Namespace) -> Memory:
    """Strategy none (the kernel alone, no mesh) over `length` tokens."""
    shape = jax.ShapeDtypeStruct((1, length, args.heads, args.head_dim), args.dtype)
    fn = loss_grad(lambda q, k, v: parallel.attention(q, k, v, causal=True, strategy="none", layout="contiguous"))
    return memory_of(f"none, T = {length:,}", 1, fn.lower(shape, shape, shape).compile())


def sharded(strategy: str, cp: int, args: argparse.Namespace) -> Memory:
    mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
    shape = jax.ShapeDtypeStruct(
        (1, args.length, args.heads, args.head_dim),
        args.dtype,
        sharding=NamedSharding(mesh, PartitionSpec(None, "context", None, None)),
    )
    fn = loss_grad(
        lambda q, k, v: parallel.attention(
            q, k, v, causal=True, mesh=mesh, strategy=strategy, axis="context", layout="dual_chunk"
        )
    )
    with jax.set_mesh(mesh):
        return memory_of(strategy, cp, fn.lower(shape, shape, shape).compile())


def all_gather_local(cp: int, args: argparse.Namespace) -> Memory:
    """One device's all_gather work compiled on one device: its T/cp queries (dual_chunk piece of device 0)
    against all T keys, forward+backward of the kernel."""
    index = layout_index(args.length, cp, "dual_chunk")
    n = args.length // cp
    q_shape = jax.ShapeDtypeStruct((1, n, args.heads, args.head_dim), args.dtype)
    kv_shape = jax.ShapeDtypeStruct((1, args.length, args.heads, args.head_dim), args.dtype)

    def fn(q, k, v):
        sides = (kernels.Tokens(index=jnp.asarray(index[:n])), kernels.Tokens(index=jnp.asarray(index)))
        options = kernels.Options(causal=True, block_q=args.block, block_kv=args.block)
        return kernels.attention(q, k, v, *sides, options, kernel="blockwise")[0]

    return memory_of("kernel: T/cp queries x T keys", 1, loss_grad(fn).lower(q_shape, kv_shape, kv_shape).compile())


def memory(args: argparse.Namespace) -> tuple[str, list[str], list[tuple[str, str, float]]]:
    blocks = dataclasses.replace(current_parallelism(), block_q=args.block, block_kv=args.block)
    with use_parallelism(blocks):
        return memory_tables(args)


def memory_tables(args: argparse.Namespace) -> tuple[str, list[str], list[tuple[str, str, float]]]:
    """(markdown table, notes, ratios: per-device args + output + temp of each strategy against none(T))."""
    itemsize = jnp.dtype(args.dtype).itemsize
    full = args.length * args.heads * args.head_dim * itemsize  # one global q-sized tensor
    whole = single_device(args.length, args)
    lines = [
        "| strategy | devices | per-device tokens | args (MiB) | output (MiB) | temp (MiB) "
        "| temp / per-device q | temp vs none(T) | args+out+temp vs none(T) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def row(m: Memory, tokens: int) -> None:
        unit = tokens * args.heads * args.head_dim * itemsize
        lines.append(
            f"| {m.name} | {m.devices} | {tokens:,} | {m.argument / MIB:,.1f} | {m.output / MIB:,.1f} "
            f"| {m.temp / MIB:,.1f} | {m.temp / unit:.2f} | {m.temp / whole.temp:.3f} "
            f"| {m.total / whole.total:.3f} |"
        )

    notes, ratios = [], []
    row(whole, args.length)
    for cp in args.cps:
        n = args.length // cp
        share = single_device(n, args)
        row(share, n)
        results = {strategy: sharded(strategy, cp, args) for strategy in STRATEGIES}
        for strategy, result in results.items():
            row(result, n)
            ratios.append(
                (
                    f"per-device args+output+temp, {strategy}, cp={cp}",
                    f"none, one device, T={args.length:,}",
                    result.total / whole.total,
                )
            )
        local = all_gather_local(cp, args)
        # kernel temp = slope * T + intercept from the two single-device compiles; the intercept is the
        # block-sized term
        slope = (whole.temp - share.temp) / (args.length - n)
        intercept = share.temp - slope * n
        target = whole.temp / cp + intercept
        ring = results["ring"].temp
        per_device = all(r.argument == 3 * full // cp for r in results.values())
        notes.append(
            f"- cp={cp}: every sharded compile reports args = {results['ring'].argument / MIB:,.1f} MiB = 3 x "
            f"{full / MIB:,.1f} MiB (global q, k, v) / {cp}: {'per device' if per_device else 'NOT per device'}. "
            f"all_gather per device args+out+temp {results['all_gather'].total / MIB:,.1f} MiB vs "
            f"{local.total / MIB:,.1f} MiB for the same local work compiled on one device "
            f"(temp {local.temp / MIB:,.1f} MiB), ratio {results['all_gather'].total / local.total:.2f}, not {cp}."
        )
        notes.append(
            f"- cp={cp}: ring temp {ring / MIB:,.1f} MiB vs target none(T) temp / cp + block term = "
            f"{whole.temp / MIB:,.1f} / {cp} + {intercept / MIB:,.1f} = {target / MIB:,.1f} MiB "
            f"(block term: intercept of the single-device temp fitted at T/cp and T): "
            f"{'met' if ring <= target else f'missed by {ring / target:.1f}x'}."
        )
    return "\n".join(lines), notes, ratios


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("balance", "memory"), help="run one of the two sections")
    parser.add_argument("--length", type=int, default=65536, help="tokens in the row")
    parser.add_argument("--cps", default="4,8", help="context sizes (at most 8)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=512, help="kernel block_q = block_kv, counted and compiled")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quick", action="store_true", help="--length 16384 --cps 8")
    args = parser.parse_args()
    if args.quick:
        args.length, args.cps = 16384, "8"
    args.cps = [int(x) for x in args.cps.split(",")]
    args.dtype = jnp.dtype(args.dtype)
    return args


def main() -> None:
    args = parse_args()
    print(
        f"device: {jax.device_count()} x {jax.devices()[0].device_kind} (simulated); causal, batch 1, "
        f"T = {args.length:,}, {args.heads} heads x {args.head_dim}, block {args.block}"
    )
    ratios = []
    if args.only != "memory":
        print("\n## Ring load balance (forward FLOPs over all ring steps, counted from visible block pairs)\n")
        table, found = balance(args)
        print(table)
        ratios += found
    if args.only != "balance":
        print(f"\n## Per-device memory, forward+backward, {args.dtype.name}, dual_chunk layout (compiled, not run)\n")
        table, notes, found = memory(args)
        print(table)
        print()
        print("\n".join(notes))
        ratios += found
    for measurement, baseline, value in ratios:
        ratio(measurement, baseline, value)


if __name__ == "__main__":
    main()
