"""bench/on_gpu.py survives a case that crashes its interpreter or hangs: rehearsed on CPU with a crash and a hang
planted in two of the bake-off's cases, the table holds each as that case's row and every other case measured."""

import json
import os
import subprocess
import sys

from tests.train.tiny_run import REPO


def test_a_crash_and_a_hang_cost_one_row_each(tmp_path):
    command = [sys.executable, "bench/on_gpu.py", "--out", str(tmp_path), "--rehearse", "--only", "kernels=pallas"]
    command += ["--fault", "crash:T=64", "--fault", "hang:T=128", "--case-seconds", "15"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr  # a part that crashed is not ok
    (part,) = json.loads((tmp_path / "on_gpu.json").read_text())["parts"]
    assert part["status"] == "timed out after 15 s, then crashed (SIGSEGV), then ok", part["status"]
    rows = {row["T"]: row for row in part["rows"]}
    assert len(part["rows"]) == len(rows) == 3, part["rows"]  # one row a case, none twice
    assert rows[64]["note"] == "crashed (SIGSEGV); the part went on in a new interpreter"
    assert rows[128]["note"] == "timed out after 15 s; the part went on in a new interpreter"
    assert rows[256]["ms"] > 0
    table = (tmp_path / "on_gpu.md").read_text()
    assert "| gqa 32/8 x 128 | 64 | 2 | pallas |" in table and "crashed (SIGSEGV)" in table
