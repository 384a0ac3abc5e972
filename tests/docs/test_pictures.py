"""docs/pictures.py draws the manual's pictures of the parallel layer from the code (layouts, ring steps, halo)."""

import importlib.util

from tests.train.tiny_run import REPO


def test_the_pictures_are_drawn(tmp_path):
    spec = importlib.util.spec_from_file_location("pictures", REPO / "docs" / "pictures.py")
    pictures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pictures)
    drawn = pictures.main(tmp_path)
    assert [p.name for p in drawn] == ["layouts.png", "ring.png", "halo.png"]
    assert all(p.stat().st_size > 10_000 for p in drawn)
    assert all((REPO / "docs" / "images" / p.name).exists() for p in drawn)  # the manual shows them
