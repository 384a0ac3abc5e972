"""What a compiled program's collectives of one kind send per device, each counted as often as it runs: an op inside
a loop body runs the loop's known trip count times (nested loops multiply). From `compiled.as_text()`."""

from __future__ import annotations

import math
import re
from collections import defaultdict

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
HEADER = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{$")
CALLS = re.compile(r"(?:body|condition|to_apply|calls)=%([\w.-]+)|branch_computations=\{([^}]*)\}")
TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def sent(hlo: str, op: str = "collective-permute") -> list[tuple[str, int, int]]:
    """[(result shapes, bytes of one run, runs)] of every `op` in the program: a synchronous op's result (CPU), or
    an async pair's `-done` result (GPU; several arrays when XLA combined them)."""
    bodies, entry = _computations(hlo)
    runs = _runs(bodies, entry)
    found = []
    pattern = re.compile(rf" = (.*) {op}(?:-done)?\(")
    for name, lines in bodies.items():
        for line in lines:
            match = pattern.search(line)
            if match and runs[name]:
                arrays = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
                size = sum(
                    BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in arrays
                )
                found.append((" ".join(f"{dtype}[{dims}]" for dtype, dims in arrays), size, runs[name]))
    return found


def total_bytes(hlo: str, op: str = "collective-permute") -> int:
    """Bytes one device sends through `op` over one run of the program."""
    return sum(size * runs for _, size, runs in sent(hlo, op))


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its lines}, the entry computation's name)."""
    bodies, entry, current = {}, "", None
    for line in hlo.splitlines():
        header = HEADER.match(line)
        if header:
            current = header.group(1)
            bodies[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line != "}":
            bodies[current].append(line)
    return bodies, entry


def _runs(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    """{computation: how many times one run of the entry runs it} (a while body: its caller's runs x trip count)."""
    callees = defaultdict(list)  # caller -> [(callee, times per run of the caller)]
    for name, lines in bodies.items():
        for line in lines:
            trips = TRIPS.search(line)
            for called, branches in CALLS.findall(line):
                for callee in [called] if called else re.findall(r"%([\w.-]+)", branches):
                    loop = f"body=%{callee}" in line and trips
                    callees[name].append((callee, int(trips.group(1)) if loop else 1))
    runs = defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee, factor in callees[name]:
            visit(callee, times * factor)

    visit(entry, 1)
    return runs
