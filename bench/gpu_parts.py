"""The parts of bench/on_gpu.py, one per call: `python -m bench.gpu_parts PART --rows FILE --scratch DIR [--argument A]
[--rehearse]`. Each appends one JSON object per measurement to FILE as soon as it has it, so a part stopped at its
time limit still reports what it measured. `ceilings` leaves its matmul rate in DIR for the parts after it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import pathlib
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.attention import forward_backward
from bench.timing import best_time
from bench.train_throughput import prepare, timed_step
from parallel import compat, kernels
from train.config import load_config
from train.flops import flops_per_token, peak_flops_per_device

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "grain")
ATTENTION_HEADS = {"gqa 32/8 x 128": (32, 8, 128, 128), "mla 16 x 192/128": (16, 16, 192, 128)}  # h, hkv, dqk, dv


class Rows:
    """Appends rows to a JSON-lines file, one flushed line each."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def add(self, **row) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps(row) + "\n")
        print(row, flush=True)


def ceilings(rows: Rows, args) -> None:
    """Versions, the device and its memory, then the TFLOP/s of bf16 [n, n] matmuls (20 chained in one call) and a
    copy's GB/s (bytes read and written), each the best of 10 calls."""
    versions = {"python": platform.python_version(), "cuda plugin": compat.cuda_plugin() or "none"}
    for package in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    device = jax.devices()[0]
    if device.platform == "gpu":
        versions["cudnn"] = str(compat.cudnn_attention().check_cudnn_version())
    stats = device.memory_stats() or {}
    rows.add(what="versions", value=", ".join(f"{k} {v}" for k, v in versions.items()))
    memory = f"{stats['bytes_limit'] / 2**30:.1f} GiB for XLA" if "bytes_limit" in stats else "unknown"
    rows.add(what="device", value=f"{device.device_kind}, {memory}")
    n = 512 if args.rehearse else 8192
    a, w = (jax.random.normal(key, (n, n), jnp.bfloat16) for key in jax.random.split(jax.random.key(0)))
    chain = jax.jit(lambda x, w: jax.lax.fori_loop(0, 20, lambda i, x: x @ w, x))
    tflops = 20 * 2 * n**3 / best_time(chain, (a, w * n**-0.5), repeats=10) / 1e12
    rows.add(what=f"bf16 matmul {n}^3", value=f"{tflops:.1f} TFLOP/s")
    (pathlib.Path(args.scratch) / "ceilings.json").write_text(json.dumps({"matmul_tflops": tflops}))
    size = (8 if args.rehearse else 4096) * 2**20
    x = jnp.ones((size // 4,), jnp.float32)
    gbs = 2 * size / best_time(jax.jit(lambda x: x * 1.5), (x,), repeats=10) / 1e9
    rows.add(what=f"copy of {size / 2**20:.0f} MiB", value=f"{gbs:,.0f} GB/s read + written")


def kernel_tests(rows: Rows, args) -> None:
    """tests/parallel/test_gpu_kernels.py over 12 workers; one row per case (result, and the failure's message)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-rf",
        "-p",
        "no:cacheprovider",
        "-n",
        "2" if args.rehearse else "12",
    ]
    command.append("tests/parallel/test_gpu_kernels.py")
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-20000:], done.stderr[-5000:], flush=True)
    messages = dict(re.findall(r"^FAILED (\S+) - (.*)$", done.stdout, re.MULTILINE))
    found = re.findall(r"(PASSED|FAILED|SKIPPED|ERROR) (tests/\S+::\S+)", done.stdout)
    found += [(r, c) for c, r in re.findall(r"(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", done.stdout)]
    for case, result in {case: result for result, case in found}.items():
        rows.add(case=case.split("::")[-1], result=result, message=messages.get(case, "")[:300])
    if not found:
        rows.add(case="(none)", result=f"pytest exit status {done.returncode}", message=done.stdout[-300:])


def tiny_train(rows: Rows, args) -> None:
    """20 steps of configs/tiny.yaml with the `auto` kernel (a rehearsal: 4 steps of a smaller model): the kernel
    lines of its log and the loss by step."""
    out = pathlib.Path(args.scratch) / "tiny"
    overrides = ["train.steps=20", "train.log_every_steps=1", "optimizer.warmup_steps=5", f"train.output_dir={out}"]
    if args.rehearse:
        overrides += [
            "train.steps=4",
            "model.embed_dim=64",
            "model.num_layers=2",
            "model.mlp_dim=128",
            "data.seq_len=64",
        ]
    overrides += ["train.eval_batches=0", "train.sample_tokens=0", "checkpoint.every_steps=1000"]
    overrides.append("parallel.attention_kernel=auto")
    command = [sys.executable, "-m", "train", "configs/tiny.yaml", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-5000:], done.stderr[-10000:], flush=True)
    for line in done.stderr.splitlines():
        if re.search(r"attention kernel|first contact|falls back|fallback", line, re.IGNORECASE):
            rows.add(what="log", value=line.strip()[:300])
    metrics = out / "metrics.jsonl"
    losses = (
        [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        if metrics.exists()
        else []
    )
    falling = bool(losses) and losses[-1] < 0.8 * losses[0]
    rows.add(what="loss", value=" ".join(f"{x:.3f}" for x in losses[:: max(1, len(losses) // 5)]), falling=falling)
    rows.add(what="exit status", value=done.returncode)


def packed_row(length: int) -> tuple[np.ndarray, list[int]]:
    """[1, length] segment ids of two documents, 3/4 and 1/4 of the row (as many as cuDNN's slots at 128K: see
    parallel.kernels.cudnn.slots), and their lengths."""
    lengths = [3 * length // 4, length - 3 * length // 4]
    return np.repeat(np.arange(1, 3, dtype=np.int32), lengths)[None], lengths


def attention(rows: Rows, args) -> None:
    """Causal fwd+bwd on one packed row per (length, heads, kernel): ms, TFLOP/s, fraction of the matmul ceiling.
    --argument: comma-separated lengths instead of 8K, 32K and 128K; blockwise only below 64K."""
    ceiling = _ceiling(args)
    lengths = (256, 1024) if args.rehearse else (8192, 32768, 131072)
    lengths = tuple(map(int, args.argument.split(","))) if args.argument else lengths
    names = ("pallas", "blockwise") if args.rehearse else ("cudnn", "pallas", "blockwise")
    dtype = jnp.float32 if args.rehearse else jnp.bfloat16
    for length in lengths:
        segment_ids, documents = packed_row(length)
        tokens = kernels.Tokens(jnp.asarray(segment_ids))  # bound as a default below: the loop's own row
        for label, (h, hkv, dqk, dv) in ATTENTION_HEADS.items():
            if args.rehearse:
                h, hkv = h // 8, hkv // 8 or 1
            rng = np.random.default_rng(0)
            shapes = [(1, length, h, dqk), (1, length, hkv, dqk), (1, length, hkv, dv)]
            qkv = [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]
            flops = sum(3.5 * 2 * n * n / 2 * h * (dqk + dv) for n in documents)
            for name in names if length < 65536 else names[:2]:  # blockwise: 24 TFLOP/s at 128K on an H200
                interpret = args.rehearse and name == "pallas"
                fn = lambda q, k, v, name=name, interpret=interpret, tokens=tokens: kernels.attention(
                    q, k, v, tokens, tokens, kernel=name, interpret=interpret
                )[0]
                seconds = best_time(forward_backward(fn), qkv, repeats=1 if args.rehearse else 3, long_call_s=2.0)
                tflops = flops / seconds / 1e12
                rows.add(
                    T=length, heads=label, kernel=name, ms=round(1e3 * seconds, 2), TFLOPS=float(f"{tflops:.3g}"),
                    of_matmul_ceiling=round(tflops / ceiling, 3) if ceiling else None,
                )  # fmt: skip


def llama_1b(rows: Rows, args) -> None:
    """Train steps of Llama 3.2 1B (rehearsal: configs/tiny.yaml at 1/64 of the length) on one device, kernel:length
    from --argument, one document per row: tokens/s, MFU, compiled and measured peak memory."""
    kernel, length = args.argument.split(":")
    length = int(length) // 64 if args.rehearse else int(length)
    if args.rehearse and kernel not in ("auto", "blockwise"):
        rows.add(kernel=kernel, T=length, skipped="the fused kernels run on GPUs only")
        return
    base = "configs/tiny.yaml" if args.rehearse else "configs/models/llama3.2-1b.yaml"
    overrides = ["compute.dtype=bfloat16", "compute.remat_policy=full", f"data.seq_len={length}"]
    overrides += ["train.batch_size=1", f"parallel.attention_kernel={kernel}", "mesh.fsdp=1"]
    run = prepare(load_config(REPO / base, overrides))
    steps = 1 if args.rehearse or length > 65536 else 2
    run.seconds = [timed_step(run) for _ in range(steps)]
    seconds = min(run.seconds)
    tokens_per_sec = length / seconds
    model_tflops = tokens_per_sec * flops_per_token(run.config.model, length) / 1e12
    memory = run.step.memory_analysis()
    stats = jax.devices()[0].memory_stats() or {}
    ceiling = _ceiling(args)
    rows.add(
        kernel=kernel, T=length, params_M=round(run.params / 1e6), step_s=round(seconds, 3),
        tokens_per_s=round(tokens_per_sec), MFU=round(model_tflops * 1e12 / peak_flops_per_device(), 3),
        of_matmul_ceiling=round(model_tflops / ceiling, 3) if ceiling else None,
        compiled_GiB=round((memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**30, 2),
        peak_GiB=round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None,
    )  # fmt: skip


def _ceiling(args) -> float | None:
    """The matmul TFLOP/s the ceilings part measured in this run, if it did."""
    path = pathlib.Path(args.scratch) / "ceilings.json"
    return json.loads(path.read_text())["matmul_tflops"] if path.exists() else None


PARTS = {f.__name__: f for f in (ceilings, kernel_tests, tiny_train, attention, llama_1b)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=tuple(PARTS))
    parser.add_argument("--rows", required=True, type=pathlib.Path)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--argument", default="")
    parser.add_argument("--rehearse", action="store_true")
    args = parser.parse_args()
    if args.rehearse:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        sys.exit(f"bench/gpu_parts.py {args.part}: no GPU (JAX's backend is {jax.default_backend()}); use --rehearse")
    PARTS[args.part](Rows(args.rows), args)


if __name__ == "__main__":
    main()
