"""Hugging Face DeepSeek-V3 and V2 <-> longctx: logits equal transformers' on tiny random models (fp32, max abs
diff <= 1e-4) with a dense layer then MoE layers, in both directions: V3 with low-rank and full-rank queries, YaRN,
group-limited routing and both rotary column layouts; V2 with a full-rank query, YaRN and greedy softmax routing
(exported as V2). YaRN frequencies and softmax scale equal transformers' at DeepSeek's own sizes; the command
line's import then export gives back the checkpoint's tensors; the V2-Lite config is DeepSeek-V2-Lite's
config.json imported; V2's group-limited routing round-trips through config.json."""

import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

import models
from models.hf import load_pretrained, save_pretrained
from models.hf.deepseek import config_from_hf, v2_config_from_hf, v2_config_to_hf
from models.hf.spec import aux_loss_coef
from tests.layers.aux_loss_reference import deepseek_aux_loss
from tests.models.hf_reference import hf_logits, hf_tensors, our_logits, tokens
from train import hf as cli
from train.config import load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "mscale": 0.7,
    "mscale_all_dim": 0.9,
    "rope_theta": 10000.0,
}
CASES = {  # name -> (DeepseekV3Config fields, max_shard_size of transformers' save_pretrained)
    "q-lowrank-yarn-groups-untied-sharded": (
        dict(
            q_lora_rank=16,
            n_group=2,
            topk_group=1,
            rope_parameters=YARN,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        "30KB",
    ),
    "q-fullrank-default-half-rope-tied": (
        dict(
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            rope_interleave=False,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            tie_word_embeddings=True,
        ),
        "10MB",
    ),
}
# deepseek-ai/DeepSeek-V2-Lite's config.json, less the keys no model reads
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "vocab_size": 102400,
}


def hf_deepseek(path, *, v2=False, max_shard_size="10MB", **fields):
    """A random DeepseekV3ForCausalLM (DeepseekV2ForCausalLM if `v2`) saved to `path`: layer 0 dense, layers 1-2
    with 8 routed experts (top 2) and a shared one; weights of std 0.1, norm scales 1 + N(0, 0.2) and (V3)
    selection biases N(0, 0.1), so that a wrong mapping shows in the logits."""
    torch.manual_seed(0)
    config_class, model_class = (
        (DeepseekV2Config, DeepseekV2ForCausalLM) if v2 else (DeepseekV3Config, DeepseekV3ForCausalLM)
    )
    config = config_class(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_shared_experts=1,
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        **fields,
    )
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


@pytest.mark.parametrize("case", CASES)
def test_import_and_export_match_transformers(tmp_path, case):
    fields, shard_size = CASES[case]
    reference = hf_deepseek(tmp_path / "hf", max_shard_size=shard_size, **fields)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == case.endswith("sharded")
    model = load_pretrained(tmp_path / "hf")
    config = model.config
    assert (config.first_dense_layers, config.num_experts, config.q_lora_rank) == (1, 8, fields["q_lora_rank"] or 0)
    ids = tokens()
    expected = hf_logits(reference, ids)
    assert np.abs(expected).max() > 1.0  # large enough for a mapping error to show
    logits = our_logits(model, ids)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)

    save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    exported, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every tensor read, none missing
    assert exported.config.to_dict()["rope_parameters"] == reference.config.to_dict()["rope_parameters"]
    np.testing.assert_allclose(hf_logits(exported, ids), logits, rtol=0, atol=1e-4)

    with torch.no_grad():  # the selection bias changes the routing, so its mapping is checked
        for name, buffer in reference.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
    assert np.abs(hf_logits(reference, ids) - expected).max() > 1e-2


