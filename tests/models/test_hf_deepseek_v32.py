"""Hugging Face DeepSeek-V3.2 and GLM-5 <-> longctx on one device: a tiny random DeepseekV32ForCausalLM /
GlmMoeDsaForCausalLM whose rows are longer than index_topk (so each query attends its indexer's selection) gives
transformers' logits at 1e-4 when imported, and exported back its tensors and logits; the indexer's selection
matters (a larger index_topk changes the logits). A config.json we cannot represent is named."""

import dataclasses

import numpy as np
import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from models.hf import load_pretrained
from models.hf.deepseek_v32 import config_from_hf, config_to_hf, glm_config_from_hf
from models.hf.families import for_export
from parallel.parallelism import Parallelism
from tests.models.hf_reference import (
    assert_round_trip,
    assert_split_rows_match,
    hf_logits,
    our_logits,
    save_random,
    tokens,
)
from tests.train.tiny_run import REPO
from train.config import load_config

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    index_topk=6,
    index_n_heads=16,  # enough that no key scores exactly 0 (relu) for every head: no ties transformers breaks its way
    index_head_dim=16,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)


KINDS = {"deepseek-v3.2": (DeepseekV32Config, DeepseekV32ForCausalLM), "glm-5": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM)}


@pytest.mark.parametrize("kind", KINDS)
def test_import_and_export_match_transformers(tmp_path, kind):
    config_class, model_class = KINDS[kind]
    torch.manual_seed(0)
    reference = save_random(model_class(config_class(**TINY)), tmp_path / "hf", "30KB")
    model = assert_round_trip(reference, tmp_path / "hf", tmp_path / "out")
    config = model.config
    assert (config.index_topk, config.index_heads, config.index_head_dim) == (6, 16, 16)
    assert config.index_rope_interleaved == (kind == "glm-5")
    ids = tokens()  # 24 tokens a row: 4 x index_topk
    reference.config.index_topk = 24
    for layer in reference.model.layers:
        layer.self_attn.indexer.index_topk = 24
    assert np.abs(hf_logits(reference, ids) - our_logits(model, ids)).max() > 1e-2  # the selection matters


# every strategy over 8 devices, rows laid out as the trainer lays them (usp: dual_chunk over its 4 ring ranks, each
# piece split over 2 Ulysses ranks); ring and usp for both families
SPLITS = {
    "ring-8": ("ring", (("context", 8),)),
    "usp-4x2": ("usp", (("context", 4), ("ulysses", 2))),
    "all_gather-8": ("all_gather", (("context", 8),)),
    "ulysses-4": ("ulysses", (("context", 4),)),
}


@pytest.mark.parametrize(
    "kind, split",
    [
        *((kind, split) for kind in KINDS for split in ("ring-8", "usp-4x2")),
        ("deepseek-v3.2", "all_gather-8"),
        ("deepseek-v3.2", "ulysses-4"),
    ],
)
def test_rows_split_over_context_devices_give_transformers_logits(tmp_path, kind, split):
    """One long document and a packed row, each document longer than index_topk."""
    config_class, model_class = KINDS[kind]
    torch.manual_seed(0)
    reference = save_random(model_class(config_class(**TINY)), tmp_path)
    strategy, mesh_axes = SPLITS[split]
    axis = ("context", "ulysses") if strategy == "usp" else "context"
    parallelism = Parallelism(strategy=strategy, axis=axis, layout="dual_chunk", block_q=8, block_kv=8)
    # grouped experts: float32
    assert_split_rows_match(reference, load_pretrained(tmp_path), parallelism, float64=False, mesh_axes=mesh_axes)


@pytest.mark.parametrize("name, kind", [("deepseek-v3.2", "deepseek-v3.2"), ("glm-5", "glm-5")])
def test_published_configs_are_transformers(name, kind):
    """configs/models: transformers' config class defaults (DeepSeek-V3.2 with V3's YaRN rope, as it ships)."""
    ours = load_config(REPO / "configs" / "models" / f"{name}.yaml").model
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096)
    rope |= dict(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    fields = dict(rope_parameters=rope) if kind == "deepseek-v3.2" else {}
    hf = KINDS[kind][0](**fields).to_dict() | {"architectures": [KINDS[kind][1].__name__]}
    imported = (config_from_hf if kind == "deepseek-v3.2" else glm_config_from_hf)(hf)
    assert dataclasses.replace(imported, param_dtype="bfloat16", max_position_embeddings=0) == ours


def test_config_round_trips():
    config = config_from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY})
    assert config_from_hf({"architectures": ["DeepseekV32ForCausalLM"], **config_to_hf(config)}) == config
    with pytest.raises(
        ValueError,
        match="index_rope_interleaved=True; it routes with 'sigmoid' and has an indexer \\(index_topk > 0\\) with half",
    ):
        config_to_hf(dataclasses.replace(config, index_rope_interleaved=True))


def test_unsupported_configs_are_named():
    with pytest.raises(ValueError, match="q_lora_rank=None; its indexer reads the query latent"):
        config_from_hf({**TINY, "q_lora_rank": None})
    with pytest.raises(ValueError, match=r"makes layers \[1\] 'shared' .*; only every layer 'full' is supported"):
        glm_config_from_hf({**TINY, "index_topk_freq": 2, "index_skip_topk_offset": 1})


def test_export_architecture_follows_the_indexer():
    config = config_from_hf({"architectures": ["DeepseekV32ForCausalLM"], **TINY})
    assert for_export(config).architecture == "DeepseekV32ForCausalLM"
    glm = glm_config_from_hf({"architectures": ["GlmMoeDsaForCausalLM"], **TINY})
    assert for_export(glm).architecture == "GlmMoeDsaForCausalLM"
    assert for_export(dataclasses.replace(config, index_topk=0)).architecture == "DeepseekV3ForCausalLM"
