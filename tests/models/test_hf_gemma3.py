"""Hugging Face Gemma 3 (text) <-> longctx: logits equal transformers' on tiny random models (fp32, max abs diff <=
1e-4) in both directions through shards, with sliding windows shorter than the 24 tokens in layers grouped by their
period, a linear-scaled global rope beside an unscaled local one (in either config.json form), Gemma's 1 + weight
norms random, q/k norms, a query_pre_attn_scalar apart from head_dim, tied and untied embeddings; the shipped configs
are the published text configs imported; soft-capping is refused in one line."""

import dataclasses
import pathlib

import pytest
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from layers.rope import RopeScalingConfig
from models.config import FULL, SLIDING
from models.hf.gemma3 import config_from_hf, config_to_hf
from tests.models.hf_reference import assert_case_round_trips
from train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5)
CASES = {  # name -> (config class, model class, fields, ModelConfig fields expected)
    "gemma3-period-3-rope-by-layer-type-tied": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            GEMMA,
            num_hidden_layers=7,
            sliding_window_pattern=3,
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        dict(
            family="gemma3",
            layer_types=(SLIDING, SLIDING, FULL) * 2 + (SLIDING,),
            rope_scaling=RopeScalingConfig(type="linear", factor=4.0),
            local_rope_theta=100.0,
            query_pre_attn_scalar=24,
            tie_embeddings=True,
        ),
    ),
    "gemma3-layer-types-untied": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(GEMMA, num_hidden_layers=3, layer_types=[FULL, SLIDING, SLIDING], tie_word_embeddings=False),
        dict(layer_types=(FULL, SLIDING, SLIDING), sliding_window=5, local_rope_theta=10000.0, tie_embeddings=False),
    ),
}
# google/gemma-3-4b-pt's and gemma-3-27b-pt's text_config, less the keys no model reads
GEMMA3_4B = {
    "architectures": ["Gemma3ForCausalLM"],
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "max_position_embeddings": 131072,
    "num_attention_heads": 8,
    "num_hidden_layers": 34,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000.0,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "vocab_size": 262208,
}
GEMMA3_27B = {
    **GEMMA3_4B,
    "head_dim": 128,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_hidden_layers": 62,
    "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168,
}


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers(tmp_path, case):
    assert_case_round_trips(tmp_path, *CASES[case])


@pytest.mark.parametrize("name, hf", [("gemma-3-4b", GEMMA3_4B), ("gemma-3-27b", GEMMA3_27B)])
def test_shipped_config_is_the_checkpoints(name, hf):
    shipped = load_config(CONFIGS / "models" / f"{name}.yaml").model
    assert shipped == config_from_hf(hf)
    assert config_from_hf(config_to_hf(shipped)) == shipped


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0; only final_logit_softcapping=None"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0; only attn_logit_softcapping=None"),
        (dict(attention_bias=True), "attention_bias=True; only attention_bias=False"),
    ],
)
def test_what_the_model_cannot_hold_is_named(changes, message):
    with pytest.raises(ValueError, match=message) as info:
        config_from_hf(dict(GEMMA3_4B, **changes))
    assert "\n" not in str(info.value)


def test_export_needs_the_local_rope():
    with pytest.raises(ValueError, match=r"Gemma3ForCausalLM cannot hold model\.local_rope_theta=0"):
        config_to_hf(dataclasses.replace(config_from_hf(GEMMA3_4B), local_rope_theta=0.0))
