"""Ring attention on 8 simulated CPU devices against the `ringattention` package, and where its time goes.

Causal forward+backward (the gradient of sum(out * dout) in q, k, v), float32, batch 1, one document. Each version
gets its natural input order: ours the dual_chunk layout (the training step reorders once per batch, outside
attention), ringattention's contiguous pieces. Outputs are checked equal (after undoing our order) before timing.
Time: best of `--repeats` calls, the versions alternating. Memory: `compiled.memory_analysis()` per device.

Where the time goes, from the bottom up, each under the same shard_map on the same 8 devices:
  1. matmul floor: the ring's useful FLOPs (causal T²/2 pairs, 2 matmuls forward and 5 backward) as the
     kernel's block-sized matmuls alone;
  2. kernel steps: every device runs the kernel calls of its ring steps (cp causal calls by global index: the
     diagonal, then cp - 1 of which one chunk against a whole piece is visible) on its own pieces: no ppermute,
     no merge;
  3. the ring itself.
Then the ring's per-device footprint (args + output + temp) against one device holding the whole sequence, at
`--footprint-length`.

With 8 simulated devices on 2 cores all devices share the cores, so the total work decides the time and a ring's
load balance does not show. `--devices 2` gives each device a core of its own (single-threaded ops), as on real
hardware: then a step waits for its busiest device, and ringattention's contiguous causal ring (device 1 does
1.5x the work of a balanced device, device 0 half) pays for its imbalance.

Needs `pip install ringattention einops` for the comparison rows (its package __init__ does not import on
JAX >= 0.5, so the module is loaded from its file); without it those rows are skipped.

    PYTHONPATH=. .venv/bin/python bench/ring.py
    PYTHONPATH=. .venv/bin/python bench/ring.py --quick     # T = 4096, one timed call
    PYTHONPATH=. .venv/bin/python bench/ring.py --devices 2  # one core per device: load balance counts
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count="
        + (sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"),
        # --devices N: each device runs its ops on its own single thread, so with N <= cores every device has a
        # core to itself, as on real hardware
        "--xla_cpu_multi_thread_eigen=false" if "--devices" in sys.argv else "",
    ]
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import dataclasses
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from bench.report import ratio
from parallel import kernels
from parallel.parallelism import current_parallelism, use_parallelism
from parallel.reorder import layout_index

MIB = 2**20
AXIS = "context"


def ringattention_module():
    """ringattention's pure-JAX ring (ringattention_jax.py), or None when the package is not installed."""
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "ringattention_jax.py")
    module_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def grad_fn(attend):
    """jit of (q, k, v, dout) -> (dq, dk, dv) of sum(attend(q, k, v) * dout), and of attend itself."""

    def loss(q, k, v, dout):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), jax.jit(attend)


def ours(mesh, args):
    def attend(q, k, v):
        return parallel.attention(q, k, v, causal=True, mesh=mesh, strategy="ring", axis=AXIS, layout="dual_chunk")

    return grad_fn(attend)


def theirs(module, mesh, args):
    options = dict(
        causal_block_size=1,
        query_chunk_size=args.block,
        key_chunk_size=args.block,
        deterministic=True,
        dropout_rng=None,
        attn_pdrop=0.0,
        dtype=jnp.float32,
        policy=jax.checkpoint_policies.nothing_saveable,
        precision=None,
        prevent_cse=True,
    )
    spec = PartitionSpec(None, AXIS, None, None)

    def local(q, k, v):
        return module.ring_attention(q, k, v, None, None, None, AXIS, True, options)

    return grad_fn(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False))


def kernel_steps(mesh, args):
    """Each device runs its ring's kernel calls on its own pieces (cp causal calls of the local queries against a
    piece, by global index: the diagonal, then cp - 1 whose visible pairs are one chunk against a whole piece; as
    rank 0 sees them, the same cost on every rank): the ring's compute without its ppermutes and merges."""
    cp, spec = mesh.shape[AXIS], PartitionSpec(None, AXIS, None, None)
    index = layout_index(args.length, cp, "dual_chunk").reshape(cp, -1)

    def local(q, k, v):
        options = kernels.Options(causal=True, block_q=args.block, block_kv=args.block)
        piece = [kernels.Tokens(index=jnp.asarray(rank_index)) for rank_index in index]
        out = kernels.attention(q, k, v, piece[0], piece[0], options, kernel="blockwise")[0]
        for step in range(1, cp):
            k = k * (1 + 1e-3 * step)  # a different key piece each step, as in the ring (no common subexpressions)
            out = out + kernels.attention(q, k, v, piece[0], piece[step], options, kernel="blockwise")[0]
        return out

    return grad_fn(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False))


def matmul_floor(mesh, args):
    """Per device, the ring's useful FLOPs as the kernel's block matmuls alone: block-sized scores [H, block,
    block] then scores x V, in a loop, nothing else (no softmax, mask, recomputation bookkeeping)."""
    spec, cp, block = PartitionSpec(None, AXIS, None, None), mesh.shape[AXIS], args.block
    pair_flops = 2 * 2 * block * block * args.heads * args.head_dim
    pairs = round(useful_flops(args) / cp / pair_flops)

    def local(q, k, v):
        a, b, c = (jnp.swapaxes(x[0, :block], 0, 1) for x in (q, k, v))  # [H, block, D]

        def pair(i, acc):
            s = jnp.einsum("hqd,hkd->hqk", a + acc[:, :, :1], b)
            return acc + jnp.einsum("hqk,hkd->hqd", s, c)

        acc = jax.lax.fori_loop(0, pairs, pair, jnp.zeros_like(a))
        return jnp.broadcast_to(acc.sum(), q.shape)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False))


