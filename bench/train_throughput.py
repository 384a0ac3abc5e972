"""Training throughput of the tiny Llama, a ~100M- and a ~1B-parameter Llama: remat policies none and full, the
context strategies (none, ring, all_gather, ulysses at context=8), or the attention kernels (GPU) on the same batch.

For each model, every variant of the comparison gets its own state, mesh and compiled train step on a fixed random
batch, one warm-up step each, then `--steps` timed steps each, alternating between the variants so that a slow
stretch of a shared machine hits all alike. Prints a markdown table (median step time, tokens/s, MFU, compiled
temp / argument memory, tokens/s relative to the comparison's first variant) and the device kind with the peak
FLOP/s that MFU is measured against (on CPU: a measured float32 matmul rate).

    --compare remat (default): mesh all local devices on fsdp; remat none (the baseline) and full.
    --compare context: 8 devices (simulated on CPU); strategy none on fsdp=8 (the baseline), and ring, all_gather
        and ulysses on context=8, all on the same rows (8 heads of 32 so that ulysses splits them).
    --compare kernel: GPU only; parallel.attention_kernel blockwise (the baseline), pallas and cudnn, bfloat16,
        remat full (cudnn runs Pallas for the calls it cannot serve). `--doc-len` packs each row with documents.

    PYTHONPATH=. python bench/train_throughput.py
    PYTHONPATH=. python bench/train_throughput.py --models 100m --steps 20 --batch 8 --seq-len 1024
    PYTHONPATH=. python bench/train_throughput.py --quick    # tiny only, 3 timed steps per variant
    PYTHONPATH=. python bench/train_throughput.py --compare context --quick
    PYTHONPATH=. python bench/train_throughput.py --compare kernel --models 1b --seq-len 8192 --doc-len 2048
    PYTHONPATH=. python bench/train_throughput.py --compare kernel --models 1b --seq-len 131072 --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

if "context" in sys.argv:  # --compare context: eight devices, simulated on CPU (set before JAX starts)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import numpy as np
from flax import nnx

from bench.report import ratio, skip
from parallel.mesh import batch_sharding, check_batch, make_mesh
from parallel.settings import make_parallelism
from train.config import Config, load_config
from train.optimizer import make_optimizer
from train.planning.flops import PEAK_FLOPS, flops_per_token, peak_flops_per_device
from train.state import create_state
from train.step import make_train_step

BASE_CONFIG = "configs/tiny.yaml"
MIB = 2**20
_CONTEXT = ("mesh.fsdp=1", "mesh.context=8")
# comparison -> variant -> its overrides (the first variant is the baseline), and overrides every variant takes
COMPARISONS = {
    "remat": {"remat none": ("compute.remat_policy=none",), "remat full": ("compute.remat_policy=full",)},
    "context": {
        "none": ("mesh.fsdp=8",),
        "ring": (*_CONTEXT, "parallel.context_strategy=ring"),
        "all_gather": (*_CONTEXT, "parallel.context_strategy=all_gather"),
        "ulysses": (*_CONTEXT, "parallel.context_strategy=ulysses"),
    },
    "kernel": {name: (f"parallel.attention_kernel={name}",) for name in ("blockwise", "pallas", "cudnn")},
}
COMMON = {
    "remat": (),
    "context": ("model.num_heads=8", "model.num_kv_heads=8", "model.head_dim=32"),
    "kernel": ("compute.dtype=bfloat16", "compute.remat_policy=full"),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """Overrides on configs/tiny.yaml and the default number of timed steps per policy."""

    overrides: tuple[str, ...]
    steps: int


MODELS = {
    "tiny": Model(overrides=(), steps=20),
    "100m": Model(
        overrides=(
            "model.embed_dim=768",
            "model.num_layers=12",
            "model.num_heads=12",
            "model.num_kv_heads=4",
            "model.head_dim=64",
            "model.mlp_dim=2048",
            "model.vocab_size=32768",
            "data.seq_len=256",
            "train.batch_size=2",
        ),
        steps=3,
    ),
    "1b": Model(
        overrides=(
            "model.embed_dim=2048",
            "model.num_layers=16",
            "model.num_heads=32",
            "model.num_kv_heads=8",
            "model.head_dim=64",
            "model.mlp_dim=8192",
            "model.vocab_size=32768",
            "data.seq_len=8192",
            "train.batch_size=1",
        ),
        steps=5,
    ),
}


@dataclasses.dataclass
class Run:
    """One variant's compiled step, its mesh, its (donated, fed back) state, its batch and its timed step seconds."""

    config: Config
    mesh: jax.sharding.Mesh
    step: jax.stages.Compiled
    state: nnx.State
    batch: dict
    params: int
    doc_len: int  # tokens per document of each row (attention FLOPs are per document)
    seconds: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Result:
    model: str
    variant: str
    params: int
    seq_len: int
    batch: int
    tokens_per_sec: float
    step_ms: float
    mfu: float
    temp_mib: float
    argument_mib: float


