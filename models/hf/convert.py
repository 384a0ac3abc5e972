"""Hugging Face checkpoints (config.json + safetensors, one file or index + shards) <-> our models, streamed.

Loading reads one tensor at a time and hands each parameter to JAX as soon as all its tensors are in, so beside
the model it holds one tensor. Saving converts one tensor at a time and writes a shard as soon as the next
tensor would take it past `max_shard_bytes`, so beside the model it holds one shard of converted tensors (and,
from an accelerator, one parameter fetched to the host). bench/hf_memory.py measures both.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import save_file

import models
from models.dtypes import PARAM_DTYPES
from models.hf.families import by_architecture, for_export
from models.hf.replace import replace_directory, umask
from models.hf.spec import Nesting
from models.hf.stored import INDEX, SINGLE, StoredTensors

log = logging.getLogger(__name__)

CONFIG = "config.json"


def read_config(path: str | pathlib.Path) -> dict:
    """config.json of a Hugging Face model directory."""
    file = pathlib.Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist; a Hugging Face model directory holds {CONFIG}")
    return json.loads(file.read_text())


def abstract_model(config) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of shapes) of `config`'s model, without allocating any parameter."""
    return nnx.split(nnx.eval_shape(lambda: models.build(config, rngs=nnx.Rngs(0))))


def _dtype_name(dtype) -> str:
    name = jnp.dtype(dtype).name
    if name not in PARAM_DTYPES:
        raise ValueError(f"dtype={name!r} is not a parameter dtype; choose one of {', '.join(PARAM_DTYPES)}")
    return name


def _aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.empty at a 64-byte aligned address: jax.device_put on CPU adopts such a buffer instead of copying it."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + size].view(dtype).reshape(shape)


def _by_table_name(family, files: dict[str, str], path: pathlib.Path) -> dict[str, tuple[str, str]]:
    """{name in the family's table: (name in the checkpoint, file)} of the checkpoint's tensors `files` ({name:
    file}) that the family's nesting does not skip; the skipped ones are counted in one log line."""
    nesting = family.nesting
    skipped = [name for name in files if nesting.skips(name)]
    if skipped:
        log.warning(
            "%s: skipped %d tensors under %s: %s", path, len(skipped), ", ".join(nesting.skipped), nesting.reason
        )
    return {nesting.table_name(name): (name, file) for name, file in files.items() if not nesting.skips(name)}


def _reads_by_file(
    family, config, hf_config: dict, files: dict[str, tuple[str, str]], shapes: dict, path: pathlib.Path
) -> dict[str, list]:
    """File name -> [(tensor name in the checkpoint, Tensor, index into our parameter)] for every tensor the model
    needs; checks that each is in `files` (_by_table_name's) and that every parameter in `shapes` is filled by some
    tensor or is one of the family's zeros."""
    reads: dict[str, list] = {}
    missing = []
    for tensor in family.tensors_to_read(config, hf_config):
        for fields, index in tensor.slices(config):
            name = tensor.hf.format(**fields)
            if name not in files:
                missing.append(name)
            stored, file = files.get(name, (name, None))
            reads.setdefault(file, []).append((stored, tensor, index))
    if missing:
        raise ValueError(
            f"{path}: {len(missing)} tensors of {family.architecture} are missing, e.g. {', '.join(missing[:3])}"
        )
    filled = {path for entries in reads.values() for _, tensor, _ in entries for path in tensor.paths}
    unfilled = set(shapes) - filled - set(family.zeros(config))
    if unfilled:
        raise ValueError(
            f"{family.architecture}: no tensor fills parameter(s) "
            f"{', '.join('.'.join(ours) for ours in sorted(unfilled))}"
        )
    return reads


