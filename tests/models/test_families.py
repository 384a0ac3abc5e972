"""Each family's train step over context=8 ring equals one device's (loss and gradients, packed rows), the expert
families' also with experts over expert x context, Qwen3.5's Gated DeltaNet layers also on a document longer than a
device's pieces and over ring 4 x tensor 2 (heads split), Qwen3-Next's (shared expert gate, load-balancing loss, a
dense layer first) over expert 2 x ring 4 (Qwen3.5-MoE's, the same decoder, over ring 8: slow), and q/k/v biases with
q/k norms over tensor=4 with repeated key/value heads; sliding windows in layers that differ (scanned in groups;
dense, MoE, Gemma 3's and GPT-OSS's blocks) over context=8 ring with a document longer than the window and than a
device's pieces, Gemma 3 and GPT-OSS also over tensor=4 and under all_gather, ulysses and usp (GPT-OSS's all_gather
and ulysses, and Gemma 3's: slow), GPT-OSS also over expert 2 x ring 4; biases, sinks and norm scales are random so
that a misplaced one shows. The registry's expert families are the ones check_model lets have experts."""

import dataclasses

import jax
import numpy as np
import pytest

import models
from layers.rope import RopeScalingConfig
from models.config import EXPERT_FAMILIES, FULL, LINEAR, SLIDING, ConfigError, check_model
from models.mixture import MixtureDecoder
from tests.tiny_models import TINY_LLAMA, TINY_MLA
from tests.train.step_reference import (
    assert_same_step,
    first_step,
    initial_state,
    long_document_batch,
    packed_batch,
)
from train.config import MeshConfig, ModelConfig, ParallelConfig

DENSE = dataclasses.replace(TINY_LLAMA, num_heads=8)
EXPERTS = dict(
    num_experts=8, experts_per_token=2, moe_mlp_dim=16, router_score="softmax", router_bias_rate=0.0, num_layers=2
)
FAMILIES = {
    "qwen2": dataclasses.replace(DENSE, family="qwen2", qkv_bias=True),
    "qwen3": dataclasses.replace(DENSE, family="qwen3", qk_norm=True),
    "mistral": dataclasses.replace(DENSE, family="mistral"),
    "qwen3_moe": dataclasses.replace(
        DENSE, family="qwen3_moe", qk_norm=True, first_dense_layers=1, norm_topk_prob=False, **EXPERTS
    ),
    "mixtral": dataclasses.replace(DENSE, family="mixtral", **EXPERTS),
    # three Gated DeltaNet layers to one gated full-attention layer with partial rotary, scanned as one group
    "qwen3_5": dataclasses.replace(
        DENSE,
        family="qwen3_5",
        qk_norm=True,
        num_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        partial_rotary_factor=0.5,
        attention_output_gate=True,
        linear_key_heads=2,
        linear_heads=4,
        linear_key_dim=32,  # keys of 8 features are so alike that the chunked form's float32 rounding grows 10x
        linear_value_dim=8,
    ),
}
# Qwen3.5-MoE / Qwen3-Next: Qwen3.5's blocks ending in experts and a gated shared expert of its own width, trained
# with the load-balancing loss (a coefficient large enough that a wrong router probability shows in the gradients);
# Qwen3-Next's first layer dense
QWEN3_5_MOE = dataclasses.replace(
    FAMILIES["qwen3_5"],
    family="qwen3_5_moe",
    **dict(EXPERTS, num_layers=4),
    num_shared_experts=1,
    shared_expert_mlp_dim=24,
    shared_expert_gate=True,
    router_aux_loss_coef=0.1,
)
QWEN3_NEXT = dataclasses.replace(QWEN3_5_MOE, family="qwen3_next", first_dense_layers=1)
# sliding windows of 8 in layers that differ, scanned in groups; rows of one 64-token document and of packed ones
WINDOWED = {
    "qwen3-layer-types": dataclasses.replace(
        DENSE, family="qwen3", qk_norm=True, num_layers=3, sliding_window=8, layer_types=(SLIDING, FULL, SLIDING)
    ),
    "mixtral-layer-types": dataclasses.replace(
        DENSE, family="mixtral", sliding_window=8, **dict(EXPERTS, num_layers=3), layer_types=(SLIDING, FULL, SLIDING)
    ),
    "gemma3": dataclasses.replace(
        DENSE,
        family="gemma3",
        qk_norm=True,
        num_layers=3,
        sliding_window=8,
        layer_types=(SLIDING, SLIDING, FULL),
        rope_scaling=RopeScalingConfig(type="linear", factor=2.0),
        local_rope_theta=100.0,
        query_pre_attn_scalar=24,
        tie_embeddings=True,
    ),
}
# GPT-OSS: layers alternating a window of 8 and full attention, q/k/v/o biases, sinks, router logit bias and clamped
# SwiGLU experts with biases (a limit that random pre-activations pass)
GPT_OSS = dataclasses.replace(
    DENSE,
    family="gpt_oss",
    sliding_window=8,
    layer_types=(SLIDING, FULL),
    qkv_bias=True,
    o_bias=True,
    attention_sinks=True,
    router_logit_bias=True,
    expert_mlp="clamped_swiglu",
    swiglu_limit=1.0,
    **EXPERTS,
)
# DeepSeek-V3.2's sparse attention (each query attends its indexer's 6 best keys) with its indexer's loss, a dense
# layer then experts; GLM-5's interleaved indexer rotary
DSA = dataclasses.replace(
    TINY_MLA, index_topk=6, index_heads=4, index_head_dim=8, first_dense_layers=1, norm_topk_prob=False, **EXPERTS
)
GLM_DSA = dataclasses.replace(DSA, index_rope_interleaved=True)
# both attention features at once, for tensor parallelism (features are fields, whatever the family)
BIASED_NORMED = dataclasses.replace(DENSE, family="qwen2", qkv_bias=True, qk_norm=True)
# the default dispatch: expert parallelism drops nothing
RING = ParallelConfig(context_strategy="ring", block_q=8, block_kv=8)
PLAIN = ParallelConfig(block_q=8, block_kv=8)
# the other context strategies, with the mesh each takes: the windowed, sink-carrying families run under each
STRATEGIES = {
    "all_gather": (MeshConfig(fsdp=1, context=8), dataclasses.replace(RING, context_strategy="all_gather")),
    "ulysses": (MeshConfig(fsdp=1, context=8), dataclasses.replace(RING, context_strategy="ulysses")),
    "usp": (MeshConfig(fsdp=1, context=4, ulysses=2), dataclasses.replace(RING, context_strategy="usp")),
}


