"""parallel/compat.py on the JAX this runs on (CI: the floor and the newest): the version check and its one line, the
CUDA plugin lookup for either CUDA major, the private cuDNN primitives' parameters, the Triton compiler params and
the distributed runtime's state."""

import importlib.util
import inspect
import subprocess
import sys

import pytest

from parallel import compat, targets
from tests.train.tiny_run import REPO

pytestmark = pytest.mark.both_stacks  # what differs between JAX versions: CI checks it on both

COMMON_BIND_PARAMETERS = {"scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout"}


@pytest.mark.parametrize("version", ["0.10.2", "0.11.2", "0.12.0", "0.12.0.1", "0.12.1.dev20261101"])
def test_versions_in_the_range_pass(version):
    compat.check_version(version)


@pytest.mark.parametrize("version", ["0.9.2", "0.10.1", "0.13.0", "1.0.0"])
def test_versions_outside_the_range_stop_in_one_line(version):
    with pytest.raises(compat.UnsupportedJax) as error:
        compat.check_version(version)
    message = str(error.value)
    assert "\n" not in message and f"JAX {version}" in message and compat.SUPPORTED in message


def test_the_installed_jax_is_in_the_range():
    import jax

    assert compat.FLOOR <= compat.version_tuple(jax.__version__) < compat.CEILING


def test_a_command_stops_with_the_one_line_on_an_unsupported_jax():
    """`python -m train` under a JAX outside the range: exit status 2 and one line on stderr, no traceback."""
    script = "import jax, runpy, sys; jax.__version__ = '0.9.2'; sys.argv = ['train', '--help']; "
    script += "runpy.run_module('train', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: longctx supports {compat.SUPPORTED}") and "not JAX 0.9.2" in line


@pytest.mark.parametrize("installed", [("jax_plugins.xla_cuda13",), ("jax_plugins.xla_cuda12",), ()])
def test_the_cuda_plugin_of_either_major_is_found(monkeypatch, installed):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    assert compat.cuda_plugin() == (installed[0] if installed else None)
    assert targets.plugin_installed() == bool(installed)


def test_cudnn_binds_take_the_parameters_the_kernel_passes():
    """The private primitives' implementation takes every parameter the kernel gives by name, and the version's extra
    ones (0.12: score_mod) are the ones compat fills in."""
    fa = compat.cudnn_attention()
    taken = set(inspect.signature(fa._dot_product_attention_fwd_impl).parameters)
    assert COMMON_BIND_PARAMETERS | {"sliding_window_length", "is_training"} <= taken
    assert set(compat.cudnn_bind_parameters()) == taken & {"score_mod"}
    assert {mask.name for mask in fa.MaskType} >= {"PADDING", "PADDING_CAUSAL"}
    forward, backward = compat.cudnn_binds()
    assert forward.keywords == backward.keywords == compat.cudnn_bind_parameters()


def test_triton_params_and_distributed_state():
    params = compat.triton_compiler_params(8, 2)
    assert (params.num_warps, params.num_stages) == (8, 2)
    state = compat.distributed_state()
    assert hasattr(state, "client") and hasattr(state, "coordinator_address")
