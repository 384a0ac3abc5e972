"""128K tokens on CPU, for real (slow: `python -m pytest -q -m slow tests/train/test_long_context.py`, tens of
minutes on 2 cores): bench/long_context_cpu.py trains a 2-layer model at seq_len 131072 with ring attention over
8 simulated devices and fails unless the loss is finite and falling and the peak RSS is at most 8 GiB."""

import os
import pathlib
import subprocess
import sys

import pytest

from bench.report import parse

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_131072_tokens_train_on_8_cpu_devices_within_8_gib():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "bench/long_context_cpu.py", "--seq-len", "131072", "--max-rss-gib", "8"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=4 * 3600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ratios, _ = parse(done.stdout)
    assert [measurement.split(",")[0] for measurement, _, _ in ratios] == ["peak RSS", "loss at step 3"], ratios
