"""DeepSeek's sparse attention compiled for an H100 (parallel/deepseek_sparse.py): the indexer's selection, the
attention over it and the indexer's losses (sparse and the dense warm-up's), forward and backward, hold no loop whose
trip count is decided at run time and no conditional (XLA's GPU runtime reads each such bound or branch back to the
host, once per key block), on packed rows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import targets
from tests.parallel.attention_reference import packed_segments
from tests.parallel.test_sparse_strategies import BATCH, LENGTH, attend, inputs, warmup

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]


@pytest.mark.parametrize("loss", [attend, warmup], ids=["sparse", "dense-warmup"])
def test_no_loop_bound_or_branch_is_decided_at_run_time(loss):
    device = targets.compile_only_devices("h100", 8)[0]
    q, rows, kv_b, indexer_out, _ = inputs()
    seg = np.asarray(packed_segments(BATCH, LENGTH, seed=3), np.int32)

    def total(*arrays):
        """A scalar of every output (the sparse attention's out and loss, or the warm-up's loss)."""
        return sum(jnp.sum(jnp.sin(out)) for out in jax.tree.leaves(loss(*arrays, seg)))

    where = jax.sharding.SingleDeviceSharding(device)
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), (q, rows, kv_b, indexer_out)
    )
    text = jax.jit(jax.grad(total, argnums=(0, 1, 2, 3))).lower(*shapes).compile().as_text()
    loops = [line for line in text.splitlines() if re.search(r" while\(", line)]
    assert loops and all('"known_trip_count"' in line for line in loops), [line[:160] for line in loops]
    assert " conditional(" not in text
