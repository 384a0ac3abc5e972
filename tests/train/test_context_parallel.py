"""Context parallelism from the run config: a ring run over 8 devices logs the losses of a one-context-device
run; every strategy's training step gives the loss and gradients of context=1 on packed rows with padding;
the parallelism and host reorder follow the config; sizes that do not fit stop with an error naming key and value."""

import dataclasses
import json
import pathlib
import types

import jax
import numpy as np
import pytest

from parallel import targets
from parallel.mesh import MeshError
from parallel.parallelism import Parallelism
from parallel.reorder import from_balanced
from parallel.settings import check_context, make_parallelism, to_layout
from tests.tiny_models import TINY_LLAMA
from tests.train.step_reference import (
    LENGTH,
    assert_same_step,
    eval_sums,
    first_step,
    initial_state,
    packed_batch,
    token_losses,
)
from train.config import MeshConfig, ParallelConfig, load_config
from train.loop import run
from train.process.environment import GPU_MEMORY_FRACTION, GPU_XLA_FLAGS, default_environment

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN = [
    "model.embed_dim=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=16",
    "model.mlp_dim=64",
    "compute.remat_policy=none",
    "compute.dtype=float32",
    "data.seq_len=64",
    "data.max_documents=40",
    "train.batch_size=8",
    "train.steps=4",
    "train.progress_bar=false",
    "train.log_every_steps=1",
    "train.eval_batches=1",
    "train.eval_position_buckets=[8, 32]",
    "train.needle_lengths=[320]",
    "train.needle_depths=[0.5]",
    "train.needle_samples=2",
    "train.sample_tokens=0",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=3e-3",
    "checkpoint.enabled=false",
    "train.peak_tflops_per_device=1",  # the MFU's peak given: no CPU matmul benchmark at start
]
MODEL = dataclasses.replace(TINY_LLAMA, num_heads=8)


def logged(output: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two end-to-end runs; the step's equality: test_strategy_step_equals_one_context_device
def test_ring_run_over_8_devices_logs_the_losses_of_one_context_device(tmp_path, capfd):
    run(load_config(REPO / "configs" / "tiny.yaml", [*RUN, f"train.output_dir={tmp_path / 'one'}"]))
    run(
        load_config(
            REPO / "configs" / "tiny.yaml",
            [
                *RUN,
                f"train.output_dir={tmp_path / 'ring'}",
                "mesh.fsdp=1",
                "mesh.context=8",
                "parallel.context_strategy=ring",
                "parallel.block_q=16",
                "parallel.block_kv=16",
                "train.sample_tokens=4",
            ],
        )
    )
    one, ring = logged(tmp_path / "one"), logged(tmp_path / "ring")
    assert [r["step"] for r in ring] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in ring], [r["loss"] for r in one], rtol=1e-5)
    needles = ("needle/single", "needle/multi_key", "needle/multi_value")
    for key in ("eval_loss", "eval_loss/pos_0_8", "eval_loss/pos_8_32", "eval_loss/pos_32_64", *needles):
        np.testing.assert_allclose(ring[-1][key], one[-1][key], rtol=1e-5)
    assert ring[-1]["loss"] < ring[0]["loss"] - 0.1, ring
    assert "--- sample ---" in capfd.readouterr().out  # sampling after a context-parallel run (no parallelism)


@pytest.fixture(scope="module")
def host_state():
    return initial_state(MODEL)


@pytest.fixture(scope="module")
def reference(host_state):
    return first_step(host_state, MODEL, MeshConfig(fsdp=1), ParallelConfig(block_q=8, block_kv=8), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh_config, parallel_config",
    [
        (
            MeshConfig(fsdp=1, context=8),
            ParallelConfig(context_strategy="all_gather", balance_layout="striped", stripe=2, block_q=8, block_kv=8),
        ),
        (MeshConfig(fsdp=1, context=8), ParallelConfig(context_strategy="ulysses", block_q=8, block_kv=8)),
        (MeshConfig(fsdp=1, context=4, ulysses=2), ParallelConfig(context_strategy="usp", block_q=8, block_kv=8)),
    ],
    ids=["all_gather8-striped", "ulysses8", "usp4x2"],
)
def test_strategy_step_equals_one_context_device(mesh_config, parallel_config, host_state, reference):
    assert_same_step(first_step(host_state, MODEL, mesh_config, parallel_config, jax.devices()), reference)


