"""The local blockwise attention kernel (parallel/kernels/blockwise.py) on one device: against dense attention, and
what block skipping saves on packed rows.

1. Kernel against dense: forward+backward (value and grad of the output's sum w.r.t. q, k, v) of the kernel
   (causal, block 512), `jax.nn.dot_product_attention(implementation="xla", is_causal=True)` and the repo's
   dense reference `bench/dense_attention.py`, batch 1, 4 heads x head_dim 64, float32. Each is
   compiled ahead of time; compiled temp memory comes from `memory_analysis()`. Time: every version is
   called once (warm-up), then the timed calls of the versions alternate; the time is the best timed call.
   A version whose warm-up call took longer than `--single-call-s` is not called again and its warm-up
   call is its time (the `calls` column says 1). Defaults: T = 2048, 4096, 8192 timed (dense_attention
   only up to `--dense-timed-max` 4096, memory above), 2 timed calls; at the long length (`--long`,
   131072) nothing runs: the table shows compiled memory only, and whether arguments + outputs + temp
   fit in this machine's RAM.
2. Block skipping: one row packed with documents of `--doc-len` tokens (131072 / 4096 = 32 documents,
   segment ids 1..32) against the same row as one causal document, 1 head x head_dim 64, float32, block 1024. Forward at
   the full row (`--long`), forward+backward at `--backward-len` (a shorter row of the same documents,
   because the unpacked long row's backward is too slow on a CPU). Visited block pairs come from
   `parallel.segments.visible_blocks`, the same summary the kernel skips by; their ratio is the FLOP
   ratio. Packed and unpacked calls alternate as in 1.

Prints two markdown tables; every ratio is within one run. About 5 minutes on 2 CPU cores, most of it the
unpacked 131072-token forward (one call).

    cd /work/main && PYTHONPATH=. .venv/bin/python bench/attention.py
    PYTHONPATH=. .venv/bin/python bench/attention.py --only packing --long 32768
    PYTHONPATH=. .venv/bin/python bench/attention.py --quick    # --lengths 2048 --long 32768 --backward-len 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.dense_attention import dense_attention
from bench.report import ratio
from parallel import kernels
from parallel.segments import block_summary, visible_blocks

MIB, GIB = 2**20, 2**30
HEADS, HEAD_DIM = 4, 64
PACK_HEADS, PACK_BLOCK = 1, 1024


@dataclasses.dataclass
class Timed:
    """One compiled function with its arguments and the seconds of its calls (the first is the warm-up)."""

    name: str
    compiled: jax.stages.Compiled
    args: tuple
    seconds: list[float] = dataclasses.field(default_factory=list)

    def call(self) -> None:
        start = time.perf_counter()
        jax.block_until_ready(self.compiled(*self.args))
        self.seconds.append(time.perf_counter() - start)

    @property
    def calls(self) -> int:
        return len(self.seconds) if len(self.seconds) == 1 else len(self.seconds) - 1

    @property
    def best(self) -> float:
        return min(self.seconds) if len(self.seconds) == 1 else min(self.seconds[1:])


def time_all(runs: list[Timed], repeats: int, single_call_s: float) -> None:
    """Warm-up call of each, then `repeats` rounds alternating over those whose warm-up was short."""
    for run in runs:
        run.call()
    again = [run for run in runs if run.seconds[0] <= single_call_s]
    for i in range(repeats):
        for run in again[::-1] if i % 2 else again:
            run.call()


def random_qkv(length: int, heads: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((1, length, heads, HEAD_DIM), np.float32)) for _ in range(3))


# ---- 1. kernel against dense ------------------------------------------------------------------------------


def kernel_out(q, k, v):
    options = kernels.Options(causal=True, block_q=512, block_kv=512)
    return kernels.attention(q, k, v, options=options, kernel="blockwise")[0]


def xla_out(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", is_causal=True)


def dense_out(q, k, v):
    return dense_attention(q, k, v, causal=True)


IMPLEMENTATIONS = {
    "blockwise kernel": kernel_out,
    "jax.nn.dot_product_attention xla": xla_out,
    "dense_attention (reference)": dense_out,
}


def forward_backward(fn):
    """Jitted value and gradient (w.r.t. q, k, v) of the sum of fn's output."""
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))


