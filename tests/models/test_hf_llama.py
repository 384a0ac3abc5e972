"""Hugging Face Llama <-> longctx: logits equal transformers' on tiny random models (fp32, max abs diff <= 1e-4),
in both directions, through one file or index + shards; the command line's import seeds a training run and its
export of that run's checkpoint gives back the imported tensors."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from models.hf import load_pretrained, save_pretrained
from models.hf.convert import abstract_model
from tests.models.hf_reference import hf_logits, hf_tensors, tokens
from train import hf as cli
from train.checkpoints.checkpoint import restore_model_params
from train.config import load_config
from train.loop import run

REPO = pathlib.Path(__file__).resolve().parents[2]
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES = {  # name -> (LlamaConfig fields, max_shard_size of transformers' save_pretrained)
    "gqa-llama3-untied-sharded": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters=dict(LLAMA3, rope_theta=500000.0),
            tie_word_embeddings=False,
        ),
        "30KB",
    ),
    "mha-default-tied-single": (dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True), "10MB"),
}


def hf_llama(path, *, vocab_size=128, max_shard_size="10MB", **fields) -> LlamaForCausalLM:
    """A 2-layer random LlamaForCausalLM saved to `path`; weights of std 0.1 and norm scales 1 + N(0, 0.2) so
    a wrong mapping shows in the logits."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        initializer_range=0.1,
        rms_norm_eps=1e-5,
        **fields,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return model


