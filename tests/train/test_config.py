"""Config loading: `base:` inheritance, dotted overrides, the model of an import (`model_from_init`) extended to
model.context_length, and each validation error."""

import dataclasses
import json
import logging
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

import models
from layers import moe, rope
from models import dtypes, remat
from parallel import experts, grouped, kernels, reorder, strategies
from parallel.parallelism import RING_GRAD_DTYPES
from train.config import CHOICES, ConfigError, ModelConfig, RopeScalingConfig, load_config, to_dict
from train.data import files, packing, record
from train.loop import check_run_directory

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# an imported Llama other than configs/models/tiny.yaml, trained at 256 positions with no rope scaling
IMPORTED = ModelConfig(vocab_size=384, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96)


def fake_import(directory: pathlib.Path, model: ModelConfig = IMPORTED, max_positions: int = 256) -> pathlib.Path:
    """What `python -m train.hf import` leaves for a config: model.yaml (max_position_embeddings left 0, as an
    import made before the field), hf_config.json and tokenizer.json (not read here)."""
    directory.mkdir(exist_ok=True)
    write(directory, "model.yaml", yaml.safe_dump({"model": dataclasses.asdict(model)}))
    write(directory, "hf_config.json", json.dumps({"max_position_embeddings": max_positions}))
    write(directory, "tokenizer.json", "{}")
    return directory


def test_defaults_without_file():
    config = load_config(None)
    assert config.model.family == "llama" and config.train.steps > 0


def test_inheritance_and_override_order(tmp_path):
    write(tmp_path, "grand.yaml", "model: {embed_dim: 128, num_layers: 3}\ntrain: {steps: 7}\n")
    write(tmp_path, "parent.yaml", "base: grand.yaml\nmodel: {num_layers: 5}\n")
    child = write(tmp_path, "child.yaml", "base: [parent.yaml]\ntrain: {batch_size: 4}\n")
    config = load_config(child, ["train.steps=11", "optimizer.learning_rate=1e-3", "model.rope_scaling.type=yarn"])
    assert config.model.embed_dim == 128  # from grand
    assert config.model.num_layers == 5  # parent overrides grand
    assert config.train.batch_size == 4 and config.train.steps == 11
    assert config.optimizer.learning_rate == pytest.approx(1e-3)
    assert config.model.rope_scaling.type == "yarn"


def test_parallel_defaults_and_fitting_context_sizes():
    assert load_config(None).parallel.context_strategy == "none" and load_config(None).parallel.load_balance
    config = load_config(CONFIGS / "tiny.yaml", ["mesh.context=4", "mesh.ulysses=2", "parallel.context_strategy=usp"])
    assert (config.mesh.context, config.mesh.ulysses, config.parallel.balance_layout) == (4, 2, "dual_chunk")
    load_config(CONFIGS / "tiny.yaml", ["mesh.fsdp=1", "mesh.context=-1"])  # size known on the mesh: checked there


def test_int_is_accepted_for_float():
    assert isinstance(load_config(None, ["optimizer.learning_rate=1"]).optimizer.learning_rate, float)


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path, tmp_path):
    # The fine-tune recipes name the import they start from; a stand-in with a model.yaml here.
    load_config(path, [f"checkpoint.init_from={fake_import(tmp_path)}"] if path.name.startswith("finetune") else [])


def test_model_from_init_is_the_lowest_layer(tmp_path):
    """The import's architecture < the config's keys < the command line; data.tokenizer is the import's."""
    imported = fake_import(tmp_path / "imported")
    recipe = write(tmp_path, "recipe.yaml", "model_from_init: true\nmodel: {num_layers: 3, mlp_dim: 128}\n")
    config = load_config(recipe, [f"checkpoint.init_from={imported}", "model.mlp_dim=192"])
    assert config.model == dataclasses.replace(IMPORTED, num_layers=3, mlp_dim=192, max_position_embeddings=256)
    assert config.data.tokenizer == str(imported / "tokenizer.json")
    assert load_config(recipe, [f"checkpoint.init_from={imported}", "data.tokenizer=byte"]).data.tokenizer == "byte"
    plain = load_config(recipe, [f"checkpoint.init_from={imported}", "model_from_init=false"])
    assert plain.model == dataclasses.replace(ModelConfig(), num_layers=3, mlp_dim=128)


