"""Attention kernels on one GPU: the Pallas kernel (parallel/kernels/pallas.py), the packed-row cuDNN kernel
(parallel/kernels/cudnn.py) and the blockwise kernel against cuDNN flash attention
(`jax.nn.dot_product_attention(implementation="cudnn")`) on the same unpacked rows, and the Pallas and cuDNN kernels
on packed rows (documents of `--doc-len` tokens), causal forward+backward (value and gradient of the
output's sum w.r.t. q, k, v), batch 1, `--heads` x `--head-dim`, bfloat16, T = `--lengths` (8K and 128K).

TFLOP/s counts causal FLOPs once: the forward does 2 matmuls of 2·T·T·H·D/2 FLOPs, the backward 2.5x that; a packed
row counts the sum over its documents. Timing as bench/attention.py: a warm-up call, then alternating timed calls,
the best one. Prints a markdown table and ratios of time against the baseline (cuDNN; blockwise where cuDNN is
absent). Without a GPU it prints a SKIP line; `--interpret` runs the Pallas rows in interpret mode on any backend
(tiny `--lengths` only: it checks the script, not the speed).

    PYTHONPATH=. python bench/gpu_attention.py
    PYTHONPATH=. python bench/gpu_attention.py --interpret --lengths 256 --doc-len 64 --heads 2 --head-dim 32
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.attention import Timed, forward_backward, time_all
from bench.report import ratio, skip
from parallel import kernels


def causal_flops(doc_lengths, heads: int, head_dim: int) -> float:
    """Forward+backward FLOPs of causal attention over documents of these lengths, each pair counted once."""
    forward = sum(2 * 2 * n * n * heads * head_dim / 2 for n in doc_lengths)
    return 3.5 * forward


def implementations(args, packed_ids) -> dict:
    """name -> (fn(q, k, v) -> out, document lengths of the row it attends)."""
    pallas = functools.partial(kernels.attention, kernel="pallas", interpret=args.interpret)
    packed = kernels.Tokens(packed_ids)
    runs = {
        "pallas": (lambda q, k, v: pallas(q, k, v)[0], None),
        "pallas, packed": (lambda q, k, v: pallas(q, k, v, packed, packed)[0], args.doc_len),
        "blockwise": (lambda q, k, v: kernels.attention(q, k, v, kernel="blockwise")[0], None),
    }
    if not args.interpret:
        runs["cudnn"] = (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
            None,
        )
        ours = functools.partial(kernels.attention, kernel="cudnn")
        runs["cudnn kernel"] = (lambda q, k, v: ours(q, k, v)[0], None)
        runs["cudnn kernel, packed"] = (lambda q, k, v: ours(q, k, v, packed, packed)[0], args.doc_len)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8192,131072", help="row lengths (comma-separated)")
    parser.add_argument("--doc-len", type=int, default=4096, help="tokens per document of the packed rows")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per version after the warm-up")
    parser.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (checks the script)")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and not args.interpret:
        skip("needs a GPU (or --interpret to check the script on tiny shapes)")
    dtype = jnp.float32 if args.interpret else jnp.bfloat16
    baseline = "blockwise" if args.interpret else "cudnn"
    lines = ["| T | kernel | fwd+bwd (ms) | TFLOP/s | time vs " + baseline + " |", "|---|---|---|---|---|"]
    for length in (int(text) for text in args.lengths.split(",")):
        rng = np.random.default_rng(0)
        qkv = tuple(jnp.asarray(rng.standard_normal((1, length, args.heads, args.head_dim)), dtype) for _ in range(3))
        packed_ids = jnp.asarray(np.arange(length) // args.doc_len + 1, jnp.int32)[None]
        runs, documents = [], {}
        for name, (fn, doc_len) in implementations(args, packed_ids).items():
            runs.append(Timed(name, forward_backward(fn).lower(*qkv).compile(), qkv))
            documents[name] = [length] if doc_len is None else [doc_len] * (length // doc_len)
        time_all(runs, args.repeats, single_call_s=float("inf"))
        best = {run.name: run.best for run in runs}
        for name, seconds in best.items():
            tflops = causal_flops(documents[name], args.heads, args.head_dim) / seconds / 1e12
            versus = seconds / best[baseline]
            lines.append(f"| {length:,} | {name} | {1e3 * seconds:,.2f} | {tflops:,.1f} | {versus:.2f} |")
            if name != baseline:
                ratio(f"fwd+bwd time, {name}, T={length:,}", baseline, versus)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
