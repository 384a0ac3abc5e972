"""`python -m train CONFIG --plan --target h100|h200 --devices N`: the plan is the GPU compiler's buffer assignment
of the step a GPU run compiles; the fit verdict uses the memory a run lets XLA take; bad targets and device counts
are named before anything compiles; the plan prints a speed estimate; and (slow) host offload plans for a GPU, and
each 128K recipe fits its GPUs with each attention kernel, with no reshard the partitioner can only do by replicating
a tensor, and with cuDNN in at most 5% more than blockwise."""

import contextlib
import io
import math
import re

import jax
import pytest

import train.__main__ as cli
from parallel import targets
from parallel.settings import make_parallelism
from tests.train.lowered_step import lowered_step
from tests.train.tiny_run import REPO, TINY
from train.config import load_config
from train.planning.memory import GPU_PLAN_OPTIONS, for_accelerator
from train.process import environment

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not targets.plugin_installed(), reason=f"needs XLA's GPU compiler: {targets.GPU_INSTALL}"),
]
INVOLUNTARY = "Involuntary full rematerialization"  # XLA's SPMD partitioner, on stderr
# a Mosaic GPU kernel's serialized module and its hash, whose bytes differ between two lowerings of one kernel in a
# process on JAX 0.11.2
KERNEL_BYTES = re.compile(r'(kernel_hash|module) = "(?:[^"\\]|\\.)*"')
OVERRIDES = [  # the GPU default kernel (auto: cuDNN on Hopper), the tiny Llama's ring step test_train_step.py leaves
    "model.num_layers=2",
    "mesh.fsdp=2",
    "mesh.context=4",
    "parallel.context_strategy=ring",
]


def plan_from_cli(argv, compiles=None):
    """(exit status, printed text, MemoryPlan) of `python -m train ARGV`, run in this process; each module it
    compiles is appended to `compiles` as (its text, the compile options)."""
    plans, plan_memory, printed = [], cli.plan_memory, io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(cli, "plan_memory", lambda *a, **kw: plans.append(plan_memory(*a, **kw)) or plans[-1])
        if compiles is not None:
            compile_lowered = jax.stages.Lowered.compile
            patch.setattr(
                jax.stages.Lowered,
                "compile",
                lambda self, options=None: compiles.append((self.as_text(), options)) or compile_lowered(self, options),
            )
        status = cli.main(argv)
    return status, printed.getvalue(), plans[0] if plans else None


@pytest.mark.parametrize(
    "config, overrides",
    [
        # every stack CI builds compiles the tiny ring (the GPU machines' JAX once crashed on the ring:
        # test_train_step.py), the GPU machines' alone the recipe
        pytest.param(TINY, OVERRIDES, id="tiny-ring"),
        pytest.param(
            REPO / "configs" / "finetune-128k-llama3.1-8b.yaml", [], id="8b-128k-recipe", marks=pytest.mark.gpu_stack
        ),
    ],
)
def test_h100_plan_reports_the_gpu_compile_of_the_step(config, overrides, capfd):
    compiles = []
    argv = [str(config), *overrides, "--plan", "--target", "h100", "--devices", "8"]
    status, text, plan = plan_from_cli(argv, compiles)
    assert status == 0, text
    assert INVOLUNTARY not in capfd.readouterr().err
    # cuDNN's calls, and Pallas (Mosaic GPU) for the ring steps' calls it leaves
    assert all(call in plan.compiled.as_text() for call in ("__cudnn$fmha", 'custom_call_target="mosaic_gpu'))
    run_config = for_accelerator(load_config(config, [*overrides, "checkpoint.init_from="]))
    # the plan compiled, once and with its options (a run's differ only in CUB's sort, see GPU_PLAN_OPTIONS), the
    # step a GPU run lowers; its numbers are that executable's
    run_step = lowered_step(run_config, targets.compile_only_devices("h100", 8)).as_text()
    assert [(without_kernel_bytes(text), options) for text, options in compiles] == [
        (without_kernel_bytes(run_step), GPU_PLAN_OPTIONS)
    ]
    stats = plan.compiled.memory_analysis()
    assert (plan.arguments, plan.temporaries, plan.outputs, plan.aliased) == (
        stats.argument_size_in_bytes,
        stats.temp_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
    )
    assert plan.device_kind == "NVIDIA H100 80GB HBM3" and plan.attention_kernel == "cudnn"
    usable = int(targets.TARGETS["h100"].memory * float(environment.GPU_MEMORY_FRACTION))
    assert f"device memory {cli.format_size(usable)}: fits" in text
    assert "gpu compiler's buffer assignment" in text and "cuDNN's workspace" in text
    assert_estimated(text)


def without_kernel_bytes(text: str) -> str:
    """A lowered module's text with Mosaic GPU's serialized kernels left out (their calls and operands kept)."""
    return KERNEL_BYTES.sub(r'\1 = ""', text)