def test_generic_recipe_takes_the_import_to_128k(tmp_path, caplog):
    imported = fake_import(tmp_path / "imported")
    with caplog.at_level(logging.INFO, logger="train.config.load"):
        config = load_config(CONFIGS / "finetune-128k.yaml", [f"checkpoint.init_from={imported}"])
    scaling = RopeScalingConfig(type="llama3", factor=512.0, original_max_position_embeddings=256)
    assert config.model == dataclasses.replace(
        IMPORTED, rope_scaling=scaling, max_position_embeddings=131072, context_length=131072
    )
    assert (config.data.seq_len, config.mesh.context, config.data.packing) == (131072, 8, "first_fit")
    assert (config.parallel.context_strategy, config.compute.remat_policy) == ("ring", "full")
    assert (
        "model.context_length=131072: rope scaling llama3 factor 512 over 256, derived from the model's none "
        "covering 256 positions" in caplog.messages
    )
    # the command line's rope wins over the import's; one that covers 131072 already is kept
    covered = load_config(
        CONFIGS / "finetune-128k.yaml",
        [
            f"checkpoint.init_from={imported}",
            "model.rope_scaling={type: yarn, factor: 1024.0, original_max_position_embeddings: 256}",
        ],
    )
    assert covered.model.rope_scaling.factor == 1024.0 and covered.model.max_position_embeddings == 262144


def test_a_plan_takes_the_model_from_init_but_not_its_parameters(tmp_path):
    imported = fake_import(tmp_path / "imported")
    config = load_config(CONFIGS / "finetune-128k.yaml", [f"checkpoint.init_from={imported}"], init_params=False)
    assert config.checkpoint.init_from == "" and config.model.embed_dim == IMPORTED.embed_dim


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_gpt_oss_configs_have_expected_fields(name, layers, experts):
    model = load_config(CONFIGS / "models" / f"{name}.yaml").model
    assert (model.num_layers, model.num_experts, model.experts_per_token, model.sliding_window) == (
        layers,
        experts,
        4,
        128,
    )
    assert model.layer_kinds == ("sliding_attention", "full_attention") * (layers // 2)
    assert model.rope_scaling.truncate is False and model.expert_mlp == "clamped_swiglu"


@pytest.mark.parametrize(
    "overrides, words",
    [
        ([], ["model_from_init: true", "checkpoint.init_from, which is ''", "python -m train.hf import"]),
        (["checkpoint.init_from={empty}"], ["has no model.yaml", "an import's directory"]),
        (["checkpoint.init_from={imported}", "model_from_init=maybe"], ["model_from_init='maybe'", "true or false"]),
        (
            ["checkpoint.init_from={imported}", "model.context_length=128", "data.seq_len=64"],
            ["context_length=128", "256 positions", "at least 256"],
        ),
        (["checkpoint.init_from={imported}", "data.seq_len=262144"], ["data.seq_len=262144", "context_length=131072"]),
        (  # a llama3 rope of the command line's: what it covers is not the import's 256
            ["checkpoint.init_from={imported}", "model.rope_scaling.type=llama3"],
            ["llama3 factor 1 over 8192", "set model.max_position_embeddings"],
        ),
    ],
)
def test_model_from_init_errors_name_the_value_and_what_is_allowed(tmp_path, overrides, words):
    paths = {"imported": fake_import(tmp_path / "imported"), "empty": tmp_path}
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "finetune-128k.yaml", [o.format(**paths) for o in overrides])
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_softmax_router_needs_a_frozen_bias():
    v2_lite = CONFIGS / "models" / "deepseek-v2-lite.yaml"
    with pytest.raises(ConfigError, match="router_score='softmax' selects experts without the router bias"):
        load_config(v2_lite, ["model.router_bias_rate=0.001"])
    with pytest.raises(ConfigError, match=re.escape("model.router_score='tanh' is not allowed")):
        load_config(v2_lite, ["model.router_score=tanh"])
    with pytest.raises(ConfigError, match=re.escape("parallel.expert_capacity_factor=0.0 must be > 0")):
        load_config(v2_lite, ["parallel.expert_capacity_factor=0"])