def _read(stored: StoredTensors, reads: dict[str, list], shapes: dict, config) -> dict[tuple, jax.Array]:
    """Reads the tensors `reads` lists one at a time into host buffers of our parameters' shapes; each parameter goes to
    JAX (and its buffer is dropped) once its last tensor is in. Returns {parameter path: array}."""
    remaining = dict.fromkeys(shapes, 0)
    for entries in reads.values():
        for _, tensor, _ in entries:
            for path in tensor.paths:
                remaining[path] += 1
    buffers: dict[tuple, np.ndarray] = {}
    params: dict[tuple, jax.Array] = {}
    for file, entries in reads.items():
        for name, tensor, index in entries:
            for path, value in zip(tensor.paths, tensor.parts(stored.get(name), config), strict=True):
                target = shapes[path]
                if value.shape != target.shape[len(index) :]:
                    raise ValueError(
                        f"{stored.path / file}: {name} gives shape {value.shape} for "
                        f"{'.'.join(path)}{list(index)}, expected {target.shape[len(index) :]}"
                    )
                if path not in buffers:
                    buffers[path] = _aligned_empty(target.shape, target.dtype)
                buffers[path][index] = value.astype(target.dtype, copy=False)
                del value  # freed before the next read
                remaining[path] -= 1
                if not remaining[path]:
                    params[path] = jax.device_put(buffers.pop(path))
    return params


def _harmless(name: str, config, hf_config: dict) -> bool:
    """Whether a tensor the model does not read carries nothing it would need: a tied model's saved lm_head copy,
    a rotary table saved as a buffer, or a DeepSeek multi-token-prediction layer (past num_hidden_layers)."""
    layer = re.fullmatch(r"model\.layers\.(\d+)\..*", name)
    extra_layers = hf_config.get("num_nextn_predict_layers", 0) or 0
    return (
        (name == "lm_head.weight" and config.tie_embeddings)
        or name.endswith("rotary_emb.inv_freq")
        or (layer is not None and config.num_layers <= int(layer[1]) < config.num_layers + extra_layers)
    )


def unused_tensors(path: pathlib.Path, names, config, hf_config: dict, allow_unused: bool, nesting: Nesting) -> None:
    """Refuses (ValueError naming them) tensors of the checkpoint at `path` the model does not read, unless
    `allow_unused`: a model that drops weights (e.g. attention biases of another architecture) is another model.
    Those known to be harmless (`_harmless`, by their name in the table of the family's `nesting`) and allowed ones
    are named in a warning."""
    names = sorted(names)
    refused = [name for name in names if not _harmless(nesting.table_name(name), config, hf_config)]
    if refused and not allow_unused:
        raise ValueError(
            f"{path}: {len(refused)} tensors are not used by the {config.family} model that config.json describes "
            f"({', '.join(refused[:4])}{', ...' if len(refused) > 4 else ''}): importing would drop them. Check that "
            f"config.json's architectures names the model these weights belong to; pass --allow-unused to import "
            f"without them"
        )
    if names:
        log.warning("%s: %d tensors not used by the model, e.g. %s", path, len(names), ", ".join(names[:3]))


def load_pretrained(path: str | pathlib.Path, dtype=jnp.float32, *, allow_unused: bool = False) -> nnx.Module:
    """Hugging Face model directory -> our model (models.build of the converted config), parameters in `dtype`.

    The model maps tokens [batch, length] (and optional positions / segment_ids) to logits [batch, length, vocab].
    Tensors the model does not read are refused (`unused_tensors`) unless harmless or `allow_unused`; those of the
    rest of a larger model that holds it (its family's `nesting`: a vision tower) are skipped.
    """
    path = pathlib.Path(path)
    hf_config = read_config(path)
    family = by_architecture(hf_config)
    config = dataclasses.replace(family.config_from_hf(hf_config), param_dtype=_dtype_name(dtype))
    graphdef, state = abstract_model(config)
    shapes = flatten_dict(nnx.to_pure_dict(state))
    stored = StoredTensors(path)
    reads = _reads_by_file(family, config, hf_config, _by_table_name(family, stored.files, path), shapes, path)
    used = {name for entries in reads.values() for name, _, _ in entries}
    unused = {name for name in stored.files if name not in used and not family.nesting.skips(name)}
    unused_tensors(path, unused, config, hf_config, allow_unused, family.nesting)
    params = _read(stored, reads, shapes, config)
    params.update({ours: jnp.zeros(shapes[ours].shape, shapes[ours].dtype) for ours in family.zeros(config)})
    nnx.replace_by_pure_dict(state, unflatten_dict(params))
    return nnx.merge(graphdef, state)


