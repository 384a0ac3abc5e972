"""The speed estimate (train/planning/speed.py) of programs XLA's GPU compiler made for compile-only H100s: a matmul's
FLOPs and an all-gather's traffic are found in the compiled schedule as the program asks for them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench import speed_calibration
from parallel import targets
from train.planning import speed

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]
N = 4096


def test_a_compiled_matmul_and_all_gather_cost_what_the_rates_say():
    mesh = jax.sharding.Mesh(np.asarray(targets.compile_only_devices("h100", 8)), ("d",))
    whole, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    a = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=whole)
    x = jax.ShapeDtypeStruct((N, 1024), jnp.bfloat16, sharding=split)
    step = jax.jit(lambda a, x: (a @ a, x), out_shardings=(whole, whole))  # x gathered whole on every device
    rates = targets.TARGETS["h100"].rates
    tally = speed.schedule_cost(step.lower(a, x).compile().as_text(), rates, [0] * 8)
    assert tally.flops[speed.MATMULS] == 2 * N**3
    assert tally.collectives["all-gather"] == pytest.approx(7 * (N // 8) * 1024 * 2 / rates.nvlink)
    assert tally.seconds >= 2 * N**3 / rates.matmul


@pytest.mark.slow
@pytest.mark.parametrize("kernel, tokens, measured", speed_calibration.MEASURED)
def test_estimate_is_within_a_quarter_of_the_one_gpu_measurements(kernel, tokens, measured):
    """bench/README.md "On one GPU": the Llama 3.2 1B steps an H200 ran, estimated from their compile for one."""
    assert 0.75 <= speed_calibration.estimate(kernel, tokens).seconds / measured <= 1.25
