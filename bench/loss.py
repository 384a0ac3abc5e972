"""The chunked cross-entropy under context parallelism: per device (parallel.token_sums, what training runs) against
plain jit over the sharded sequence. Time of value and gradients, compiled temporaries per device, and the
collectives inside the chunk loop, on 8 simulated CPU devices.

Run: PYTHONPATH=. python bench/loss.py [--length 8192]
     PYTHONPATH=. python bench/loss.py --quick    # T = 4096
"""

from __future__ import annotations

import argparse
import os
import re
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from bench.report import ratio
from layers.loss import chunked_cross_entropy
from parallel.token_sums import token_sums

EMBED, VOCAB, CHUNK, REPEATS = 128, 4096, 512, 3
COLLECTIVE = re.compile(r"\s(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(")


def loss_fn(per_device: bool):
    sums = lambda h, t, m, k: chunked_cross_entropy(h, k, t, m, chunk_size=CHUNK)
    if per_device:
        return lambda h, k, t, m: token_sums(sums, (h, t, m), (k,))[0]
    return lambda h, k, t, m: sums(h, t, m, k)[0]


def in_loop_collectives(text: str) -> int:
    names = {name.lstrip("%") for name in re.findall(r"body=(%?[\w.\-]+)", text)}
    blocks = [b for b in re.split(r"\n(?=\S)", text) if (m := re.match(r"%?([\w.\-]+)", b)) and m.group(1) in names]
    return sum(bool(COLLECTIVE.search(line)) for block in blocks for line in block.splitlines())


def measure(per_device: bool, args, mesh) -> tuple[float, float, int]:
    """(median seconds of value and gradients, temporaries MiB per device, collectives inside loops)."""
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss_fn(per_device), argnums=(0, 1)))
        compiled = step.lower(*args).compile()
        jax.block_until_ready(step(*args))
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times.append(time.perf_counter() - start)
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    return float(np.median(times)), temp, in_loop_collectives(compiled.as_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="T = 4096")
    args = parser.parse_args()
    length = 4096 if args.quick else args.length
    mesh = jax.make_mesh((8,), ("context",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    rows = NamedSharding(mesh, PartitionSpec(None, "context"))
    hidden = jax.device_put(jnp.asarray(rng.normal(size=(1, length, EMBED)), jnp.float32), rows)
    kernel = jax.device_put(
        jnp.asarray(rng.normal(size=(EMBED, VOCAB)) * 0.1, jnp.float32), NamedSharding(mesh, PartitionSpec())
    )
    targets = jax.device_put(jnp.asarray(rng.integers(0, VOCAB, (1, length)), jnp.int32), rows)
    mask = jax.device_put(jnp.ones((1, length), jnp.float32), rows)
    inputs = (hidden, kernel, targets, mask)
    plain, per_device = measure(False, inputs, mesh), measure(True, inputs, mesh)
    print(f"| loss, context=8, T={length}, vocab {VOCAB} | time s | temp MiB/device | collectives in loop |")
    print("|---|---|---|---|")
    for name, (seconds, temp, collectives) in (("plain jit", plain), ("per device", per_device)):
        print(f"| {name} | {seconds:.3f} | {temp:.1f} | {collectives} |")
    ratio(f"loss value+grad time, per device, context=8 T={length}", "plain jit", per_device[0] / plain[0])
    ratio(f"loss temp memory, per device, context=8 T={length}", "plain jit", per_device[1] / plain[1])


if __name__ == "__main__":
    main()
