"""Hugging Face GPT-OSS <-> longctx: logits equal transformers' on a tiny random GptOssForCausalLM (fp32, max abs diff
<= 1e-4) in both directions through shards: rows longer than the sliding window, layers alternating sliding and full,
random q/k/v/o biases, sinks, router bias and expert biases, clamps that bite, YaRN without truncation. An MXFP4
checkpoint (experts as *_blocks / *_scales, quantization_config mxfp4) imports as its dequantized weights; the shipped
configs are the published config.json files imported; what the model cannot hold is refused in one line."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from models.hf import load_pretrained
from models.hf.gpt_oss import config_from_hf
from tests.models.hf_reference import assert_round_trip, hf_tensors, our_logits, save_random, tokens
from train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "truncate": False,
}
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=5,  # rows of 24 tokens
    swiglu_limit=1.0,  # random pre-activations pass it
    rope_parameters={**YARN, "rope_theta": 150000.0},
    max_position_embeddings=64,
    initializer_range=0.1,
)
# openai/gpt-oss-20b's config.json, less the keys no model reads
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
GPT_OSS_120B = {**GPT_OSS_20B, "layer_types": ["sliding_attention", "full_attention"] * 18, "num_hidden_layers": 36,
                "num_local_experts": 128}  # fmt: skip


def random_reference(path: pathlib.Path) -> GptOssForCausalLM:
    """The tiny GptOssForCausalLM with expert biases N(0, 0.1) too (transformers starts them at zero), saved in
    shards to `path`."""
    torch.manual_seed(0)
    reference = GptOssForCausalLM(GptOssConfig(**TINY))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("_proj_bias"):
                param.normal_(0.0, 0.1)
    return save_random(reference, path, max_shard_size="30KB")


def test_import_and_export_match_transformers(tmp_path):
    reference = random_reference(tmp_path / "hf")
    model = assert_round_trip(reference, tmp_path / "hf", tmp_path / "out")
    config = model.config
    assert config.layer_kinds == ("sliding_attention", "full_attention") * 2 and config.sliding_window == 5
    assert config.rope_scaling.truncate is False and config.swiglu_limit == 1.0
    assert config.qkv_bias and config.o_bias and config.attention_sinks and config.router_logit_bias


def pack(weights: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks and scales of the shape that dequantizes to `weights`' [experts, in, out]."""
    experts, inputs, outputs = weights.shape
    blocks = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
    return blocks, rng.integers(122, 128, (experts, outputs, inputs // 32), dtype=np.uint8)


def test_an_mxfp4_checkpoint_imports_dequantized(tmp_path):
    """The experts of the tiny checkpoint replaced by random MXFP4 blocks and scales import as transformers'
    dequantization of them: the same logits as the checkpoint holding those floats."""
    random_reference(tmp_path / "hf")
    tensors, rng = hf_tensors(tmp_path / "hf"), np.random.default_rng(0)
    quantized, floats = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = pack(tensors[name], rng)
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        floats[name] = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        ).numpy()
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for folder, weights, extra in [
        ("mxfp4", quantized, {"quantization_config": {"quant_method": "mxfp4"}}),
        ("floats", floats, {}),
    ]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps({**hf_config, **extra}))
        save_file(weights, tmp_path / folder / "model.safetensors")
    ids = tokens()
    expected = our_logits(load_pretrained(tmp_path / "floats"), ids)
    np.testing.assert_array_equal(our_logits(load_pretrained(tmp_path / "mxfp4"), ids), expected)


@pytest.mark.parametrize("name, hf", [("gpt-oss-20b", GPT_OSS_20B), ("gpt-oss-120b", GPT_OSS_120B)])
def test_shipped_config_is_the_checkpoints(name, hf):
    shipped = load_config(CONFIGS / "models" / f"{name}.yaml").model
    assert shipped == dataclasses.replace(config_from_hf(hf), max_position_embeddings=131072)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config 'fp8'; only mxfp4 .* and unquantized"),
        (dict(rope_scaling={**YARN, "attention_factor": 2.0}), "attention_factor=2.0; only attention_factor=None"),
    ],
)
def test_what_the_model_cannot_hold_is_named(changes, message):
    with pytest.raises(ValueError, match=message) as info:
        config_from_hf(dict(GPT_OSS_20B, **changes))
    assert "\n" not in str(info.value)
