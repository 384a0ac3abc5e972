"""`python -m train CONFIG --plan --target v5e|v5p|v6e|tpu7x --devices N` compiles the train step for a TPU slice with
no TPU (parallel/tpu_targets.py, libtpu with JAX_PLATFORMS=cpu) and prints the TPU compiler's memory plan against
the generation's HBM, and the speed estimate from the TPU program: the tiny Llama over a slice of each generation,
each context strategy once."""

import contextlib
import io

import pytest

import train.__main__ as cli
from parallel import tpu_targets
from tests.train.tiny_run import TINY

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not tpu_targets.libtpu_installed(), reason=f"needs the TPU compiler: {tpu_targets.TPU_INSTALL}"),
]


@pytest.mark.parametrize(
    "target, devices, kind, strategy, mesh",
    [
        ("v5p", 8, "TPU v5", "ring", ["mesh.fsdp=2", "mesh.context=4"]),
        ("v6e", 8, "TPU v6 lite", "usp", ["mesh.fsdp=2", "mesh.context=2", "mesh.ulysses=2"]),
        ("v5e", 4, "TPU v5 lite", "ulysses", ["mesh.context=4"]),
        ("tpu7x", 8, "TPU7x", "all_gather", ["mesh.fsdp=2", "mesh.context=4"]),
    ],
)
def test_the_tiny_step_plans_for_a_tpu_slice(target, devices, kind, strategy, mesh):
    argv = [str(TINY), "model.num_layers=2", *mesh, f"parallel.context_strategy={strategy}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main([*argv, "--plan", "--target", target, "--devices", str(devices)])
    text = printed.getvalue()
    assert status == 0, text
    memory = tpu_targets.TPU_TARGETS[target].memory
    assert f"{target}: {memory >> 30}.00 GiB of HBM per device" in text
    assert f"memory plan: {devices} tpu devices ({kind})" in text and "attention kernel splash" in text
    assert "tpu compiler's buffer assignment" in text and f"device memory {memory >> 30}.00 GiB: fits" in text
    assert f"speed estimate ({target}: data-sheet rates at assumed shares" in text and "tokens/s per device" in text
