"""The numbers a run logs: model FLOPs from a batch's documents, MFU at most 1, no rate for the step that compiles,
the learning rate each step used, save time left out of step times, and no compilation after the first step (seeded
or not, with ring attention over the context axis too)."""

import dataclasses
import json
import logging
import pathlib
import time
from unittest import mock

import jax
import numpy as np
import pytest

from tests.train import tiny_run
from tests.train.tiny_run import records
from train.checkpoints.checkpoint import Checkpointer
from train.config import load_config
from train.data.pipeline import build_dataset
from train.data.tokenizer import make_tokenizer
from train.loop import run
from train.metrics import MetricsLogger
from train.optimizer import learning_rate_schedule
from train.planning.flops import Peak, batch_flops, document_lengths, flops_per_token, matmul_params

STEPS = 5
SAVE_SECONDS = 1.0  # each checkpoint save is slowed by this much: none of it may show in a step_time
RATES = {"tokens_per_sec", "mfu", "step_time"}
PEAK_TFLOPS = 1000.0
PACKED = [
    *tiny_run.SMALL,
    "data.format=jsonl",
    "data.packing=first_fit",
    "data.seq_len=256",
    f"train.peak_tflops_per_device={PEAK_TFLOPS}",  # stated: a measured one differs between test processes
    f"train.steps={STEPS}",
    "train.sample_tokens=0",
    "train.eval_batches=0",
    "optimizer.warmup_steps=3",
    "optimizer.learning_rate=1e-3",
    "checkpoint.every_steps=2",
]
# the 128K recipe's parallel shape on the same small model: ring attention over 8 devices, load-balanced, full remat
RING = [
    "mesh.fsdp=1",
    "mesh.context=8",
    "parallel.context_strategy=ring",
    "parallel.load_balance=true",
    "parallel.block_q=16",
    "parallel.block_kv=16",
    "compute.remat_policy=full",
    "train.steps=3",
]


def write_corpus(path: pathlib.Path) -> pathlib.Path:
    """Documents of 12 to 198 bytes: several to a 256-token row, with padding."""
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": "x = 1\n" * int(n)}) for n in rng.integers(2, 34, 300)]
    path.write_text("\n".join(lines) + "\n")
    return path


