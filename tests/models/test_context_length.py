"""model.context_length: the rope scaling a model gets to cover a longer context, derived from its own (llama3 or
YaRN factor = target / the original context), kept when the model covers it, refused when it is shorter than the
context the model was trained at or what the model covers is not stated."""

import dataclasses
import pathlib

import numpy as np
import pytest

from layers.rope import RopeScalingConfig, inverse_frequencies, stretch_scaling
from models.config import ConfigError, ModelConfig, covered_context, extend_context
from models.hf.families import for_export
from train.config import load_config

MODELS = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs" / "models").glob("*.yaml"))

LLAMA31 = RopeScalingConfig(type="llama3", factor=8.0, original_max_position_embeddings=8192)
V3_YARN = RopeScalingConfig(type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale_all_dim=1.0)


def model(family="llama", **fields) -> ModelConfig:
    return dataclasses.replace(ModelConfig(family=family), **fields)


def test_unscaled_llama_gets_llama3_over_its_trained_context():
    extended, line = extend_context(model(max_position_embeddings=4096, context_length=131072))
    assert extended.rope_scaling == RopeScalingConfig(type="llama3", factor=32.0, original_max_position_embeddings=4096)
    assert extended.max_position_embeddings == 131072 and extended.context_length == 131072
    assert line == (
        "model.context_length=131072: rope scaling llama3 factor 32 over 4096, derived from the model's none "
        "covering 4096 positions"
    )


def test_unscaled_deepseek_gets_yarn():
    extended, _ = extend_context(model("deepseek", max_position_embeddings=2048, context_length=32768))
    assert extended.rope_scaling == RopeScalingConfig(type="yarn", factor=16.0, original_max_position_embeddings=2048)


def test_unscaled_gemma3_gets_linear_on_its_full_layers():
    extended, _ = extend_context(model("gemma3", max_position_embeddings=32768, context_length=131072))
    assert extended.rope_scaling == RopeScalingConfig(type="linear", factor=4.0, original_max_position_embeddings=32768)


def test_llama3_stretches_by_the_ratio_to_what_the_model_covers():
    """Llama 3.1 covers 131072 with factor 8 (its config.json's max_position_embeddings, not 8 x 8192)."""
    llama31 = model(rope_scaling=LLAMA31, max_position_embeddings=131072)
    extended, _ = extend_context(dataclasses.replace(llama31, context_length=524288))
    assert extended.rope_scaling == dataclasses.replace(LLAMA31, factor=32.0)
    assert extended.max_position_embeddings == 524288


def test_yarn_factor_is_target_over_original_with_its_other_fields_kept():
    """A yarn rope that states no max_position_embeddings covers factor x original (40 x 4096 = 163840)."""
    v3 = model("deepseek", rope_scaling=V3_YARN, context_length=262144)
    assert covered_context(v3) == 163840
    extended, line = extend_context(v3)
    assert extended.rope_scaling == dataclasses.replace(V3_YARN, factor=64.0)
    assert "yarn factor 64 over 4096, derived from the model's yarn factor 40 over 4096" in line


@pytest.mark.parametrize("target", [8192, 65536, 131072])
def test_a_model_that_covers_the_target_keeps_its_rope(target):
    llama31 = model(rope_scaling=LLAMA31, max_position_embeddings=131072, context_length=target)
    kept, line = extend_context(llama31)
    assert kept == llama31
    assert line == f"model.context_length={target}: the model's rope (llama3 factor 8 over 8192) covers 131072; kept"


def test_a_yarn_model_that_covers_the_target_records_what_it_covers():
    kept, _ = extend_context(model("deepseek", rope_scaling=V3_YARN, context_length=131072))
    assert kept.rope_scaling == V3_YARN and kept.max_position_embeddings == 163840


def test_no_context_length_changes_nothing():
    assert extend_context(model(max_position_embeddings=4096)) == (model(max_position_embeddings=4096), "")


def test_extending_twice_changes_nothing_more():
    """A resolved config (a run's config.yaml) read again keeps its derived rope."""
    once, _ = extend_context(model(max_position_embeddings=4096, context_length=131072))
    assert extend_context(once)[0] == once


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(max_position_embeddings=4096, context_length=2048), ["context_length=2048", "4096 positions", "0"]),
        (dict(rope_scaling=LLAMA31, max_position_embeddings=131072, context_length=4096), ["4096", "8192"]),
        (dict(context_length=131072), ["context_length=131072", "model.max_position_embeddings"]),
        (dict(rope_scaling=LLAMA31, context_length=131072), ["llama3 factor 8 over 8192", "max_position_embeddings"]),
    ],
)
def test_too_short_or_unknown_context_is_refused(fields, words):
    with pytest.raises(ConfigError) as info:
        extend_context(model(**fields))
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_stretched_low_frequencies_turn_at_the_target_as_the_original_did_at_its_length():
    """The lowest frequency's angle at the new length equals the unscaled one's at the trained length, for both
    types; the highest frequency is not changed."""
    plain, _ = inverse_frequencies(64, 10000.0)
    for kind in ("llama3", "yarn"):
        stretched, _ = inverse_frequencies(64, 10000.0, stretch_scaling(RopeScalingConfig(), 256, 4096, kind))
        np.testing.assert_allclose(stretched[-1] * 4096, plain[-1] * 256, rtol=1e-5)
        assert stretched[0] == plain[0]
    with pytest.raises(ValueError, match="llama3, yarn, linear, not 'none'"):
        stretch_scaling(RopeScalingConfig(), 256, 4096, "none")


@pytest.mark.parametrize("path", MODELS, ids=[path.stem for path in MODELS])
def test_every_shipped_model_stretched_past_its_context_exports(path):
    """What a long-context fine-tune derives, every family's Hugging Face config can hold: the run can leave."""
    m = load_config(path).model
    covered = covered_context(m) or 131072
    stretched, _ = extend_context(dataclasses.replace(m, max_position_embeddings=covered, context_length=2 * covered))
    assert stretched.rope_scaling.type != "none"
    hf = for_export(stretched).config_to_hf(stretched)
    assert (hf.get("rope_parameters") or hf.get("rope_scaling"))["factor"] >= 2.0
