"""What the Hugging Face tests share: tiny random transformers models whose mapping errors show in the logits,
tokens, both sides' logits, a checkpoint's tensors, the import / export round trip at 1e-4 (float32), and the logits
with rows split over context devices."""

import copy
import dataclasses
import math
import pathlib

import jax
import numpy as np
import torch
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

from models.hf import load_pretrained, save_pretrained
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced
from parallel.settings import to_layout


def save_random(model, path, max_shard_size="10MB"):
    """`model` (random, initializer_range 0.1) with norm scales 1 + N(0, 0.2) and biases N(0, 0.1), so that a wrong
    mapping shows in the logits, saved to `path`; returns it in eval mode."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model.eval()


def tokens(vocab_size=128, length=24):
    """[2, length] int32 token ids."""
    return np.random.default_rng(0).integers(0, vocab_size, size=(2, length)).astype(np.int32)


def hf_logits(model, ids) -> np.ndarray:
    """A transformers model's logits [batch, length, vocab] for ids [batch, length]."""
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.numpy()


def our_logits(model, ids) -> np.ndarray:
    """Our model's logits [batch, length, vocab] for ids [batch, length], jitted."""
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))


def hf_tensors(path) -> dict:
    """Every tensor of the safetensors files in `path`, by name."""
    return {k: v for file in sorted(pathlib.Path(path).glob("*.safetensors")) for k, v in load_file(file).items()}


def assert_round_trip(reference, source: pathlib.Path, out: pathlib.Path, vocab_size=128):
    """Imports `source` (where `reference` was saved): our logits within 1e-4 of reference's; exports it to `out` in
    shards: transformers loads every tensor (none missing or unexpected) as reference's class, its logits within
    1e-4 of ours, and the tensors are the source's. Returns our model."""
    model = load_pretrained(source)
    ids = tokens(vocab_size)
    expected = hf_logits(reference, ids)
    assert np.abs(expected).max() > 1.0  # large enough for a mapping error to show
    logits = our_logits(model, ids)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)

    assert len(save_pretrained(model, out, max_shard_bytes=40_000)) > 1
    exported, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert type(exported) is type(reference)
    assert exported.config.to_dict()["rope_parameters"] == reference.config.to_dict()["rope_parameters"]
    np.testing.assert_allclose(hf_logits(exported.eval(), ids), logits, rtol=0, atol=1e-4)
    original, written = hf_tensors(source), hf_tensors(out)
    assert sorted(written) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    return model


# the small sizes of the GQA families' round-trip cases (Qwen, Mistral)
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)


def assert_case_round_trips(tmp_path: pathlib.Path, config_class, model_class, fields: dict, expected: dict):
    """A random `model_class` of SIZES and `fields` (weights of std 0.1), saved by transformers in shards, round-trips
    (assert_round_trip), and the imported config holds `expected` ({field: value})."""
    torch.manual_seed(0)
    reference = model_class(config_class(**SIZES, initializer_range=0.1, **fields))
    save_random(reference, tmp_path / "hf", max_shard_size="30KB")
    model = assert_round_trip(reference, tmp_path / "hf", tmp_path / "out")
    assert {key: getattr(model.config, key) for key in expected} == expected


def assert_split_rows_match(
    reference, model, parallelism: Parallelism, float64: bool = True, mesh_axes=(("context", 8),)
) -> None:
    """`model`'s logits with rows split over the mesh of `mesh_axes` ((name, size) pairs of 8 devices) in `parallelism`
    (one long document; two packed), laid out as the trainer lays them (parallel.settings.to_layout over the context
    axis, then split over the parallelism's axis), equal transformers' `reference` (run in float64 when `float64`) for
    each document alone, to 1e-4."""
    length, first = 48, 29  # the packed row: a document of 29 tokens, then one of 19
    ids = np.random.default_rng(0).integers(0, SIZES["vocab_size"], size=(2, length)).astype(np.int32)
    positions = np.stack([np.arange(length), np.concatenate([np.arange(first), np.arange(length - first)])])
    segments = np.stack([np.ones(length), np.repeat([1, 2], [first, length - first])]).astype(np.int32)
    in_float64 = copy.deepcopy(reference).double() if float64 else reference  # its float32 is as far as ours
    exact = lambda x: hf_logits(in_float64, x)
    documents = np.concatenate([exact(ids[1:, :first]), exact(ids[1:, first:])], axis=1)  # each document alone
    expected = np.concatenate([exact(ids[:1]), documents])

    names, sizes = zip(*mesh_axes, strict=True)
    mesh = Mesh(np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes), names)
    context = dict(mesh_axes)["context"]
    batch = to_layout(dict(ids=ids, positions=positions, segments=segments), parallelism, context)
    graph, state = nnx.split(model)

    def logits(state, ids, positions, segments):
        out = nnx.merge(graph, state)(ids, positions, segments)
        if parallelism.layout == "contiguous":
            return out
        return from_balanced(out, context, layout=parallelism.layout, stripe=parallelism.stripe)

    with jax.set_mesh(mesh), use_parallelism(dataclasses.replace(parallelism, mesh=mesh)):
        actual = np.asarray(jax.jit(logits)(state, batch["ids"], batch["positions"], batch["segments"]))
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-4)