def test_load_balancing_loss_scope_is_checked():
    v2_lite = CONFIGS / "models" / "deepseek-v2-lite.yaml"
    allowed = "model.router_aux_loss_scope='row' is not allowed; choose one of pooled, layer, sequence"
    with pytest.raises(ConfigError, match=re.escape(allowed)):
        load_config(v2_lite, ["model.router_aux_loss_scope=row"])
    sigmoid = ["model.router_score=sigmoid", "model.router_bias_rate=0.001"]
    with pytest.raises(
        ConfigError, match=re.escape("set model.router_aux_loss_scope=sequence or model.router_aux_loss_coef=0")
    ):
        load_config(v2_lite, [*sigmoid, "model.router_aux_loss_scope=layer"])
    assert load_config(v2_lite, sigmoid).model.router_aux_loss_scope == "sequence"  # DeepSeek-V3's sequence-wise


def test_llama_configs_have_expected_fields():
    config = load_config(CONFIGS / "models" / "llama3.1-70b.yaml")
    assert (config.model.embed_dim, config.model.num_layers, config.model.num_kv_heads) == (8192, 80, 8)
    assert config.model.rope_scaling.type == "llama3" and config.model.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.embed=3"], ["model.embed", "allowed keys", "embed_dim"]),
        (["trian.steps=3"], ["trian", "allowed keys", "train"]),
        (["train.steps=ten"], ["train.steps", "'ten'", "int"]),
        (["train.steps=1.5"], ["train.steps", "1.5", "int"]),
        (["train.progress_bar=3"], ["train.progress_bar", "bool"]),
        (["train.steps=0"], ["train.steps", "> 0"]),
        (["model.num_heads=6", "model.num_kv_heads=4"], ["model.num_heads=6", "num_kv_heads=4", "divisible"]),
        (["data.packing=greedy"], ["data.packing", "'greedy'", "concat", "first_fit"]),
        (["model.rope_scaling.type=ntk"], ["model.rope_scaling.type", "llama3", "yarn"]),
        (["mesh.context=3", "parallel.context_strategy=ring"], ["data.seq_len=256", "mesh.context=3"]),
        (["parallel.context_strategy=ringg"], ["parallel.context_strategy", "'ringg'", "all_gather", "usp"]),
        (["parallel.balance_layout=zigzag"], ["parallel.balance_layout", "'zigzag'", "dual_chunk", "striped"]),
        (["parallel.stripe=0"], ["parallel.stripe=0", "> 0"]),
        (["parallel.block_kv=0"], ["parallel.block_kv=0", "> 0"]),
        (["parallel.load_balance=maybe"], ["parallel.load_balance", "bool"]),
        (["parallel.expert_dispatch=dense"], ["parallel.expert_dispatch", "'dense'", "capacity", "ragged", "auto"]),
        (["parallel.expert_chunk_size=-1"], ["parallel.expert_chunk_size=-1", ">= 0"]),
        (["parallel.ring_grad_dtype=bfloat16"], ["parallel.ring_grad_dtype", "'bfloat16'", "float32", "compute"]),
        (["mesh.ulysses=0"], ["mesh.ulysses=0", ">= 1 or -1"]),
        (["mesh.context=2"], ["mesh.context=2", "parallel.context_strategy=none", "ring"]),
        (["mesh.context=2", "mesh.ulysses=2", "parallel.context_strategy=ring"], ["mesh.ulysses=2", "usp"]),
        (["mesh.context=8", "parallel.context_strategy=ulysses"], ["model.num_heads=4", "mesh.context=8", "ulysses"]),
        (["mesh.ulysses=8", "parallel.context_strategy=usp"], ["model.num_heads=4", "mesh.ulysses=8", "usp"]),
        (
            ["mesh.context=2", "mesh.ulysses=2", "parallel.context_strategy=usp", "data.seq_len=6"],
            ["data.seq_len=6", "mesh.context=2 x mesh.ulysses=2"],
        ),
        (
            ["mesh.context=8", "parallel.context_strategy=ring", "data.seq_len=8"],
            ["data.seq_len=8", "2 x mesh.context=8", "dual_chunk", "parallel.load_balance=false"],
        ),
        (
            [
                "mesh.context=4",
                "parallel.context_strategy=ring",
                "parallel.balance_layout=striped",
                "parallel.stripe=128",
            ],
            ["data.seq_len=256", "mesh.context=4 x parallel.stripe=128", "striped"],
        ),
        (["mesh.data=-1"], ["only one mesh axis", "mesh.data", "mesh.fsdp"]),
        (["train.batch_size=6", "train.grad_accum_steps=4"], ["train.batch_size=6", "grad_accum_steps=4"]),
        (["mesh.tensor=3", "model.num_heads=4"], ["model.num_heads=4", "mesh.tensor=3"]),
        (["checkpoint.init_from=/does/not/exist"], ["checkpoint.init_from", "/does/not/exist", "does not exist"]),
        (["train.steps"], ["train.steps", "section.key=value"]),
        (["data.eval_fraction=0"], ["data.eval_fraction=0", "train.eval_batches=4", "must be 0"]),
        (["model.expert_mlp=geglu"], ["model.expert_mlp", "'geglu'", "swiglu", "clamped_swiglu"]),
        (
            ["model.expert_mlp=clamped_swiglu", "model.swiglu_limit=0"],
            ["model.swiglu_limit=0", "> 0", "clamped_swiglu"],
        ),
        (["model.sliding_window=-1"], ["model.sliding_window=-1", ">= 0"]),
        (["model.layer_types=[full_attention]"], ["model.layer_types has 1 entries", "model.num_layers=4"]),
        (["model.num_layers=2", "model.layer_types=[full_attention, local]"], ["model.layer_types", "'local'"]),
        (
            ["model.num_layers=2", "model.layer_types=[full_attention, sliding_attention]"],
            ["sliding_attention", "model.sliding_window=0"],
        ),
    ],
)
def test_validation_errors_name_key_value_and_allowed(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "tiny.yaml", overrides)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_base_cycle_and_missing_file(tmp_path):
    write(tmp_path, "a.yaml", "base: b.yaml\n")
    write(tmp_path, "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_cli_reports_a_bad_config_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "train", str(CONFIGS / "tiny.yaml"), "train.stpes=3"],
        cwd=CONFIGS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "error: unknown key 'train.stpes'" in result.stderr and "Traceback" not in result.stderr


def test_every_choice_comes_from_the_registry_that_implements_it():
    registries = {
        "model.family": models.REGISTRY,
        "model.rope_scaling.type": rope.SCALINGS,
        "model.param_dtype": dtypes.PARAM_DTYPES,
        "model.router_score": moe.ROUTER_SCORES,
        "model.router_aux_loss_scope": moe.AUX_LOSS_SCOPES,
        "model.expert_mlp": moe.EXPERT_MLPS,
        "compute.dtype": ("auto", *dtypes.DTYPES),
        "optimizer.mu_dtype": ("param", *dtypes.PARAM_DTYPES),
        "compute.remat_policy": remat.POLICIES,
        "data.format": ("auto", "text", *files.READERS),
        "data.packing": packing.PACKINGS,
        "data.on_change": record.ON_CHANGE,
        "parallel.context_strategy": strategies.STRATEGIES,
        "parallel.balance_layout": [layout for layout in reorder.LAYOUTS if layout != "contiguous"],
        "parallel.expert_dispatch": ("auto", *experts.DISPATCHES),
        "parallel.grouped_matmul": ("auto", *grouped.GROUPED_MATMULS),
        "parallel.attention_kernel": kernels.KERNELS,
        "parallel.ring_grad_dtype": RING_GRAD_DTYPES,
    }
    assert CHOICES.keys() == registries.keys()
    for key, registry in registries.items():
        assert list(CHOICES[key]) == list(registry), key
    for name in rope.SCALINGS:  # each scaling type is one the rope layer computes
        rope.inverse_frequencies(8, 1e4, rope.RopeScalingConfig(type=name, factor=2.0))


def test_a_retired_key_is_ignored_with_a_warning(tmp_path):
    """A run directory's config.yaml from before parallel.fused_attention was folded into the kernel choice."""
    path = write(tmp_path, "old.yaml", "parallel:\n  fused_attention: true\n  context_strategy: none\n")
    with pytest.warns(UserWarning, match="'parallel.fused_attention' is ignored: .*attention_kernel=cudnn"):
        config = load_config(path)
    assert config.parallel.attention_kernel == "auto"


@pytest.mark.parametrize(
    "override, key, value",
    [
        ("data.file_pattern=*.txt", "file_pattern", "*.txt"),  # a YAML alias
        ("data.text_field=123", "text_field", "123"),
        ("data.text_field=yes", "text_field", "yes"),
        ("data.text_field='quoted'", "text_field", "quoted"),
        ("data.text_field=", "text_field", ""),
    ],
)
def test_a_string_key_takes_the_override_as_written(override, key, value):
    """What YAML would read as an alias, a number or a bool stays text for a key whose type is str (docs/data.md's
    `data.file_pattern='*.txt'` reaches the program as *.txt); other keys are still read as YAML."""
    config = load_config(None, [override])
    assert getattr(config.data, key) == value
    assert load_config(None, ["data.seq_len=512"]).data.seq_len == 512
    with pytest.raises(ConfigError, match=r"data\.seq_len='many' has type str; expected int"):
        load_config(None, ["data.seq_len=many"])


def test_a_run_directory_from_before_a_key_was_added_resumes(tmp_path):
    """A run's config.yaml written before model.context_length existed lacks it: the run used the default, so
    resuming is not refused; a key it holds with another value still is."""
    config = load_config(CONFIGS / "tiny.yaml")
    saved = to_dict(config)
    del saved["model"]["context_length"], saved["model"]["max_position_embeddings"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    check_run_directory(tmp_path, config)
    with pytest.raises(ConfigError, match=re.escape("model.embed_dim=256, now 128")):
        check_run_directory(tmp_path, load_config(CONFIGS / "tiny.yaml", ["model.embed_dim=128"]))


def test_data_settings_may_change_on_a_resume_that_restarts_the_data_position(tmp_path):
    """data.on_change=restart starts the data position fresh, so the data section may change with it; without it the
    refusal names that way on; data.on_change itself may always change."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(CONFIGS / "tiny.yaml"))))
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"data\.seq_len=256, now 128: .* with data\.on_change=restart, which starts"):
        check_run_directory(tmp_path, load_config(CONFIGS / "tiny.yaml", ["data.seq_len=128"]))
    check_run_directory(tmp_path, load_config(CONFIGS / "tiny.yaml", ["data.seq_len=128", "data.on_change=restart"]))
    check_run_directory(tmp_path, load_config(CONFIGS / "tiny.yaml", ["data.on_change=grown"]))
    with pytest.raises(ConfigError, match=r"model\.embed_dim=256, now 128: a resumed run keeps"):
        check_run_directory(
            tmp_path, load_config(CONFIGS / "tiny.yaml", ["model.embed_dim=128", "data.on_change=restart"])
        )


def test_a_run_directory_with_no_checkpoint_advises_starting_afresh(tmp_path):
    """A run that stopped before its first checkpoint has nothing to seed another from: the advice is not init_from."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(CONFIGS / "tiny.yaml"))))
    with pytest.raises(ConfigError, match=r"data\.seq_len=256, now 128, and no checkpoint to go on from: start afresh"):
        check_run_directory(tmp_path, load_config(CONFIGS / "tiny.yaml", ["data.seq_len=128"]))
