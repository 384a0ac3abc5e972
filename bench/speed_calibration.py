"""The speed estimate (train/planning/speed.py) against what one GPU measured: the Llama 3.2 1B train steps of
bench/README.md "On one GPU" (an H200, 2026-11-26) compiled here for a compile-only H200 as bench/gpu_parts.py's
llama_1b part builds them, each estimate printed beside the measured step time with their ratio. No GPU needed.

    PYTHONPATH=. python bench/speed_calibration.py      # three compiles, about a minute on 2 cores
"""

from __future__ import annotations

import pathlib

from bench.report import ratio, skip
from parallel import targets
from train.config import load_config
from train.planning.memory import plan_memory
from train.planning.speed import estimate_plan

REPO = pathlib.Path(__file__).resolve().parents[1]
# (kernel, tokens, measured seconds of one step): bench/README.md "On one GPU", Llama 3.2 1B, one row of one document
MEASURED = (("auto", 8192, 0.27), ("auto", 32768, 1.74), ("pallas", 32768, 3.69))


def estimate(kernel: str, tokens: int):
    """The speed estimate of the 1B train step of `kernel` on one row of `tokens` tokens, for one H200."""
    overrides = ["compute.dtype=bfloat16", "compute.remat_policy=full", f"data.seq_len={tokens}"]
    overrides += ["train.batch_size=1", f"parallel.attention_kernel={kernel}", "mesh.fsdp=1"]
    config = load_config(REPO / "configs" / "models" / "llama3.2-1b.yaml", overrides)
    target = targets.target("h200")
    return estimate_plan(plan_memory(config, targets.compile_only_devices(target.name, 1)), target.rates)


def main() -> None:
    if not targets.plugin_installed():
        skip(f"needs XLA's GPU compiler: {targets.GPU_INSTALL}")
    print("| kernel | T | measured step (s) | estimated step (s) | estimate / measured | largest costs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kernel, tokens, measured in MEASURED:
        result = estimate(kernel, tokens)
        top = ", ".join(f"{name} {share:.0%}" for name, share in result.top())
        print(
            f"| {kernel} | {tokens:,} | {measured} | {result.seconds:.3g} | {result.seconds / measured:.2f} | {top} |"
        )
        ratio(f"estimated step, Llama 3.2 1B, {kernel}, T={tokens}", "measured on an H200", result.seconds / measured)


if __name__ == "__main__":
    main()