@pytest.mark.parametrize(
    "mesh_config, parallel_config, devices",
    [
        (MeshConfig(fsdp=1), ParallelConfig(), 1),
        (MeshConfig(fsdp=1, context=8), ParallelConfig(context_strategy="ring", block_q=8, block_kv=8), 8),
    ],
    ids=["one-device", "ring8"],
)
def test_eval_loss_by_position_equals_direct_token_losses(host_state, mesh_config, parallel_config, devices):
    """Packed rows: each position bucket's loss sum and token count equal the per-token losses from the model's
    logits, whether the eval step runs on one device or over 8 context devices in the balanced order."""
    buckets = ((0, 4), (4, 16), (16, LENGTH))
    sums, counts = eval_sums(host_state, MODEL, mesh_config, parallel_config, jax.devices()[:devices], buckets)
    batch, losses = packed_batch(MODEL.vocab_size), token_losses(host_state, MODEL)
    for i, (start, end) in enumerate(((0, LENGTH), *buckets)):
        weights = batch["loss_mask"] * ((batch["positions"] >= start) & (batch["positions"] < end))
        assert counts[i] == weights.sum() > 0
        np.testing.assert_allclose(sums[i], (weights * losses).sum(), rtol=1e-5)


@pytest.mark.parametrize(
    "parallel_config, sizes, expected",
    [
        (
            ParallelConfig(context_strategy="ring"),
            {"context": 4},
            Parallelism(strategy="ring", axis="context", layout="dual_chunk", stripe=1, platform="cpu"),
        ),
        (
            ParallelConfig(context_strategy="usp", balance_layout="striped", stripe=4, block_q=64, block_kv=128),
            {"context": 2, "ulysses": 4},
            Parallelism(
                strategy="usp",
                axis=("context", "ulysses"),
                layout="striped",
                stripe=4,
                block_q=64,
                block_kv=128,
                platform="cpu",
            ),
        ),
        (
            ParallelConfig(context_strategy="ring", load_balance=False),
            {"context": 4},
            Parallelism(strategy="ring", layout="contiguous", platform="cpu"),
        ),
        (
            ParallelConfig(context_strategy="usp"),
            {"context": 1, "ulysses": 8},
            Parallelism(strategy="usp", axis=("context", "ulysses"), layout="contiguous", platform="cpu"),
        ),
        (ParallelConfig(), {"context": 1}, Parallelism(platform="cpu")),
    ],
)
def test_parallelism_from_config(parallel_config, sizes, expected):
    assert make_parallelism(parallel_config, sizes) == expected


def test_attention_kernel_by_platform():
    """Resolved for the mesh's devices (platform and CUDA compute capability), not for the compiling machine."""
    hopper, ampere = (types.SimpleNamespace(platform="gpu", compute_capability=c) for c in ("9.0", "8.0"))
    assert make_parallelism(ParallelConfig(), {}).kernel == "blockwise"
    assert make_parallelism(ParallelConfig(), {}, hopper).kernel == "cudnn"
    assert make_parallelism(ParallelConfig(), {}, ampere).kernel == "pallas"
    parallelism = make_parallelism(ParallelConfig(attention_kernel="pallas"), {}, hopper)
    assert (parallelism.kernel, parallelism.platform, parallelism.capability) == ("pallas", "gpu", "9.0")
    with pytest.raises(MeshError, match=r"attention_kernel='pallas': attention kernel 'pallas' compiles for GPU"):
        make_parallelism(ParallelConfig(attention_kernel="pallas"), {})
    assert make_parallelism(ParallelConfig(attention_kernel="cudnn"), {}, hopper).kernel == "cudnn"
    with pytest.raises(MeshError, match=r"attention_kernel='cudnn': .* compute capability 9.0 .*, not cpu"):
        make_parallelism(ParallelConfig(attention_kernel="cudnn"), {})
    with pytest.raises(MeshError, match=r"'cudnn' runs on GPUs .*, not a GPU of compute capability 8.0"):
        make_parallelism(ParallelConfig(attention_kernel="cudnn"), {}, ampere)


