"""The train step compiles for 8 H100s through XLA's GPU compiler, with no GPU (parallel/targets.py), for every context
strategy x attention kernel on llama-tiny, deepseek-tiny and qwen3_5-tiny (also as Qwen3.5-MoE): packed rows,
scattered tensor parallelism, expert parallelism with the capacity and the ragged dispatch. Each is what `python -m
train CONFIG --plan --target h100 --devices 8` compiles, and each checks that the kernel it names is the one in the
compiled program. The GPU compiler takes 20-150 s a case, so most are slow; every stack CI builds (the floor, the GPU
machines' JAX 0.11.2 and the newest) compiles EVERY_STACK: the tiny Llama's ring and usp steps with each kernel (the
ring's with cuDNN, the default path with its Pallas fallback, through the plan command in
tests/gpu_compile/test_gpu_plan.py); the GPU machines' stack alone also deepseek-tiny's latent ring with cuDNN. No
case may leave the SPMD partitioner a reshard it can only do by replicating a whole tensor (XLA logs "Involuntary full
rematerialization" on stderr); the embedding lookup over fsdp x context was one (parallel/lookup.py).

    python -m pytest -q -m "gpu_compile and not slow"   # python -m pytest -q -m gpu_compile: all of them
"""

import re

import pytest

from parallel import kernels, targets
from parallel.kernels import flash3, tokamax_attention
from tests.train.tiny_run import REPO
from train.config import load_config
from train.planning.memory import plan_memory

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]

