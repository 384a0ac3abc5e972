"""TPU slices to plan for (parallel/tpu_targets.py): `--devices N` as the slice a generation has of N devices, and the
requests no slice or no libtpu can serve refused in one line before anything compiles."""

import train.__main__ as cli
from parallel import tpu_targets
from parallel.tpu_targets import TPU_TARGETS, sizes, slice_shape
from tests.train.tiny_run import TINY


def test_slices_grow_as_the_generations_name_them():
    v5e, v5p, ironwood = TPU_TARGETS["v5e"], TPU_TARGETS["v5p"], TPU_TARGETS["tpu7x"]
    assert [slice_shape(v5e, n) for n in (1, 4, 8, 16, 32, 256)] == [(1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (16, 16)]
    assert [slice_shape(v5p, n) for n in (4, 8, 16, 32, 64, 128)] == [
        (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8),
    ]  # fmt: skip
    assert slice_shape(v5p, 2) is None and slice_shape(v5e, 12) is None
    assert sizes(v5p, 64) == [1, 4, 8, 16, 32, 64] and sizes(ironwood, 16) == [2, 8, 16, 32]


def refused(argv, capsys) -> str:
    """The error `python -m train ARGV` printed, having exited 2."""
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_a_slice_no_generation_has_or_a_missing_libtpu_is_one_line(monkeypatch, capsys):
    plan = [str(TINY), "--plan", "--target"]
    err = refused([*plan, "v5p", "--devices", "12"], capsys)
    assert "--devices=12: a v5p slice has one of 1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, ... devices" in err
    err = refused([*plan, "tpu7x", "--devices", "4"], capsys)
    assert "--devices=4: a tpu7x slice has one of 2, 8, 16, 32, " in err and "... devices (2 a chip)" in err
    monkeypatch.setattr(tpu_targets, "libtpu_installed", lambda: False)
    err = refused([*plan, "v6e", "--devices", "8"], capsys)
    assert f"compiling for v6e needs the TPU compiler: {tpu_targets.TPU_INSTALL}" in err
