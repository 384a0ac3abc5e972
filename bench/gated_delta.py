"""Gated DeltaNet (Qwen3.5 / Qwen3-Next's linear attention) against full attention under context parallelism: what a
layer costs as the row grows, and what its split over the context devices moves.

1. Time and memory, run on 8 simulated CPU devices (ring, dual_chunk, float32): one layer's recurrence (the causal
   convolution of q, k and v, then the gated delta rule: parallel.causal_conv + parallel.gated_delta) forward +
   backward against one layer of causal attention (parallel.attention under the ring) of the same width (4 heads of
   64) at T = 8K, 32K and 128K (`--quick`: 4K, 8K, 16K). Attention at the longest T is predicted from the one before
   by its T^2 work unless `--attention-at-longest` (about 15 min on 2 cores). The slope is that of log(seconds) over
   log(T) between the shortest and the longest measured T: 1 is linear, 2 quadratic. Memory is the compiled
   program's temp per device.
2. Bytes per layer, compiled (not run) for 8 H100s (`--target h100`, the default with XLA's GPU compiler installed)
   or 8 CPU devices, at T = 131072 and Qwen3.5-35B-A3B's shapes (Gated DeltaNet: 16 key heads, 32 value heads of
   128; attention: 16 query and 2 key/value heads of 256; bfloat16): the result bytes per device of every
   collective in the program (all-gathers, reduce-scatters, all-reduces, permutes, all-to-alls; the Gated DeltaNet
   split gathers every piece's state map and the convolution's halo, and its backward reduce-scatters them), forward
   + backward, against the ring's.
3. The state exchange's designs, computed from the same shapes (no program): the all-gather of every piece's map
   (one round), a scan over the pieces in log2(pieces) dependent rounds of one map per piece, and a head all-to-all
   as under ulysses (q, k, v, g and beta to the heads' devices, the output back), bytes per device and layer.

    PYTHONPATH=. .venv/bin/python bench/gated_delta.py
    PYTHONPATH=. .venv/bin/python bench/gated_delta.py --quick
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import parallel
from bench.collectives import total_bytes
from bench.report import ratio
from bench.timing import best_time
from parallel import targets
from parallel.parallelism import Parallelism, use_parallelism

CP, TAPS, MIB = 8, 4, 2**20
# Qwen3.5-35B-A3B's linear and full attention layers
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 16, 32, 128, 128
HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def l2_normalised(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def recurrence_grad(mesh):
    """jit of the Gated DeltaNet recurrence's gradient in (q, k, v, g, beta, conv weights): conv, L2 norms, rule."""

    def loss(q, k, v, g, beta, weights):
        q, k, v = parallel.causal_conv((q, k, v), weights, mesh=mesh)
        q = l2_normalised(q.astype(jnp.float32)) * q.shape[-1] ** -0.5
        k = l2_normalised(k.astype(jnp.float32))
        repeat = v.shape[2] // k.shape[2]  # key heads repeated to value heads
        q, k = (jnp.repeat(x, repeat, axis=2).astype(v.dtype) for x in (q, k))
        return jnp.sum(parallel.gated_delta(q, k, v, g, beta, mesh=mesh).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))


