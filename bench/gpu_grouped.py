"""The `grouped` part of bench/on_gpu.py: the experts' grouped matmul (parallel/grouped.py) by each implementation,
tokamax's kernel and XLA's `ragged_dot`, at one device's share of the Qwen3.5-35B-A3B recipe (16 local experts, embed
2048, expert MLP 512; 1024 tokens x 8 experts = 8192 rows a balanced load fills), in a receive buffer of 1.25 x those
rows and in the dropless dispatch's usual one (COMMON_LOAD x, parallel/experts.py): the SwiGLU experts' forward and
backward, ms, TFLOP/s on the filled rows, the fraction of the matmul ceiling and the largest error against XLA's
(float32 at full precision). A rehearsal: 4 experts, embed 64, MLP 32, 256 filled rows, XLA's only (tokamax's kernel
needs a GPU).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_cases import Rows
from bench.gpu_parts import _relative_error
from bench.timing import best_time
from layers.moe import expert_swiglu
from parallel import tokamax_calls
from parallel.experts import COMMON_LOAD
from parallel.parallelism import Parallelism, use_parallelism

# receive buffer rows / the rows a balanced load fills
BUFFERS = {"capacity 1.25": 1.25, "dropless": COMMON_LOAD}
CANDIDATES = ("tokamax", "xla")


def grouped_bakeoff(rows: Rows, args, ceiling: float | None) -> None:
    """One row per (buffer, candidate); `ceiling`: the run's matmul TFLOP/s, if measured."""
    experts, embed, mlp, filled = (4, 64, 32, 256) if args.rehearse else (16, 2048, 512, 8192)
    device = jax.devices()[0]
    dtype = jnp.float32 if args.rehearse else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 4)
    weights = [jax.random.normal(keys[i], shape, dtype) / 16 for i, shape in enumerate(
        ((experts, embed, mlp), (experts, embed, mlp), (experts, mlp, embed)))]  # fmt: skip
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(filled, [1 / experts] * experts), jnp.int32)
    flops = 3 * 3 * 2 * filled * embed * mlp  # three matmuls, each forward and its two gradients
    rows_x = jax.random.normal(keys[3], (int(filled * max(BUFFERS.values())), embed), dtype)
    # the reference on the filled rows alone (past them a buffer is padding)
    reference = _run("xla", device, rows_x[:filled], weights, sizes, filled)
    for buffer_name, scale in BUFFERS.items():
        buffer = int(filled * scale)
        x = rows_x[:buffer]
        where = dict(buffer=buffer_name, rows=buffer, filled=filled)
        for candidate in CANDIDATES:
            if candidate == "tokamax" and (args.rehearse or not tokamax_calls.installed()):
                rows.add(**where, candidate=candidate, note="not available: a GPU and the tokamax extra")
                continue
            if rows.done(**where, candidate=candidate):
                continue
            with rows.case(**where, candidate=candidate):
                try:
                    start = time.perf_counter()
                    fn = _compiled(candidate, device, x, weights, sizes, filled)
                    compile_s = round(time.perf_counter() - start, 1)
                    seconds = best_time(fn, (x, *weights), repeats=1 if args.rehearse else 3)
                    error = max(_relative_error(a, b) for a, b in zip(fn(x, *weights), reference, strict=True))
                except Exception as failure:  # noqa: BLE001 - any failure is this candidate's row
                    rows.add(**where, candidate=candidate, note=f"{type(failure).__name__}: {str(failure)[:300]}")
                    continue
            tflops = flops / seconds / 1e12
            of_ceiling = round(tflops / ceiling, 3) if ceiling else None
            rows.add(**where, candidate=candidate, ms=round(1e3 * seconds, 2), TFLOPS=float(f"{tflops:.3g}"),
                     of_matmul_ceiling=of_ceiling, error=error, compile_s=compile_s, note="")  # fmt: skip


def _compiled(candidate: str, device, x, weights, sizes, filled: int):
    """The experts' (out over the filled rows, dx, dgate, dup, ddown) of `candidate`, compiled."""
    parallelism = Parallelism(grouped_matmul=candidate, device=device)

    def run(x, *weights):
        def loss(x, *weights):
            with use_parallelism(parallelism):
                out = expert_swiglu(x, *weights, group_sizes=sizes)[:filled].astype(jnp.float32)
            return jnp.sum(jnp.sin(out)), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, *weights)
        return out, grads[0][:filled], *grads[1:]

    return jax.jit(run).lower(x, *weights).compile()


def _run(candidate: str, device, x, weights, sizes, filled: int):
    """`_compiled`'s outputs in float32 at full matmul precision."""
    f32 = [a.astype(jnp.float32) for a in (x, *weights)]
    with jax.default_matmul_precision("highest"):
        return _compiled(candidate, device, f32[0], f32[1:], sizes, filled)(*f32)
