"""First contact: a fused kernel that disagrees with the blockwise kernel on the run's devices (here: deliberately
wrong ones on CPU) is replaced by the next fused kernel that agrees, else the blockwise kernel, and a ragged dispatch
that disagrees with the capacity dispatch by it, each with a warning naming it and the error; a right one is
kept."""

import dataclasses
import logging
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from parallel import experts, first_contact, kernels
from parallel.kernels import pallas, splash
from parallel.mesh import make_mesh
from parallel.parallelism import Parallelism, current_parallelism
from train.config import MeshConfig
from train.process.stall import StallWatch

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


def check(parallelism, mesh=None, experts_=(0, 0), **options):
    return first_contact.checked(parallelism, mesh or make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]), dims=DIMS,
                                 experts=experts_, dtype=jnp.bfloat16, **options)  # fmt: skip


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
    assert "ragged expert dispatch (xla grouped matmul) checked against the capacity dispatch" in caplog.text

    def wrong(*args):
        y, dropped = experts._capacity(*args)
        return y.at[0].add(1.0), dropped

    monkeypatch.setattr(experts, "_ragged", wrong)
    with caplog.at_level(logging.WARNING):
        assert check(parallelism, mesh, (8, 2)).expert_dispatch == "capacity"
    assert "ragged expert dispatch (xla grouped matmul) disagrees with the capacity dispatch on cpu (y differs" in (
        caplog.text
    )


def test_a_ragged_dispatch_wrong_with_tokamax_falls_back_to_xla_s_grouped_matmul(monkeypatch, caplog):
    """tokamax's grouped matmul wrong, XLA's right (the capacity dispatch standing in for the ragged one on CPU):
    the run keeps the ragged dispatch with XLA's, one warning line."""
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, context=2))
    parallelism = Parallelism(platform="cpu", expert_dispatch="ragged", expert_capacity=8.0, grouped_matmul="tokamax")

    def ragged(*args):
        y, dropped = experts._capacity(*args)
        return (y * 1.5 if current_parallelism().grouped_matmul == "tokamax" else y), dropped

    monkeypatch.setattr(experts, "_ragged", ragged)
    with caplog.at_level(logging.INFO):
        assert check(parallelism, mesh, (8, 2)) == dataclasses.replace(parallelism, grouped_matmul="xla")
    assert "ragged expert dispatch (tokamax grouped matmul) disagrees with the capacity dispatch on cpu" in caplog.text
    assert "trying the xla grouped matmul" in caplog.text
    assert "ragged expert dispatch (xla grouped matmul) checked against the capacity dispatch" in caplog.text


def serve_cudnn(monkeypatch, forward):
    """kernels.select("cudnn") on CPU: the interpret-mode Pallas kernel named cudnn, with `forward` as its own."""
    select = kernels.select

    def standin(kernel="auto", **options):
        if kernel == "cudnn":
            return select("pallas", **options)._replace(name="cudnn", forward=forward)
        return select(kernel, **options)

    monkeypatch.setattr(kernels, "select", standin)


def test_a_wrong_kernel_falls_back_to_the_next_fused_kernel(monkeypatch, caplog):
    """cuDNN wrong: Pallas, the next fused kernel, is checked and kept; one line each."""
    serve_cudnn(monkeypatch, broken)
    with caplog.at_level(logging.INFO):
        assert check(dataclasses.replace(PALLAS, kernel="cudnn")).kernel == "pallas"
    assert "attention kernel 'cudnn' disagrees with the blockwise kernel on cpu (RuntimeError" in caplog.text
    assert "trying 'pallas'" in caplog.text
    assert "attention kernel 'pallas' checked against the blockwise kernel on cpu" in caplog.text


def test_every_fused_kernel_wrong_falls_back_to_blockwise(monkeypatch, caplog):
    serve_cudnn(monkeypatch, broken)
    serve(monkeypatch, broken)  # Pallas too
    with caplog.at_level(logging.WARNING):
        assert check(dataclasses.replace(PALLAS, kernel="cudnn")).kernel == "blockwise"
    lines = [r.getMessage() for r in caplog.records if "disagrees" in r.getMessage()]
    assert len(lines) == 2 and "trying 'pallas'" in lines[0] and "this run uses the blockwise kernel" in lines[1]


def watched(timeout: float) -> tuple[StallWatch, threading.Event]:
    """A started stall watch whose end sets the event instead of ending the process."""
    ended = threading.Event()
    watch = StallWatch(timeout, None, end=lambda status: ended.set())
    watch.start(interval=0.05)
    return watch, ended


def test_a_hang_in_first_contact_is_caught_by_the_stall_watch(monkeypatch, capsys):
    """A kernel that makes the device wait (a host callback sleeping past the timeout) ends the run with the watch's
    line naming the check."""

    def hanging(*args, **kwargs):
        out, lse = pallas.forward(*args, **kwargs, interpret=True)
        sleep = lambda x: (time.sleep(2.0), x)[1]
        return jax.pure_callback(sleep, jax.ShapeDtypeStruct(out.shape, out.dtype), out), lse

    serve(monkeypatch, hanging)
    watch, ended = watched(0.5)
    check(PALLAS, waiting=watch.waiting)
    watch.close()
    assert ended.is_set()
    assert "error: first contact with attention kernel 'pallas' made no progress" in capsys.readouterr().err


def test_first_contact_compiles_outside_the_stall_watch():
    """Compiling the interpret-mode kernels takes seconds, running them a fraction of one: a watch of one second
    sees no hang."""
    watch, ended = watched(1.0)
    assert check(PALLAS, waiting=watch.waiting) == PALLAS
    watch.close()
    assert not ended.is_set()