def attention_grad(mesh):
    """jit of causal ring attention's gradient in (q, k, v)."""

    def loss(q, k, v):
        out = parallel.attention(q, k, v, strategy="ring", axis="context", layout="dual_chunk", mesh=mesh)
        return jnp.sum(out.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def recurrence_inputs(length, key_heads, heads, dk, dv, dtype, mesh, make):
    """(q, k, v, g, beta, conv weights) of a row of `length` made by make(shape, dtype, sharding, kind), kind
    "normal", "decay" (g) or "gate" (beta)."""
    rows = lambda *tail: NamedSharding(mesh, PartitionSpec(None, "context", *([None] * len(tail))))
    replicated = NamedSharding(mesh, PartitionSpec())
    q, k = (make((1, length, key_heads, dk), dtype, rows(1, 1), "normal") for _ in range(2))
    v = make((1, length, heads, dv), dtype, rows(1, 1), "normal")
    g, beta = (make((1, length, heads), jnp.float32, rows(1), kind) for kind in ("decay", "gate"))
    shapes = ((key_heads, dk), (key_heads, dk), (heads, dv))
    weights = tuple(make((TAPS, h, d), dtype, replicated, "normal") for h, d in shapes)
    return q, k, v, g, beta, weights


def attention_inputs(length, heads, kv_heads, dim, dtype, mesh, make):
    """(q, k, v) of a row of `length` made by make(shape, dtype, sharding, "normal")."""
    sharding = NamedSharding(mesh, PartitionSpec(None, "context", None, None))
    return tuple(make((1, length, h, dim), dtype, sharding, "normal") for h in (heads, kv_heads, kv_heads))


def random_maker(seed: int):
    """make(shape, dtype, sharding, kind) -> a placed random array: normal, a decay (-|N| / 10) or a gate in (0, 1)."""
    rng = np.random.default_rng(seed)
    kinds = {"normal": lambda x: x, "decay": lambda x: -np.abs(x) / 10, "gate": lambda x: 1 / (1 + np.exp(-x))}

    def make(shape, dtype, sharding, kind):
        return jax.device_put(jnp.asarray(kinds[kind](rng.normal(size=shape)), dtype), sharding)

    return make


def abstract(shape, dtype, sharding, kind):
    """The array's shape, dtype and sharding only (a compile without data)."""
    del kind
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def timed(args, mesh) -> None:
    """Part 1: seconds and temp per device of each layer at each length, and the slopes."""
    parallelism = Parallelism(strategy="ring", layout="dual_chunk", mesh=mesh)
    print(f"\n## One layer forward + backward on {CP} simulated CPU devices (ring, dual_chunk), 4 heads of 64\n")
    print("| T | Gated DeltaNet s | temp MiB | attention s | temp MiB | attention / Gated DeltaNet |")
    print("| --- | --- | --- | --- | --- | --- |")
    times = {"gdn": {}, "attention": {}}
    for index, length in enumerate(args.lengths):
        make = random_maker(index)
        with use_parallelism(parallelism):
            recurrence = recurrence_grad(mesh)
            inputs = recurrence_inputs(length, 4, 4, 64, 64, jnp.float32, mesh, make)
            times["gdn"][length] = best_time(recurrence, inputs, args.repeats, long_call_s=60)
            gdn_temp = recurrence.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
            attention = attention_grad(mesh)
            inputs = attention_inputs(length, 4, 4, 64, jnp.float32, mesh, make)
            attention_temp = attention.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
            predicted = index == len(args.lengths) - 1 and index > 0 and not args.attention_at_longest
            if predicted:  # T^2 work from the length before
                previous = args.lengths[index - 1]
                times["attention"][length] = times["attention"][previous] * (length / previous) ** 2
            else:
                times["attention"][length] = best_time(attention, inputs, args.repeats, long_call_s=60)
        mark = " (predicted: T^2)" if predicted else ""
        gdn, full = times["gdn"][length], times["attention"][length]
        print(f"| {length} | {gdn:.3f} | {gdn_temp / MIB:.0f} | {full:.3f}{mark} | {attention_temp / MIB:.0f} | "
              f"{full / gdn:.2f} |")  # fmt: skip
        ratio(f"one layer forward + backward, T={length}, cpu x{CP}: attention{mark}", "Gated DeltaNet", full / gdn)
    first, last = args.lengths[0], args.lengths[-1]
    for name, measured in times.items():
        top = last if name == "gdn" or args.attention_at_longest else args.lengths[-2]
        slope = math.log(measured[top] / measured[first]) / math.log(top / first)
        print(f"\n{name}: slope of log(seconds) over log(T) from {first} to {top}: {slope:.2f}")
        ratio(f"{name} time growth exponent, T={first}..{top}, cpu x{CP}", "linear (1)", slope)


def compiled_bytes(args) -> None:
    """Part 2: collective bytes per device and temp of one layer at Qwen3.5-35B-A3B's shapes, compiled."""
    if args.target == "h100":
        mesh = Mesh(np.array(targets.compile_only_devices("h100", CP)), ("context",))
        parallelism = Parallelism(platform="gpu", capability="9.0", strategy="ring", layout="dual_chunk", mesh=mesh)
    else:
        mesh = Mesh(np.array(jax.devices()[:CP]), ("context",))
        parallelism = Parallelism(strategy="ring", layout="dual_chunk", mesh=mesh)
    length = args.length
    with use_parallelism(parallelism):
        inputs = recurrence_inputs(length, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, jnp.bfloat16, mesh, abstract)
        recurrence = recurrence_grad(mesh).lower(*inputs).compile()
        inputs = attention_inputs(length, HEADS, KV_HEADS, HEAD_DIM, jnp.bfloat16, mesh, abstract)
        attention = attention_grad(mesh).lower(*inputs).compile()
    gathered, permuted = (collective_bytes(compiled.as_text()) for compiled in (recurrence, attention))
    print(f"\n## One layer forward + backward at T = {length} on {CP} {args.target} devices, Qwen3.5-35B-A3B shapes\n")
    print("| layer | collective results per device (MiB) | temp per device (MiB) |")
    print("| --- | --- | --- |")
    print(f"| Gated DeltaNet | {gathered / MIB:.1f} | "
          f"{recurrence.memory_analysis().temp_size_in_bytes / MIB:.0f} |")  # fmt: skip
    print(f"| ring attention | {permuted / MIB:.1f} | "
          f"{attention.memory_analysis().temp_size_in_bytes / MIB:.0f} |")  # fmt: skip
    ratio(f"collective bytes per layer, T={length}, {args.target} x{CP}: Gated DeltaNet", "ring attention",
          gathered / permuted)  # fmt: skip


def collective_bytes(hlo: str) -> int:
    """Result bytes per device of every collective of the program, each counted as often as it runs."""
    return sum(total_bytes(hlo, op) for op in COLLECTIVES)


def designs(args) -> None:
    """Part 3: bytes per device and layer (forward) of each state exchange, from the shapes."""
    length, pieces = args.length, 2 * CP  # dual_chunk: two pieces a device
    state = VALUE_HEADS * KEY_DIM * (KEY_DIM + VALUE_DIM) * 4  # one piece's [M | E], float32
    gather = (pieces - 2) * state  # every other device's two maps
    scan = math.ceil(math.log2(pieces)) * 2 * state  # each round: one map per piece of this device
    local = length // CP
    to_heads = local * (2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM) * 2 + local * 2 * VALUE_HEADS * 4
    back = local * VALUE_HEADS * VALUE_DIM * 2
    all_to_all = (to_heads + back) * (CP - 1) / CP
    print(f"\n## The state exchange's designs at T = {length}, {CP} devices ({pieces} pieces), forward, computed\n")
    print("| design | rounds | received per device (MiB) | vs all-gather |")
    print("| --- | --- | --- | --- |")
    for name, rounds, size in (
        ("all-gather of every piece's map (built)", 1, gather),
        ("scan over pieces, log depth", math.ceil(math.log2(pieces)), scan),
        ("head all-to-all (as ulysses)", 2, all_to_all),
    ):
        print(f"| {name} | {rounds} | {size / MIB:.1f} | {size / gather:.2f} |")
    ratio(f"state exchange bytes, T={length}, x{CP}: head all-to-all", "all-gather of maps", all_to_all / gather)
    ratio(f"state exchange bytes, T={length}, x{CP}: log-depth scan", "all-gather of maps", scan / gather)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="T = 4K, 8K, 16K timed, 16384 compiled, one call")
    parser.add_argument("--attention-at-longest", action="store_true", help="run attention at the longest T too")
    parser.add_argument("--target", choices=("h100", "cpu"), default="h100" if targets.plugin_installed() else "cpu")
    args = parser.parse_args()
    args.lengths = (8192, 32768, 131072)
    if args.quick:
        args.lengths, args.length, args.repeats = (4096, 8192, 16384), 16384, 1
    timed(args, Mesh(np.array(jax.devices()[:CP]), ("context",)))
    compiled_bytes(args)
    designs(args)


if __name__ == "__main__":
    main()
