"""One prepared run on a machine with one GPU (H100 or H200): every part in its own interpreter, each time-boxed, a
failing or timed-out part does not stop the rest, and the whole run ends within 8 minutes. A part runs its
measurements as cases (bench/gpu_cases.py): one that crashes the interpreter (a signal: XLA's compiler, a kernel) or
runs past its time becomes that case's row, and the part goes on in a new interpreter with the cases left. Writes
`on_gpu.md` (a markdown table per part), `on_gpu.json` (every row, each part's status) and `on_gpu.log` (what the
parts printed) to `--out DIR`.

Parts (bench/gpu_parts.py):
  ceilings      versions, device name and memory; a large bf16 matmul's TFLOP/s and a device-to-device copy's GB/s
  kernels       the attention kernels' bake-off: causal fwd+bwd of cuDNN (ours, and JAX's on one document),
                FlashAttention-3 and Pallas for the recipes' heads (GQA 32/8 x 128 and x 64, MLA 16 x 192/128, GQA
                16/2 x 256) at 8K, 32K and 128K on rows of 1, 2 and 16 documents, most important first: TFLOP/s per
                visible pair, as a fraction of the matmul ceiling, and at 8K the errors against blockwise in float32
  grouped       the experts' grouped matmul (bench/gpu_grouped.py): tokamax's kernel and XLA's ragged_dot at one
                device's share of the Qwen3.5-35B-A3B recipe, in a receive buffer of 1.25 x a balanced load and a
                dropless one: ms, TFLOP/s on the filled rows, errors
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
    PYTHONPATH=. python bench/on_gpu.py --out /tmp/on_gpu --rehearse --only kernels --fault crash:T=128   # a crash
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from bench.gpu_cases import Rows, case_file, parse_fault, running_case

REPO = pathlib.Path(__file__).resolve().parents[1]
# (part, argument, seconds allowed, seconds a case may take or None: the part's): the order they run in, the most
# valuable first. Each part also stops at DEADLINE seconds after the run started; a part with no time left is not run
# (its status says so). The boxes add up to DEADLINE, so that every part gets its whole box.
PARTS = (
    ("ceilings", "", 25, None),
    # what its box reaches of bakeoff_order (bench/gpu_parts.py), most important first; a case compiles a kernel's
    # forward and backward at one shape and times three calls
    ("kernels", "", 125, 60),
    ("grouped", "", 25, None),  # tokamax's and XLA's grouped matmul: compiles of a few seconds, calls of milliseconds
    ("llama_1b", "auto:131072", 150, None),  # compile 40-60 s, then a warm-up and a timed step of 15-25 s each
    ("kernel_tests", "", 90, None),  # cuDNN, FlashAttention-3 and Pallas over 12 workers (cuDNN, Pallas: 78 s over 8)
    ("tiny_train", "", 55, None),  # 42 s on an H200
)
DEADLINE = 470  # seconds: the whole run ends within 8 minutes
REHEARSAL_SLOWER = 3  # a rehearsal's time boxes: CPU compiles and steps are slower than a GPU's, even at toy sizes
POLL = 0.2  # seconds between looks at a running part


class Part(NamedTuple):
    """One part to run: its name and argument, its time box and the time one of its cases may take."""

    name: str
    argument: str
    seconds: float
    case_seconds: float | None


def run_part(part: Part, scratch: pathlib.Path, rehearse: bool, faults: list[str], log) -> dict:
    """Runs one part in its own interpreter for at most its box; its rows (whatever it wrote before a time-out or
    failure) and its status: ok, failed (exit status), crashed (the signal) or timed out. When the interpreter dies
    inside a case (bench/gpu_cases.py), or the case runs past its time, that case gets a row saying so and the part
    starts again in a new interpreter with the box's time left, skipping the cases that have rows."""
    rows_file = scratch / f"{part.name}-{part.argument.replace(':', '-') or 'all'}.jsonl"
    command = [sys.executable, "-m", "bench.gpu_parts", part.name, "--rows", str(rows_file), "--scratch", str(scratch)]
    command += ["--argument", part.argument] * bool(part.argument) + ["--rehearse"] * rehearse
    command += [item for fault in faults for item in ("--fault", fault)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    label = f"{part.name} {part.argument}".strip()
    log.write(f"\n===== {label} (at most {part.seconds:.0f} s)\n")
    log.flush()
    start, statuses = time.perf_counter(), []
    while (left := part.seconds - (time.perf_counter() - start)) >= 1:
        status, case = run_once([*command, "--seconds", f"{left:.0f}"], env, left, part.case_seconds, rows_file, log)
        statuses.append(status)
        if case is None:
            break
        fields = case["fields"]
        note = f"{status}; the part went on in a new interpreter"
        Rows(rows_file, part.name).add(**fields, note=note)
        log.write(f"===== {label}: {fields} {status}\n")
    elapsed = time.perf_counter() - start
    rows = Rows(rows_file, part.name).rows()
    status = statuses[-1] if len(set(statuses)) == 1 else ", then ".join(statuses)
    log.write(f"===== {label}: {status}, {elapsed:.1f} s\n")
    log.flush()
    return {"part": part.name, "argument": part.argument, "status": status, "seconds": round(elapsed, 1), "rows": rows}


def run_once(command, env, seconds: float, case_seconds: float | None, rows_file: pathlib.Path, log):
    """(status, the case it died in or None) of one interpreter of a part, stopped after `seconds`, or once a case
    has run `case_seconds`."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    start, status = time.perf_counter(), None
    while status is None and process.poll() is None:
        case = running_case(rows_file)
        if time.perf_counter() - start > seconds:
            status = stop(process, f"timed out after {seconds:.0f} s")
        elif case is not None and case_seconds is not None and time.time() - case["started"] > case_seconds:
            status = stop(process, f"timed out after {case_seconds:.0f} s")
        else:
            time.sleep(POLL)
    code = process.returncode
    if status is None:
        status = (
            "ok"
            if code == 0
            else f"crashed ({signal.Signals(-code).name})"
            if code < 0
            else f"failed (exit status {code})"
        )
    case = running_case(rows_file) if code != 0 else None
    case_file(rows_file).unlink(missing_ok=True)  # the next interpreter starts in no case
    return status, case


def stop(process: subprocess.Popen, status: str) -> str:
    """`status`, once `process` and every process it started are killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return status


def selected(only: set[str]) -> list[Part]:
    """PARTS, or those named in `only`: a part's name, or PART=ARGUMENT (its time boxes, this argument)."""
    parts = [Part(*entry) for entry in PARTS]
    if not only:
        return parts
    known = {f"{part.name}={part.argument}" for part in parts}
    chosen = [part for part in parts if part.name in only or f"{part.name}={part.argument}" in only]
    for entry in sorted(only - known):
        if "=" in entry:
            name, argument = entry.split("=", 1)
            chosen.append(next(part for part in parts if part.name == name)._replace(argument=argument))
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
            columns = sorted(dict.fromkeys(key for row in rows for key in row), key=lambda c: c == "note")
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
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        help="with --rehearse: plant a fault in the cases it names, crash|hang:FIELD=VALUE[,...] "
        "(crash:candidate=pallas,T=128; part=NAME names a part), to check that the run survives it",
    )
    parser.add_argument("--case-seconds", type=float, help="the time a case may take (default: each part's own)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    names = dict.fromkeys(entry[0] for entry in PARTS)
    unknown = sorted(entry for entry in only if entry.split("=")[0] not in names)
    if unknown:
        parser.error(f"--only {', '.join(unknown)}: unknown part; choose from {', '.join(names)}")
    if args.fault and not args.rehearse:
        parser.error("--fault goes with --rehearse")
    for fault in args.fault:
        try:
            parse_fault(fault)
        except ValueError as error:
            parser.error(f"--fault: {error}")
    results = []
    with tempfile.TemporaryDirectory() as scratch, open(args.out / "on_gpu.log", "w") as log:
        start = time.perf_counter()
        for part in selected(only):
            slower = REHEARSAL_SLOWER if args.rehearse else 1
            seconds = min(part.seconds, DEADLINE - (time.perf_counter() - start) / slower) * slower
            case_seconds = args.case_seconds or (part.case_seconds and part.case_seconds * slower)
            part = part._replace(seconds=seconds, case_seconds=case_seconds)
            if seconds < 5:
                results.append(dict(part=part.name, argument=part.argument, status="not run: no time left", seconds=0,
                                    rows=[]))  # fmt: skip
            else:
                results.append(run_part(part, pathlib.Path(scratch), args.rehearse, args.fault, log))
            print(f"{part.name} {part.argument}: {results[-1]['status']} ({results[-1]['seconds']} s)", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = f"## On one GPU{' (rehearsal on CPU)' * args.rehearse}, {when}"
    (args.out / "on_gpu.json").write_text(json.dumps({"rehearse": args.rehearse, "parts": results}, indent=1))
    table = markdown(results, header)
    (args.out / "on_gpu.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
