"""`python -m train CONFIG --plan`: the planned bytes are those of the real step compiled on real arrays; the
--device-memory sizes, the fits verdict, the device count, and the remat policy checks."""

import contextlib
import io
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

import train.__main__ as cli
import train.planning.memory
from models.remat import POLICIES, RematError, check_policy, remat
from parallel.mesh import batch_sharding, make_mesh
from parallel.settings import make_parallelism
from tests.train import tiny_run
from train.__main__ import DOES_NOT_FIT, main
from train.config import ConfigError, load_config
from train.data.batch import BATCH_FIELDS
from train.data.pipeline import build_dataset
from train.data.tokenizer import make_tokenizer
from train.optimizer import make_optimizer
from train.planning.memory import MemoryPlan, format_plan
from train.planning.sizes import parse_size
from train.state import create_state
from train.step import make_train_step

TINY = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
SMALL = [
    *tiny_run.MODEL,
    "compute.dtype=float32",
    "data.seq_len=64",
    "data.max_documents=20",
    "train.batch_size=4",
    "mesh.fsdp=2",
]  # 2 devices: the product of the mesh


@pytest.fixture(autouse=True)
def jax_started():
    """JAX runs (8 devices, conftest) before `main` is called: --plan then keeps this process's devices and uses
    the first N, instead of starting JAX with N devices for the tests that follow."""
    assert jax.device_count() == 8


def plan_from_cli(argv):
    """(exit status, printed text, MemoryPlan) of `python -m train ARGV`, run in this process."""
    plans = []

    def spy(*args, **kwargs):
        plans.append(plan_memory(*args, **kwargs))
        return plans[-1]

    plan_memory, printed = cli.plan_memory, io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(cli, "plan_memory", spy)
        status = cli.main(argv)
    return status, printed.getvalue(), plans[0]


def real_step(config):
    """(state, memory_analysis()) of the train step as train.loop builds it, compiled on real arrays."""
    mesh = make_mesh(config.mesh, jax.devices()[:2])
    state = create_state(
        config.model, make_optimizer(config.optimizer, config.train.steps), mesh, seed=0, compute=config.compute
    )
    rows = next(
        iter(build_dataset(config.data, make_tokenizer(config.data.tokenizer), batch_size=config.train.batch_size))
    )
    assert {key: value.dtype for key, value in rows.items()} == {key: np.dtype(d) for key, d in BATCH_FIELDS.items()}
    batch = {key: jax.device_put(value, batch_sharding(mesh)) for key, value in rows.items()}
    with jax.set_mesh(mesh):
        step = make_train_step(
            state,
            mesh,
            chunk_size=config.compute.loss_chunk_size,
            accum_steps=config.train.grad_accum_steps,
            parallelism=make_parallelism(config.parallel, mesh.shape),
        )
        return state.state, step.lower(state.state, batch).compile().memory_analysis()


def local_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_plan_matches_the_real_step_compiled_on_real_arrays():
    status, printed, plan = plan_from_cli([TINY, *SMALL, "--plan", "--device-memory", "1MiB"])
    assert plan.devices == 2 and plan.mesh == {"fsdp": 2}
    assert status == DOES_NOT_FIT and "device memory 1.00 MiB: does NOT fit" in printed
    assert "CPU compiler's buffer assignment" in printed and "gradients" in printed
    state, stats = real_step(load_config(TINY, SMALL))
    assert (plan.arguments, plan.outputs, plan.aliased, plan.temporaries) == (
        stats.argument_size_in_bytes,
        stats.output_size_in_bytes,
        stats.alias_size_in_bytes,
        stats.temp_size_in_bytes,
    )
    params = local_bytes(nnx.filter_state(state[0], nnx.Param))
    assert plan.params == plan.gradients == params and plan.optimizer == local_bytes(state[1])
    assert plan.arguments == plan.params + plan.model_state + plan.optimizer + plan.batch