def randomised(host_state):
    """The state with biases and sinks N(0, 0.1) and norm scales 1 + N(0, 0.2) (they start at 0 and 1)."""
    rng = np.random.default_rng(0)

    def change(path, leaf):
        name = jax.tree_util.keystr(path)
        if name.startswith("[0]") and name.endswith(("_bias']['bias']", "_bias']", "['sinks']")):
            return leaf + rng.normal(0.0, 0.1, leaf.shape).astype(leaf.dtype)
        if name.startswith("[0]") and "['scale']" in name:
            return leaf + rng.normal(0.0, 0.2, leaf.shape).astype(leaf.dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(change, host_state)


@pytest.fixture(scope="module")
def references():
    """(ModelConfig, batch maker) -> (host state, one-device step result), computed on first use."""
    cache = {}

    def get(model, make_batch):
        if (model, make_batch) not in cache:
            host_state = randomised(initial_state(model))
            step = first_step(host_state, model, MeshConfig(fsdp=1), PLAIN, jax.devices()[:1], make_batch)
            cache[model, make_batch] = host_state, step
        return cache[model, make_batch]

    return get


# The gated delta rule's chunked form amplifies float32 rounding: the same qwen3_5 step on one device with chunks of
# 8 instead of 64 tokens moves its Gated DeltaNet gradients by up to 7e-5 (relative L2), and split over 2 to 8 devices
# by up to 5e-5, alike for every device count and layout (a piece boundary that leaked would grow with their number).
# With experts after them, the decay parameters' gradients (a_log, dt_bias, a: sums of cancelling terms over every
# token) differ by up to 1e-4 alike under ring 8 (8.3e-5) and expert 2 x ring 4 (9.9e-5), while the losses agree to 3e-7
TOLERANCE = {"qwen3_5": 1e-4, "qwen3_5_moe": 2e-4, "qwen3_next": 2e-4}


def newest(*case):
    """A case the floor stack skips: expert, tensor and other-strategy variants, whose paths the floor checks in
    tests/train/test_tensor_parallel.py, tests/parallel/test_experts.py and tests/parallel/test_strategies.py."""
    return pytest.param(*case, marks=pytest.mark.newest_stack)


def slow(*case):
    """A case left to `-m slow`: qwen2 / mistral (config variants of the Llama class that qwen3's case runs), and
    variants whose layers another default test splits the same way (experts under the ring: tests/models/
    test_deepseek.py and tests/parallel/test_experts.py; the hybrid over 8 devices: tests/layers/test_gated_deltanet.py
    and tests/train/test_hung_steps.py; windows and sinks: tests/parallel/test_strategy_windows.py; MLA's latent ring:
    tests/parallel/test_latent_ring.py; sparse attention and its indexer's loss: tests/parallel/
    test_sparse_strategies.py)."""
    return pytest.param(*case, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "model, mesh_config, parallel_config, make_batch",
    [
        *(
            slow(FAMILIES[name], MeshConfig(fsdp=1, context=8), RING, packed_batch)
            if name in ("qwen2", "mistral", "mixtral", "qwen3_5", "qwen3_moe")
            else (FAMILIES[name], MeshConfig(fsdp=1, context=8), RING, packed_batch)
            for name in FAMILIES
        ),
        *(slow(WINDOWED[name], MeshConfig(fsdp=1, context=8), RING, long_document_batch) for name in WINDOWED),
        # the hybrid over 8 devices by default: tests/layers/test_gated_deltanet.py, tests/train/test_hung_steps.py
        slow(FAMILIES["qwen3_5"], MeshConfig(fsdp=1, context=8), RING, long_document_batch),
        # MLA's latent around the ring (by default: tests/parallel/test_latent_ring.py and the model's permutes in
        # tests/train/test_tensor_parallel.py)
        slow(TINY_MLA, MeshConfig(fsdp=1, context=8), RING, packed_batch),
        slow(FAMILIES["qwen3_5"], MeshConfig(fsdp=1, context=4, tensor=2), RING, packed_batch),
        # sparse attention's split by default: tests/parallel/test_sparse_strategies.py (loss and index gradients)
        slow(DSA, MeshConfig(fsdp=1, expert=2, context=4), RING, long_document_batch),
        slow(DSA, MeshConfig(fsdp=1, context=8), RING, packed_batch),
        slow(GLM_DSA, MeshConfig(fsdp=1, context=8), RING, long_document_batch),
        slow(GLM_DSA, MeshConfig(fsdp=1, expert=2, context=4), RING, packed_batch),
        # experts over expert x context by default: tests/models/test_deepseek.py, tests/parallel/test_experts.py
        slow(FAMILIES["qwen3_moe"], MeshConfig(fsdp=1, expert=2, context=4), RING, packed_batch),
        slow(FAMILIES["mixtral"], MeshConfig(fsdp=1, expert=2, context=4), RING, packed_batch),
        # the same decoder class as Qwen3-Next's case below, without its dense layer
        pytest.param(QWEN3_5_MOE, MeshConfig(fsdp=1, context=8), RING, packed_batch, marks=pytest.mark.slow),
        slow(QWEN3_NEXT, MeshConfig(fsdp=1, expert=2, context=4), RING, packed_batch),
        newest(BIASED_NORMED, MeshConfig(fsdp=2, tensor=4), PLAIN, packed_batch),
        slow(WINDOWED["gemma3"], MeshConfig(fsdp=2, tensor=4), PLAIN, long_document_batch),
        slow(GPT_OSS, MeshConfig(fsdp=1, context=8), RING, long_document_batch),
        slow(GPT_OSS, MeshConfig(fsdp=1, expert=2, context=4), RING, long_document_batch),
        slow(GPT_OSS, MeshConfig(fsdp=2, tensor=4), PLAIN, packed_batch),
        # every strategy with windows and sinks: tests/parallel/test_strategy_windows.py; here slow
        *(pytest.param(GPT_OSS, *STRATEGIES[name], long_document_batch, marks=pytest.mark.slow) for name in STRATEGIES),
        *(
            pytest.param(WINDOWED["gemma3"], *STRATEGIES[name], long_document_batch, marks=pytest.mark.slow)
            for name in STRATEGIES
        ),
    ],
    ids=[
        *(f"{name}-ring8" for name in FAMILIES),
        *(f"{name}-long-document-ring8" for name in WINDOWED),
        "qwen3_5-long-document-ring8",
        "deepseek-ring8",
        "qwen3_5-ring4-tensor2",
        "deepseek-v3.2-long-document-expert2-ring4",
        "deepseek-v3.2-ring8",
        "glm-5-long-document-ring8",
        "glm-5-expert2-ring4",
        "qwen3_moe-expert2-ring4",
        "mixtral-expert2-ring4",
        "qwen3_5_moe-ring8",
        "qwen3_next-expert2-ring4",
        "qkv-tensor4",
        "gemma3-tensor4",
        "gpt_oss-long-document-ring8",
        "gpt_oss-long-document-expert2-ring4",
        "gpt_oss-tensor4",
        *(f"gpt_oss-long-document-{name}" for name in STRATEGIES),
        *(f"gemma3-long-document-{name}" for name in STRATEGIES),
    ],
)
def test_step_equals_one_device(references, model, mesh_config, parallel_config, make_batch):
    host_state, reference = references(model, make_batch)
    step = first_step(host_state, model, mesh_config, parallel_config, jax.devices(), make_batch)
    assert_same_step(step, reference, tolerance=TOLERANCE.get(model.family, 1e-5))


def test_expert_families_are_the_registrys_mixture_decoders():
    assert {family for family, decoder in models.REGISTRY.items() if issubclass(decoder, MixtureDecoder)} == set(
        EXPERT_FAMILIES
    )
    with pytest.raises(ConfigError, match=r"num_experts=8 needs a family with expert blocks .*=qwen3 has dense blocks"):
        check_model(dataclasses.replace(FAMILIES["qwen3_moe"], family="qwen3"))
    with pytest.raises(ConfigError, match=r"model\.query_pre_attn_scalar=24 is a grouped-query attention feature"):
        check_model(dataclasses.replace(TINY_MLA, query_pre_attn_scalar=24))
    with pytest.raises(ConfigError, match=r"model\.qk_norm=true is a grouped-query attention feature"):
        check_model(
            ModelConfig(
                family="deepseek", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, qk_norm=True
            )
        )