def test_v2_import_and_export_match_transformers(tmp_path):
    reference = hf_deepseek(
        tmp_path / "hf",
        v2=True,
        q_lora_rank=None,
        topk_method="greedy",
        rope_parameters=YARN,
        max_position_embeddings=64,
        routed_scaling_factor=1.5,
        tie_word_embeddings=False,
        aux_loss_alpha=0.01,
        seq_aux=True,
    )
    model = load_pretrained(tmp_path / "hf")
    config = model.config
    assert (config.router_score, config.router_bias_rate, config.norm_topk_prob) == ("softmax", 0.0, False)
    assert (config.n_group, config.routed_scaling_factor, config.q_lora_rank) == (1, 1.5, 0)
    assert (config.router_aux_loss_coef, config.router_aux_loss_scope) == (0.01, "sequence")
    assert not np.any(np.asarray(model.moe_layers.moe.bias[...]))
    ids = np.concatenate([tokens(), tokens()[:, ::-1]])  # rows that route apart
    routing = []  # each MoE layer's (router logits [tokens, experts], chosen experts [tokens, k])
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _, __, out: routing.append((out[0], out[2])))
        for layer in reference.model.layers[1:]
    ]
    expected = hf_logits(reference, ids)
    for hook in hooks:
        hook.remove()
    assert np.abs(expected).max() > 1.0
    logits = our_logits(model, ids)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-4)

    # the load-balancing loss DeepSeek's own code adds (transformers' lacks it), on transformers' routing
    scores = np.stack([torch.softmax(logit, -1).numpy().reshape(*ids.shape, -1) for logit, _ in routing])
    chosen = np.stack([experts.numpy().reshape(*ids.shape, -1) for _, experts in routing])
    losses = nnx.jit(lambda m, x: {k: v[1] for k, v in m.aux_losses(m.hidden(x).aux).items()})(model, ids)
    np.testing.assert_allclose(float(losses["router_aux_loss"]), deepseek_aux_loss(chosen, scores, True), rtol=1e-5)
    assert abs(float(losses["router_aux_loss"]) - 2.0) > 1e-2  # not the balanced value of 2 layers

    save_pretrained(model, tmp_path / "out")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in hf_tensors(tmp_path / "out")
    exported, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    assert isinstance(exported, DeepseekV2ForCausalLM) and exported.config.topk_method == "greedy"
    assert (exported.config.aux_loss_alpha, exported.config.seq_aux) == (0.01, True)
    assert exported.config.to_dict()["rope_parameters"] == reference.config.to_dict()["rope_parameters"]
    np.testing.assert_allclose(hf_logits(exported, ids), logits, rtol=0, atol=1e-4)


def test_v2_lite_config_is_the_checkpoints():
    assert load_config(CONFIGS / "models" / "deepseek-v2-lite.yaml").model == v2_config_from_hf(V2_LITE)


def test_v2_group_limited_routing_round_trips():
    hf = dict(V2_LITE, topk_method="group_limited_greedy", n_group=8, topk_group=3, routed_scaling_factor=16.0)
    config = v2_config_from_hf(hf)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (8, 3, 16.0)
    written = v2_config_to_hf(config)
    assert {key: written[key] for key in ("topk_method", "n_group", "topk_group", "scoring_func")} == {
        "topk_method": "group_limited_greedy",
        "n_group": 8,
        "topk_group": 3,
        "scoring_func": "softmax",
    }
    assert v2_config_from_hf(written) == config
    assert v2_config_to_hf(v2_config_from_hf(V2_LITE))["topk_method"] == "greedy"


