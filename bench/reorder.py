"""Load-balanced sequence reorder (parallel/reorder.py): static layout ops against an index gather.

For each array, cp, layout and direction, both versions are jitted: `to_balanced` / `from_balanced`
(reshape, slice, flip, transpose) and `jnp.take` along the sequence axis with the precomputed permutation
from `layout_index`. After one warm-up call each, their timed calls alternate (which goes first
alternates too); the time is the best of the array's repeats. Prints a markdown table per array with
the time ratio gather / static (> 1: static is faster) and gather, while and total instruction counts of
each compiled HLO.

    PYTHONPATH=. python bench/reorder.py
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from parallel.reorder import from_balanced, layout_index, to_balanced

# name -> (shape, dtype, timed calls per version)
ARRAYS = {"activation [1, 131072, 8, 128] bf16": ((1, 131072, 8, 128), jnp.bfloat16, 10),
          "tokens [1, 131072] int32": ((1, 131072), jnp.int32, 100)}
CPS = (2, 8, 16)
LAYOUTS = (("dual_chunk", 1), ("striped", 1))


def static_fn(cp, strategy, stripe, forward):
    """Jitted to_balanced / from_balanced along axis 1."""
    fn = to_balanced if forward else from_balanced
    return jax.jit(lambda x: fn(x, cp, axis=1, strategy=strategy, stripe=stripe))


def gather_fn(cp, strategy, stripe, forward, length):
    """Jitted jnp.take along axis 1 with the layout's permutation (or its inverse) as a constant."""
    perm = layout_index(length, cp, strategy, stripe)
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


def measure(x, repeats, cp, strategy, stripe, forward) -> str:
    """One table row: static and gather versions compiled, checked equal, timed interleaved."""
    versions = [static_fn(cp, strategy, stripe, forward), gather_fn(cp, strategy, stripe, forward, x.shape[1])]
    compiled = [fn.lower(x).compile() for fn in versions]
    static_out, gather_out = (c(x) for c in compiled)
    assert bool(jnp.array_equal(static_out, gather_out)), (cp, strategy, forward)
    del static_out, gather_out
    best = [float("inf")] * 2
    for repeat in range(repeats):
        for i in (0, 1) if repeat % 2 else (1, 0):
            best[i] = min(best[i], seconds(compiled[i], x))
    counts = [hlo_counts(c) for c in compiled]
    direction = "to" if forward else "from"
    return (f"| {cp} | {strategy} | {direction} | {1e3 * best[0]:.3f} | {1e3 * best[1]:.3f} "
            f"| {best[1] / best[0]:.2f} | " + " | ".join(f"{g} / {w} / {n}" for g, w, n in counts) + " |")


def main() -> None:
    for name, (shape, dtype, repeats) in ARRAYS.items():
        x = jnp.asarray(np.random.default_rng(0).normal(size=shape) * 1000, dtype)
        print(f"{name}, {x.nbytes / 2**20:g} MiB, best of {repeats} calls")
        print()
        print("| cp | layout | direction | static (ms) | gather (ms) | gather / static "
              "| static HLO gather / while / instr | gather HLO gather / while / instr |")
        print("|---|---|---|---|---|---|---|---|")
        for cp in CPS:
            for strategy, stripe in LAYOUTS:
                for forward in (True, False):
                    print(measure(x, repeats, cp, strategy, stripe, forward), flush=True)
        print()
    print(f"device: {jax.device_count()} x {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()
