"""Hugging Face Qwen3.5 <-> longctx: a tiny random Qwen3_5ForCausalLM (three Gated DeltaNet layers to one gated
full-attention layer, partial rotary, 1 + weight norms random) gives transformers' logits (fp32, 1e-4) in both
directions through shards, and with its row split over 8 context devices (ring, dual_chunk) on one long document and
on packed rows (each document's logits as transformers gives them for that document alone); the text model of a
Qwen3_5ForConditionalGeneration imports with its vision tower and multi-token-prediction tensors skipped."""

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from layers.rope import RopeScalingConfig
from models.config import FULL, LINEAR
from models.hf import load_pretrained
from parallel.parallelism import Parallelism
from tests.models.hf_reference import SIZES, assert_case_round_trips, assert_split_rows_match, hf_logits, save_random

TEXT = dict(
    head_dim=16,
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
)


def test_import_and_export_match_transformers(tmp_path):
    expected = dict(
        family="qwen3_5",
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        partial_rotary_factor=0.25,
        attention_output_gate=True,
        linear_key_heads=2,
        linear_heads=4,
        linear_key_dim=8,
        linear_value_dim=16,
    )
    assert_case_round_trips(tmp_path, Qwen3_5TextConfig, Qwen3_5ForCausalLM, TEXT, expected)


def test_a_yarn_rope_imports_and_exports(tmp_path):
    """What a 128K fine-tune extends the rope with (configs/finetune-128k.yaml) leaves as a Qwen3.5 model."""
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1e4, beta_fast=32.0)
    yarn["beta_slow"] = 1.0  # as written on export: the values transformers takes when they are left out
    fields = dict(TEXT, rope_parameters=dict(yarn, partial_rotary_factor=0.25), max_position_embeddings=64)
    scaling = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.0)
    assert_case_round_trips(tmp_path, Qwen3_5TextConfig, Qwen3_5ForCausalLM, fields, dict(rope_scaling=scaling))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers' tiny Qwen3_5ForCausalLM, ours imported from it)."""
    path = tmp_path_factory.mktemp("qwen3_5")
    torch.manual_seed(0)
    reference = save_random(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SIZES, initializer_range=0.1, **TEXT)), path)
    return reference, load_pretrained(path)


def test_rows_split_over_8_context_devices_give_transformers_logits(tiny):
    assert_split_rows_match(*tiny, Parallelism(strategy="ring", layout="dual_chunk", block_q=8, block_kv=8))


def test_conditional_generation_imports_its_text_model(tmp_path, caplog):
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=SIZES["hidden_size"])
    config = Qwen3_5Config(text_config=dict(SIZES, initializer_range=0.1, **TEXT), vision_config=vision)
    reference = save_random(Qwen3_5ForConditionalGeneration(config), tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)  # the published checkpoints' multi-token prediction
    save_file(tensors, file, metadata={"format": "pt"})
    vision = sum(name.startswith("model.visual.") for name in tensors)
    model = load_pretrained(tmp_path)
    ids = np.random.default_rng(1).integers(0, SIZES["vocab_size"], size=(2, 24)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda m, x: m(x))(model, ids)), hf_logits(reference, ids), rtol=0, atol=1e-4
    )
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
    assert len(skipped) == 1 and f"skipped {vision + 1} tensors" in skipped[0], skipped
