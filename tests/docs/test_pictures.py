"""docs/pictures.py draws the manual's pictures of the parallel layer from the code (layouts, ring steps, halo);
(slow) docs/retrieval_pictures.py trains and evaluates the tiny retrieval run and draws its heatmap and its held-out
loss by position."""

import importlib.util

import pytest

from tests.train.tiny_run import REPO


def script(name: str):
    """The module docs/<name>.py (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pictures_are_drawn(tmp_path):
    drawn = script("pictures").main(tmp_path)
    assert [p.name for p in drawn] == ["layouts.png", "ring.png", "halo.png"]
    assert all(p.stat().st_size > 10_000 for p in drawn)
    assert all((REPO / "docs" / "images" / p.name).exists() for p in drawn)  # the manual shows them


@pytest.mark.slow
def test_the_retrieval_run_s_pictures_are_made_by_running_it(tmp_path):
    drawn = script("retrieval_pictures").main(tmp_path / "run", docs=tmp_path / "docs")
    assert [p.name for p in drawn] == ["needle-tiny.png", "loss-by-position.png"]
    assert all(p.stat().st_size > 10_000 for p in drawn)