STRATEGIES = ("none", "all_gather", "ring", "ulysses", "usp")
KERNELS = ("blockwise", "pallas", "cudnn", "flash3", "tokamax")
LLAMA_MESHES = {  # 8 devices each: the sequence, heads and parameters split every way a strategy allows
    "none": dict(fsdp=4, tensor=2),
    "all_gather": dict(fsdp=2, context=2, tensor=2),
    "ring": dict(fsdp=2, context=4),
    "ulysses": dict(fsdp=2, context=2, tensor=2),
    "usp": dict(fsdp=2, context=2, ulysses=2),
}
MODELS = {  # config, overrides, mesh per strategy (deepseek: the experts split too)
    "llama": ("configs/tiny.yaml", ["model.num_layers=2"], LLAMA_MESHES),
    "deepseek": (
        "configs/deepseek-tiny.yaml",
        [],
        {name: {**mesh, "fsdp": mesh["fsdp"] // 2, "expert": 2} for name, mesh in LLAMA_MESHES.items()},
    ),
    "qwen3_5": ("configs/qwen3_5-tiny.yaml", [], LLAMA_MESHES),
    # Qwen3.5-MoE: the tiny Qwen3.5's blocks ending in experts and a gated shared expert, with the load-balancing loss
    "qwen3_5_moe": (
        "configs/qwen3_5-tiny.yaml",
        [
            "model.family=qwen3_5_moe",
            "model.num_experts=8",
            "model.experts_per_token=2",
            "model.moe_mlp_dim=64",
            "model.num_shared_experts=1",
            "model.shared_expert_gate=true",
            "model.router_score=softmax",
            "model.router_bias_rate=0",
            "model.router_aux_loss_coef=0.001",
        ],
        {name: {**mesh, "fsdp": mesh["fsdp"] // 2, "expert": 2} for name, mesh in LLAMA_MESHES.items()},
    ),
}
EXPERT_MODELS = ("deepseek", "qwen3_5_moe")
# the custom calls that show a kernel in the compiled program: Pallas on an H100 is Mosaic GPU's kernels
# (parallel/kernels/mosaic.py), tokamax's too, each in its kernel's scope (parallel/kernels/visible.py)
CUSTOM_CALLS = {
    "cudnn": re.compile(r"__cudnn\$fmha"),
    "pallas": re.compile(r'custom_call_target="mosaic_gpu.*attention_pallas_visible'),
    "flash3": re.compile("dew_flash3_mha_varlen"),
    "tokamax": re.compile(r'custom_call_target="mosaic_gpu.*attention_tokamax_visible'),
}
INVOLUNTARY = "Involuntary full rematerialization"  # XLA's SPMD partitioner, on stderr
# The steps every supported JAX compiles, the GPU machines' too (.ci/run): the ring and usp with each kernel (the ring
# x cuDNN through the plan command in tests/gpu_compile/test_gpu_plan.py); XLA 0.11.2's GPU compiler once crashed on
# the ring alone (tests/train/test_shard_map_operands.py)
EVERY_STACK = {
    *(("llama", "ring", kernel) for kernel in KERNELS if kernel != "cudnn"),
    *(("llama", "usp", kernel) for kernel in KERNELS if kernel != "tokamax"),
}
GPU_STACK = {("deepseek", "ring", "cudnn")}  # the latent ring (90-190 s): on the GPU machines' JAX only


def overrides(model: str, strategy: str, kernel: str) -> list[str]:
    """Config overrides of one case; the expert models dispatch by capacity under the blockwise kernel and by the
    GPU default (ragged) under the others."""
    _, extra, meshes = MODELS[model]
    dispatch = ["parallel.expert_dispatch=capacity"] if model in EXPERT_MODELS and kernel == "blockwise" else []
    return [
        *extra,
        *(f"mesh.{axis}={size}" for axis, size in meshes[strategy].items()),
        f"parallel.context_strategy={strategy}",
        f"parallel.attention_kernel={kernel}",
        *dispatch,
    ]


def marks(model: str, strategy: str, kernel: str) -> list:
    """Slow (see the docstring) but for EVERY_STACK and GPU_STACK; FlashAttention-3's and tokamax's cases skip where
    they are not installed."""
    missing = {"flash3": flash3.missing(), "tokamax": tokamax_attention.missing()}.get(kernel)
    wheel = pytest.mark.skipif(bool(missing), reason=missing or "")
    if (model, strategy, kernel) in GPU_STACK:
        return [pytest.mark.gpu_stack, wheel]
    return [wheel] if (model, strategy, kernel) in EVERY_STACK else [pytest.mark.slow, wheel]


def cases() -> list:
    """(model, strategy, kernel) for every model x strategy x kernel, marked (see `marks`)."""
    return [
        pytest.param(model, strategy, kernel, marks=marks(model, strategy, kernel))
        for model in MODELS
        for strategy in STRATEGIES
        for kernel in KERNELS
    ]


@pytest.mark.parametrize("model, strategy, kernel", cases())
def test_train_step_compiles_for_h100(model, strategy, kernel, capfd):
    config = load_config(REPO / MODELS[model][0], overrides(model, strategy, kernel))
    plan = plan_memory(config, targets.compile_only_devices("h100", 8))
    assert INVOLUNTARY not in capfd.readouterr().err
    assert (plan.platform, plan.devices, plan.attention_kernel) == ("gpu", 8, kernel)
    dense = model not in EXPERT_MODELS
    assert plan.expert_dispatch == ("none" if dense else "capacity" if kernel == "blockwise" else "ragged")
    text = plan.compiled.as_text()
    for name, call in CUSTOM_CALLS.items():
        if kernel == "tokamax" and name == "pallas":
            continue  # Pallas runs tokamax's calls with keys out of order where a step has any (the ring's branch)
        # a packed kernel serves the diagonal and all-visible calls and compiles Pallas for the rest (a run-time branch)
        wanted = name == kernel or (kernel in kernels.PACKED and name == "pallas")
        assert bool(call.search(text)) == wanted, f"{call} {'missing from' if wanted else 'in'} the {kernel} program"
    assert 0 < plan.total < 2**30


@pytest.mark.parametrize(
    "strategy",
    [pytest.param("all_gather", marks=pytest.mark.slow), pytest.param("ulysses", marks=pytest.mark.slow)],
)
def test_parameters_split_over_fsdp_and_context_are_not_replicated(strategy, capfd):
    """The embedding table split on embed over fsdp x context: a plain `take` left its rows in the table's sharding,
    which the partitioner could only replicate to reach the residual stream's (forward and backward)."""
    mesh = ["mesh.fsdp=2", "mesh.context=4", f"parallel.context_strategy={strategy}"]
    config = load_config(
        REPO / "configs/tiny.yaml", ["model.num_layers=1", *mesh, "parallel.attention_kernel=blockwise"]
    )
    plan_memory(config, targets.compile_only_devices("h100", 8))
    assert INVOLUNTARY not in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_sparse_attention_step_compiles_for_h100(strategy, capfd):
    """The tiny DeepSeek-V3.2 (rows of 256 tokens, index_topk 64: every layer attends sparsely) with experts over
    expert 2 x context 4: no attention kernel in the program, the latents and indexer keys gathered (about 30 s)."""
    mesh = ["mesh.fsdp=1", "mesh.expert=2", "mesh.context=4", f"parallel.context_strategy={strategy}"]
    plan = plan_memory(
        load_config(REPO / "configs/deepseek-v3.2-tiny.yaml", mesh), targets.compile_only_devices("h100", 8)
    )
    assert INVOLUNTARY not in capfd.readouterr().err
    text = plan.compiled.as_text()
    assert not any(call in text for call in CUSTOM_CALLS.values()) and "all-gather" in text
    assert 0 < plan.total < 2**30
