"""What a part of bench/on_gpu.py leaves as it goes, so that a crash costs one row: its rows (a JSON-lines file, one
flushed line each) and the case it is running (a file beside them, there only while the case runs). When the part's
interpreter dies inside a case (a signal, a hang the run stops), bench/on_gpu.py writes that case's row and starts
the part again, which skips every case that has a row. A rehearsal can plant a fault in a case to check this.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import time

FAULTS = ("crash", "hang")  # a planted crash ends the interpreter with SIGSEGV; a planted hang sleeps until stopped


def parse_fault(text: str) -> tuple[str, dict[str, str]]:
    """'crash:candidate=pallas,T=128' -> ('crash', {'candidate': 'pallas', 'T': '128'}): the fault and the fields of
    the cases it is planted in (part=NAME names a part)."""
    fault, _, fields = text.partition(":")
    pairs = [pair.split("=", 1) for pair in fields.split(",") if pair]
    if fault not in FAULTS or not pairs or any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"a planted fault {text!r}: write {'|'.join(FAULTS)}:FIELD=VALUE[,FIELD=VALUE...]")
    return fault, dict(pairs)


def case_file(rows_file: pathlib.Path) -> pathlib.Path:
    """The file that names the case a part is running, beside its rows."""
    return rows_file.with_suffix(".case")


def running_case(rows_file: pathlib.Path) -> dict | None:
    """(the case's fields, when it started) of the case a part was running, or None when it was in none (its
    interpreter may remove the file at any moment: read once, not after a check)."""
    try:
        return json.loads(case_file(rows_file).read_text())
    except FileNotFoundError:
        return None


class Rows:
    """A part's rows: appended as measured (a row already in the file is not written twice, so that a part started
    again repeats none), and the cases it runs, each skipped when a row of it exists."""

    def __init__(self, path: pathlib.Path, part: str, faults: tuple[str, ...] = ()):
        self.path, self.part, self.faults = path, part, [parse_fault(f) for f in faults]

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []

    def add(self, **row) -> None:
        if row in self.rows():
            return
        with open(self.path, "a") as file:
            file.write(json.dumps(row) + "\n")
        print(row, flush=True)

    def done(self, **fields) -> bool:
        """Whether a row of the case `fields` exists (an earlier run of the part measured it, or it crashed)."""
        return any(fields.items() <= row.items() for row in self.rows())

    @contextlib.contextmanager
    def case(self, **fields):
        """Runs the body as the case `fields` (its row's identifying columns): named in the case file while it runs,
        and faulted where a fault is planted in it."""
        path = case_file(self.path)
        written = path.with_suffix(".case-new")
        written.write_text(json.dumps({"fields": fields, "started": time.time()}))
        written.replace(path)  # whole: the parent reads it while this runs
        self.fault({"part": self.part, **fields})
        yield
        path.unlink()

    def fault(self, fields: dict) -> None:
        """The planted fault whose fields `fields` has, if any: a crash or a hang."""
        for fault, where in self.faults:
            if all(str(fields.get(key)) == value for key, value in where.items()):
                print(f"planted {fault} in {fields}", flush=True)
                if fault == "crash":
                    os.kill(os.getpid(), signal.SIGSEGV)
                while True:
                    time.sleep(60)