def test_v2_load_balancing_loss_over_the_batch_round_trips():
    config = v2_config_from_hf(dict(V2_LITE, seq_aux=False))
    assert (config.router_aux_loss_coef, config.router_aux_loss_scope) == (0.001, "layer")
    assert v2_config_to_hf(config)["seq_aux"] is False
    pooled = dataclasses.replace(config, router_aux_loss_scope="pooled")
    refused = "cannot hold model.router_aux_loss_scope='pooled' with model.router_aux_loss_coef=0.001; its "
    with pytest.raises(ValueError, match=re.escape(refused + "load-balancing loss is over sequence or layer")):
        v2_config_to_hf(pooled)
    mixtral = "MixtralForCausalLM cannot hold model.router_aux_loss_scope='layer'"
    with pytest.raises(ValueError, match=re.escape(mixtral)):
        aux_loss_coef(config, "MixtralForCausalLM")  # transformers' families pool every layer's tokens


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },  # DeepSeek-V3
        {
            "rope_type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },  # DeepSeek-V2-Lite, beta_fast / beta_slow left out
        {"type": "yarn", "factor": 8, "mscale_all_dim": 1.0},  # no mscale; original_max_position_embeddings left out
    ],
)
def test_yarn_frequencies_and_softmax_scale_match_transformers(rope):
    hf = DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        max_position_embeddings=163840,
        rope_scaling=dict(rope, rope_theta=10000.0),
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    config_json = {k: v for k, v in hf.to_dict().items() if k != "rope_parameters"}  # as an older config.json
    config = config_from_hf(dict(config_json, rope_scaling=rope, rope_theta=10000.0))
    attention = nnx.eval_shape(lambda: models.build(config, rngs=nnx.Rngs(0))).dense_layers.attn
    np.testing.assert_allclose(attention.inv_freq, inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(attention.rope_factor, attention_factor, rtol=1e-12)
    np.testing.assert_allclose(attention.scale, DeepseekV3Attention(hf, 0).scaling, rtol=1e-12)


def test_cli_import_then_export_gives_back_the_tensors(tmp_path):
    hf_deepseek(
        tmp_path / "hf",
        max_shard_size="30KB",
        q_lora_rank=16,
        n_group=2,
        topk_group=1,
        rope_parameters=YARN,
        max_position_embeddings=64,
        bos_token_id=7,
        eos_token_id=9,
    )
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    assert (
        cli.main(["export", str(tmp_path / "imported"), str(tmp_path / "exported"), "--max-shard-bytes", "50000"]) == 0
    )
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "exported")
    assert sorted(original) == sorted(exported)
    for name in original:
        np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["max_position_embeddings"]) == (7, 9, 64)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("attention_bias", True, "attention_bias=True; only attention_bias=False"),
        ("hidden_act", "gelu", "hidden_act='gelu'; only hidden_act='silu'"),
        ("scoring_func", "softmax", "scoring_func='softmax'; only scoring_func='sigmoid'"),
        ("topk_method", "greedy", "topk_method='greedy'; only topk_method='noaux_tc'"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config 'fp8'; only unquantized"),
        (
            "rope_parameters",
            dict(YARN, attention_factor=1.2),
            "rope parameter attention_factor=1.2; only attention_factor=None",
        ),
        (
            "rope_parameters",
            {"rope_type": "llama3", "factor": 8.0},
            "rope type 'llama3' is not supported; supported rope types: default, yarn",
        ),
    ],
)
def test_unsupported_config_is_named(key, value, message):
    hf = DeepseekV3Config(vocab_size=128, hidden_size=32, num_attention_heads=2, n_routed_experts=4).to_dict()
    config_from_hf(hf)
    with pytest.raises(ValueError, match=message):
        config_from_hf(dict(hf, **{key: value}))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mlp_bias", True, "mlp_bias=True; only mlp_bias=False"),
        ("norm_topk_prob", True, "norm_topk_prob=True; only norm_topk_prob=False"),
        ("scoring_func", "sigmoid", "scoring_func='sigmoid'; only scoring_func='softmax'"),
        ("topk_method", "noaux_tc", "topk_method='noaux_tc'; supported topk methods: greedy, group_limited_greedy"),
    ],
)
def test_unsupported_v2_config_is_named(key, value, message):
    v2_config_from_hf(V2_LITE)
    with pytest.raises(ValueError, match=message):
        v2_config_from_hf(dict(V2_LITE, **{key: value}))
