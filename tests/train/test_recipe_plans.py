"""The 128K recipes fit 80 GiB per device in `--plan`: Qwen3-8B on 8 devices, Qwen3-30B-A3B on 16 and gpt-oss-20b on
8 (about 10 s each), DeepSeek-V2-Lite on 8, V3 and V3.2 on 256 (slow: each compiles the full-size step for simulated CPU
devices, about a minute each; `python -m pytest -m slow`)."""

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def plan(name: str, devices: int) -> subprocess.CompletedProcess:
    """`python -m train configs/<name>.yaml --plan --devices <devices> --device-memory 80GiB`, finished."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            f"configs/{name}.yaml",
            "--plan",
            "--devices",
            str(devices),
            "--device-memory",
            "80GiB",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.mark.parametrize(
    "name, devices",
    [
        pytest.param("finetune-128k-qwen3-8b", 8, marks=pytest.mark.slow),  # Llama 3.1 8B's recipe's shape
        pytest.param("finetune-128k-qwen3-30b-a3b", 16, marks=pytest.mark.slow),
        ("finetune-128k-gpt-oss-20b", 8),
    ],
)
@pytest.mark.newest_stack
def test_128k_recipe_fits_80_gib(name, devices):
    done = plan(name, devices)
    assert done.returncode == 0 and "fits" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, devices",
    [("finetune-128k-deepseek-v2-lite", 8), ("finetune-128k-deepseek-v3", 256), ("finetune-128k-deepseek-v3.2", 256)],
)
def test_deepseek_128k_recipe_fits_80_gib(name, devices):
    done = plan(name, devices)
    assert done.returncode == 0 and "fits" in done.stdout, done.stdout + done.stderr