@pytest.mark.parametrize("case", CASES)
def test_load_pretrained_matches_transformers(tmp_path, case):
    fields, shard_size = CASES[case]
    reference = hf_llama(tmp_path, max_shard_size=shard_size, **fields)
    assert (tmp_path / "model.safetensors.index.json").exists() == case.endswith("sharded")
    model = load_pretrained(tmp_path)
    assert model.config.tie_embeddings == fields["tie_word_embeddings"]
    ids = tokens()
    expected = hf_logits(reference, ids)
    assert np.abs(expected).max() > 1.0  # large enough for a mapping error to show
    np.testing.assert_allclose(np.asarray(model(ids)), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_save_pretrained_loads_in_transformers(tmp_path, tied):
    source = hf_llama(
        tmp_path / "source",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters=dict(LLAMA3, rope_theta=10000.0),
        tie_word_embeddings=tied,
    )
    model = load_pretrained(tmp_path / "source")
    names = save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    assert len(names) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert exported.config.to_dict()["rope_parameters"] == source.config.to_dict()["rope_parameters"]
    ids = tokens()
    logits = hf_logits(exported, ids)
    np.testing.assert_allclose(logits, np.asarray(model(ids)), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(logits, hf_logits(source, ids))


def test_older_rope_config_keys_read_the_same(tmp_path):
    """config.json files written before `rope_parameters` carry rope_theta and rope_scaling (with `type` in some)."""
    hf_llama(tmp_path, num_attention_heads=4, rope_parameters=dict(LLAMA3, rope_theta=500000.0))
    expected = load_pretrained(tmp_path).config
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    legacy = dict(config, rope_theta=rope.pop("rope_theta"), rope_scaling=dict(rope, type=rope.pop("rope_type")))
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    assert load_pretrained(tmp_path).config == expected


def test_bfloat16_checkpoint_round_trips_bit_for_bit(tmp_path):
    source = hf_llama(tmp_path / "fp32", num_attention_heads=4, tie_word_embeddings=False).to(torch.bfloat16)
    source.save_pretrained(tmp_path / "bf16")
    model = load_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    save_pretrained(model, tmp_path / "out")
    original = load_torch(tmp_path / "bf16" / "model.safetensors")
    exported = load_torch(tmp_path / "out" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for name in original:
        assert torch.equal(exported[name], original[name]), name
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.bfloat16


def test_cli_import_seeds_training_and_export_of_its_checkpoint_round_trips(tmp_path):
    """A learning rate of 1e-30 moves no float32 weight, so the step-1 checkpoint holds the imported weights; the
    export of the run carries the import's token ids, positions and tokenizer."""
    hf_llama(
        tmp_path / "hf",
        vocab_size=384,
        max_shard_size="30KB",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        bos_token_id=7,
        eos_token_id=9,
        max_position_embeddings=512,
    )
    (tmp_path / "hf" / "tokenizer.json").write_text('{"kept": true}')  # copied along, not read
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    loaded = load_pretrained(tmp_path / "hf")
    _, abstract = abstract_model(loaded.config)
    restored = flatten_dict(nnx.to_pure_dict(restore_model_params(tmp_path / "imported", abstract)))
    for key, value in flatten_dict(nnx.to_pure_dict(nnx.state(loaded))).items():
        np.testing.assert_array_equal(restored[key], value, err_msg=str(key))

    (tmp_path / "run.yaml").write_text(
        f"base: [{REPO / 'configs' / 'tiny.yaml'}, {tmp_path / 'imported' / 'model.yaml'}]\n"
    )
    config = load_config(
        tmp_path / "run.yaml",
        [
            f"checkpoint.init_from={tmp_path / 'imported'}",
            f"train.output_dir={tmp_path / 'run'}",
            "train.steps=1",
            "optimizer.learning_rate=1e-30",
            "data.seq_len=32",
            "data.max_documents=20",
            "train.batch_size=8",
            "train.progress_bar=false",
            "train.sample_tokens=0",
            "train.eval_batches=0",
            "train.log_every_steps=1",
            "checkpoint.async_save=false",
            "train.peak_tflops_per_device=1",
        ],
    )  # the MFU's peak given: no CPU matmul benchmark at start
    assert config.model == loaded.config  # model.yaml holds the whole architecture
    assert np.isfinite(run(config)["loss"])

    assert (
        cli.main(
            [
                "export",
                str(tmp_path / "run" / "checkpoints"),
                str(tmp_path / "exported"),
                "--max-shard-bytes",
                "50000",
            ]
        )
        == 0
    )
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "exported")
    assert sorted(original) == sorted(exported)
    for name in original:
        np.testing.assert_array_equal(exported[name], original[name], err_msg=name)
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    # the import's config.json and tokenizer, kept in the run directory
    assert (written["bos_token_id"], written["eos_token_id"], written["max_position_embeddings"]) == (7, 9, 512)
    assert (tmp_path / "exported" / "tokenizer.json").read_text() == '{"kept": true}'


def test_unsupported_architecture_and_rope_type_are_named(tmp_path):
    hf_llama(tmp_path, num_attention_heads=4)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["FalconForCausalLM"])))
    with pytest.raises(
        ValueError, match="'FalconForCausalLM' is not supported; supported architectures: LlamaForCausalLM"
    ):
        load_pretrained(tmp_path)
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported; supported rope types: default, llama3"):
        load_pretrained(tmp_path)
    assert cli.main(["import", str(tmp_path), str(tmp_path / "out")]) == 2


def test_tensors_the_model_would_drop_are_refused_unless_allowed(tmp_path, capsys):
    """A Qwen2-style checkpoint (attention biases) whose config.json says Llama: importing would drop the biases,
    so it is refused with their names; --allow-unused imports without them. A tied model's saved lm_head copy and
    a rotary buffer are harmless and import with a warning."""
    hf_llama(tmp_path / "hf", num_attention_heads=4, tie_word_embeddings=True)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    extra = {f"model.layers.{i}.self_attn.{p}_proj.bias": np.ones(64, np.float32) for i in (0, 1) for p in "qkv"}
    harmless = {"lm_head.weight": weights["model.embed_tokens.weight"], "model.rotary_emb.inv_freq": np.ones(8)}
    save_file({**weights, **extra}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"6 tensors are not used by the llama model .*model\.layers\.0\.self_attn"):
        load_pretrained(tmp_path / "hf")
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    assert "--allow-unused" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "out"), "--allow-unused"]) == 0
    save_file({**weights, **harmless}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model = load_pretrained(tmp_path / "hf")
    ids = tokens()
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids))),
        hf_logits(hf_llama(tmp_path / "again", num_attention_heads=4, tie_word_embeddings=True), ids),
        atol=1e-4,
    )
