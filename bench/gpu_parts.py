"""The parts of bench/on_gpu.py, one per call: `python -m bench.gpu_parts PART --rows FILE --scratch DIR [--argument A]
[--rehearse] [--fault F]`. Each appends one JSON object per measurement to FILE as soon as it has it, so a part
stopped at its time limit still reports what it measured, and runs its measurements as cases (bench/gpu_cases.py),
so that a crash costs one row. `ceilings` leaves its matmul rate in DIR for the parts after it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import pathlib
import platform
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_cases import Rows
from bench.timing import best_time
from bench.train_throughput import prepare, timed_step
from parallel import compat, kernels
from parallel.kernels import cudnn
from train.config import load_config
from train.planning.flops import flops_per_token, peak_flops_per_device

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "orbax-checkpoint", "grain")
# the recipes' attention shapes: query heads, key/value heads, q/k head dim, v head dim
GQA_8B, MLA = "gqa 32/8 x 128", "mla 16 x 192/128"
ATTENTION_HEADS = {
    GQA_8B: (32, 8, 128, 128),  # Llama 3.1 8B
    MLA: (16, 16, 192, 128),  # DeepSeek-V2-Lite
    "gqa 32/8 x 64": (32, 8, 64, 64),  # Llama 3.2 1B
    "gqa 16/2 x 256": (16, 2, 256, 256),  # Qwen3.5's full attention
}
# jax-cudnn: jax.nn.dot_product_attention's cuDNN; pallas runs Mosaic GPU's kernels on Hopper where they serve the
# call (parallel/kernels/mosaic.py), pallas-triton the Triton kernels there too
CANDIDATES = ("cudnn", "jax-cudnn", "flash3", "tokamax", "pallas", "pallas-triton")
GPU_ONLY = (
    "cudnn",
    "jax-cudnn",
    "flash3",
    "tokamax",
    "pallas-triton",
)  # pallas-triton is pallas off Hopper (and interpreted)
PACKED = ("cudnn", "flash3")  # kernels on packed rows: the calls they cannot serve run their general kernel, Pallas
ERRORS = ("out", "lse", "dq", "dk", "dv")


def ceilings(rows: Rows, args) -> None:
    """Versions, the device and its memory, then the TFLOP/s of bf16 [n, n] matmuls (20 chained in one call) and a
    copy's GB/s (bytes read and written), each the best of 10 calls."""
    versions = {"python": platform.python_version(), "cuda plugin": compat.cuda_plugin() or "none"}
    for package in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    device = jax.devices()[0]
    if device.platform == "gpu":
        versions["cudnn"] = str(compat.cudnn_attention().check_cudnn_version())
    stats = device.memory_stats() or {}
    rows.add(what="versions", value=", ".join(f"{k} {v}" for k, v in versions.items()))
    memory = f"{stats['bytes_limit'] / 2**30:.1f} GiB for XLA" if "bytes_limit" in stats else "unknown"
    rows.add(what="device", value=f"{device.device_kind}, {memory}")
    n = 512 if args.rehearse else 8192
    a, w = (jax.random.normal(key, (n, n), jnp.bfloat16) for key in jax.random.split(jax.random.key(0)))
    chain = jax.jit(lambda x, w: jax.lax.fori_loop(0, 20, lambda i, x: x @ w, x))
    tflops = 20 * 2 * n**3 / best_time(chain, (a, w * n**-0.5), repeats=10) / 1e12
    rows.add(what=f"bf16 matmul {n}^3", value=f"{tflops:.1f} TFLOP/s")
    (pathlib.Path(args.scratch) / "ceilings.json").write_text(json.dumps({"matmul_tflops": tflops}))
    size = (8 if args.rehearse else 4096) * 2**20
    x = jnp.ones((size // 4,), jnp.float32)
    gbs = 2 * size / best_time(jax.jit(lambda x: x * 1.5), (x,), repeats=10) / 1e9
    rows.add(what=f"copy of {size / 2**20:.0f} MiB", value=f"{gbs:,.0f} GB/s read + written")


def kernel_tests(rows: Rows, args) -> None:
    """tests/parallel/test_gpu_kernels.py over 12 workers; one row per case (result, and the failure's message)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-rf",
        "-p",
        "no:cacheprovider",
        "-n",
        "2" if args.rehearse else "12",
    ]
    command.append("tests/parallel/test_gpu_kernels.py")
    try:  # stopped a little before the part's box, so that the cases it ran still make rows
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(args.seconds - 15, 5))
        stdout, stderr, status = done.stdout, done.stderr, f"pytest exit status {done.returncode}"
    except subprocess.TimeoutExpired as stopped:
        stdout, stderr = (_text(x) for x in (stopped.stdout, stopped.stderr))
        status = f"pytest stopped after {stopped.timeout:.0f} s"
    print(stdout[-20000:], stderr[-5000:], flush=True)
    messages = dict(re.findall(r"^FAILED (\S+) - (.*)$", stdout, re.MULTILINE))
    found = re.findall(r"(PASSED|FAILED|SKIPPED|ERROR) (tests/\S+::\S+)", stdout)
    found += [(r, c) for c, r in re.findall(r"(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", stdout)]
    for case, result in {case: result for result, case in found}.items():
        rows.add(case=case.split("::")[-1], result=result, message=messages.get(case, "")[:300])
    if not found or status.startswith("pytest stopped"):
        rows.add(case="(run)", result=status, message=stdout[-300:])


def _text(output) -> str:
    """A stopped process's captured output as text (bytes when a time-out cut it)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def tiny_train(rows: Rows, args) -> None:
    """20 steps of configs/tiny.yaml with the `auto` kernel (a rehearsal: 4 steps of a smaller model): the kernel
    lines of its log and the loss by step."""
    out = pathlib.Path(args.scratch) / "tiny"
    overrides = ["train.steps=20", "train.log_every_steps=1", "optimizer.warmup_steps=5", f"train.output_dir={out}"]
    if args.rehearse:
        overrides += [
            "train.steps=4",
            "model.embed_dim=64",
            "model.num_layers=2",
            "model.mlp_dim=128",
            "data.seq_len=64",
        ]
    overrides += ["train.eval_batches=0", "train.sample_tokens=0", "checkpoint.every_steps=1000"]
    overrides.append("parallel.attention_kernel=auto")
    command = [sys.executable, "-m", "train", "configs/tiny.yaml", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-5000:], done.stderr[-10000:], flush=True)
    for line in done.stderr.splitlines():
        if re.search(r"attention kernel|first contact|falls back|fallback", line, re.IGNORECASE):
            rows.add(what="log", value=line.strip()[:300])
    metrics = out / "metrics.jsonl"
    losses = (
        [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
        if metrics.exists()
        else []
    )
    falling = bool(losses) and losses[-1] < 0.8 * losses[0]
    rows.add(what="loss", value=" ".join(f"{x:.3f}" for x in losses[:: max(1, len(losses) // 5)]), falling=falling)
    rows.add(what="exit status", value=done.returncode)


def packed_row(length: int, documents: int) -> tuple[np.ndarray, list[int]]:
    """[1, length] segment ids 1..documents of contiguous documents of equal lengths (the later ones a token longer
    where `documents` does not divide `length`), and their lengths."""
    lengths = np.diff([length * i // documents for i in range(documents + 1)]).tolist()
    return np.repeat(np.arange(1, documents + 1, dtype=np.int32), lengths)[None], lengths


def bakeoff_order(lengths: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(heads, T, documents) of every bake-off measurement, the most important first: GQA 32/8 x 128 at the longest
    and middle of the three `lengths` and MLA at the middle, each on two documents; then two, one and 16 documents,
    each by length and heads."""
    first = [(GQA_8B, lengths[2], 2), (GQA_8B, lengths[1], 2), (MLA, lengths[1], 2)]
    rest = [(heads, t, documents) for documents in (2, 1, 16) for t in lengths for heads in ATTENTION_HEADS]
    return first + [measurement for measurement in rest if measurement not in first]


def runnable(rows: Rows, args) -> list[str]:
    """The candidates --argument names (joined by +; default: all) that can run here; a row for each that cannot."""
    chosen = args.argument.split("+") if args.argument else CANDIDATES
    for name in sorted(set(chosen) - set(CANDIDATES)):
        bakeoff_row(rows, candidate=name, note=f"unknown: choose from {', '.join(CANDIDATES)}")
    running = []
    for candidate in (c for c in CANDIDATES if c in chosen):
        why = unavailable(candidate, args.rehearse)
        if why:
            bakeoff_row(rows, candidate=candidate, note=why)
        else:
            running.append(candidate)
    return running


def unavailable(candidate: str, rehearse: bool) -> str | None:
    """Why `candidate` cannot run in this process (None: it can): a GPU-only one in a rehearsal, or a kernel that
    parallel.kernels cannot select here (unknown to it, or not for this GPU)."""
    if rehearse and candidate in GPU_ONLY:
        return "not available on cpu"
    if candidate != "jax-cudnn":
        try:
            kernel(candidate, rehearse)
        except (ValueError, ImportError) as error:
            return f"not available: {_first_line(error)}"
    return None


def attend(candidate: str, tokens: kernels.Tokens, interpret: bool):
    """(q [1, T, h, dqk], k [1, T, hkv, dqk], v [1, T, hkv, dv]) -> (out [1, T, h, dv], lse [1, T, h] or None) of
    `candidate` (a kernel of parallel.kernels, or jax-cudnn: one document, no lse), causal on the row of `tokens`."""
    if candidate == "jax-cudnn":
        return lambda q, k, v: (jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), None)
    chosen = kernel(candidate, interpret)
    return lambda q, k, v: kernels.attention(q, k, v, tokens, tokens, kernel=chosen)


def kernel(candidate: str, interpret: bool) -> kernels.Kernel:
    """parallel.kernels' kernel of `candidate` (pallas-triton: Pallas as on a GPU before Hopper, Triton's kernels)."""
    if candidate == "pallas-triton":
        return kernels.select("pallas", interpret=interpret, capability="8.0")
    return kernels.select(candidate, interpret=interpret)


def outputs_and_grads(fn):
    """fn as `attend` returns it -> jitted (q, k, v, dout [1, T, h, dv]) -> (out, lse, dq, dk, dv): fn's outputs and
    the gradients of sum(out * dout)."""

    def run(q, k, v, dout):
        """fn's forward and backward."""
        out, pullback, lse = jax.vjp(fn, q, k, v, has_aux=True)
        return out, lse, *pullback(dout)

    return jax.jit(run)


def blockwise_reference(inputs, tokens: kernels.Tokens):
    """(out, lse, dq, dk, dv) of the blockwise kernel in float32 at full matmul precision on `inputs` (q, k, v, dout
    as outputs_and_grads takes them, cast to float32)."""
    with jax.default_matmul_precision("highest"):
        return outputs_and_grads(attend("blockwise", tokens, False))(*(x.astype(jnp.float32) for x in inputs))


def relative_errors(got, want) -> dict:
    """err_out .. err_dv: max |got - want| / max |want| of each of (out, lse, dq, dk, dv); "n/a" where got has none."""
    pairs = zip(ERRORS, got, want, strict=True)
    return {f"err_{name}": "n/a" if a is None else _relative_error(a, b) for name, a, b in pairs}


def _relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, to 3 significant digits."""
    expected = np.asarray(expected, np.float64)
    error = np.max(np.abs(np.asarray(actual, np.float64) - expected)) / max(np.max(np.abs(expected)), 1e-30)
    return float(f"{error:.3g}")


def bakeoff_row(rows: Rows, heads="", T=None, documents=None, candidate="", **measured) -> None:
    """One row with every bake-off column (those not measured empty), so that each table has them in one order."""
    columns = dict(ms=None, TFLOPS=None, of_matmul_ceiling=None, **dict.fromkeys(f"err_{e}" for e in ERRORS))
    columns.update(compile_s=None, note="")
    rows.add(heads=heads, T=T, documents=documents, candidate=candidate, **{**columns, **measured})


def kernel_bakeoff(rows: Rows, args) -> None:
    """Causal fwd+bwd of each candidate kernel (CANDIDATES; --argument: some of them joined by +) per (heads, length,
    documents) of bakeoff_order, a row written per measurement: ms, TFLOP/s per visible pair, fraction of the matmul
    ceiling, at the shortest length the errors against the blockwise kernel in float32 (at the longer ones the
    blockwise kernel, ~24 TFLOP/s on a GPU, is too slow), and the compile's seconds. A candidate that cannot run here
    gets one row saying why; one that raises for a shape, a row with the error's first line. A rehearsal: lengths 64,
    128 and 256, float32, an eighth of the heads, Pallas interpreted, GQA 32/8 x 128 on two documents only."""
    lengths = (64, 128, 256) if args.rehearse else (8192, 32768, 131072)
    order = [m for m in bakeoff_order(lengths) if not args.rehearse or m[::2] == (GQA_8B, 2)]
    running = runnable(rows, args)
    for heads, length, documents in order:
        where = dict(heads=heads, T=length, documents=documents)
        segment_ids, document_lengths = packed_row(length, documents)
        tokens = kernels.Tokens(jnp.asarray(segment_ids))
        inputs, flops = bakeoff_inputs(heads, length, document_lengths, args.rehearse)
        want = None
        for candidate in list(running):
            skipped = not_measured(candidate, heads, length, documents)
            if skipped:
                bakeoff_row(rows, **where, candidate=candidate, note=skipped)
                continue
            if rows.done(**where, candidate=candidate):  # measured, or crashed, before the part started again
                continue
            with rows.case(**where, candidate=candidate):
                if want is None and length == lengths[0]:
                    want = blockwise_reference(inputs, tokens)
                try:
                    measured = measure(
                        outputs_and_grads(attend(candidate, tokens, args.rehearse)), inputs, flops, want, args
                    )
                except ImportError as error:
                    bakeoff_row(rows, **where, candidate=candidate, note=f"not available: {_first_line(error)}")
                    running.remove(candidate)
                    continue
                except Exception as error:  # noqa: BLE001 - any failure is this candidate's row; the next one runs
                    note = f"{type(error).__name__}: {_first_line(error)}"
                    bakeoff_row(rows, **where, candidate=candidate, note=note)
                    continue
            note = "" if want is not None else f"errors at T={lengths[0]:,} only (blockwise is too slow here)"
            bakeoff_row(rows, **where, candidate=candidate, **measured, note=note)


def bakeoff_inputs(heads: str, length: int, document_lengths: list[int], rehearse: bool):
    """([q [1, T, h, dqk], k, v [1, T, hkv, d], dout [1, T, h, dv]] random, bfloat16 (rehearsal: float32, an eighth
    of the heads), and the fwd+bwd FLOPs over the row's visible pairs) of the `heads` shape."""
    h, hkv, dqk, dv = ATTENTION_HEADS[heads]
    if rehearse:
        h, hkv = h // 8, hkv // 8 or 1
    shapes = [(1, length, h, dqk), (1, length, hkv, dqk), (1, length, hkv, dv), (1, length, h, dv)]
    dtype = jnp.float32 if rehearse else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), len(shapes))
    inputs = [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes, strict=True)]
    return inputs, sum(3.5 * 2 * n * n / 2 * h * (dqk + dv) for n in document_lengths)  # a backward: 2.5 forwards


def not_measured(candidate: str, heads: str, length: int, documents: int) -> str:
    """Why `candidate` is not measured on this row ("" where it is): jax-cudnn takes one document a row; a kernel on
    packed rows hands some calls to Pallas, which has its own row."""
    if candidate == "jax-cudnn" and documents > 1:
        return "not applicable: one document per row only"
    handed = _handed_to_pallas(candidate, heads, length, documents) if candidate in PACKED else ""
    return f"not measured, Pallas runs this call: {handed}" if handed else ""


def measure(fn, inputs, flops: float, want, args) -> dict:
    """The bake-off columns of fn (outputs_and_grads') compiled ahead for inputs (a jitted call may trace again on its
    second call: JAX 0.12 registers a tracing option when Pallas first runs): ms and TFLOP/s of its fastest call
    (`flops` of work), their fraction of the matmul ceiling, given the reference's outputs `want` its errors against
    them, and the compile's seconds."""
    start = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    compile_s = round(time.perf_counter() - start, 1)
    seconds = best_time(compiled, inputs, repeats=1 if args.rehearse else 3, long_call_s=1.0)
    tflops = flops / seconds / 1e12
    measured = dict(
        ms=round(1e3 * seconds, 2), TFLOPS=float(f"{tflops:.3g}"), of_matmul_ceiling=_of_ceiling(tflops, args)
    )
    errors = relative_errors(compiled(*inputs), want) if want is not None else {}
    return dict(**measured, **errors, compile_s=compile_s)


def _handed_to_pallas(candidate: str, heads: str, length: int, documents: int) -> str:
    """Why a kernel on packed rows (PACKED) hands this call to its general kernel, Pallas: (cuDNN) more documents than
    its slots at this size (parallel/kernels/cudnn.py); "" where it serves the call itself. (The bake-off's loss
    reads no lse, so no shape here needs the lse cotangent's two extra columns.)"""
    h, _, dqk, dv = ATTENTION_HEADS[heads]
    slots = cudnn.slots((1, length, h, dqk), dv)
    if candidate == "cudnn" and documents > slots:
        return f"{documents} documents, cuDNN {slots} slots at this size"
    return ""


def _of_ceiling(tflops: float, args) -> float | None:
    """tflops as a fraction of the matmul ceiling measured in this run, if it was."""
    ceiling = _ceiling(args)
    return round(tflops / ceiling, 3) if ceiling else None


def _first_line(error: BaseException) -> str:
    """The error's message's first line (at most 300 characters), or its type's name when it has none."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def llama_1b(rows: Rows, args) -> None:
    """Train steps of Llama 3.2 1B (rehearsal: configs/tiny.yaml at 1/64 of the length) on one device, kernel:length
    from --argument, one document per row: tokens/s, MFU, compiled and measured peak memory."""
    kernel, length = args.argument.split(":")
    length = int(length) // 64 if args.rehearse else int(length)
    if args.rehearse and kernel not in ("auto", "blockwise"):
        rows.add(kernel=kernel, T=length, skipped="the fused kernels run on GPUs only")
        return
    if rows.done(kernel=kernel, T=length):  # it crashed before the part started again
        return
    base = "configs/tiny.yaml" if args.rehearse else "configs/models/llama3.2-1b.yaml"
    overrides = ["compute.dtype=bfloat16", "compute.remat_policy=full", f"data.seq_len={length}"]
    overrides += ["train.batch_size=1", f"parallel.attention_kernel={kernel}", "mesh.fsdp=1"]
    with rows.case(kernel=kernel, T=length):
        run = prepare(load_config(REPO / base, overrides))
        steps = 1 if args.rehearse or length > 65536 else 2
        run.seconds = [timed_step(run) for _ in range(steps)]
    seconds = min(run.seconds)
    tokens_per_sec = length / seconds
    model_tflops = tokens_per_sec * flops_per_token(run.config.model, length) / 1e12
    memory = run.step.memory_analysis()
    stats = jax.devices()[0].memory_stats() or {}
    rows.add(
        kernel=kernel, T=length, params_M=round(run.params / 1e6), step_s=round(seconds, 3),
        tokens_per_s=round(tokens_per_sec), MFU=round(model_tflops * 1e12 / peak_flops_per_device(), 3),
        of_matmul_ceiling=_of_ceiling(model_tflops, args),
        compiled_GiB=round((memory.argument_size_in_bytes + memory.temp_size_in_bytes) / 2**30, 2),
        peak_GiB=round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None,
    )  # fmt: skip


def _ceiling(args) -> float | None:
    """The matmul TFLOP/s the ceilings part measured in this run, if it did."""
    path = pathlib.Path(args.scratch) / "ceilings.json"
    return json.loads(path.read_text())["matmul_tflops"] if path.exists() else None


def grouped(rows: Rows, args) -> None:
    """The experts' grouped-matmul bake-off (bench/gpu_grouped.py, which reads this module's helpers), at this run's
    matmul ceiling."""
    from bench.gpu_grouped import grouped_bakeoff

    grouped_bakeoff(rows, args, _ceiling(args))


PARTS = dict(
    ceilings=ceilings,
    kernel_tests=kernel_tests,
    tiny_train=tiny_train,
    kernels=kernel_bakeoff,
    llama_1b=llama_1b,
    grouped=grouped,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=tuple(PARTS))
    parser.add_argument("--rows", required=True, type=pathlib.Path)
    parser.add_argument("--scratch", required=True)
    parser.add_argument("--argument", default="")
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--seconds", type=float, default=600, help="the part's time box (bench/on_gpu.py's)")
    parser.add_argument("--fault", action="append", default=[], help="a planted fault (bench/gpu_cases.py)")
    args = parser.parse_args()
    if args.rehearse:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        sys.exit(f"bench/gpu_parts.py {args.part}: no GPU (JAX's backend is {jax.default_backend()}); use --rehearse")
    rows = Rows(args.rows, args.part, tuple(args.fault))
    rows.fault({"part": args.part, "argument": args.argument})
    PARTS[args.part](rows, args)


if __name__ == "__main__":
    main()
