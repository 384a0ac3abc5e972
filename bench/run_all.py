"""Runs every benchmark script in bench/ and writes one markdown table of the ratios they report.

Each `bench/*.py` but this file and the helpers in NOT_BENCHMARKS runs in its own interpreter (repository root as
working directory and on PYTHONPATH), with no arguments or, with `--quick`, with `--quick`. A script reports ratios
and skips through `bench/report.py`; a skipped, failed or timed-out script gets a row saying so. The table (benchmark,
measurement, baseline, ratio) goes to stdout and to `--out`; progress goes to stderr.

    PYTHONPATH=. .venv/bin/python bench/run_all.py --quick
    PYTHONPATH=. .venv/bin/python bench/run_all.py --only reorder,segments --out /tmp/results.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys
import time

from bench.report import parse

BENCH = pathlib.Path(__file__).resolve().parent
REPO = BENCH.parent
# helpers and the GPU run (bench/on_gpu.py, its own command with its own report), not ratio benchmarks
NOT_BENCHMARKS = {"run_all", "report", "collectives", "timing", "on_gpu", "gpu_parts"}


@dataclasses.dataclass
class Outcome:
    """One script's run: the ratios it reported, or why there are none."""

    name: str
    seconds: float
    ratios: list[tuple[str, str, str]]
    note: str = ""  # skipped / failed / timed out / no ratios


def benchmarks() -> list[str]:
    return sorted(path.stem for path in BENCH.glob("*.py") if path.stem not in NOT_BENCHMARKS)


def run_one(name: str, quick: bool, timeout: float) -> Outcome:
    command = [sys.executable, str(BENCH / f"{name}.py"), *(["--quick"] if quick else [])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(name, time.perf_counter() - start, [], f"timed out after {timeout:.0f} s")
    seconds = time.perf_counter() - start
    ratios, skipped = parse(done.stdout)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Outcome(name, seconds, ratios, f"failed (exit {done.returncode}): {last[:200]}")
    if skipped:
        return Outcome(name, seconds, [], f"skipped: {skipped}")
    return Outcome(name, seconds, ratios, "" if ratios else "no ratios reported")


def escape(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|")


def table(outcomes: list[Outcome], quick: bool) -> str:
    """Markdown: one row per ratio, one row per note; then each script's wall time."""
    lines = [
        f"`bench/run_all.py{' --quick' if quick else ''}`",
        "",
        "| benchmark | measurement | baseline | ratio |",
        "|---|---|---|---|",
    ]
    for outcome in outcomes:
        for measurement, baseline, value in outcome.ratios:
            lines.append(f"| {outcome.name} | {escape(measurement)} | {escape(baseline)} | {value} |")
        if outcome.note:
            lines.append(f"| {outcome.name} | {escape(outcome.note)} | - | - |")
    lines += ["", "wall time: " + ", ".join(f"{o.name} {o.seconds:.0f} s" for o in outcomes)]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--only", default="", help=f"comma-separated, from {', '.join(benchmarks())}")
    parser.add_argument("--out", type=pathlib.Path, default=BENCH / "results.md", help="markdown file to write")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds allowed per benchmark")
    args = parser.parse_args()
    args.only = args.only.split(",") if args.only else benchmarks()
    unknown = sorted(set(args.only) - set(benchmarks()))
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(benchmarks())}")
    return args


def main() -> int:
    args = parse_args()
    outcomes = []
    for name in args.only:
        print(f"{name} ...", file=sys.stderr, flush=True)
        outcomes.append(run_one(name, args.quick, args.timeout))
        print(f"{name}: {outcomes[-1].seconds:.0f} s {outcomes[-1].note}", file=sys.stderr, flush=True)
    text = table(outcomes, args.quick)
    print(text, end="")
    args.out.write_text(text)
    return 1 if any(o.note.startswith(("failed", "timed out")) for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
