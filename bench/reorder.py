"""Load-balanced sequence reorder (parallel/reorder.py): static layout ops against an index gather.

For each array, cp, layout and direction, both versions are jitted: `to_balanced` / `from_balanced`
(reshape, slice, flip, transpose) and `jnp.take` along the sequence axis with the precomputed permutation
from `layout_index`. After one warm-up call each, their timed calls alternate (which goes first
alternates too); the time is the best of the array's repeats. Prints a markdown table per array with
the time ratio gather / static (> 1: static is faster) and gather, while and total instruction counts of
each compiled HLO, and per array and layout the median gather / static ratio over cp and direction.

    PYTHONPATH=. python bench/reorder.py
    PYTHONPATH=. python bench/reorder.py --quick    # cp 8 only, 3 timed calls per version on the activation
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import ratio
from parallel.reorder import from_balanced, layout_index, to_balanced

# name -> (shape, dtype, timed calls per version, the same with --quick)
ARRAYS = {
    "activation [1, 131072, 8, 128] bf16": ((1, 131072, 8, 128), jnp.bfloat16, 10, 3),
    "tokens [1, 131072] int32": ((1, 131072), jnp.int32, 100, 100),
}
CPS = (2, 8, 16)
LAYOUTS = (("dual_chunk", 1), ("striped", 1))


def static_fn(cp, layout, stripe, forward):
    """Jitted to_balanced / from_balanced along axis 1."""
    fn = to_balanced if forward else from_balanced
    return jax.jit(lambda x: fn(x, cp, axis=1, layout=layout, stripe=stripe))


def gather_fn(cp, layout, stripe, forward, length):
    """Jitted jnp.take along axis 1 with the layout's permutation (or its inverse) as a constant."""
    perm = layout_index(length, cp, layout, stripe)
    perm = perm if forward else np.argsort(perm).astype(np.int32)
    return jax.jit(lambda x: jnp.take(x, perm, axis=1))


def hlo_counts(compiled) -> tuple[int, int, int]:
    """(gather ops, while ops, all instructions) of compiled HLO text, fused computations included."""
    ops = [op.lower() for op in re.findall(r"=\s*\S+\s+([\w-]+)\(", compiled.as_text())]
    return ops.count("gather"), ops.count("while"), len(ops)


def seconds(compiled, x) -> float:
    """Wall seconds of one call, waited for."""
    start = time.perf_counter()
    compiled(x).block_until_ready()
    return time.perf_counter() - start


def measure(x, repeats, cp, layout, stripe, forward) -> tuple[str, float]:
    """(table row, gather / static time): static and gather versions compiled, checked equal, timed interleaved."""
    versions = [static_fn(cp, layout, stripe, forward), gather_fn(cp, layout, stripe, forward, x.shape[1])]
    compiled = [fn.lower(x).compile() for fn in versions]
    static_out, gather_out = (c(x) for c in compiled)
    assert bool(jnp.array_equal(static_out, gather_out)), (cp, layout, forward)
    del static_out, gather_out
    best = [float("inf")] * 2
    for repeat in range(repeats):
        for i in (0, 1) if repeat % 2 else (1, 0):
            best[i] = min(best[i], seconds(compiled[i], x))
    counts = [hlo_counts(c) for c in compiled]
    direction = "to" if forward else "from"
    row = (
        f"| {cp} | {layout} | {direction} | {1e3 * best[0]:.3f} | {1e3 * best[1]:.3f} "
        f"| {best[1] / best[0]:.2f} | " + " | ".join(f"{g} / {w} / {n}" for g, w, n in counts) + " |"
    )
    return row, best[1] / best[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="cp 8 only, 3 timed calls per version on the activation")
    args = parser.parse_args()
    cps = (8,) if args.quick else CPS
    ratios = {}
    for name, (shape, dtype, repeats, quick_repeats) in ARRAYS.items():
        repeats = quick_repeats if args.quick else repeats
        x = jnp.asarray(np.random.default_rng(0).normal(size=shape) * 1000, dtype)
        print(f"{name}, {x.nbytes / 2**20:g} MiB, best of {repeats} calls")
        print()
        print(
            "| cp | layout | direction | static (ms) | gather (ms) | gather / static "
            "| static HLO gather / while / instr | gather HLO gather / while / instr |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for cp in cps:
            for layout, stripe in LAYOUTS:
                for forward in (True, False):
                    row, gather_over_static = measure(x, repeats, cp, layout, stripe, forward)
                    ratios.setdefault((name.split(" [")[0], layout), []).append(gather_over_static)
                    print(row, flush=True)
        print()
    print(f"device: {jax.device_count()} x {jax.devices()[0].device_kind}")
    for (array, layout), values in ratios.items():
        ratio(
            f"{array} reorder time, index gather, {layout} (median over cp {'/'.join(map(str, cps))}, to/from)",
            "static layout ops",
            statistics.median(values),
        )


if __name__ == "__main__":
    main()
