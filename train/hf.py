"""`python -m train.hf import HF_DIR OUT` and `python -m train.hf export CHECKPOINT HF_DIR`.

import writes OUT/model (an orbax `model` item: `checkpoint.init_from=OUT` seeds a run's parameters from it),
OUT/model.yaml (the architecture under a top-level `model:` key, for a run config's `base:`) and
OUT/hf_config.json (the source config.json, whose token ids and max_position_embeddings export carries over) and
OUT/tokenizer.json when the source has one (for `data.tokenizer`). A run initialised from OUT keeps the last two
in its run directory (train/origin.py), so the export of a fine-tune carries them too.

export reads CHECKPOINT: an import's OUT, a run's checkpoints/<step>, or a run's checkpoints/ (its newest step
that can be read: a damaged newer one is passed over with a warning, and nothing is moved), onto this process's
devices whatever the devices it was saved on, and prints the step it wrote. The architecture comes from --config
if given, else CHECKPOINT/model.yaml (an import), else the resolved config a run saves in every checkpoint (its
`meta` item). HF_DIR is written whole beside itself and swapped in, so an interrupted export leaves the previous
one; an HF_DIR that holds another model is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys

import orbax.checkpoint as ocp
import yaml
from flax import nnx

from models.config import ConfigError, ModelConfig
from models.hf.convert import CONFIG, abstract_model, load_pretrained, save_pretrained
from train import environment, library_log
from train.architecture import saved_model
from train.checkpoint import newest_readable, read_model_params
from train.config import load_config
from train.config.imported import HF_CONFIG, MODEL_YAML, TOKENIZER
from train.errors import CheckpointError
from train.origin import origin_file

# config.json keys the model does not determine, carried from the imported config.json on export
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def import_checkpoint(
    hf_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "float32", *, allow_unused: bool = False
) -> ModelConfig:
    """Hugging Face directory -> OUT/model (orbax), OUT/model.yaml, OUT/hf_config.json (and OUT/tokenizer.json);
    returns the config. Tensors the model would not read are refused unless `allow_unused` (load_pretrained)."""
    model = load_pretrained(hf_dir, dtype, allow_unused=allow_unused)
    out = pathlib.Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(out / "model", nnx.to_pure_dict(nnx.state(model)), force=True)
    architecture = dataclasses.asdict(model.config)
    (out / MODEL_YAML).write_text(
        f"# Imported from {pathlib.Path(hf_dir).absolute()}; use as a run config's "
        f"`base:` with checkpoint.init_from={out}\n" + yaml.safe_dump({"model": architecture}, sort_keys=False)
    )
    (out / HF_CONFIG).write_text((pathlib.Path(hf_dir) / CONFIG).read_text())
    if (pathlib.Path(hf_dir) / TOKENIZER).is_file():
        shutil.copyfile(pathlib.Path(hf_dir) / TOKENIZER, out / TOKENIZER)
    return model.config


def checkpoint_config(step_dir: pathlib.Path, config_path: str | pathlib.Path | None = None) -> ModelConfig:
    """The model config of a checkpoint: --config, else its own (train.architecture.saved_model)."""
    if config_path:
        return load_config(config_path).model
    saved = saved_model(step_dir)
    if saved is None:
        raise FileNotFoundError(f"{step_dir} holds neither {MODEL_YAML} nor a run's `meta` item; pass --config")
    return saved


def export_checkpoint(
    checkpoint: str | pathlib.Path,
    hf_dir: str | pathlib.Path,
    *,
    config_path: str | pathlib.Path | None = None,
    hf_config: str | pathlib.Path | None = None,
    max_shard_bytes: int = 2**31,
    overwrite: bool = False,
) -> tuple[pathlib.Path, list[str], list[str]]:
    """CHECKPOINT's parameters (its newest readable step, see `newest_readable`) -> a Hugging Face directory, written
    whole beside it and swapped in (save_pretrained). `hf_config` (default: the config.json the checkpoint came
    with, train.origin) gives the token ids, and max_position_embeddings unless the model states its own; the
    tokenizer.json it came with is copied. Returns the directory read, the shard file names and notes on what
    differs from the imported config.json."""
    step_dir, model = newest_readable(checkpoint, lambda directory: _read_model(directory, config_path))
    source = pathlib.Path(hf_config) if hf_config else origin_file(step_dir, HF_CONFIG)
    original = json.loads(source.read_text()) if source else {}
    extra = {key: original[key] for key in TOKEN_IDS if key in original}
    notes = []
    positions, imported = model.config.max_position_embeddings, original.get("max_position_embeddings")
    if imported is not None and positions in (0, imported):
        extra["max_position_embeddings"] = imported
    elif imported is not None:
        notes.append(
            f"max_position_embeddings is {positions} (the model's, as fine-tuned), not {imported} as in {source}"
        )
    tokenizer = origin_file(step_dir, TOKENIZER)
    names = save_pretrained(
        model,
        hf_dir,
        max_shard_bytes=max_shard_bytes,
        extra_config=extra,
        extra_files=(tokenizer,) if tokenizer else (),
        overwrite=overwrite,
    )
    return step_dir, names, notes


def _read_model(step_dir: pathlib.Path, config_path: str | pathlib.Path | None) -> nnx.Module:
    """The model of `step_dir` (its config from `checkpoint_config`), its parameters on this process's devices."""
    graphdef, abstract = abstract_model(checkpoint_config(step_dir, config_path))
    return nnx.merge(graphdef, read_model_params(step_dir, abstract))


