"""What a ring step compiles to on 8 H100s (no GPU: parallel/targets.py), against a baseline revision in the same run:
cuDNN custom calls (forward / backward, by mask), Pallas calls (Triton, or Mosaic GPU on Hopper), fusions and
compile seconds of a tiny train step under the ring with the cuDNN kernel, and the HALVES glue's float32
scatter-adds. The baseline is checked out in a
temporary git worktree and measured by the same code in a subprocess of its own.

    PYTHONPATH=. python bench/ring_compile.py                     # deepseek-tiny, against 4fe6023 (traced steps)
    PYTHONPATH=. python bench/ring_compile.py --quick             # the tiny Llama
    PYTHONPATH=. python bench/ring_compile.py --baseline HEAD     # against the last commit
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from bench.report import ratio, skip
from parallel import targets

REPO = pathlib.Path(__file__).resolve().parents[1]
BEFORE_STATIC_STEPS = "4fe6023"  # the last revision whose ring steps traced their indices
KEYS = ("cudnn_forward", "cudnn_backward", "causal", "pallas", "fusions", "scatters", "seconds", "temporaries_mib")
MESH = ["mesh.fsdp=1", "mesh.context=4", "mesh.expert=2", "parallel.context_strategy=ring"]
MEASURE = """
import json, re, sys
import parallel
from parallel import targets
from train.config import load_config
from train.planning.memory import plan_memory
config = load_config(sys.argv[1], sys.argv[2:])
plan = plan_memory(config, targets.compile_only_devices("h100", 8))
text = plan.compiled.as_text()
calls = re.findall(r'custom_call_target="(__cudnn\\$fmha\\w*)".*?"mask_type":\\s*"(\\w+)"', text)
print("RESULT", json.dumps(dict(
    cudnn_forward=sum(name == "__cudnn$fmhaSoftmax" for name, _ in calls),
    cudnn_backward=sum(name == "__cudnn$fmhaSoftmaxBackward" for name, _ in calls),
    masks=sorted(set(mask for _, mask in calls)),
    causal=sum(mask == "CAUSAL" or mask == "PADDING_CAUSAL" for _, mask in calls),
    pallas=text.count('custom_call_target="__gpu$xla.gpu.triton"') + text.count('custom_call_target="mosaic_gpu'),
    fusions=len(re.findall(r"= [^=]*? fusion\\(", text)),
    scatters=len(re.findall(r"f32\\[[^\\]]*\\][^=]*= [^=]*? scatter\\(", text)),
    seconds=round(plan.compile_seconds, 1),
    temporaries_mib=round(plan.temporaries / 2**20, 1),
    code=parallel.__file__,
)))
"""


def measure(tree: pathlib.Path, config: str, overrides: list[str]) -> dict:
    """The counts of `config` compiled by the code in `tree` (a subprocess)."""
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(REPO / config), *overrides],
        cwd=tree, env={"PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: no result\n{result.stderr[-3000:]}")
    found = json.loads(line.removeprefix("RESULT "))
    if not found.pop("code").startswith(str(tree)):
        raise SystemExit(f"{tree}: the measurement imported another tree's code")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BEFORE_STATIC_STEPS, help=f"git revision (default {BEFORE_STATIC_STEPS})")
    parser.add_argument("--config", default="configs/deepseek-tiny.yaml")
    parser.add_argument("--quick", action="store_true", help="the tiny Llama (configs/tiny.yaml)")
    parser.add_argument("--kernel", default="cudnn")
    args = parser.parse_args()
    args.config = "configs/tiny.yaml" if args.quick else args.config
    if not targets.plugin_installed():
        skip(f"needs XLA's GPU compiler: {targets.GPU_INSTALL}")
    overrides = [*MESH, f"parallel.attention_kernel={args.kernel}"]
    if "deepseek" not in args.config:
        overrides = [o for o in overrides if not o.startswith("mesh.expert")] + ["mesh.fsdp=2"]
    with tempfile.TemporaryDirectory() as work:
        tree = pathlib.Path(work) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        try:
            base = measure(tree, args.config, overrides)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    now = measure(REPO, args.config, overrides)
    print(f"{args.config} ring x {args.kernel} on 8 H100s ({' '.join(overrides)}): baseline {args.baseline} -> now")
    print(f"| {'':<16} | {'baseline':>10} | {'now':>10} | {'now/base':>9} |")
    for key in KEYS:
        share = f"{now[key] / base[key]:.3g}" if base[key] else "-"
        print(f"| {key:<16} | {base[key]:>10} | {now[key]:>10} | {share:>9} |")
    print(f"masks: baseline {base['masks']}, now {now['masks']}")
    for key in ("cudnn_forward", "fusions", "seconds"):
        if base[key]:
            ratio(f"{key}, ring x {args.kernel} now", f"{key} at {args.baseline}", now[key] / base[key])


if __name__ == "__main__":
    main()
