"""Kernel calls named in the compiled program with the share of their (query, key) pairs a query may see, so that the
speed estimate (train/planning/speed.py) costs the work a kernel does rather than its dense [tq, tk] shape: a call runs
in the named scope `attention_<kernel>_visible_<share>`, and the general kernel that cuDNN's calls run when a row
turns out to have more documents than they serve in the scope `fallback` (a run-time branch, not the usual path); a
loop whose trip count is data (the blockwise kernel's walk over a block's visible partners) runs in the scope
`loop_bound_<trips>` naming the most it can take, which the estimate costs it at."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from parallel.kernels.arguments import Options, Tokens

SCOPE = "attention_{kernel}_visible_{share:.4f}"
FALLBACK = "fallback"
BOUND = "loop_bound_{trips}"


def share(q_tokens: Tokens, kv_tokens: Tokens, options: Options) -> float:
    """The share of [tq, tk] pairs the causal mask and window leave visible (documents not counted: segment ids are
    data). Exact when both sides' indices are known at trace time; for traced ones (a ring step against another
    device's piece), a half when causal, as the pieces of a load-balanced ring average."""
    q_index, kv_index = q_tokens.index, kv_tokens.index
    if not options.causal:
        return 1.0
    if not (isinstance(q_index, np.ndarray) and isinstance(kv_index, np.ndarray)):
        tk = kv_tokens.segment_ids.shape[-1]
        return 0.5 if options.window is None else min(0.5, options.window / tk)
    keys = np.sort(kv_index)
    seen = np.searchsorted(keys, q_index, side="right")
    if options.window is not None:
        seen = seen - np.searchsorted(keys, q_index - options.window, side="right")
    return float(seen.sum()) / max(1, q_index.size * keys.size)


def named(kernel: str, call: Callable) -> Callable:
    """`call` (a kernel's forward or backward: q, k, v, q_tokens, kv_tokens, ..., options=...) run in its scope."""

    @functools.wraps(call)
    def scoped(q, k, v, q_tokens, kv_tokens, *args, options, **kwargs):
        """call(...) in the scope naming `kernel` and the call's visible share."""
        with jax.named_scope(SCOPE.format(kernel=kernel, share=share(q_tokens, kv_tokens, options))):
            return call(q, k, v, q_tokens, kv_tokens, *args, options=options, **kwargs)

    return scoped


def fallback(call: Callable) -> Callable:
    """`call` run in the scope `fallback`."""

    @functools.wraps(call)
    def scoped(*args, **kwargs):
        """call(...) in the fallback scope."""
        with jax.named_scope(FALLBACK):
            return call(*args, **kwargs)

    return scoped


def bounded(trips: int):
    """The scope of a loop whose trip count is decided at run time and is at most `trips`."""
    return jax.named_scope(BOUND.format(trips=trips))