def _described(step_dir: pathlib.Path) -> str:
    """`step N of RUN/checkpoints` for a run's step directory, else the directory (an import)."""
    return f"step {step_dir.name} of {step_dir.parent}" if step_dir.name.isdigit() else str(step_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    load = commands.add_parser("import", help="Hugging Face directory -> checkpoint for checkpoint.init_from")
    load.add_argument("hf_dir", help="directory with config.json and model.safetensors (or index + shards)")
    load.add_argument("out", help="output directory: model (orbax), model.yaml, hf_config.json, tokenizer.json")
    load.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameter dtype")
    load.add_argument(
        "--allow-unused", action="store_true", help="import even when the model would not read some tensors"
    )
    save = commands.add_parser("export", help="checkpoint -> Hugging Face directory")
    save.add_argument("checkpoint", help="an import's output, a run's checkpoints/<step>, or checkpoints/ (newest)")
    save.add_argument("hf_dir", help="output directory for config.json and safetensors shards")
    save.add_argument(
        "--config", help="YAML with a `model:` section (run config or model.yaml) overriding the checkpoint's own"
    )
    save.add_argument(
        "--hf-config",
        help=f"config.json whose {', '.join(TOKEN_IDS)} (and max_position_embeddings, unless the model states its "
        f"own) are carried over (default: the {HF_CONFIG} of the import the checkpoint came from)",
    )
    save.add_argument(
        "--overwrite", action="store_true", help="replace everything in hf_dir even when it holds another model"
    )
    save.add_argument("--max-shard-bytes", type=int, default=2**31, help="shard size limit (default 2 GiB)")
    args = parser.parse_args(argv)
    environment.set_up()
    library_log.install()
    try:
        if args.command == "import":
            config = import_checkpoint(args.hf_dir, args.out, args.dtype, allow_unused=args.allow_unused)
            print(f"imported {config.num_layers}-layer {config.family} to {args.out}")
        else:
            step_dir, names, notes = export_checkpoint(
                args.checkpoint,
                args.hf_dir,
                config_path=args.config,
                hf_config=args.hf_config,
                max_shard_bytes=args.max_shard_bytes,
                overwrite=args.overwrite,
            )
            print(f"exported {_described(step_dir)} to {args.hf_dir}: {len(names)} shard(s)")
            for note in notes:
                print(f"note: {note}")
    except (ValueError, FileNotFoundError, ConfigError, CheckpointError) as error:
        print(f"error: {error}{library_log.mention()}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