def logged_run(output: pathlib.Path, overrides: list[str]) -> None:
    """Trains with every checkpoint save slowed by SAVE_SECONDS; writes events.json: ["compile", name] for each
    program compiled, ["log", step] for each logged step and ["save", step] / ["saved", step] around each save, in
    order."""
    events = []

    class Compiles(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling "):
                events.append(["compile", str(record.args[0])])

    def log(self, step, values):
        events.append(["log", step])
        return original_log(self, step, values)

    def slow_save(self, step, *args, **kwargs):
        events.append(["save", step])
        time.sleep(SAVE_SECONDS)
        original_save(self, step, *args, **kwargs)
        events.append(["saved", step])

    original_log, original_save = MetricsLogger.log, Checkpointer.save
    handler, jax_logger = Compiles(), logging.getLogger("jax")
    jax_logger.addHandler(handler)
    try:
        with (
            jax.log_compiles(),
            mock.patch.object(MetricsLogger, "log", log),
            mock.patch.object(Checkpointer, "save", slow_save),
        ):
            run(load_config(tiny_run.TINY, [*overrides, f"train.output_dir={output}"]))
    finally:
        jax_logger.removeHandler(handler)
    (output / "events.json").write_text(json.dumps(events))


def packed_config(corpus: pathlib.Path, *overrides: str):
    return load_config(tiny_run.TINY, [*PACKED, f"data.source={corpus}", *overrides])


@pytest.fixture(scope="module")
def packed(shared_run):
    """A run on rows packed from short documents, then one seeded from its checkpoint with ring attention."""

    def make(directory):
        corpus = write_corpus(directory / "corpus.jsonl")
        logged_run(directory / "run", [*PACKED, f"data.source={corpus}"])
        seeded = [*PACKED, f"data.source={corpus}", f"checkpoint.init_from={directory / 'run' / 'checkpoints'}"]
        logged_run(directory / "ring", [*seeded, *RING])

    return shared_run("test_metrics-packed", make)


def compiles_between_steps(output: pathlib.Path) -> tuple[list[str], list[str]]:
    """(what compiled up to step 1's log, what compiled after it outside checkpoint saves)."""
    events = json.loads((output / "events.json").read_text())
    first_log = events.index(["log", 1])
    saving, later = False, []
    for kind, value in events[first_log:]:
        saving = kind == "save" or (saving and kind != "saved")
        if kind == "compile" and not saving:
            later.append(value)
    return [value for kind, value in events[:first_log] if kind == "compile"], later


@pytest.mark.parametrize("run_name", ["run", "ring"])
def test_nothing_compiles_after_the_first_step(packed, run_name):
    """The train step compiles once, at step 1; nothing else compiles in later steps (the first checkpoint save
    compiles what it needs, outside any step's time)."""
    first, later = compiles_between_steps(packed / run_name)
    assert first.count("jit(step)") == 1 and later == []


def test_the_first_step_logs_no_rate_and_the_others_do(packed):
    lines = records(packed / "run")
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert not RATES & set(lines[0]) and "learning_rate" in lines[0]
    assert all(set(r) >= RATES and r["tokens_per_sec"] > 0 for r in lines[1:])


def test_each_step_logs_the_learning_rate_it_used_and_the_first_is_above_zero(packed):
    config = packed_config(packed / "corpus.jsonl")
    schedule = learning_rate_schedule(config.optimizer, config.train.steps)
    lines = records(packed / "run")
    assert lines[0]["learning_rate"] == pytest.approx(1e-3 / 3)
    for line in lines:
        assert line["learning_rate"] == pytest.approx(float(schedule(line["step"] - 1)))


def test_mfu_counts_each_batch_s_documents_and_stays_at_most_one(packed):
    """mfu x step_time x peak = the model FLOPs of the step's batch: attention within its documents."""
    config = packed_config(packed / "corpus.jsonl")
    data = iter(build_dataset(config.data, make_tokenizer(config.data.tokenizer), batch_size=config.train.batch_size))
    segments = [next(data)["segment_ids"] for _ in range(STEPS)]  # the batches of steps 1 ... STEPS
    data.close()
    assert max(int(s.max()) for s in segments) > 3  # rows of several documents
    peak = PEAK_TFLOPS * 1e12 * jax.device_count()
    for line in records(packed / "run")[1:]:
        assert 0 < line["mfu"] <= 1
        flops = batch_flops(config.model, segments[line["step"] - 1])
        assert line["mfu"] * line["step_time"] * peak == pytest.approx(flops, rel=1e-6)


def test_a_checkpoint_save_is_no_step_s_time(packed):
    """Saves after steps 2 and 4 each take SAVE_SECONDS more: steps 3 and 5 do not show it."""
    for line in records(packed / "run")[1:]:
        assert line["step_time"] < 0.9 * SAVE_SECONDS, line  # a step counted with the save would take longer


def test_batch_flops_of_equal_documents_match_the_per_token_count():
    config = load_config(tiny_run.TINY, tiny_run.MODEL).model
    rows = np.repeat(np.arange(1, 5), 64)[None].repeat(2, 0)  # 2 rows of 4 documents of 64 tokens
    assert batch_flops(config, rows) == pytest.approx(rows.size * flops_per_token(config, 64))
    padded = np.where(np.arange(256) < 192, rows, 0)  # the last document replaced by padding
    attention = batch_flops(config, padded) - 6 * matmul_params(config) * padded.size
    assert attention == pytest.approx(0.75 * (batch_flops(config, rows) - 6 * matmul_params(config) * rows.size))


def test_a_sliding_window_caps_the_attention_flops():
    """A window of 16 in every layer: a 64-token document counts 64 * 16 - 16^2 / 2 pairs, not 64^2 / 2 (as squares,
    2 * 64 * 16 - 16^2 of 64^2); documents within the window count in full."""
    config = load_config(tiny_run.TINY, tiny_run.MODEL).model
    windowed = dataclasses.replace(config, sliding_window=16)
    rows = np.repeat(np.arange(1, 5), 64)[None].repeat(2, 0)
    matmuls = 6 * matmul_params(config) * rows.size
    ratio = (batch_flops(windowed, rows) - matmuls) / (batch_flops(config, rows) - matmuls)
    assert ratio == pytest.approx((2 * 64 * 16 - 16**2) / 64**2)
    short = np.repeat(np.arange(1, 17), 16)[None].repeat(2, 0)
    assert batch_flops(windowed, short) == batch_flops(config, short)


def test_sparse_attention_counts_its_keys_and_the_indexer():
    """index_topk 16: a 64-token document attends 64 * 16 - 16^2 / 2 pairs (as a window of 16 would) and the
    indexer scores all 64^2 / 2 pairs forward (2 FLOPs x index heads x index head dim each) after its projections,
    and its loss's backward over the selected pairs (twice their forward) when it trains; the warm-up runs dense
    attention and the model's matmuls forward only and the indexer's scores of every pair forward and backward."""
    config = load_config(tiny_run.REPO / "configs/deepseek-v3.2-tiny.yaml").model
    dense = dataclasses.replace(config, index_topk=0)
    rows = np.repeat(np.arange(1, 5), 64)[None].repeat(2, 0)
    indexer = config.q_lora_rank * 8 * 32 + config.embed_dim * (32 + 8)
    matmuls = 6 * matmul_params(config) * rows.size
    dense_attention = batch_flops(dense, rows) - matmuls
    selected = (2 * 64 * 16 - 16**2) / 64**2
    scores = config.num_layers * 8 * 32 * 64**2 * 8  # 8 documents
    ways = {
        "sparse": matmuls + 4 * config.num_layers * indexer * rows.size + dense_attention * selected
        + scores * (1 + 2 * selected),
        "frozen": matmuls + 2 * config.num_layers * indexer * rows.size + dense_attention * selected + scores,
        "warmup": matmuls / 3 + 4 * config.num_layers * indexer * rows.size + dense_attention / 3 + 3 * scores,
    }  # fmt: skip
    for way, expected in ways.items():
        sparse = dataclasses.replace(config, index_topk=16, indexer_training=way)
        assert batch_flops(sparse, rows) == pytest.approx(expected), way
        assert flops_per_token(sparse, 64) == pytest.approx(batch_flops(sparse, rows) / rows.size), way


def test_document_lengths_count_each_id_of_each_row_without_padding():
    lengths = document_lengths(np.array([[1, 1, 1, 2, 0, 0], [1, 2, 2, 3, 3, 3]]))
    np.testing.assert_array_equal(lengths, [[3, 1, 0], [1, 2, 3]])


def test_a_step_faster_than_the_peak_raises_it():
    messages = []
    peak = Peak(100.0)
    assert peak.mfu(50.0, messages.append) == 0.5 and not messages
    assert peak.mfu(150.0, messages.append) == 1.0 and peak.flops == 150.0
    assert len(messages) == 1 and "train.peak_tflops_per_device" in messages[0]