def test_ring_grad_dtype_reaches_the_parallelism():
    assert make_parallelism(ParallelConfig(), {}).ring_grad_dtype == "float32"
    assert make_parallelism(ParallelConfig(ring_grad_dtype="compute"), {}).ring_grad_dtype == "compute"


def test_host_reorder_is_undone_by_from_balanced():
    batch = packed_batch(MODEL.vocab_size)
    parallelism = Parallelism(strategy="ring", layout="dual_chunk")
    balanced = to_layout(batch, parallelism, 4)
    assert not np.array_equal(balanced["positions"], batch["positions"])
    for key, value in batch.items():
        assert balanced[key].dtype == value.dtype
        np.testing.assert_array_equal(from_balanced(balanced[key], 4, axis=1, layout="dual_chunk"), value)
    contiguous = to_layout(batch, Parallelism(), 4)
    assert all(contiguous[key] is value for key, value in batch.items())


def test_fill_context_axis_is_checked_before_compiling(tmp_path):
    with pytest.raises(MeshError, match=r"mesh.context=8 splits the sequence but parallel.context_strategy=none"):
        run(
            load_config(
                REPO / "configs" / "tiny.yaml", [*RUN, f"train.output_dir={tmp_path}", "mesh.fsdp=1", "mesh.context=-1"]
            )
        )
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "parallel_config, sizes, words",
    [  # more cases through the config: tests/train/test_config.py
        (ParallelConfig(context_strategy="ring"), {"context": 2, "ulysses": 2}, ["mesh.ulysses=2", "usp", "got ring"]),
        (
            ParallelConfig(context_strategy="ulysses"),
            {"context": 2, "tensor": 4},
            ["model.num_heads=4", "mesh.context=2 x mesh.tensor=4"],
        ),
        (
            ParallelConfig(context_strategy="usp"),
            {"context": 4, "ulysses": 3},
            ["data.seq_len=64", "mesh.context=4 x mesh.ulysses=3"],
        ),
    ],
)
def test_sizes_that_do_not_fit_name_key_and_value(parallel_config, sizes, words):
    with pytest.raises(MeshError) as info:
        check_context(parallel_config, sizes, seq_len=64, num_heads=4)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_fitting_sizes_pass():
    check_context(ParallelConfig(context_strategy="ring", load_balance=False), {"context": 64}, seq_len=64, num_heads=4)
    check_context(
        ParallelConfig(context_strategy="usp"), {"context": 2, "ulysses": 4, "tensor": 1}, seq_len=64, num_heads=4
    )


def test_gpu_environment_unless_set(monkeypatch):
    """The overlap flags and XLA's share of GPU memory, unless the user set them; JAX_PLATFORMS=cpu only where the
    CUDA plugin is installed on a machine without a GPU."""
    monkeypatch.setattr(targets, "plugin_installed", lambda: False)
    environ = {}
    default_environment(environ)
    assert environ == {"XLA_FLAGS": GPU_XLA_FLAGS, "XLA_PYTHON_CLIENT_MEM_FRACTION": GPU_MEMORY_FRACTION}
    assert "latency_hiding_scheduler=true" in GPU_XLA_FLAGS
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".8"}
    default_environment(environ)
    assert environ == {"XLA_FLAGS": "--xla_dump_to=/tmp/x", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".8"}
    monkeypatch.setattr(targets, "plugin_installed", lambda: True)
    for gpu, platforms in ((False, "cpu"), (True, None)):
        monkeypatch.setattr(targets, "gpu_present", lambda gpu=gpu: gpu)
        environ = {}
        default_environment(environ)
        assert environ.get("JAX_PLATFORMS") == platforms
