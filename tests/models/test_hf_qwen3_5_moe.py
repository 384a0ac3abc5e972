"""Hugging Face Qwen3.5-MoE and Qwen3-Next <-> longctx: tiny random Qwen3_5MoeForCausalLM and Qwen3NextForCausalLM
(Gated DeltaNet and gated attention layers, routed experts and a gated shared expert; Qwen3-Next's input projections
grouped by key head, two value heads to a key head, and its first layer dense) give transformers' logits (fp32, 1e-4)
in both directions through shards; the load-balancing loss of the imported model is transformers' aux_loss; the text
model of a Qwen3_5MoeForConditionalGeneration imports with its vision tower skipped; the shipped configs are the
published config.json files imported."""

import pathlib

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import (
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from models.config import FULL, LINEAR
from models.hf import load_pretrained
from models.hf.families import by_architecture
from parallel.settings import make_parallelism
from tests.models import test_hf_qwen3_5
from tests.models.hf_reference import SIZES, assert_case_round_trips, hf_logits, save_random
from train.config import ParallelConfig, load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"

EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
TEXT = dict(test_hf_qwen3_5.TEXT, router_aux_loss_coef=0.02, **EXPERTS)  # the dense test's layers
EXPECTED = dict(
    layer_types=(LINEAR, LINEAR, LINEAR, FULL),
    linear_key_heads=2,
    linear_heads=4,
    num_experts=4,
    experts_per_token=2,
    moe_mlp_dim=32,
    num_shared_experts=1,
    shared_expert_mlp_dim=48,
    shared_expert_gate=True,
    router_aux_loss_coef=0.02,
)


def test_qwen3_5_moe_imports_and_exports_as_transformers(tmp_path):
    expected = dict(EXPECTED, family="qwen3_5_moe", first_dense_layers=0)
    assert_case_round_trips(tmp_path, Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, TEXT, expected)


def test_qwen3_next_imports_and_exports_as_transformers(tmp_path):
    fields = dict(TEXT, mlp_only_layers=[0], norm_topk_prob=False)
    expected = dict(EXPECTED, family="qwen3_next", first_dense_layers=1, norm_topk_prob=False)
    assert_case_round_trips(tmp_path, Qwen3NextConfig, Qwen3NextForCausalLM, fields, expected)


@pytest.mark.parametrize("architecture", ["qwen3_5_moe", pytest.param("qwen3_next", marks=pytest.mark.newest_stack)])
def test_rows_over_ring_8_with_the_default_dispatch_give_transformers_logits(tmp_path, architecture):
    """8 experts, one per token, one per context device, dispatched by the defaults (CPU: capacity): a buffer of
    1.25 x the balanced load would drop assignments here; the default drops none."""
    torch.manual_seed(0)
    config, causal_lm, fields = {
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, TEXT),
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, dict(TEXT, mlp_only_layers=[0], norm_topk_prob=False)),
    }[architecture]
    fields = dict(fields, num_experts=8, num_experts_per_tok=1)
    reference = save_random(causal_lm(config(**SIZES, initializer_range=0.1, **fields)), tmp_path)
    parallelism = make_parallelism(ParallelConfig(context_strategy="ring", block_q=8, block_kv=8), {"context": 8})
    assert parallelism.expert_dispatch == "capacity"
    # torch's grouped experts have no float64
    test_hf_qwen3_5.assert_split_rows_match(reference, load_pretrained(tmp_path), parallelism, float64=False)


def test_load_balancing_loss_is_transformers_aux_loss(tmp_path):
    torch.manual_seed(0)
    config = Qwen3_5MoeTextConfig(**SIZES, initializer_range=0.1, output_router_logits=True, **TEXT)
    reference = save_random(Qwen3_5MoeForCausalLM(config), tmp_path)
    model = load_pretrained(tmp_path)
    ids = np.random.default_rng(2).integers(0, SIZES["vocab_size"], size=(2, 24)).astype(np.int64)
    with torch.no_grad():
        expected = float(reference(torch.from_numpy(ids)).aux_loss)
    losses = nnx.jit(lambda m, x: {k: v[1] for k, v in m.aux_losses(m.hidden(x).aux).items()})(
        model, ids.astype(np.int32)
    )
    assert model.config.router_aux_loss_coef == 0.02 and losses.keys() == {"router_aux_loss"}
    loss = losses["router_aux_loss"]
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert abs(expected - 2.0) > 1e-3  # not the balanced value k, which any counts near balance would give


def test_conditional_generation_imports_its_text_model(tmp_path, caplog):
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=SIZES["hidden_size"])
    config = Qwen3_5MoeConfig(text_config=dict(SIZES, initializer_range=0.1, **TEXT), vision_config=vision)
    reference = save_random(Qwen3_5MoeForConditionalGeneration(config), tmp_path)
    model = load_pretrained(tmp_path)
    ids = np.random.default_rng(1).integers(0, SIZES["vocab_size"], size=(2, 24)).astype(np.int32)
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda m, x: m(x))(model, ids)), hf_logits(reference, ids), rtol=0, atol=1e-4
    )
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
    assert len(skipped) == 1 and "vision tower" in skipped[0], skipped
    assert model.config.family == "qwen3_5_moe"


# the published config.json files of the shipped configs as public transcriptions give them, less the keys no model
# reads (Qwen3.5-35B-A3B's is a ConditionalGeneration's: its text_config)
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_size": 2048,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25, "rope_theta": 10000000.0},
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
    },
}
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize("name, hf", [("qwen3.5-35b-a3b", QWEN3_5_35B_A3B), ("qwen3-next-80b-a3b", QWEN3_NEXT_80B_A3B)])
def test_shipped_config_is_the_checkpoints(name, hf):
    shipped = load_config(CONFIGS / "models" / f"{name}.yaml").model
    assert shipped == by_architecture(hf).config_from_hf(hf)
