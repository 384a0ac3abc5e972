"""Test setup: 8 simulated CPU devices, a quickly compiling CPU backend and one compilation cache for the session (set
before JAX is imported, inherited by the runs tests start), the repository on sys.path; `shared_run` for outputs that
several tests read.

JAX runs on CPU, its default backend, with a machine's GPU beside it where it has one (JAX_PLATFORMS=cpu,cuda):
the GPU tests (tests/parallel/test_gpu_kernels.py) put their arrays on it, and the rest run as everywhere else."""

import fcntl
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

# The tests compile far more than they compute: without LLVM's optimisation passes XLA:CPU compiles 2-4x faster
# and runs the tiny steps a little slower. XLA's own (HLO) optimisations are unchanged, and every comparison the
# tests make is between programs compiled the same way.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
# an NVIDIA device node and JAX's CUDA plugin, as parallel.targets asks (importing `parallel` would import JAX before
# this); a GPU beside the CPU allocates as it goes, so test processes can share it
gpu = any(pathlib.Path("/dev").glob("nvidia[0-9]*")) and importlib.util.find_spec("jax_plugins") is not None
os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda" if gpu else "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# One persistent compilation cache per test session, which the pytest-xdist workers and the runs tests start inherit
# (made here, in the session's first process, before the workers start): many tests compile the same tiny programs
# (a train command's step, a GPU compile's kernels), and the key is the program, its options and the versions. JAX
# 0.12 cannot read back an executable compiled for compile-only GPUs (a UserWarning, then it compiles again).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = CACHE = tempfile.mkdtemp(prefix="longctx-compile-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"
else:
    CACHE = None  # a worker's, or one the caller chose: kept
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def pytest_unconfigure(config):
    """The session's compilation cache removed by the process that made it."""
    if CACHE is not None:
        shutil.rmtree(CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """shared_run(name, make) -> a directory that `make(directory)` filled, made once per test session: with
    pytest-xdist the first worker to ask makes it while the others wait, then all read the same files."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # each worker's base is a folder of the session's base
    root = root / "shared"
    root.mkdir(exist_ok=True)

    def get(name: str, make) -> pathlib.Path:
        directory, done = root / name, root / f"{name}.done"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not done.exists():
                shutil.rmtree(directory, ignore_errors=True)  # left by a make that failed
                directory.mkdir()
                make(directory)
                done.touch()
        return directory

    return get


FLOOR = tuple(int(part) for part in importlib.metadata.version("jax").split(".")[:2]) < (0, 11)


def pytest_collection_modifyitems(config, items):
    """The GPU compiles (the longest tests) first: with pytest-xdist no worker is left alone with one at the end. On
    the floor stack the `newest_stack` and `gpu_stack` variants skip: the floor checks each path once (every strategy
    and kernel), the newest stack every variant but the GPU machines' own (.ci/run: their JAX 0.11.2 compiles for GPUs
    too)."""
    items.sort(key=lambda item: item.get_closest_marker("gpu_compile") is None)
    if FLOOR:
        skip = pytest.mark.skip(reason="a further variant, checked on the stacks of JAX >= 0.11 only")
        for item in items:
            if item.get_closest_marker("newest_stack") or item.get_closest_marker("gpu_stack"):
                item.add_marker(skip)
