"""Peak host memory of Hugging Face import and export (models/hf) against the sizes of the model, its largest
shard and its largest tensor.

A random LlamaForCausalLM (fp32, 351 MB by default) is made with transformers and saved in shards of at most
--shard-mb. Each step then runs in a fresh interpreter and reports its peak resident memory (getrusage
ru_maxrss); the table gives each peak minus that of `baseline`, which imports the same modules and starts JAX.
Steps: `load` = load_pretrained; `load + save` = load_pretrained then save_pretrained in shards of the same
limit; `cli import` = `python -m train.hf import` (load + orbax save); `cli export` = `python -m train.hf
export` of that import (orbax restore + save_pretrained).

    PYTHONPATH=. .venv/bin/python bench/hf_memory.py [--layers 12] [--shard-mb 100]
    PYTHONPATH=. .venv/bin/python bench/hf_memory.py --quick    # --layers 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile

from bench.report import ratio, skip

MIB = 2**20
STEPS = ("baseline", "load", "load + save", "cli import", "cli export")


def make_model(path: pathlib.Path, layers: int, shard_bytes: int) -> None:
    """Random Llama (embed 768, 12 heads / 4 kv heads, mlp 2048, vocab 8000, untied) saved in shards."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size=shard_bytes)


def child(step: str, work: pathlib.Path, shard_bytes: int, layers: int) -> None:
    """Runs one step in this interpreter; prints its peak RSS in MiB as JSON."""
    if step == "make":
        make_model(work / "hf", layers, shard_bytes)
        return
    import jax
    import jax.numpy as jnp

    from models.hf import load_pretrained, save_pretrained
    from train.hf import export_checkpoint, import_checkpoint

    jnp.zeros(1).block_until_ready()
    if step == "load":
        jax.block_until_ready(jax.tree.leaves(load_pretrained(work / "hf")))
    elif step == "load + save":
        save_pretrained(load_pretrained(work / "hf"), work / "saved", max_shard_bytes=shard_bytes)
    elif step == "cli import":
        import_checkpoint(work / "hf", work / "imported")
    elif step == "cli export":
        export_checkpoint(work / "imported", work / "exported", max_shard_bytes=shard_bytes)
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MIB}))


def in_subprocess(step: str, work: pathlib.Path, shard_bytes: int, layers: int) -> float | None:
    """Runs `child(step, ...)` in a fresh interpreter and returns its peak RSS. This process stays small: a
    child's ru_maxrss starts from the memory of the process that spawned it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    out = subprocess.run(
        [sys.executable, __file__, "--child", step, str(work), str(shard_bytes), str(layers)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"] if step != "make" else None


def sizes(path: pathlib.Path) -> tuple[float, float, float, int]:
    """(total MiB, largest shard MiB, largest tensor MiB, shard count) of a safetensors directory."""
    from models.hf.reader import SafetensorsFile

    shards = sorted(path.glob("*.safetensors"))
    tensor = max(
        end - begin
        for file in shards
        for entry in SafetensorsFile(file).header.values()
        for begin, end in [entry["data_offsets"]]
    )
    bytes_ = [file.stat().st_size for file in shards]
    return sum(bytes_) / MIB, max(bytes_) / MIB, tensor / MIB, len(shards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--shard-mb", type=int, default=100, help="max shard size of the source and the export")
    parser.add_argument("--quick", action="store_true", help="--layers 2")
    parser.add_argument("--child", nargs=4, metavar=("STEP", "WORK", "SHARD_BYTES", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        step, work, shard_bytes, layers = args.child
        child(step, pathlib.Path(work), int(shard_bytes), int(layers))
        return
    if not all(importlib.util.find_spec(name) for name in ("torch", "transformers")):
        skip("needs torch and transformers (pip install -e '.[hf]')")
    if args.quick:
        args.layers = 2
    shard_bytes = args.shard_mb * 10**6
    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        in_subprocess("make", work, shard_bytes, args.layers)
        model, shard, tensor, count = sizes(work / "hf")
        peaks = {step: in_subprocess(step, work, shard_bytes, args.layers) for step in STEPS}
        _, exported_shard, _, exported_count = sizes(work / "exported")
    print(
        f"model {model:.1f} MiB in {count} shards (largest shard {shard:.1f} MiB, largest tensor {tensor:.1f} "
        f"MiB); export wrote {exported_count} shards (largest {exported_shard:.1f} MiB); baseline peak "
        f"{peaks['baseline']:.1f} MiB\n"
    )
    print(
        "| step | peak RSS (MiB) | above baseline (MiB) | above / model | (above - model) / largest shard "
        "| (above - model) / largest tensor |"
    )
    print("|---|---|---|---|---|---|")
    for step in STEPS[1:]:
        above = peaks[step] - peaks["baseline"]
        print(
            f"| {step} | {peaks[step]:.1f} | {above:.1f} | {above / model:.2f} | {(above - model) / shard:.2f} "
            f"| {(above - model) / tensor:.2f} |"
        )
    for step in STEPS[1:]:
        above = peaks[step] - peaks["baseline"]
        ratio(f"peak RSS above baseline, {step}, {args.layers} layers", "model size", above / model)


if __name__ == "__main__":
    main()
