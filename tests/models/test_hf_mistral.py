"""Hugging Face Mistral and Mixtral <-> longctx: logits equal transformers' on tiny random models (fp32, max abs diff
<= 1e-4) in both directions through shards, with and without a sliding window shorter than the 24 tokens (Mixtral:
softmax top-2 of 8 experts, w1 / w3 / w2); the shipped configs are the published config.json files imported; a
config.json leaving keys out reads as transformers reads it; export refuses what the architecture cannot hold."""

import dataclasses
import pathlib

import pytest
from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

from models.config import FULL, SLIDING, ModelConfig
from models.hf.families import for_export
from models.hf.mistral import mistral_config_from_hf, mixtral_config_from_hf
from tests.models.hf_reference import assert_case_round_trips
from train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
CASES = {  # name -> (config class, model class, fields, ModelConfig fields expected)
    "mistral-untied": (
        MistralConfig,
        MistralForCausalLM,
        dict(num_hidden_layers=2, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        dict(family="mistral", rope_theta=1e6, tie_embeddings=False),
    ),
    "mistral-head-dim-tied": (
        MistralConfig,
        MistralForCausalLM,
        dict(num_hidden_layers=2, sliding_window=None, head_dim=24, tie_word_embeddings=True),
        dict(family="mistral", head_dim=24, tie_embeddings=True),
    ),
    "mixtral-top2-of-8": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2),
        dict(family="mixtral", num_experts=8, experts_per_token=2, moe_mlp_dim=96, first_dense_layers=0),
    ),
    "mistral-window": (
        MistralConfig,
        MistralForCausalLM,
        dict(num_hidden_layers=2, sliding_window=5),
        dict(family="mistral", sliding_window=5, layer_types=()),
    ),
    "mixtral-window": (
        MixtralConfig,
        MixtralForCausalLM,
        dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
        dict(family="mixtral", sliding_window=6, layer_types=()),
    ),
}
# the published config.json files of the shipped configs, less the keys no model reads
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32768,
}
MIXTRAL_8X7B = {
    **MISTRAL_7B,
    "architectures": ["MixtralForCausalLM"],
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_aux_loss_coef": 0.02,
    "vocab_size": 32000,
}


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers(tmp_path, case):
    assert_case_round_trips(tmp_path, *CASES[case])


@pytest.mark.parametrize(
    "name, hf, from_hf",
    [("mistral-7b", MISTRAL_7B, mistral_config_from_hf), ("mixtral-8x7b", MIXTRAL_8X7B, mixtral_config_from_hf)],
)
def test_shipped_config_is_the_checkpoints(name, hf, from_hf):
    shipped = load_config(CONFIGS / "models" / f"{name}.yaml").model
    assert shipped == dataclasses.replace(from_hf(hf), max_position_embeddings=32768)


def test_mistral_config_json_leaving_the_window_out_reads_as_transformers_does():
    """MistralConfig's sliding_window: 4096 in every layer."""
    left_out = {key: value for key, value in MISTRAL_7B.items() if key != "sliding_window"}
    assert mistral_config_from_hf(left_out) == mistral_config_from_hf(dict(MISTRAL_7B, sliding_window=4096))
    assert (mistral_config_from_hf(left_out).sliding_window, mistral_config_from_hf(left_out).layer_types) == (4096, ())


def test_another_activation_is_refused():
    with pytest.raises(ValueError, match="hidden_act='gelu'; only hidden_act='silu'") as info:
        mixtral_config_from_hf(dict(MIXTRAL_8X7B, hidden_act="gelu"))
    assert "\n" not in str(info.value)


def test_mixtral_config_json_leaving_keys_out_reads_as_transformers_does():
    """MixtralConfig's defaults: rope_theta 1e6, no window, 8 experts, top 2, rms_norm_eps 1e-5."""
    left_out = ("rope_theta", "sliding_window", "num_local_experts", "num_experts_per_tok", "rms_norm_eps")
    config = mixtral_config_from_hf({key: value for key, value in MIXTRAL_8X7B.items() if key not in left_out})
    assert config == mixtral_config_from_hf(MIXTRAL_8X7B)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            ModelConfig(family="llama", qkv_bias=True),
            "LlamaForCausalLM cannot hold model.qkv_bias=True; it needs model.qkv_bias=False",
        ),
        (
            ModelConfig(family="mistral", qk_norm=True),
            "MistralForCausalLM cannot hold model.qk_norm=True; it needs model.qk_norm=False",
        ),
        (
            dataclasses.replace(mixtral_config_from_hf(MIXTRAL_8X7B), norm_topk_prob=False),
            "MixtralForCausalLM cannot hold model.norm_topk_prob=False",
        ),
        (
            ModelConfig(family="qwen2"),
            "Qwen2ForCausalLM cannot hold model.qkv_bias=False; it needs model.qkv_bias=True",
        ),
        (
            ModelConfig(family="llama", sliding_window=8),
            "LlamaForCausalLM cannot hold model.sliding_window=8: it has no sliding windows",
        ),
        (
            ModelConfig(family="mistral", num_layers=2, sliding_window=8, layer_types=(FULL, SLIDING)),
            r"MistralForCausalLM cannot hold model.layer_types=\['full_attention', 'sliding_attention'\]: it slides "
            r"every layer or none",
        ),
    ],
)
def test_export_refuses_what_the_architecture_cannot_hold(config, message):
    with pytest.raises(ValueError, match=message):
        for_export(config).config_to_hf(config)
