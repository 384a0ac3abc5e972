"""Compiled temp memory and wall time of seqlens_offsets (cuDNN's per-segment lengths and offsets under a padding
mask) against one-hot O(T·S) and explicit-mask O(T²) methods.

Run: PYTHONPATH=. python bench/segments.py
     PYTHONPATH=. python bench/segments.py --quick    # T = 8192 only
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.report import ratio
from parallel.segments import INT32_MAX, seqlens_offsets

SEGMENTS = 16
LONG, SHORT = 131072, 8192


def packed(length: int, segments: int, seed: int = 0):
    """[1, T] segment ids: `segments` random-length documents, then padding."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length - length // 16), segments - 1, replace=False))
    bounds = np.concatenate([[0], cuts, [length - length // 16]])
    seg = np.zeros(length, np.int32)
    for s, (a, b) in enumerate(itertools.pairwise(bounds), 1):
        seg[a:b] = s
    return jnp.asarray(seg[None])


def _count_first(visible, member):
    """[T] visibility, [T, S+1] membership -> ([S] count, [S] first index or -1)."""
    hits = member & visible[:, None]
    count = hits.sum(0, dtype=jnp.int32)[1:]
    first = jnp.where(hits, jnp.arange(visible.shape[0], dtype=jnp.int32)[:, None], INT32_MAX).min(0)[1:]
    return count, jnp.where(count > 0, first, -1)


def onehot(q_seg, kv_seg, *, max_segments):
    """O(T·S): [T, S+1] one-hot membership, reduced over T per segment."""

    def row(q_seg, kv_seg):
        ids = jnp.arange(max_segments + 1)
        q_mem, kv_mem = q_seg[:, None] == ids, kv_seg[:, None] == ids
        q_vis, kv_vis = kv_mem.any(0)[q_seg], q_mem.any(0)[kv_seg]
        q_len, q_off = _count_first(q_vis & (q_seg > 0), q_mem)
        kv_len, kv_off = _count_first(kv_vis & (kv_seg > 0), kv_mem)
        return q_len, kv_len, q_off, kv_off

    return jax.vmap(row)(q_seg, kv_seg)


def explicit(q_seg, kv_seg, *, max_segments):
    """O(T²): the [Tq, Tk] visibility matrix, reduced along each axis."""

    def row(q_seg, kv_seg):
        vis = (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] > 0)
        ids = jnp.arange(max_segments + 1)
        q_len, q_off = _count_first(vis.any(1), q_seg[:, None] == ids)
        kv_len, kv_off = _count_first(vis.any(0), kv_seg[:, None] == ids)
        return q_len, kv_len, q_off, kv_off

    return jax.vmap(row)(q_seg, kv_seg)


def measure(fn, length: int, run: bool = True):
    """(temp MiB, best-of-5 wall ms or None) of jitted `fn` on a [1, length] packing."""
    seg = packed(length, SEGMENTS)
    jitted = jax.jit(lambda s: fn(s, s, max_segments=SEGMENTS))
    compiled = jitted.lower(seg).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    if not run:
        return temp, None
    jax.block_until_ready(compiled(seg))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(seg))
        times.append(time.perf_counter() - start)
    return temp, min(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 8192 only")
    lengths = (SHORT,) if parser.parse_args().quick else (LONG, SHORT)
    methods = (
        ("(a) segment reductions", seqlens_offsets),
        ("(b) one-hot [T, S+1]", onehot),
        ("(c) explicit [T, T] mask", explicit),
    )
    print(f"backend: {jax.default_backend()}, batch 1, S={SEGMENTS}, padding mask\n")
    print("| T | method | temp MiB | time ms | temp / (a) | time / (a) |")
    print("|---|---|---|---|---|---|")
    ratios = []  # (measurement, baseline, value), reported after the table
    for length in lengths:
        base_temp, base_time = measure(seqlens_offsets, length)
        for name, fn in methods:
            run = not (fn is explicit and length == LONG)
            temp, ms = (base_temp, base_time) if fn is seqlens_offsets else measure(fn, length, run)
            ms_text = f"{ms:.2f}" if ms is not None else "not run"
            ratio_text = f"{ms / base_time:.1f}x" if ms is not None else "-"
            print(f"| {length} | {name} | {temp:.2f} | {ms_text} | {temp / max(base_temp, 1e-9):.1f}x | {ratio_text} |")
            if fn is not seqlens_offsets and length == LONG:
                ratios.append(
                    (f"T={length} temp memory, {name[4:]}", "segment reductions", temp / max(base_temp, 1e-9))
                )
            if fn is not seqlens_offsets and ms is not None:
                ratios.append((f"T={length} time, {name[4:]}", "segment reductions", ms / base_time))
    for measurement, baseline, value in ratios:
        ratio(measurement, baseline, value)


if __name__ == "__main__":
    main()