def useful_flops(args) -> float:
    """Causal fwd+bwd FLOPs counted once: T²/2 pairs x (2 forward + 5 backward matmuls) x 2·H·D."""
    return args.length**2 / 2 * 7 * 2 * args.heads * args.head_dim


@dataclasses.dataclass
class Row:
    name: str
    fn: object
    inputs: tuple
    seconds: float = float("inf")
    temp: float = float("nan")


def timed(rows, repeats):
    for row in rows:
        compiled = row.fn.lower(*row.inputs).compile()
        row.temp = compiled.memory_analysis().temp_size_in_bytes
        jax.block_until_ready(row.fn(*row.inputs))
    for _ in range(repeats):
        for row in rows:
            start = time.perf_counter()
            jax.block_until_ready(row.fn(*row.inputs))
            row.seconds = min(row.seconds, time.perf_counter() - start)


def footprint(args) -> tuple[float, float]:
    """(ring per-device args+output+temp, one device's for the whole sequence) in bytes, compiled, not run."""

    def total(fn, *shapes):
        stats = fn.lower(*shapes).compile().memory_analysis()
        return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes

    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    sharding = NamedSharding(mesh, PartitionSpec(None, AXIS, None, None))
    shape = (1, args.footprint_length, args.heads, args.head_dim)
    sharded = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
    with jax.set_mesh(mesh):
        ring = total(ours(mesh, args)[0], sharded, sharded, sharded, sharded)
    whole = jax.ShapeDtypeStruct(shape, jnp.float32)
    none = grad_fn(lambda q, k, v: parallel.attention(q, k, v, causal=True, strategy="none"))[0]
    return ring, total(none, whole, whole, whole, whole)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=256, help="both kernels' query and key block")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--footprint-length", type=int, default=16384)
    parser.add_argument(
        "--devices", type=int, default=8, help="simulated devices (cp), each single-threaded (<= cores: a core each)"
    )
    parser.add_argument("--quick", action="store_true", help="--length 4096 --repeats 1 --footprint-length 8192")
    args = parser.parse_args()
    if args.quick:
        args.length, args.repeats, args.footprint_length = 4096, 1, 8192

    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    cp = mesh.shape[AXIS]
    rng = np.random.default_rng(0)
    shape = (1, args.length, args.heads, args.head_dim)
    q, k, v, dout = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    order = layout_index(args.length, cp, "dual_chunk")
    sharding = NamedSharding(mesh, PartitionSpec(None, AXIS, None, None))
    natural = tuple(jax.device_put(x, sharding) for x in (q, k, v, dout))
    reordered = tuple(jax.device_put(x[:, order], sharding) for x in (q, k, v, dout))
    print(
        f"device: {cp} x {jax.devices()[0].device_kind} (simulated); causal fwd+bwd, float32, batch 1, "
        f"T = {args.length:,}, {args.heads} heads x {args.head_dim}, block {args.block}"
    )

    with (
        jax.set_mesh(mesh),
        use_parallelism(dataclasses.replace(current_parallelism(), block_q=args.block, block_kv=args.block)),
    ):
        ring_grad, ring_out = ours(mesh, args)
        rows = [
            Row("matmul floor (useful FLOPs as batched matmuls)", matmul_floor(mesh, args), natural[:3]),
            Row("kernel steps alone (no ppermute, no merge)", kernel_steps(mesh, args)[0], natural),
            Row("ring (ours, dual_chunk)", ring_grad, reordered),
        ]
        module = ringattention_module()
        if module is None:
            print("ringattention is not installed (pip install ringattention einops): its rows are skipped")
        else:
            their_grad, their_out = theirs(module, mesh, args)
            got = np.asarray(ring_out(*reordered[:3]))
            want = np.asarray(their_out(*natural[:3]))[:, order]
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
            rows.append(Row("ringattention (pip, contiguous)", their_grad, natural))
        timed(rows, args.repeats)
        ring_total, whole_total = footprint(args)

    flops = useful_flops(args)
    by_name = {row.name.split(" (")[0]: row for row in rows}
    ring = by_name["ring"]
    print("\n| version | time (ms) | GFLOP/s (useful) | time vs ring | temp per device (MiB) | temp vs ring |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row.name} | {row.seconds * 1e3:,.0f} | {flops / row.seconds / 1e9:.1f} "
            f"| {row.seconds / ring.seconds:.2f} | {row.temp / MIB:,.1f} | {row.temp / ring.temp:.2f} |"
        )
    print(
        f"\nring footprint per device at T = {args.footprint_length:,}: {ring_total / MIB:,.1f} MiB vs "
        f"{whole_total / MIB:,.1f} MiB on one device: {ring_total / whole_total:.3f} (1/cp = {1 / cp:.3f}, "
        f"target 1.5/cp = {1.5 / cp:.3f})"
    )
    ratio("ring fwd+bwd time", "matmul floor", ring.seconds / by_name["matmul floor"].seconds)
    ratio("ring fwd+bwd time", "kernel steps alone", ring.seconds / by_name["kernel steps alone"].seconds)
    if "ringattention" in by_name:
        ratio("ring fwd+bwd time", "ringattention", ring.seconds / by_name["ringattention"].seconds)
        ratio("ring temp per device", "ringattention", ring.temp / by_name["ringattention"].temp)
    ratio(
        f"ring args+output+temp per device, T={args.footprint_length}",
        "one device, whole sequence",
        ring_total / whole_total,
    )


if __name__ == "__main__":
    main()
