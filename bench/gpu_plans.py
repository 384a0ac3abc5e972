"""The 128K recipes compiled for H100s with each attention kernel, and for simulated CPU devices: what XLA's GPU
compiler assigns per device (no GPU needed: parallel/targets.py, the `gpu` extra), against the blockwise kernel's
GPU plan and the CPU plan of the same step, in one run; for each GPU plan the speed estimate (train/planning/speed.py:
step seconds, tokens/s per GPU, MFU, the three largest costs) and how many reshards XLA's partitioner could only do by
replicating a tensor ("involuntary", from its stderr). A kernel that does not compile gets a row saying why.

    PYTHONPATH=. python bench/gpu_plans.py                       # the RECIPES below, about 15 min on 2 cores
    PYTHONPATH=. python bench/gpu_plans.py --quick               # the 8B recipe only
    PYTHONPATH=. python bench/gpu_plans.py --plans cudnn         # the default kernel's GPU plans only
    PYTHONPATH=. python bench/gpu_plans.py --recipes finetune-128k-deepseek-v3:128 --overrides mesh.fsdp=1
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from bench.report import ratio, skip
from parallel import targets
from train.process.environment import default_environment

REPO = pathlib.Path(__file__).resolve().parents[1]
RECIPES = (
    "finetune-128k-llama3.1-8b:8",
    "finetune-128k-deepseek-v2-lite:8",
    "finetune-128k-deepseek-v3:256",
    "finetune-128k-qwen3.5-35b-a3b:16",
)
KERNELS = ("blockwise", "pallas", "cudnn")
GIB = 2**30
INVOLUNTARY = "Involuntary full rematerialization"  # XLA's SPMD partitioner, on stderr
# one plan per process: a CPU plan starts JAX with its own device count
PLAN = """
import sys
from parallel import targets
from train.config import load_config
from train.planning.memory import plan_memory
from train.__main__ import simulate_cpu_devices
recipe, target, count, *overrides = sys.argv[1:]
config = load_config(f"configs/{recipe}.yaml", [*overrides, "checkpoint.init_from="])
if target == "cpu":
    simulate_cpu_devices(int(count))
    import jax
    devices = jax.devices()[: int(count)]
else:
    devices = targets.compile_only_devices(target, int(count))
p = plan_memory(config, devices)
print("PLAN", p.arguments, p.temporaries, p.total, f"{p.compile_seconds:.1f}", p.attention_kernel)
if target != "cpu":
    from train.planning.speed import estimate_plan
    e = estimate_plan(p, targets.target(target).rates)
    top = ", ".join(f"{name} {share:.0%}" for name, share in e.top())
    print(f"ESTIMATE {e.seconds:.3g}|{e.tokens_per_second_per_device:,.0f}|{e.mfu:.1%}|{top}")
"""


def plan(recipe: str, target: str, count: int, overrides: list[str]) -> tuple | str:
    """(arguments, temporaries, total bytes, compile seconds, kernel, estimate cells, involuntary reshards) of one
    plan, or the error's last line."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    default_environment(env)  # the XLA flags a run of python -m train compiles with (they change the schedule)
    done = subprocess.run(
        [sys.executable, "-c", PLAN, recipe, target, str(count), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    line = next((line for line in done.stdout.splitlines() if line.startswith("PLAN ")), None)
    if line is None:
        return (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
    arguments, temporaries, total, seconds, kernel = line.split()[1:]
    estimate = next((line[9:].split("|") for line in done.stdout.splitlines() if line.startswith("ESTIMATE ")), None)
    cells = estimate or ["", "", "", ""]
    return int(arguments), int(temporaries), int(total), seconds, kernel, cells, done.stderr.count(INVOLUNTARY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(RECIPES), help="NAME:DEVICES,... (configs/NAME.yaml)")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides for every plan")
    parser.add_argument("--quick", action="store_true", help="the first recipe only")
    parser.add_argument("--plans", default=",".join(("cpu", *KERNELS)), help="cpu and kernels to plan, comma-separated")
    args = parser.parse_args()
    if not targets.plugin_installed():
        skip(f"needs XLA's GPU compiler: {targets.GPU_INSTALL}")
    recipes = [entry.split(":") for entry in args.recipes.split(",")][: 1 if args.quick else None]
    plans = args.plans.split(",")
    print(
        "| recipe | devices | plan | arguments GiB | temporaries GiB | total GiB | compile s | step s (estimate) | "
        "tokens/s per GPU | MFU | largest costs | involuntary |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, count in recipes:
        rows = {"cpu": plan(name, "cpu", int(count), args.overrides)} if "cpu" in plans else {}
        for kernel in (k for k in KERNELS if k in plans):
            rows[kernel] = plan(name, args.target, int(count), [*args.overrides, f"parallel.attention_kernel={kernel}"])
        for label, row in rows.items():
            where = "CPU compiler, blockwise" if label == "cpu" else f"{args.target}, {label}"
            if isinstance(row, str):
                print(f"| {name} | {count} | {where} | does not compile: {row} |" + " |" * 8)
                continue
            arguments, temporaries, total, seconds, _, estimate, involuntary = row
            print(f"| {name} | {count} | {where} | {arguments / GIB:.2f} | {temporaries / GIB:.2f} | "
                  f"{total / GIB:.2f} | {seconds} | {' | '.join(estimate)} | {involuntary} |")  # fmt: skip
        base = rows.get("blockwise", "not planned")
        for label, row in rows.items():
            if label != "blockwise" and not isinstance(row, str) and not isinstance(base, str):
                what = "CPU plan" if label == "cpu" else f"{args.target} plan, {label}"
                ratio(f"{name}: temporaries, {what}", f"{args.target} plan, blockwise", row[1] / base[1])


if __name__ == "__main__":
    main()