def build_config(name: str, variant: str, args: argparse.Namespace) -> Config:
    overrides = [*MODELS[name].overrides, *COMMON[args.compare], *COMPARISONS[args.compare][variant]]
    if args.batch:
        overrides.append(f"train.batch_size={args.batch}")
    if args.seq_len:
        overrides.append(f"data.seq_len={args.seq_len}")
    return load_config(BASE_CONFIG, overrides)


def random_batch(config: Config, mesh, doc_len: int) -> dict:
    """A fixed batch, each row documents of `doc_len` tokens, placed over the mesh's batch axes."""
    rows, length = config.train.batch_size, config.data.seq_len
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, config.model.vocab_size, size=(2, rows, length), dtype=np.int32)
    batch = {
        "tokens": tokens,
        "targets": targets,
        "segment_ids": np.broadcast_to(np.arange(length, dtype=np.int32) // doc_len + 1, (rows, length)),
        "positions": np.broadcast_to(np.arange(length, dtype=np.int32) % doc_len, (rows, length)),
        "loss_mask": np.ones((rows, length), np.float32),
    }
    sharding = batch_sharding(mesh)
    return {key: jax.device_put(value, sharding) for key, value in batch.items()}


def prepare(config: Config, doc_len: int = 0) -> Run:
    """Mesh, state, batch (rows of documents of `doc_len` tokens; 0: one per row) and compiled train step for
    `config`, after one warm-up step."""
    doc_len = doc_len or config.data.seq_len
    mesh = make_mesh(config.mesh)
    check_batch(config.train.batch_size, config.train.grad_accum_steps, mesh)
    train_state = create_state(
        config.model, make_optimizer(config.optimizer, config.train.steps), mesh, seed=0, compute=config.compute
    )
    with jax.set_mesh(mesh):
        jitted = make_train_step(
            train_state,
            mesh,
            chunk_size=config.compute.loss_chunk_size,
            accum_steps=config.train.grad_accum_steps,
            parallelism=make_parallelism(config.parallel, mesh.shape, mesh.devices.flat[0]),
        )
        batch = random_batch(config, mesh, doc_len)  # random tokens: the sequence layout changes nothing measured
        run = Run(
            config,
            mesh,
            jitted.lower(train_state.state, batch).compile(),
            train_state.state,
            batch,
            sum(x.size for x in jax.tree.leaves(train_state.state[0].filter(nnx.Param))),
            doc_len,
        )
        timed_step(run)
    return run


def timed_step(run: Run) -> float:
    """Seconds of one train step, waited for through its loss; the returned state replaces the donated one."""
    start = time.perf_counter()
    with jax.set_mesh(run.mesh):
        run.state, metrics = run.step(run.state, run.batch)
    metrics["loss"].block_until_ready()
    return time.perf_counter() - start


def result(name: str, variant: str, run: Run, peak: float) -> Result:
    config, memory = run.config, run.step.memory_analysis()
    seconds = statistics.median(run.seconds)
    tokens_per_sec = config.train.batch_size * config.data.seq_len / seconds
    return Result(
        model=name,
        variant=variant,
        params=run.params,
        seq_len=config.data.seq_len,
        batch=config.train.batch_size,
        tokens_per_sec=tokens_per_sec,
        step_ms=1e3 * seconds,
        mfu=tokens_per_sec * flops_per_token(config.model, run.doc_len) / peak,
        temp_mib=memory.temp_size_in_bytes / MIB,
        argument_mib=memory.argument_size_in_bytes / MIB,
    )


def measure(name: str, args: argparse.Namespace, peak: float) -> list[Result]:
    """Every variant of the comparison on one model, their timed steps interleaved."""
    variants = COMPARISONS[args.compare]
    runs = {variant: prepare(build_config(name, variant, args), args.doc_len) for variant in variants}
    for _ in range(args.steps or MODELS[name].steps):
        for run in runs.values():
            run.seconds.append(timed_step(run))
    return [result(name, variant, run, peak) for variant, run in runs.items()]


def table(results: list[Result], baseline: str) -> str:
    base = {r.model: r.tokens_per_sec for r in results if r.variant == baseline}
    lines = [
        "| model | variant | params (M) | seq_len | batch | tokens/s | step (ms) | MFU | temp (MiB) "
        f"| args (MiB) | tokens/s vs {baseline} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.model} | {r.variant} | {r.params / 1e6:.1f} | {r.seq_len} | {r.batch} "
            f"| {r.tokens_per_sec:,.0f} | {r.step_ms:.1f} | {r.mfu:.1%} | {r.temp_mib:.1f} "
            f"| {r.argument_mib:.1f} | {r.tokens_per_sec / base[r.model]:.2f} |"
        )
    return "\n".join(lines)


def report_ratios(results: list[Result], baseline: str) -> None:
    """tokens/s and compiled temp memory of every variant against the baseline variant, per model."""
    base = {r.model: r for r in results if r.variant == baseline}
    for r in results:
        if r.variant != baseline:
            b = base[r.model]
            ratio(f"{r.model} tokens/s, {r.variant}", baseline, r.tokens_per_sec / b.tokens_per_sec)
            ratio(f"{r.model} compiled temp memory, {r.variant}", baseline, r.temp_mib / b.temp_mib)


def device_line(peak_per_device: float) -> str:
    kind = jax.devices()[0].device_kind
    source = (
        "dense bf16 peak from train/planning/flops.py"
        if kind.startswith(tuple(PEAK_FLOPS))
        else "measured float32 matmul"
    )
    return f"device: {jax.device_count()} x {kind}; peak {peak_per_device / 1e12:.3f} TFLOP/s per device ({source})"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,100m", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--compare", default="remat", choices=tuple(COMPARISONS), help="what the variants differ in")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per variant (default: 20 tiny, 3 100m, 5 1b)")
    parser.add_argument(
        "--batch", type=int, default=0, help="global batch rows for every model (default: 8 tiny, 2 100m, 1 1b)"
    )
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per row for every model (default: 256)")
    parser.add_argument("--doc-len", type=int, default=0, help="tokens per document of each row (default: the row)")
    parser.add_argument("--quick", action="store_true", help="--models tiny --steps 3")
    args = parser.parse_args()
    if args.quick:
        args.models, args.steps = "tiny", 3
    args.models = args.models.split(",")
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.compare == "kernel" and jax.default_backend() != "gpu":
        skip("--compare kernel needs a GPU: the Pallas and cuDNN kernels compile for GPU only")
    peak_per_device = peak_flops_per_device()
    peak = peak_per_device * jax.device_count()
    results = [r for name in args.models for r in measure(name, args, peak)]
    baseline = next(iter(COMPARISONS[args.compare]))
    print(table(results, baseline))
    print()
    print(device_line(peak_per_device))
    report_ratios(results, baseline)


if __name__ == "__main__":
    main()
