"""One prepared run on a machine with one GPU (H100 or H200): every part in its own interpreter, each time-boxed, a
failing or timed-out part does not stop the rest, and the whole run ends within 8 minutes. Writes `on_gpu.md` (a
markdown table per part), `on_gpu.json` (every row, each part's status) and `on_gpu.log` (what the parts printed) to
`--out DIR`.

Parts (bench/gpu_parts.py):
  ceilings      versions, device name and memory; a large bf16 matmul's TFLOP/s and a device-to-device copy's GB/s
  kernels       the attention kernels' bake-off: causal fwd+bwd of cuDNN (ours, and JAX's on one document),
                FlashAttention-3 and Pallas for the recipes' heads (GQA 32/8 x 128 and x 64, MLA 16 x 192/128, GQA
                16/2 x 256) at 8K, 32K and 128K on rows of 1, 2 and 16 documents, most important first: TFLOP/s per
                visible pair, as a fraction of the matmul ceiling, and at 8K the errors against blockwise in float32
  llama_1b      a Llama 3.2 1B train step on one GPU with `auto` at 128K (compile included in its box): tokens/s,
                MFU (train/planning/flops.py), peak device memory; llama_1b=KERNEL:LENGTH runs another
  kernel_tests  tests/parallel/test_gpu_kernels.py (cuDNN, FlashAttention-3 and Pallas against blockwise on the GPU),
                per case
  tiny_train    20 steps of configs/tiny.yaml with the `auto` kernel: its first-contact line and the loss falling

`--rehearse` runs every part on CPU at toy sizes (Pallas in interpret mode, the GPU-only kernels reported as not
available), so that on a GPU only the GPU is new; CI runs it. A GPU machine without a package registry installs the
wheels it lacks first (bench/gpu_wheels.sh prepares them; docs/gpus.md).

    PYTHONPATH=. python bench/on_gpu.py --out /tmp/on_gpu
    PYTHONPATH=. python bench/on_gpu.py --out /tmp/on_gpu --rehearse
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
# (part, argument, seconds allowed): the order they run in, the most valuable first. Each part also stops at DEADLINE
# seconds after the run started; a part with no time left is not run (its status says so). The boxes add up to
# DEADLINE, so that every part gets its whole box.
PARTS = (
    ("ceilings", "", 25),
    ("kernels", "", 150),  # what its box reaches of bakeoff_order (bench/gpu_parts.py), most important first
    ("llama_1b", "auto:131072", 150),  # compile 40-60 s, then a warm-up and a timed step of 15-25 s each
    ("kernel_tests", "", 90),  # cuDNN, FlashAttention-3 and Pallas over 12 workers (cuDNN and Pallas: 78 s over 8)
    ("tiny_train", "", 55),  # 42 s on an H200
)
DEADLINE = 470  # seconds: the whole run ends within 8 minutes
REHEARSAL_SLOWER = 3  # a rehearsal's time boxes: CPU compiles and steps are slower than a GPU's, even at toy sizes


def run_part(name: str, argument: str, seconds: float, scratch: pathlib.Path, rehearse: bool, log) -> dict:
    """Runs one part in its own interpreter for at most `seconds`; its rows (whatever it wrote before a time-out or
    failure) and its status: ok, failed (exit status) or timed out."""
    rows_file = scratch / f"{name}-{argument.replace(':', '-') or 'all'}.jsonl"
    command = [sys.executable, "-m", "bench.gpu_parts", name, "--rows", str(rows_file), "--scratch", str(scratch)]
    command += ["--argument", argument] * bool(argument) + ["--rehearse"] * rehearse + ["--seconds", f"{seconds:.0f}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    label = f"{name} {argument}".strip()
    log.write(f"\n===== {label} (at most {seconds:.0f} s)\n")
    log.flush()
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=seconds)
        status = "ok" if done.returncode == 0 else f"failed (exit status {done.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {seconds:.0f} s"
    elapsed = time.perf_counter() - start
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()] if rows_file.exists() else []
    log.write(f"===== {label}: {status}, {elapsed:.1f} s\n")
    log.flush()
    return {"part": name, "argument": argument, "status": status, "seconds": round(elapsed, 1), "rows": rows}


def selected(only: set[str]) -> list[tuple[str, str, float]]:
    """PARTS, or those named in `only`: a part's name, or PART=ARGUMENT (its time box, this argument)."""
    if not only:
        return list(PARTS)
    boxes = {name: seconds for name, _, seconds in PARTS}
    chosen = []
    for name, argument, seconds in PARTS:
        if name in only or f"{name}={argument}" in only:
            chosen.append((name, argument, seconds))
    chosen += [
        (*entry.split("=", 1), boxes[entry.split("=")[0]])
        for entry in only
        if entry not in {f"{n}={a}" for n, a, _ in PARTS} and "=" in entry
    ]
    return chosen


def markdown(results: list[dict], header: str) -> str:
    """One table per part (its rows' keys as columns), each headed by its status."""
    lines = [header, ""]
    tables: dict[str, list[dict]] = {}
    for result in results:
        tables.setdefault(result["part"], []).append(result)
    for part, runs in tables.items():
        statuses = ", ".join(f"{r['argument'] or part}: {r['status']} ({r['seconds']} s)" for r in runs)
        lines += [f"### {part}", "", statuses, ""]
        rows = [row for r in runs for row in r["rows"]]
        if rows:
            columns = list(dict.fromkeys(key for row in rows for key in row))
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
            lines.append("")
    return "\n".join(lines)


def _cell(value) -> str:
    """A table cell: floats to 3 significant digits (thousands whole), None empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=pathlib.Path, help="directory for on_gpu.md / .json / .log")
    parser.add_argument("--rehearse", action="store_true", help="every part on CPU at toy sizes")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated parts, or PART=ARGUMENT (llama_1b=pallas:32768, kernels=flash3+cudnn), to run "
        "(default: all)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    unknown = sorted(entry for entry in only if entry.split("=")[0] not in {name for name, _, _ in PARTS})
    if unknown:
        parser.error(
            f"--only {', '.join(unknown)}: unknown part; choose from {', '.join(dict.fromkeys(p[0] for p in PARTS))}"
        )
    results = []
    with tempfile.TemporaryDirectory() as scratch, open(args.out / "on_gpu.log", "w") as log:
        start = time.perf_counter()
        for name, argument, seconds in selected(only):
            slower = REHEARSAL_SLOWER if args.rehearse else 1
            seconds = min(seconds, DEADLINE - (time.perf_counter() - start) / slower) * slower
            if seconds < 5:
                results.append(dict(part=name, argument=argument, status="not run: no time left", seconds=0, rows=[]))
            else:
                results.append(run_part(name, argument, seconds, pathlib.Path(scratch), args.rehearse, log))
            print(f"{name} {argument}: {results[-1]['status']} ({results[-1]['seconds']} s)", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = f"## On one GPU{' (rehearsal on CPU)' * args.rehearse}, {when}"
    (args.out / "on_gpu.json").write_text(json.dumps({"rehearse": args.rehearse, "parts": results}, indent=1))
    table = markdown(results, header)
    (args.out / "on_gpu.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
