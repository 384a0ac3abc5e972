"""First contact: a fused kernel or the ragged dispatch that disagrees with the reference path on the run's devices
(here: deliberately wrong ones on CPU) is replaced by it with a warning naming it and the error; a right one is
kept."""

import logging

import jax
import jax.numpy as jnp
import pytest

from parallel import experts, first_contact, kernels
from parallel.kernels import pallas, splash
from parallel.mesh import make_mesh
from parallel.parallelism import Parallelism
from train.config import MeshConfig

PALLAS = Parallelism(kernel="pallas", interpret=True, platform="cpu")
SPLASH = Parallelism(kernel="splash", interpret=True, platform="cpu", block_q=128, block_kv=128)  # as on a TPU
DIMS = (4, 2, 32, 16)  # GQA, q-k and v head dims that differ


@pytest.fixture(autouse=True)
def short_rows(monkeypatch):
    monkeypatch.setattr(first_contact, "LENGTH", 64)


def serve(monkeypatch, forward, name="pallas"):
    """kernels.select(name) gives the interpret-mode kernel `name` with `forward` in place of its own."""
    select = kernels.select

    def standin(kernel="auto", **options):
        chosen = select(kernel, **options)
        return chosen._replace(forward=forward) if kernel == name else chosen

    monkeypatch.setattr(kernels, "select", standin)


def broken(*args, **kwargs):
    """A kernel that fails to build."""
    raise RuntimeError("no kernel for this device")


def check(parallelism, mesh=None, experts_=(0, 0)):
    return first_contact.checked(parallelism, mesh or make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), dims=DIMS,
                                 experts=experts_, dtype=jnp.bfloat16)  # fmt: skip


@pytest.mark.parametrize("parallelism", [PALLAS, SPLASH], ids=["pallas", "splash"])
def test_a_right_kernel_is_kept(caplog, parallelism):
    with caplog.at_level(logging.INFO):
        assert check(parallelism) == parallelism
    assert f"attention kernel '{parallelism.kernel}' checked against the blockwise kernel on cpu" in caplog.text


def test_a_wrong_splash_kernel_falls_back_to_blockwise(monkeypatch, caplog):
    """On a TPU the kernel after splash is the blockwise kernel."""
    wrong = lambda *a, **kw: (lambda out, lse: (out, lse * 1.5))(*splash.forward(*a, **kw, interpret=True))
    serve(monkeypatch, wrong, "splash")
    with caplog.at_level(logging.WARNING):
        assert check(SPLASH).kernel == "blockwise"
    assert "attention kernel 'splash' disagrees with the blockwise kernel on cpu (diagonal: lse differs" in caplog.text


@pytest.mark.parametrize(
    "forward, error",
    [
        (
            lambda *a, **kw: (lambda out, lse: (out * 1.1, lse))(*pallas.forward(*a, **kw, interpret=True)),
            "out differs",
        ),
        (
            lambda *a, **kw: (lambda out, lse: (out, lse + 0.5))(*pallas.forward(*a, **kw, interpret=True)),
            "lse differs",
        ),
        (broken, "RuntimeError: no kernel for this device"),
    ],
)
def test_a_wrong_kernel_falls_back_to_blockwise_with_a_warning(monkeypatch, caplog, forward, error):
    serve(monkeypatch, forward)
    with caplog.at_level(logging.WARNING):
        assert check(PALLAS).kernel == "blockwise"
    assert "attention kernel 'pallas' disagrees with the blockwise kernel on cpu" in caplog.text
    assert error in caplog.text and "this run uses the blockwise kernel" in caplog.text


def test_ragged_dispatch_is_checked_against_capacity(monkeypatch, caplog):
    """XLA:CPU has no ragged all-to-all: the capacity dispatch stands in for a right ragged one, and a corrupted
    copy of it for a wrong one."""
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, context=2))
    parallelism = Parallelism(platform="cpu", expert_dispatch="ragged", expert_capacity=8.0)
    monkeypatch.setattr(experts, "_ragged", experts._capacity)
    with caplog.at_level(logging.INFO):
        assert check(parallelism, mesh, (8, 2)) == parallelism
    assert "ragged expert dispatch checked against the capacity dispatch" in caplog.text

    def wrong(*args):
        y, dropped = experts._capacity(*args)
        return y.at[0].add(1.0), dropped

    monkeypatch.setattr(experts, "_ragged", wrong)
    with caplog.at_level(logging.WARNING):
        assert check(parallelism, mesh, (8, 2)).expert_dispatch == "capacity"
    assert "ragged expert dispatch disagrees with the capacity dispatch on cpu (y differs" in caplog.text