class _Shards:
    """Collects tensors; writes a shard when the next tensor would take it past `max_bytes`."""

    def __init__(self, path: pathlib.Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = self.total_bytes = 0
        self.files: list[pathlib.Path] = []
        self.shard_of: dict[str, int] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        if self.pending and self.pending_bytes + array.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = array
        self.pending_bytes += array.nbytes

    def _flush(self) -> None:
        file = self.path / f"model-{len(self.files) + 1:05d}.safetensors.partial"
        save_file(self.pending, file, metadata={"format": "pt"})
        self.shard_of.update(dict.fromkeys(self.pending, len(self.files)))
        self.files.append(file)
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Writes the last shard, names the shards (model.safetensors when one) and writes the index when several."""
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        names = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for file, name in zip(self.files, names, strict=True):
            file.chmod(0o666 & ~umask())  # safetensors writes 0600: the mode any new file gets here
            file.rename(self.path / name)
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {tensor: names[shard] for tensor, shard in self.shard_of.items()},
            }
            (self.path / INDEX).write_text(json.dumps(index, indent=2))
        return names


# config.json keys that may differ between two saves of one model (token ids, what its rope covers, dtype)
SAME_MODEL_IGNORES = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "torch_dtype")
WRITTEN = re.compile(r"config\.json|tokenizer\.json|model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors")


def other_model(path: pathlib.Path, hf_config: dict) -> str:
    """Why directory `path` holds something else than an earlier save of the model `hf_config` describes (files a
    save does not write, or a config.json of another architecture or sizes); "" when it holds nothing or such a
    save."""
    if not path.is_dir():
        return ""
    foreign = sorted(child.name for child in path.iterdir() if not WRITTEN.fullmatch(child.name))
    if foreign:
        return f"it holds files a save does not write ({', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''})"
    if not (path / CONFIG).is_file():
        return ""
    try:
        saved = json.loads((path / CONFIG).read_text())
    except ValueError:
        return f"its {CONFIG} does not read as JSON"
    differ = [key for key in hf_config if key not in SAME_MODEL_IGNORES and saved.get(key) != hf_config[key]]
    described = ", ".join(f"{key}: {saved.get(key)!r} there, {hf_config[key]!r} here" for key in differ[:3])
    return f"its {CONFIG} describes another model ({described}{', ...' if len(differ) > 3 else ''})" if differ else ""


def save_pretrained(
    model: nnx.Module,
    path: str | pathlib.Path,
    *,
    max_shard_bytes: int = 2**31,
    extra_config: dict | None = None,
    extra_files: tuple[pathlib.Path, ...] = (),
    overwrite: bool = False,
) -> list[str]:
    """Writes `model` as a Hugging Face directory (config.json + safetensors shards, + index when several) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads; tensors keep the parameters' dtype.

    `extra_config` keys (e.g. bos_token_id, eos_token_id) go into config.json over the derived ones; `extra_files`
    (e.g. a tokenizer.json) are copied in. The whole set is written beside `path` and takes its place in one step
    (models/hf/replace.py), so an interruption leaves `path` as it was. A `path` that holds another model
    (`other_model`) is refused (ValueError) unless `overwrite`, which replaces everything in it.
    Returns the shard file names.
    """
    path = pathlib.Path(path)
    config = model.config
    family = for_export(config)
    hf_config = {**family.config_to_hf(config), "torch_dtype": config.param_dtype, **(extra_config or {})}
    if path.exists() and not path.is_dir():
        raise ValueError(f"not saving into {path}: it is a file; choose a directory")
    refusal = other_model(path, hf_config)
    if refusal and not overwrite:
        raise ValueError(
            f"not saving into {path}: {refusal}. Choose an empty or new directory, or pass --overwrite to replace "
            f"everything in it"
        )
    params = flatten_dict(nnx.to_pure_dict(nnx.state(model)))

    def write(directory: pathlib.Path) -> list[str]:
        shards = _Shards(directory, max_shard_bytes)
        for tensor in family.tensors(config):
            host = [np.asarray(params[path]) for path in tensor.paths]  # no copy on CPU; one (stacked) parameter each
            for fields, index in tensor.slices(config):
                value = tensor.joined(tuple(h[index] for h in host), config)
                shards.add(tensor.hf.format(**fields), np.ascontiguousarray(value))
        names = shards.finish()
        (directory / CONFIG).write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        for file in extra_files:
            shutil.copyfile(file, directory / pathlib.Path(file).name)
        return names

    return replace_directory(path, write)
