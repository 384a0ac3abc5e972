"""Hugging Face Gemma3ForConditionalGeneration (Gemma 3 text and vision) -> longctx gemma3: a tiny random one saved by
transformers in shards imports its text model, in both tensor prefix forms, with logits within 1e-4 (fp32) of the
conditional-generation model's forward on token ids alone (no image); the vision tensors are skipped in one log line,
another unexpected tensor is still refused, and export writes a Gemma3ForCausalLM. The published 4B and 27B
config.json files (text_config naming few keys) import as the shipped configs."""

import json
import logging
import pathlib

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from models.config import FULL, SLIDING
from models.hf import load_pretrained
from models.hf.convert import INDEX
from models.hf.families import for_export
from models.hf.gemma3_vision import config_from_hf
from tests.models.hf_reference import SIZES, hf_logits, our_logits, save_random, tokens
from train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
TEXT = dict(
    SIZES,
    head_dim=16,
    query_pre_attn_scalar=24,
    sliding_window=5,
    num_hidden_layers=3,
    layer_types=[SLIDING, FULL, SLIDING],
    initializer_range=0.1,
)
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
# the module names transformers loads the published files into
LOADED_FORM = {
    "language_model.model.": "model.language_model.",
    "vision_tower.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}
# google/gemma-3-4b-pt's and gemma-3-27b-pt's config.json, less the vision_config
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}
GEMMA3_27B = {
    **GEMMA3_4B,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}


def copy(source: pathlib.Path, path: pathlib.Path) -> None:
    """Copies the files of the Hugging Face directory `source` into `path`."""
    for file in source.iterdir():
        (path / file.name).write_bytes(file.read_bytes())


def rewrite_shards(path: pathlib.Path, change) -> None:
    """Rewrites the shards and index at `path` with `change(tensors) -> tensors` applied to each shard's tensors."""
    index = json.loads((path / INDEX).read_text())
    index["weight_map"] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors = change(load_file(file))
        save_file(tensors, file, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, file.name))
    (path / INDEX).write_text(json.dumps(index))


def loaded_form(tensors: dict) -> dict:
    """The tensors under the module names transformers loads them into."""
    renamed = {}
    for name, value in tensors.items():
        prefix = next((p for p in LOADED_FORM if name.startswith(p)), "")
        renamed[LOADED_FORM.get(prefix, "") + name.removeprefix(prefix)] = value
    return renamed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(the random model, the directory transformers saved it to in shards)."""
    path = tmp_path_factory.mktemp("gemma3-vision")
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4))
    return save_random(model, path, max_shard_size="30KB"), path


@pytest.mark.parametrize("form", ["published", "loaded"])
def test_text_model_imports_with_transformers_logits(reference, tmp_path, caplog, form):
    model, source = reference
    if form == "loaded":
        copy(source, tmp_path)
        rewrite_shards(tmp_path, loaded_form)
        source = tmp_path
    names = json.loads((source / INDEX).read_text())["weight_map"]
    vision = [name for name in names if "vision_tower." in name or "multi_modal_projector." in name]
    with caplog.at_level(logging.WARNING, logger="models.hf.convert"):
        ours = load_pretrained(source)
    assert len(caplog.records) == 1 and f"skipped {len(vision)} tensors" in caplog.text
    assert "the vision tower and its projector" in caplog.text
    ids = tokens()
    expected = hf_logits(model, ids)
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(our_logits(ours, ids), expected, rtol=0, atol=1e-4)
    assert for_export(ours.config).architecture == "Gemma3ForCausalLM"


def test_an_unexpected_tensor_is_refused(reference, tmp_path):
    _, source = reference
    copy(source, tmp_path)
    name = "language_model.model.layers.0.self_attn.q_proj.bias"
    save_file({name: np.zeros(64, np.float32)}, tmp_path / "extra.safetensors")
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"][name] = "extra.safetensors"
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"1 tensors are not used by the gemma3 model .*\({name}\)"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("name, hf", [("gemma-3-4b", GEMMA3_4B), ("gemma-3-27b", GEMMA3_27B)])
def test_published_config_is_the_shipped_one(name, hf):
    assert config_from_hf(hf) == load_config(CONFIGS / "models" / f"{name}.yaml").model
