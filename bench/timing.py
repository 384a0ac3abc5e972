"""Wall-clock timing of jitted calls, shared by the benchmarks."""

from __future__ import annotations

import time

import jax


def best_time(fn, inputs, repeats: int, long_call_s: float = float("inf")) -> float:
    """Seconds of the fastest of `repeats` calls of fn(*inputs) after one warm-up call; one call only when the warm-up
    (compile included) took longer than `long_call_s`."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    if time.perf_counter() - start > long_call_s:
        repeats = 1
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        best = min(best, time.perf_counter() - start)
    return best
