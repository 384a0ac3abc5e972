"""The train step compiles for 8 v5p chips through libtpu's compiler, with no TPU (parallel/tpu_targets.py), for every
context strategy on llama-tiny, deepseek-tiny (latent attention, experts), deepseek-v3.2-tiny (sparse attention),
qwen3_5-tiny (Gated DeltaNet) and as Qwen3.5-MoE, with every attention call on the splash kernel: its Mosaic TPU
calls are in the program and no call of the blockwise kernel is. Each is what `python -m train CONFIG --plan --target
v5p --devices 8` compiles. A few cases run by default (the tiny Llama's under each strategy: test_tpu_plan.py); the
rest are slow.

    python -m pytest -q -m "tpu_compile and not slow"   # python -m pytest -q -m tpu_compile: all of them
"""

import re

import pytest

from parallel import tpu_targets
from tests.gpu_compile.test_train_step import INVOLUNTARY, MODELS, STRATEGIES
from tests.train.tiny_run import REPO
from train.config import load_config
from train.planning.memory import plan_memory

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not tpu_targets.libtpu_installed(), reason=f"needs the TPU compiler: {tpu_targets.TPU_INSTALL}"),
]

FAMILIES = {
    **MODELS,
    "deepseek_v32": (
        "configs/deepseek-v3.2-tiny.yaml",
        [],
        {name: {**mesh, "fsdp": mesh["fsdp"] // 2, "expert": 2} for name, mesh in MODELS["llama"][2].items()},
    ),
}
DEFAULT = {("deepseek", "ring"), ("qwen3_5_moe", "usp"), ("deepseek_v32", "all_gather"), ("qwen3_5", "ulysses")}
MOSAIC = "tpu_custom_call"  # a Pallas TPU kernel in the compiled program
BLOCKWISE = re.compile(r"attention_blockwise_visible")  # the blockwise kernel's scope (parallel/kernels/visible.py)


@pytest.fixture(scope="module")
def v5p():
    return tpu_targets.compile_only_tpus(tpu_targets.TPU_TARGETS["v5p"], 8)


@pytest.mark.parametrize(
    "model, strategy",
    [
        pytest.param(model, strategy, marks=[] if (model, strategy) in DEFAULT else [pytest.mark.slow])
        for model in FAMILIES
        for strategy in STRATEGIES
        if model != "llama"
    ],
)
def test_train_step_compiles_for_v5p_on_splash(model, strategy, v5p, capfd):
    path, extra, meshes = FAMILIES[model]
    mesh = [f"mesh.{axis}={size}" for axis, size in meshes[strategy].items()]
    plan = plan_memory(load_config(REPO / path, [*extra, *mesh, f"parallel.context_strategy={strategy}"]), v5p)
    assert INVOLUNTARY not in capfd.readouterr().err
    assert (plan.platform, plan.devices, plan.attention_kernel) == ("tpu", 8, "splash")
    text = plan.compiled.as_text()
    assert MOSAIC in text and not BLOCKWISE.search(text)
    assert 0 < plan.total < tpu_targets.TPU_TARGETS["v5p"].memory
