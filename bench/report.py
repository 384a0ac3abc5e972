"""How a benchmark script reports its results to `bench/run_all.py`: one stdout line per ratio, or one skip line.

    from bench.report import ratio, skip

    ratio("tokens/s, remat full", "remat none", 1.02)  # prints: RATIO<TAB>tokens/s, remat full<TAB>remat none<TAB>1.02
    skip("needs a GPU")                                 # prints: SKIP<TAB>needs a GPU, then exits with status 0

Everything else a script prints (its own markdown tables, notes) is for people and is ignored by run_all.
"""

from __future__ import annotations

import sys

RATIO, SKIP = "RATIO", "SKIP"


def _clean(text: str) -> str:
    return " ".join(str(text).split())  # no tabs or newlines inside a field


def ratio(measurement: str, baseline: str, value: float) -> None:
    """Prints one machine-readable ratio line: `measurement` / `baseline` = `value` (measured in this run)."""
    print(f"{RATIO}\t{_clean(measurement)}\t{_clean(baseline)}\t{value:.4g}", flush=True)


def skip(reason: str) -> None:
    """Prints one machine-readable skip line and ends the script successfully (e.g. no GPU present)."""
    print(f"{SKIP}\t{_clean(reason)}", flush=True)
    sys.exit(0)


def parse(stdout: str) -> tuple[list[tuple[str, str, str]], str | None]:
    """(ratios as (measurement, baseline, value text), skip reason or None) from a script's stdout."""
    ratios, reason = [], None
    for line in stdout.splitlines():
        fields = line.rstrip("\n").split("\t")
        if fields[0] == RATIO and len(fields) == 4:
            ratios.append((fields[1], fields[2], fields[3]))
        elif fields[0] == SKIP and len(fields) == 2:
            reason = fields[1]
    return ratios, reason
