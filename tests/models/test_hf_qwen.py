"""Hugging Face Qwen2, Qwen3 and Qwen3-MoE <-> longctx: logits equal transformers' on tiny random models (fp32, max
abs diff <= 1e-4) in both directions through shards, with q/k/v biases (Qwen2), q/k norms and a head_dim apart from
hidden / heads (Qwen3), dense layers first then softmax-routed experts with and without renormalisation (Qwen3-MoE),
and sliding windows shorter than the 24 tokens (from max_window_layers, alternating layer_types scanned in groups,
every MoE layer); the shipped configs are the published config.json files imported; windows read as transformers
reads them; what the models cannot hold is refused in one line naming the key."""

import dataclasses
import pathlib

import pytest
from transformers import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from models.config import FULL, SLIDING
from models.hf.qwen import qwen2_config_from_hf, qwen3_config_from_hf, qwen3_moe_config_from_hf
from tests.models.hf_reference import assert_case_round_trips
from train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0}
CASES = {  # name -> (config class, model class, fields, ModelConfig fields expected)
    "qwen2-biases-yarn-untied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(num_hidden_layers=2, rope_parameters=YARN, max_position_embeddings=64, tie_word_embeddings=False),
        dict(family="qwen2", qkv_bias=True, qk_norm=False),
    ),
    "qwen3-qk-norms-head-dim-tied": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(num_hidden_layers=2, head_dim=24, tie_word_embeddings=True),
        dict(family="qwen3", qk_norm=True, head_dim=24),
    ),
    "qwen3-moe-dense-first-renormalised": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_hidden_layers=3,
            mlp_only_layers=[0],
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        dict(family="qwen3_moe", qk_norm=True, first_dense_layers=1, num_experts=8, norm_topk_prob=True),
    ),
    "qwen3-moe-all-experts": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False),
        dict(family="qwen3_moe", first_dense_layers=0, experts_per_token=3, norm_topk_prob=False),
    ),
    "qwen2-window-from-max-window-layers": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        dict(sliding_window=5, layer_types=(FULL, SLIDING, SLIDING)),
    ),
    "qwen3-alternating-layer-types": (
        Qwen3Config,
        Qwen3ForCausalLM,
        dict(
            num_hidden_layers=5, use_sliding_window=True, sliding_window=4, layer_types=[SLIDING, FULL] * 2 + [SLIDING]
        ),
        dict(sliding_window=4, layer_types=(SLIDING, FULL) * 2 + (SLIDING,)),
    ),
    "qwen3-moe-window": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        dict(
            num_hidden_layers=2,
            mlp_only_layers=[0],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            use_sliding_window=True,
            sliding_window=6,
        ),
        dict(sliding_window=6, layer_types=(), first_dense_layers=1),
    ),
}
# the published config.json files of the shipped configs, less the keys no model reads
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    **QWEN3_8B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "router_aux_loss_coef": 0.001,
    "num_key_value_heads": 4,
}


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers(tmp_path, case):
    assert_case_round_trips(tmp_path, *CASES[case])


@pytest.mark.parametrize(
    "name, hf, from_hf",
    [
        ("qwen2.5-7b", QWEN25_7B, qwen2_config_from_hf),
        ("qwen3-8b", QWEN3_8B, qwen3_config_from_hf),
        ("qwen3-30b-a3b", QWEN3_30B_A3B, qwen3_moe_config_from_hf),
    ],
)
def test_shipped_config_is_the_checkpoints(name, hf, from_hf):
    """The configs state the 32768 positions Qwen trains at (what a rope stretch starts from)."""
    shipped = load_config(CONFIGS / "models" / f"{name}.yaml").model
    assert shipped == dataclasses.replace(from_hf(hf), max_position_embeddings=32768)


def test_a_sliding_window_switched_on_for_no_layer_imports():
    """transformers windows the layers from max_window_layers on: none of Qwen2.5-7B's 28."""
    assert qwen2_config_from_hf(dict(QWEN25_7B, use_sliding_window=True)) == qwen2_config_from_hf(QWEN25_7B)


@pytest.mark.parametrize(
    "hf, changes, from_hf, window, layer_types",
    [
        (
            QWEN25_7B,
            dict(use_sliding_window=True, max_window_layers=20),
            qwen2_config_from_hf,
            131072,
            (FULL,) * 20 + (SLIDING,) * 8,
        ),
        (QWEN3_8B, dict(sliding_window=4096, layer_types=[SLIDING] * 36), qwen3_config_from_hf, 0, ()),
        (
            QWEN3_8B,
            dict(use_sliding_window=True, sliding_window=4096, layer_types=[SLIDING] * 36),
            qwen3_config_from_hf,
            4096,
            (),
        ),
        (QWEN3_30B_A3B, dict(use_sliding_window=True, sliding_window=4096), qwen3_moe_config_from_hf, 4096, ()),
    ],
)
def test_windows_read_as_transformers_reads_them(hf, changes, from_hf, window, layer_types):
    """use_sliding_window switches windows on; the windowed layers are every one (sliding_window alone) or some."""
    config = from_hf(dict(hf, **changes))
    assert (config.sliding_window, config.layer_types) == (window, layer_types)


@pytest.mark.parametrize(
    "hf, changes, from_hf, message",
    [
        (QWEN3_8B, dict(attention_bias=True), qwen3_config_from_hf, "attention_bias=True; only attention_bias=False"),
        (QWEN3_8B, dict(hidden_act="gelu"), qwen3_config_from_hf, "hidden_act='gelu'; only hidden_act='silu'"),
        (
            QWEN3_8B,
            dict(quantization_config={"quant_method": "fp8"}),
            qwen3_config_from_hf,
            "quantization_config 'fp8'; only unquantized",
        ),
        (
            QWEN3_30B_A3B,
            dict(mlp_only_layers=[1]),
            qwen3_moe_config_from_hf,
            r"mlp_only_layers=\[1\], which makes layers \[1\] dense; only dense layers before all MoE layers",
        ),
        (
            QWEN3_30B_A3B,
            dict(decoder_sparse_step=2),
            qwen3_moe_config_from_hf,
            r"decoder_sparse_step=2, which makes layers \[0, 2, 4, ",
        ),
    ],
)
def test_what_the_model_cannot_hold_is_named(hf, changes, from_hf, message):
    with pytest.raises(ValueError, match=message) as info:
        from_hf(dict(hf, **changes))
    assert "\n" not in str(info.value)
