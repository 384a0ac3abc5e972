"""Training at 128K tokens on CPU: a 2-layer Llama with ring attention over 8 simulated devices (mesh.context=8,
dual_chunk load balancing), run through the real training loop (`train.loop.run`, data from the stdlib corpus).

One row of `--seq-len` tokens per step, so each device holds seq_len / 8 tokens. Prints the loss, seconds and
tokens/s of every step (from the run's metrics.jsonl; step 1 includes compilation, so it has no time), the
peak resident memory of this process (getrusage ru_maxrss) and two ratios. Exits 1 when a loss is not finite,
the last loss is not below the first, or the peak RSS is above `--max-rss-gib`.

    PYTHONPATH=. .venv/bin/python bench/long_context_cpu.py            # 131072 tokens, 3 steps
    PYTHONPATH=. .venv/bin/python bench/long_context_cpu.py --quick    # 16384 tokens, 3 steps
"""

from __future__ import annotations

import os

# 8 simulated devices share a few cores, so one device can reach a ring transfer minutes after the others:
# no "may be stuck" warnings or termination for waits that long.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=1800",
        "--xla_cpu_collective_call_terminate_timeout_seconds=7200",
        "--xla_cpu_collective_timeout_seconds=7200",
    ]
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import json
import math
import pathlib
import resource
import sys
import tempfile
import time

from bench.report import ratio
from train.config import Config, load_config
from train.loop import run

REPO = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30
# A small vocabulary and embedding keep everything but attention cheap; activations are small enough
# (16K tokens x 64 per device and layer) to keep without remat, and the loss is chunked per 2048 tokens.
OVERRIDES = (
    "model.vocab_size=320",
    "model.embed_dim=64",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.mlp_dim=128",
    "compute.remat_policy=none",
    "compute.loss_chunk_size=2048",
    "compute.dtype=float32",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.context=8",
    "parallel.context_strategy=ring",
    "parallel.balance_layout=dual_chunk",
    "parallel.block_q=1024",
    "parallel.block_kv=1024",
    "data.max_documents=300",
    "train.batch_size=1",
    "train.log_every_steps=1",
    "train.eval_batches=0",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "optimizer.learning_rate=1e-2",
    "optimizer.warmup_steps=0",
    "checkpoint.enabled=false",
)


def build_config(seq_len: int, steps: int, output_dir: pathlib.Path) -> Config:
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [*OVERRIDES, f"data.seq_len={seq_len}", f"train.steps={steps}", f"train.output_dir={output_dir}"],
    )


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def problems(losses: list[float], peak: int, max_rss: int) -> list[str]:
    """What makes the run a failure: non-finite or not falling loss, too much memory."""
    found = []
    if not all(math.isfinite(loss) for loss in losses):
        found.append(f"loss not finite: {losses}")
    elif len(losses) < 2 or not losses[-1] < losses[0]:
        found.append(f"loss not falling: {losses}")
    if peak > max_rss:
        found.append(f"peak RSS {peak / GIB:.2f} GiB above the limit {max_rss / GIB:.2f} GiB")
    return found


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=131072, help="tokens per row (one row per step)")
    parser.add_argument("--steps", type=int, default=3, help="training steps, the first one compiles")
    parser.add_argument("--max-rss-gib", type=float, default=8.0, help="peak resident memory allowed")
    parser.add_argument("--quick", action="store_true", help="--seq-len 16384 --steps 3")
    args = parser.parse_args()
    if args.quick:
        args.seq_len, args.steps = 16384, 3
    return args


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory() as output:
        config = build_config(args.seq_len, args.steps, pathlib.Path(output))
        start = time.perf_counter()
        run(config)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (pathlib.Path(output) / "metrics.jsonl").read_text().splitlines()]
    peak, max_rss = peak_rss_bytes(), int(args.max_rss_gib * GIB)
    m, c, p = config.model, config.compute, config.parallel
    print(
        f"\n{m.num_layers} layers, embed {m.embed_dim}, {m.num_heads} heads x {m.head_dim} ({m.num_kv_heads} kv), "
        f"vocab {m.vocab_size}, remat {c.remat_policy}, loss chunk {c.loss_chunk_size}; seq_len "
        f"{config.data.seq_len:,} x batch {config.train.batch_size}; mesh context={config.mesh.context} "
        f"({p.context_strategy}, {p.balance_layout}, blocks {p.block_q}/{p.block_kv})\n"
    )
    print("| step | loss | s/step | tokens/s |")
    print("|---|---|---|---|")
    for r in records:
        timing = f"{r['step_time']:.1f} | {r['tokens_per_sec']:,.0f}" if r["step"] > 1 else "(compiles) | -"
        print(f"| {r['step']} | {r['loss']:.4f} | {timing} |")
    timed = [r for r in records if r["step"] > 1]
    seconds = sum(r["step_time"] for r in timed) / max(len(timed), 1)
    tokens_per_sec = config.data.seq_len * config.train.batch_size / seconds if timed else 0.0
    print(
        f"\nmean {seconds:.1f} s/step, {tokens_per_sec:,.0f} tokens/s over steps 2-{args.steps}; "
        f"whole run {wall:.0f} s; peak RSS {peak / GIB:.2f} GiB"
    )
    losses = [r["loss"] for r in records]
    ratio(f"peak RSS, {config.data.seq_len:,} tokens, context=8", f"{args.max_rss_gib:g} GiB limit", peak / max_rss)
    ratio(f"loss at step {records[-1]['step']}", "loss at step 1", losses[-1] / losses[0])
    found = problems(losses, peak, max_rss)
    for problem in found:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