def test_fits_verdict_at_the_boundary():
    plan = MemoryPlan(
        params=4,
        model_state=0,
        optimizer=8,
        gradients=4,
        batch=1,
        arguments=13,
        outputs=14,
        aliased=12,
        temporaries=100,
        platform="cpu",
        devices=2,
        device_kind="cpu",
        mesh={"fsdp": 2},
        attention_kernel="blockwise",
        expert_dispatch="none",
        expert_axes=(),
        config=load_config(TINY),
        hosts=(0, 0),
        compile_seconds=1.0,
        compiled=None,
    )
    assert plan.total == 13 + 100 + 14 - 12
    assert plan.fits(115) and "device memory 115 B: fits, 0 B free (total 100% of it)" in format_plan(plan, 115)
    assert not plan.fits(100) and "device memory 100 B: does NOT fit, 15 B over (total 115% of it)" in format_plan(
        plan, 100
    )
    assert "device memory" not in format_plan(plan)


def test_auto_dtype_is_planned_as_bfloat16_and_an_explicit_one_kept():
    assert train.planning.memory.for_accelerator(load_config(TINY, ["compute.dtype=auto"])).compute.dtype == "bfloat16"
    explicit = load_config(TINY, ["compute.dtype=float32"])
    assert train.planning.memory.for_accelerator(explicit) is explicit


@pytest.mark.parametrize(
    "text, size",
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("141e9", 141 * 10**9),
        ("85899345920", 80 * 2**30),
        ("512 MiB", 512 * 2**20),
        ("1.5TB", 1.5e12),
        ("80gib", 80 * 2**30),
        ("4096B", 4096),
    ],
)
def test_device_memory_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "", "-1GB", "0", "0.5B", "80GiBs", "1e3e3"])
def test_bad_device_memory_names_the_value_and_the_forms(text, capsys):
    with pytest.raises(ValueError, match="80GiB, 80GB"):
        parse_size(text)
    with pytest.raises(SystemExit):
        main([TINY, "--plan", f"--device-memory={text}"])
    assert f"device memory {text!r} is not a size of at least 1 byte" in capsys.readouterr().err


def test_device_count_comes_from_the_mesh_or_devices(capsys):
    assert main([TINY, "--plan", "checkpoint.init_from=/not/imported/yet"]) == 2  # a plan reads no checkpoint
    assert "mesh.fsdp=-1 takes the remaining devices: give --devices N" in capsys.readouterr().err
    assert main([TINY, "--plan", "--devices", "16"]) == 2  # this process started JAX with 8 devices
    assert "needs 16 devices but JAX started with 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([TINY, "--device-memory", "80GiB"])
    assert "go with --plan" in capsys.readouterr().err


def test_unknown_remat_policy_lists_the_choices():
    with pytest.raises(ConfigError, match="compute.remat_policy='most'.*" + ", ".join(POLICIES)):
        load_config(TINY, ["compute.remat_policy=most"])
    with pytest.raises(RematError, match="unknown; choose one of " + ", ".join(POLICIES)):
        remat(lambda x: x, "most")


def test_host_offload_is_refused_on_cpu_before_compiling(capsys):
    check_policy("offload_projections", "gpu")
    check_policy("offload_projections", "tpu")
    with pytest.raises(RematError, match=r"offload_projections.*cpu backend.*save_projections"):
        remat(lambda x: x, "offload_projections")
    for plan in ([], ["--plan"]):  # training stops before reading data, the plan before compiling
        assert main([TINY, *SMALL, "compute.remat_policy=offload_projections", *plan]) == 2
        assert "pinned host memory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "mesh, factor, words",
    [
        (["mesh.expert=2"], "1.0", "split over expert=2; the capacity dispatch keeps at most 1.0 x the balanced load"),
        ([], "1.0", "every device runs all of them on its own tokens, dropless (no expert-parallel axis); "),
        (["mesh.expert=2"], "null", "split over expert=2, dropless (parallel.expert_capacity_factor unset)"),
    ],
)
def test_the_plan_says_what_the_capacity_factor_does_on_its_mesh(mesh, factor, words, capsys):
    """The same factor drops assignments under expert parallelism and none without it: the plan says which."""
    config = str(pathlib.Path(TINY).parent / "deepseek-tiny.yaml")
    argv = [config, *mesh, f"parallel.expert_capacity_factor={factor}", "model.num_layers=2", "--plan"]
    assert main([*argv, "--devices", "2" if mesh else "1"]) == 0
    assert words in capsys.readouterr().out
