"""MLA's latent on the ring (parallel/latent.py) against rotating its expanded K/V, in the same run: DeepSeek-V3's
attention (128 heads, keys 128 + 64 wide, values 128, latent 512 + 64) at 128K over a ring of 16 H100s on two hosts,
as its recipe splits it, forward + backward of one layer compiled for H100 (no GPU: parallel/targets.py, the `gpu`
extra). Prints the bytes each ring step moves per device (from the compiled collective-permutes), the speed
estimate's step seconds and its collective-permutes' seconds, hidden or exposed (train/planning/speed.py), the matmul
FLOPs the per-step expansion adds against the attention kernels' FLOPs, and the compiled temporaries.

    PYTHONPATH=. python bench/mla_ring.py            # 128K over 16 devices, cuDNN (about 3 minutes on 2 cores)
    PYTHONPATH=. python bench/mla_ring.py --quick    # 32K over 8 devices, 16 heads
"""

from __future__ import annotations

import argparse
import math
import re
import time

from bench.report import ratio, skip
from parallel import targets

MIB = 2**20
DTYPE_BYTES = {"bf16": 2, "f32": 4}


def step_bytes(text: str) -> tuple[int, int]:
    """(forward, backward) bytes one ring step moves per device in compiled HLO text: every distinct array a
    collective-permute carries counted once (a permute-start's result pairs operand and output: the operand half),
    the forward's those in bfloat16 (K/V or the latent rows), the backward's all (with dK/dV or the rows' gradient in
    float32)."""
    carried = set()
    for line in text.splitlines():
        match = re.search(r"= (\(.*?\)|\S+) collective-permute(-start)?\(", line)
        if match:
            arrays = re.findall(r"(bf16|f32)\[([\d,]*)\]", match.group(1))
            carried.update(arrays[: len(arrays) // 2] if match.group(2) else arrays)
    size = {array: DTYPE_BYTES[array[0]] * math.prod(int(d) for d in array[1].split(",") if d) for array in carried}
    return sum(b for (dtype, _), b in size.items() if dtype == "bf16"), sum(size.values())


def compile_layer(devices, *, length: int, heads: int, latent: bool, kernel: str):
    """(compiled, seconds to compile) of one MLA attention's forward + backward under the ring over `devices`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import parallel
    from parallel.latent import expand
    from parallel.parallelism import Parallelism, use_parallelism

    lora, rope, nope, dv = 512, 64, 128, 128
    mesh = Mesh(np.array(devices), ("context",))
    shapes = dict(
        q=((1, length, heads, nope + rope), PartitionSpec(None, "context")),
        rows=((1, length, lora + rope), PartitionSpec(None, "context")),
        kv_b=((lora, heads, nope + dv), PartitionSpec()),
        w=((1, length, heads, dv), PartitionSpec(None, "context")),
    )
    args = [
        jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)) for shape, spec in shapes.values()
    ]

    def loss(q, rows, kv_b, w):
        k, v = expand(kv_b, rows, nope)
        bundle = parallel.Latent(parallel.gather(rows), kv_b, nope) if latent else None
        out = parallel.attention(q, k, v, causal=True, latent=bundle)
        return jnp.sum(out.astype(jnp.float32) * w.astype(jnp.float32))

    parallelism = Parallelism(strategy="ring", layout="dual_chunk", kernel=kernel, platform="gpu", capability="9.0")
    with jax.set_mesh(mesh), use_parallelism(parallelism):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
        start = time.perf_counter()
        compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32K over 8 devices, 16 heads")
    parser.add_argument("--kernel", default="cudnn", choices=("cudnn", "pallas", "blockwise"))
    args = parser.parse_args()
    if not targets.plugin_installed():
        skip(f"compiling for H100 needs XLA's GPU compiler: {targets.GPU_INSTALL}")
    from train.planning.speed import schedule_cost

    count, length, heads = (8, 32768, 16) if args.quick else (16, 131072, 128)
    devices = targets.compile_only_devices("h100", count)
    hosts = [d.process_index for d in devices]
    rates = targets.target("h100").rates
    print(f"MLA attention, {heads} heads, {length} tokens over a ring of {count} H100s ({len(set(hosts))} hosts), "
          f"{args.kernel}, forward + backward\n")  # fmt: skip
    columns = (
        "rotates", "bytes per step, forward (MiB)", "backward (MiB)", "step estimate (s)", "permutes (s)",
        "of them exposed (s)", "matmul TFLOP", "attention TFLOP", "temporaries (MiB)", "compile (s)",
    )  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    found = {}
    for name, latent in (("K/V", False), ("latent", True)):
        compiled, seconds = compile_layer(devices, length=length, heads=heads, latent=latent, kernel=args.kernel)
        text = compiled.as_text()
        forward, backward = step_bytes(text)
        tally = schedule_cost(text, rates, hosts)
        memory = compiled.memory_analysis()
        exposed = sum(s for part, s in tally.parts.items() if part.startswith("collective-permute"))
        matmul = tally.flops.get("matmuls", 0.0) / 1e12
        attention = tally.flops.get("attention kernels", 0.0) / 1e12
        found[name] = dict(forward=forward, backward=backward, seconds=tally.seconds, exposed=exposed, matmul=matmul)
        permutes = tally.collectives.get("collective-permute", 0.0)
        row = (name, f"{forward / MIB:.1f}", f"{backward / MIB:.1f}", f"{tally.seconds:.3g}", f"{permutes:.3g}",
               f"{exposed:.3g}", f"{matmul:.3g}", f"{attention:.3g}", f"{memory.temp_size_in_bytes / MIB:,.0f}",
               f"{seconds:.0f}")  # fmt: skip
        print("| " + " | ".join(row) + " |")
    before, after = found["K/V"], found["latent"]
    ratio("ring bytes per forward step, latent", "K/V", after["forward"] / before["forward"])
    ratio("ring bytes per backward step, latent", "K/V", after["backward"] / before["backward"])
    ratio("attention layer step estimate, latent", "K/V", after["seconds"] / before["seconds"])


if __name__ == "__main__":
    main()
