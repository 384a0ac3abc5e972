"""The manual in docs/ builds as a site with `mkdocs build --strict` (every page in the nav exists, every link and
anchor between pages resolves, bench/README.md is included whole as the benchmarks page), and README.md is a front
door of at most 150 lines whose links into the manual resolve."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.train.tiny_run import REPO


@pytest.mark.both_stacks  # the docs extra is installed on the newest stack
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs mkdocs: pip install -e '.[docs]'")
def test_the_manual_builds_strictly(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "On one GPU" in benchmarks and "The speed estimate" in benchmarks


def test_the_readme_is_a_short_front_door_whose_links_resolve():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert {"docs/getting-started.md", "docs/architecture.md", "bench/README.md"} <= set(links)
    assert [link for link in links if not (REPO / link).exists()] == []
