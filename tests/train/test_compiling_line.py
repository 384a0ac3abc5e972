"""Before a command compiles a step it logs the software stack and what it compiles, so that a compile that ends the
process with a signal (no Python error) leaves a report naming them: the plan before its compile, a run (and
`train.evaluate`) before first contact compiles its kernels."""

import logging
from importlib.metadata import version

import jax
import pytest

import train.__main__ as cli
from parallel import first_contact
from parallel.mesh import make_mesh
from tests.train.tiny_run import MODEL, TINY
from train.config import load_config
from train.planning import run_parallelism

RING = [*MODEL, "data.seq_len=64", "mesh.context=4", "parallel.context_strategy=ring"]


def expected(devices: int) -> list[str]:
    """What the line names: the devices, the stack's versions, the strategy and its layout, the kernel."""
    return [
        f"compiling for {devices} cpu device(s)",
        f"jax {version('jax')}, jaxlib {version('jaxlib')}",
        "context strategy ring (dual_chunk), attention kernel blockwise",
    ]


class PlantedCrash(Exception):
    """Stands for a compile that never returns."""


def crash(*args, **kwargs):
    raise PlantedCrash


def test_a_plan_names_what_it_compiles_before_compiling(monkeypatch, capsys):
    monkeypatch.setattr(jax.stages.Lowered, "compile", crash)
    with pytest.raises(PlantedCrash):
        cli.main([str(TINY), *RING, "--plan", "--devices", "4"])
    line = next(line for line in capsys.readouterr().err.splitlines() if "compiling for" in line)
    assert all(part in line for part in expected(4)), line


def test_a_run_names_what_it_compiles_before_first_contact(monkeypatch, caplog):
    monkeypatch.setattr(first_contact, "checked", crash)
    config = load_config(TINY, RING)
    with caplog.at_level(logging.INFO), pytest.raises(PlantedCrash):
        run_parallelism.run_parallelism(config, make_mesh(config.mesh, jax.devices()[:4]))
    line = next(record.getMessage() for record in caplog.records if "compiling for" in record.getMessage())
    assert all(part in line for part in expected(4)), line
