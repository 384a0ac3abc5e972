"""bfloat16 AdamW first moments (optimizer.mu_dtype) against float32 ones, in one run: the loss of a short training
run of configs/tiny.yaml (same seed, same data; the final loss and the mean over the last 10 steps) and the
optimizer state and total per device of the Qwen3-30B-A3B 128K recipe's plan on one host of 8 devices (CPU
compiler).

    PYTHONPATH=. python bench/mu_dtype.py             # 100 steps of configs/tiny.yaml, about 4 minutes on 2 cores
    PYTHONPATH=. python bench/mu_dtype.py --quick     # 100 steps of a smaller model (embed 64, 2 layers)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from bench.report import ratio
from train.process.environment import default_environment

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS = 100
SMALL = ["model.embed_dim=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32"]
RUN = [
    f"train.steps={STEPS}",
    "train.log_every_steps=1",
    "train.eval_batches=0",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "train.peak_tflops_per_device=1",  # no CPU matmul benchmark at start
    "checkpoint.every_steps=1000000",
    "data.max_documents=400",
]
RECIPE, DEVICES = "finetune-128k-qwen3-30b-a3b", 8
ONE_HOST = ["mesh.expert=1", "train.grad_accum_steps=8", "parallel.expert_chunk_size=1024"]  # the recipe takes 16
# one plan per process: a CPU plan starts JAX with its own device count
PLAN = """
import sys
from train.config import load_config
from train.planning.memory import plan_memory
from train.__main__ import simulate_cpu_devices
recipe, count, *overrides = sys.argv[1:]
simulate_cpu_devices(int(count))
import jax
config = load_config(f"configs/{recipe}.yaml", [*overrides, "checkpoint.init_from="])
p = plan_memory(config, jax.devices()[: int(count)])
print("PLAN", p.optimizer, p.total)
"""
GIB = 2**30


def environment() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    default_environment(env)
    return env


def losses(mu_dtype: str, overrides: list[str], output: pathlib.Path) -> list[float]:
    """The per-step training losses [STEPS] of configs/tiny.yaml with optimizer.mu_dtype=`mu_dtype`."""
    command = [sys.executable, "-m", "train", "configs/tiny.yaml", *RUN, *overrides]
    command += [f"optimizer.mu_dtype={mu_dtype}", f"train.output_dir={output}"]
    done = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"training with mu_dtype={mu_dtype} failed: {done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def plan(mu_dtype: str) -> tuple[int, int]:
    """(optimizer state, total) bytes per device of the recipe's plan on DEVICES CPU devices."""
    done = subprocess.run(
        [sys.executable, "-c", PLAN, RECIPE, str(DEVICES), *ONE_HOST, f"optimizer.mu_dtype={mu_dtype}"],
        cwd=REPO, env=environment(), capture_output=True, text=True,
    )  # fmt: skip
    line = next((line for line in done.stdout.splitlines() if line.startswith("PLAN ")), None)
    if line is None:
        sys.exit(f"plan with mu_dtype={mu_dtype} failed: {done.stderr[-2000:]}")
    optimizer, total = map(int, line.split()[1:])
    return optimizer, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model (embed 64, 2 layers)")
    args = parser.parse_args()
    overrides = SMALL if args.quick else []
    with tempfile.TemporaryDirectory() as directory:
        runs = {dtype: losses(dtype, overrides, pathlib.Path(directory) / dtype) for dtype in ("float32", "bfloat16")}
    plans = {dtype: plan(dtype) for dtype in ("float32", "bfloat16")}
    base, half = runs["float32"], runs["bfloat16"]
    print("| mu_dtype | loss, step 1 | final loss (step 100) | mean loss, last 10 steps | "
          f"{RECIPE} x{DEVICES}: optimizer state GiB | total GiB |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype, run in runs.items():
        optimizer, total = plans[dtype]
        print(
            f"| {dtype} | {run[0]:.4f} | {run[-1]:.4f} | {sum(run[-10:]) / 10:.4f} | {optimizer / GIB:.2f} | "
            f"{total / GIB:.2f} |"
        )
    ratio(f"final training loss after {len(half)} steps, mu bfloat16", "mu float32", half[-1] / base[-1])
    ratio("mean training loss of the last 10 steps, mu bfloat16", "mu float32", sum(half[-10:]) / sum(base[-10:]))
    ratio(f"{RECIPE} optimizer state per device, mu bfloat16", "mu float32", plans["bfloat16"][0] / plans["float32"][0])
    ratio(f"{RECIPE} plan total per device, mu bfloat16", "mu float32", plans["bfloat16"][1] / plans["float32"][1])


if __name__ == "__main__":
    main()