def assert_estimated(text: str) -> None:
    """The plan's text has a speed estimate: a finite step time, tokens/s and an MFU below 100% (a tiny model's
    rounds to 0.0%)."""
    estimate = re.search(r"step ([0-9.e+-]+) s, ([0-9,]+) tokens/s per GPU, MFU ([0-9.]+)%", text)
    assert estimate and 0 < float(estimate.group(1)) < math.inf and float(estimate.group(3)) < 100, text
    assert int(estimate.group(2).replace(",", "")) > 0, text
    assert "where the step goes: " in text


@pytest.mark.slow
def test_the_1m_recipe_fits_two_h100_hosts():
    """configs/finetune-1m-llama3.1-8b.yaml: 1M-token rows over 16 H100s (usp: ring 2 x ulysses 8), with an
    estimate (about a minute)."""
    recipe = REPO / "configs" / "finetune-1m-llama3.1-8b.yaml"
    status, text, _ = plan_from_cli([str(recipe), "--plan", "--target", "h100", "--devices", "16"])
    assert status == 0 and "fits" in text, text
    assert_estimated(text)


@pytest.mark.slow
def test_h200_plan_has_its_memory_and_hosts():
    argv = [str(TINY), *OVERRIDES, "mesh.fsdp=-1", "--plan", "--target", "h200", "--devices", "16"]
    status, text, plan = plan_from_cli(argv)
    assert status == 0, text
    assert plan.devices == 16 and plan.mesh == {"fsdp": 4, "context": 4} and "H200" in plan.device_kind
    assert "h200: 141.00 GiB per device" in text


@pytest.mark.slow
def test_host_offload_plans_for_a_gpu(capsys):
    """Refused on CPU, where there is no host memory apart from the device's, but a GPU has one."""
    argv = [str(TINY), *OVERRIDES, "model.num_layers=1", "compute.remat_policy=offload_projections", "--plan"]
    status, text, plan = plan_from_cli([*argv, "--target", "h100", "--devices", "8"])
    assert status == 0 and plan.config.compute.remat_policy == "offload_projections", text
    assert cli.main([*argv, "--devices", "8"]) == 2
    assert "offloads to pinned host memory, which the cpu backend does not have" in capsys.readouterr().err


def test_auto_is_cudnn_on_compile_only_hoppers():
    """The kernel is resolved from the target's devices (compute capability 9.0), not from this machine's CPU."""
    for name in targets.TARGETS:
        device = targets.compile_only_devices(name, 1)[0]
        assert make_parallelism(load_config(TINY).parallel, {}, device).kernel == "cudnn"


def test_bad_target_requests_are_named_before_compiling(monkeypatch, capsys):
    assert cli.main([str(TINY), "--plan", "--target", "h100", "--devices", "12"]) == 2
    assert "--devices=12: a GPU plan takes 1 to 8 devices (one host) or a multiple of 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(TINY), "--plan", "--target", "a100"])
    assert "argument --target: invalid choice: 'a100'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(TINY), "--target", "h100"])
    assert "go with --plan" in capsys.readouterr().err
    monkeypatch.setattr(targets, "plugin_installed", lambda: False)
    assert cli.main([str(TINY), "--plan", "--target", "h100", "--devices", "8"]) == 2
    assert f"compiling for h100 needs XLA's GPU compiler: {targets.GPU_INSTALL}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, devices",
    [
        ("finetune-128k-llama3.1-8b", 8),
        ("finetune-128k-qwen3-8b", 8),
        ("finetune-128k-qwen3-30b-a3b", 16),
        ("finetune-128k-gpt-oss-20b", 8),
        ("finetune-128k-deepseek-v2-lite", 8),
        ("finetune-128k-deepseek-v3", 256),
        ("finetune-128k-deepseek-v3.2", 256),
        ("finetune-128k-qwen3.5-35b-a3b", 16),
    ],
)
def test_128k_recipe_fits_h100_with_every_kernel(recipe, devices, capfd):
    """Each kernel's plan fits, with no reshard the partitioner can only do by replicating a tensor, and cuDNN's
    plan is within 5% of the blockwise kernel's."""
    totals = {}
    for kernel in ("blockwise", "pallas", "cudnn"):
        argv = [str(REPO / "configs" / f"{recipe}.yaml"), f"parallel.attention_kernel={kernel}", "--plan"]
        status, text, plan = plan_from_cli([*argv, "--target", "h100", "--devices", str(devices)])
        assert status == 0 and "fits" in text, text
        assert plan.attention_kernel == kernel
        assert INVOLUNTARY not in capfd.readouterr().err, kernel
        assert_estimated(text)
        totals[kernel] = plan.total
    assert totals["cudnn"] <= 1.05 * totals["blockwise"], totals