def kernel_vs_dense(args: argparse.Namespace) -> tuple[str, list[tuple[str, str, float]]]:
    """(markdown table, ratios: time of each timed version and temp memory at --long, against the kernel)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    lines = [
        f"| T | implementation | fwd+bwd (ms) | calls | time vs kernel | temp (MiB) | temp vs kernel "
        f"| fits in {ram / GIB:.0f} GiB RAM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for length in [*args.lengths, args.long]:
        timed = length != args.long
        qkv = (
            random_qkv(length, HEADS)
            if timed
            else (jax.ShapeDtypeStruct((1, length, HEADS, HEAD_DIM), jnp.float32),) * 3
        )
        runs, temps, totals = [], {}, {}
        for name, fn in IMPLEMENTATIONS.items():
            compiled = forward_backward(fn).lower(*qkv).compile()
            memory = compiled.memory_analysis()
            temps[name] = memory.temp_size_in_bytes
            totals[name] = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
            if timed and not (name.startswith("dense") and length > args.dense_timed_max):
                runs.append(Timed(name, compiled, qkv))
        if runs:
            time_all(runs, args.repeats, args.single_call_s)
        by_name = {run.name: run for run in runs}
        kernel = by_name.get("blockwise kernel")
        for name in IMPLEMENTATIONS:
            run = by_name.get(name)
            if run:
                time_cells = f"{1e3 * run.best:,.0f} | {run.calls} | {run.best / kernel.best:.2f}"
            else:
                time_cells = "not run | - | -"
            fits = "yes" if totals[name] < ram else "no"
            lines.append(
                f"| {length:,} | {name} | {time_cells} | {temps[name] / MIB:,.1f} "
                f"| {temps[name] / temps['blockwise kernel']:,.1f} | {fits} |"
            )
            if run and run is not kernel:
                ratios.append((f"fwd+bwd time, {name}, T={length:,}", "blockwise kernel", run.best / kernel.best))
            if length == args.long and name != "blockwise kernel":
                ratios.append(
                    (
                        f"compiled temp memory, {name}, T={length:,}",
                        "blockwise kernel",
                        temps[name] / temps["blockwise kernel"],
                    )
                )
    return "\n".join(lines), ratios


# ---- 2. block skipping on packed rows ---------------------------------------------------------------------


def packed_ids(length: int, doc_len: int) -> np.ndarray:
    """[1, length] segment ids 1, 1, ..., 2, 2, ...: documents of `doc_len` tokens back to back."""
    return (np.arange(length, dtype=np.int32) // doc_len + 1)[None]


def visited_pairs(segment_ids: np.ndarray, block: int) -> int:
    """Block pairs the kernel computes for a causal row with these segment ids (index 0..T-1)."""
    summary = block_summary(jnp.asarray(segment_ids), jnp.arange(segment_ids.shape[1], dtype=jnp.int32), block)
    return int(visible_blocks(summary, summary, causal=True).sum())


def kernel_with_ids(q, k, v, seg):
    options = kernels.Options(causal=True, block_q=PACK_BLOCK, block_kv=PACK_BLOCK)
    return kernels.attention(q, k, v, kernels.Tokens(seg), kernels.Tokens(seg), options, kernel="blockwise")[0]


def packing(args: argparse.Namespace) -> tuple[str, list[tuple[str, str, float]]]:
    """(markdown table, ratios: visited block pairs and time of the unpacked row against the packed one)."""
    lines = [
        "| T | pass | row | documents | visited block pairs | pairs unpacked / packed | time (s) | calls "
        "| time unpacked / packed | ms per visited pair |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    forward = jax.jit(kernel_with_ids)
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(kernel_with_ids(q, k, v, seg)), argnums=(0, 1, 2)))
    for length, name, fn in ((args.long, "fwd", forward), (args.backward_len, "fwd+bwd", fwd_bwd)):
        qkv = random_qkv(length, PACK_HEADS)
        rows = {"packed": packed_ids(length, args.doc_len), "unpacked": np.ones((1, length), np.int32)}
        pairs = {row: visited_pairs(ids, PACK_BLOCK) for row, ids in rows.items()}
        runs = [
            Timed(row, fn.lower(*qkv, jnp.asarray(ids)).compile(), (*qkv, jnp.asarray(ids)))
            for row, ids in rows.items()
        ]
        time_all(runs, args.repeats, args.single_call_s)
        best = {run.name: run for run in runs}
        for row in rows:
            run = best[row]
            docs = length // args.doc_len if row == "packed" else 1
            lines.append(
                f"| {length:,} | {name} | {row} | {docs} x {length // docs:,} | {pairs[row]:,} "
                f"| {pairs['unpacked'] / pairs[row]:.1f} | {run.best:.2f} | {run.calls} "
                f"| {best['unpacked'].best / run.best:.1f} | {1e3 * run.best / pairs[row]:.1f} |"
            )
        what = f"{name}, T={length:,}, one causal document vs {length // args.doc_len} packed documents"
        ratios.append((f"visited block pairs, {what}", "packed row", pairs["unpacked"] / pairs["packed"]))
        ratios.append((f"time, {what}", "packed row", best["unpacked"].best / best["packed"].best))
    return "\n".join(lines), ratios


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("dense", "packing"), help="run one of the two sections")
    parser.add_argument("--lengths", default="2048,4096,8192", help="timed lengths of section 1")
    parser.add_argument(
        "--long",
        type=int,
        default=131072,
        help="compile-only length of section 1 and the forward row length of section 2",
    )
    parser.add_argument(
        "--dense-timed-max",
        type=int,
        default=4096,
        help="longest T at which dense_attention is timed (above: memory only)",
    )
    parser.add_argument("--doc-len", type=int, default=4096, help="tokens per packed document")
    parser.add_argument("--backward-len", type=int, default=32768, help="row length of section 2's fwd+bwd")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per version after the warm-up")
    parser.add_argument(
        "--single-call-s",
        type=float,
        default=15.0,
        help="a version whose warm-up call is longer than this is timed by that call alone",
    )
    parser.add_argument("--quick", action="store_true", help="--lengths 2048 --long 32768 --backward-len 8192")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.long, args.backward_len = "2048", 32768, 8192
    args.lengths = [int(x) for x in args.lengths.split(",")]
    return args


def main() -> None:
    args = parse_args()
    print(f"device: {jax.devices()[0].device_kind} ({jax.device_count()} device), float32, batch 1")
    ratios = []
    if args.only != "packing":
        print(f"\n## Kernel vs dense, causal, {HEADS} heads x {HEAD_DIM}, forward+backward\n")
        table, found = kernel_vs_dense(args)
        print(table)
        ratios += found
    if args.only != "dense":
        print(
            f"\n## Block skipping: {args.doc_len:,}-token documents packed in one row vs one causal document, "
            f"{PACK_HEADS} head x {HEAD_DIM}, block {PACK_BLOCK}\n"
        )
        table, found = packing(args)
        print(table)
        ratios += found
    for measurement, baseline, value in ratios:
        ratio(measurement, baseline, value)


if __name__ == "__main__":
    main()
