"""`python -m train.hf import HF_DIR OUT` and `python -m train.hf export CHECKPOINT HF_DIR`.

import writes OUT/model (an orbax `model` item: `checkpoint.init_from=OUT` seeds a run's parameters from it),
OUT/model.yaml (the architecture under a top-level `model:` key, for a run config's `base:`) and
OUT/hf_config.json (the source config.json, whose token ids and max_position_embeddings export carries over) and
OUT/tokenizer.json when the source has one (for `data.tokenizer`). A run initialised from OUT keeps the last two
in its run directory (train/checkpoints/origin.py), so the export of a fine-tune carries them too. OUT is written whole
beside itself and swapped in; an OUT that holds anything (another import, or the same one made before) is refused unless
--overwrite, which replaces everything in it.

export reads CHECKPOINT: an import's OUT, a run's checkpoints/<step>, or a run's checkpoints/ (its newest step
that can be read: a damaged newer one is passed over with a warning, and nothing is moved), onto this process's
devices whatever the devices it was saved on, and prints the step it wrote. The architecture comes from --config
if given, else CHECKPOINT/model.yaml (an import), else the resolved config a run saves in every checkpoint (its
`meta` item). HF_DIR is written whole beside itself and swapped in, so an interrupted export leaves the previous
one; an HF_DIR that holds another model is refused unless --overwrite.

A write that fails (a full or read-only disk) leaves OUT or HF_DIR as it was and ends in one line (exit status 2),
its traceback in the library log the line names (train/process/library_log.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

import orbax.checkpoint as ocp
import yaml
from flax import nnx
from safetensors import SafetensorError

from models.config import ConfigError, ModelConfig
from models.hf.convert import CONFIG, abstract_model, load_pretrained, save_pretrained
from models.hf.replace import replace_directory
from train.checkpoints.architecture import saved_model
from train.checkpoints.checkpoint import Unreadable, newest_readable, read_meta, read_model_params
from train.checkpoints.origin import origin_file
from train.config import load_config
from train.config.imported import HF_CONFIG, MODEL_YAML, TOKENIZER
from train.data.tokenizer import make_tokenizer
from train.errors import CheckpointError, OutputError, leave
from train.process import environment, library_log

# config.json keys the model does not determine, carried from the imported config.json on export
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
IMPORTED = ("model", MODEL_YAML, HF_CONFIG, TOKENIZER)  # what an import writes into OUT
T = TypeVar("T")


def import_checkpoint(
    hf_dir: str | pathlib.Path,
    out: str | pathlib.Path,
    dtype: str = "float32",
    *,
    allow_unused: bool = False,
    overwrite: bool = False,
) -> ModelConfig:
    """Hugging Face directory -> OUT/model (orbax), OUT/model.yaml, OUT/hf_config.json (and OUT/tokenizer.json),
    written whole beside OUT and swapped in; returns the config. An OUT that holds anything is refused (ValueError)
    unless `overwrite`, which replaces everything in it. Tensors the model would not read are refused unless
    `allow_unused` (load_pretrained)."""
    source, out = pathlib.Path(hf_dir).absolute(), pathlib.Path(out).absolute()
    refusal = _refusal(source, out, overwrite)
    if refusal:
        raise ValueError(f"not importing into {out}: {refusal}")
    model = load_pretrained(source, dtype, allow_unused=allow_unused)

    def write(directory: pathlib.Path) -> None:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(directory / "model", nnx.to_pure_dict(nnx.state(model)))
        architecture = dataclasses.asdict(model.config)
        (directory / MODEL_YAML).write_text(
            f"# Imported from {source}; use as a run config's `base:` with checkpoint.init_from={out}\n"
            + yaml.safe_dump({"model": architecture}, sort_keys=False)
        )
        (directory / HF_CONFIG).write_text((source / CONFIG).read_text())
        if (source / TOKENIZER).is_file():
            shutil.copyfile(source / TOKENIZER, directory / TOKENIZER)

    _writing(out, lambda: replace_directory(out, write))
    return model.config


def _refusal(source: pathlib.Path, out: pathlib.Path, overwrite: bool) -> str:
    """Why `out` may not take the import of `source`, e.g. `it holds an import (model, model.yaml, ...)` unless
    `overwrite`; "" when it is new or empty."""
    if out.is_file():
        return "it is a file; choose a directory"
    if out == source or out in source.parents:
        return f"it holds {source}, the directory imported; choose another directory"
    names = sorted(child.name for child in out.iterdir()) if out.is_dir() else []
    if not names or overwrite:
        return ""
    what = "an import" if set(names) & set(IMPORTED) else "files an import does not write"
    return (
        f"it holds {what} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}). Choose an empty or new "
        f"directory, or pass --overwrite to replace everything in it"
    )


def _writing(path: pathlib.Path, write: Callable[[], T]) -> T:
    """write(), whose failure to write (OSError, SafetensorError: a full or read-only disk) raises OutputError naming
    `path`, left as it was; the traceback goes to the library log."""
    try:
        return write()
    except (OSError, SafetensorError) as error:
        library_log.note("".join(traceback.format_exception(error)))
        raise OutputError(
            f"writing {path} failed ({_cause(error)}); {path} is left as it was. Free space or choose another "
            f"directory, then run the same command again"
        ) from None


def _cause(error: Exception) -> str:
    """Why a write failed, in one line: an OSError's strerror (`No space left on device`), the message in
    safetensors' `IoError(Os { ..., message: "..." })`, else the error's own text."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    message = re.search(r'message: "([^"]*)"', str(error))
    return message[1] if message else " ".join(str(error).split())


def checkpoint_config(step_dir: pathlib.Path, config_path: str | pathlib.Path | None = None) -> ModelConfig:
    """The model config of a checkpoint: --config, else its own (train.checkpoints.architecture.saved_model)."""
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
    with, train.checkpoints.origin) gives the token ids, and max_position_embeddings unless the model states its own;
    the tokenizer.json it came with is copied. A failed write raises OutputError (`_writing`). Returns the directory
    read, the shard file names and notes on what differs from the imported config.json."""
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
    if source is None:  # a run trained from scratch: its own tokenizer's ids and file
        own_ids, own_file = _run_tokenizer(step_dir)
        extra = {**own_ids, **extra}
        tokenizer = tokenizer or own_file
    names = _writing(
        pathlib.Path(hf_dir).absolute(),
        lambda: save_pretrained(
            model,
            hf_dir,
            max_shard_bytes=max_shard_bytes,
            extra_config=extra,
            extra_files=(tokenizer,) if tokenizer else (),
            overwrite=overwrite,
        ),
    )
    return step_dir, names, notes


def _run_tokenizer(step_dir: pathlib.Path) -> tuple[dict, pathlib.Path | None]:
    """The token ids ({bos, eos, pad}_token_id) of the tokenizer the run of `step_dir` trained with (the data.tokenizer
    of the config saved with the step), and its tokenizer.json when it is one; ({}, None) for an import."""
    try:
        spec = read_meta(step_dir)["config"]["data"]["tokenizer"]
    except (Unreadable, KeyError, TypeError):  # an import has no meta
        return {}, None
    try:
        tokenizer = make_tokenizer(spec)
    except FileNotFoundError:  # a relative path from where the run started, or since moved: no ids to carry
        return {}, None
    ids = dict(zip(TOKEN_IDS, (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id), strict=True))
    file = getattr(tokenizer, "path", None)  # a Hugging Face tokenizer's file; the byte tokenizer has none
    return {key: value for key, value in ids.items() if value is not None}, file and pathlib.Path(file)


def _read_model(step_dir: pathlib.Path, config_path: str | pathlib.Path | None) -> nnx.Module:
    """The model of `step_dir` (its config from `checkpoint_config`), its parameters on this process's devices."""
    graphdef, abstract = abstract_model(checkpoint_config(step_dir, config_path))
    return nnx.merge(graphdef, read_model_params(step_dir, abstract))


def _described(step_dir: pathlib.Path) -> str:
    """`step N of RUN/checkpoints` for a run's step directory, else the directory (an import)."""
    return f"step {step_dir.name} of {step_dir.parent}" if step_dir.name.isdigit() else str(step_dir)


def _positive(text: str) -> int:
    """A positive whole number of bytes, else argparse's one-line error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of bytes")
    return value


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
    load.add_argument(
        "--overwrite", action="store_true", help="replace everything in out, e.g. an earlier import, tokenizer included"
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
    save.add_argument("--max-shard-bytes", type=_positive, default=2**31, help="shard size limit (default 2 GiB)")
    args = parser.parse_args(argv)
    environment.set_up()
    library_log.install()
    handler = signal.getsignal(signal.SIGINT)
    try:
        if args.command == "import":
            config = import_checkpoint(
                args.hf_dir, args.out, args.dtype, allow_unused=args.allow_unused, overwrite=args.overwrite
            )
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # written: a Ctrl-C from here on changes nothing
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
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # written: a Ctrl-C from here on changes nothing
            print(f"exported {_described(step_dir)} to {args.hf_dir}: {len(names)} shard(s)")
            for note in notes:
                print(f"note: {note}")
    except (ValueError, FileNotFoundError, ConfigError, CheckpointError, OutputError) as error:
        print(f"error: {error}{library_log.mention()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        target = args.out if args.command == "import" else args.hf_dir
        print(f"error: stopped by Ctrl-C before the {args.command} finished; {target} is as it was", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGINT, handler)  # a caller's own, as it was
    return 0


if __name__ == "__main__":
    code = main()
    if code == 0:  # written: a Ctrl-C while the process exits changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(leave(code))
