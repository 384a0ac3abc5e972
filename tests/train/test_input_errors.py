"""Bad input stops with a typed one-paragraph error naming the file or key, never a traceback: YAML syntax errors
(file, line, column), a key a YAML file gives twice (file, key, both lines), a `base:` that is not a path, a
data.tokenizer that is not a tokenizer.json, a mesh.tensor (also resolved from -1) that does not divide the heads, a
truncated .safetensors import, a Parquet file without the text column."""

import pathlib
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

import models
from models.hf import save_pretrained
from models.hf.reader import SafetensorsError, SafetensorsFile
from parallel.mesh import MeshError
from parallel.settings import check_tensor
from tests.train.test_config import fake_import
from train import hf
from train.__main__ import main
from train.config import ConfigError, DataConfig, ModelConfig, load_config
from train.data.sources import open_source
from train.data.tokenizer import make_tokenizer
from train.errors import DataError

TINY = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    return path


def error_line(capsys) -> str:
    """The one line a command wrote to stderr (log lines left out)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("through_base", [False, True])
def test_yaml_syntax_error_names_file_line_and_column(tmp_path, through_base):
    bad = write(tmp_path / "bad.yaml", f"base: {TINY}\ntrain:\n  steps: [1, 2\n")
    config = write(tmp_path / "run.yaml", "base: bad.yaml\n") if through_base else bad
    with pytest.raises(ConfigError) as info:
        load_config(config)
    message = str(info.value)
    assert f"config {bad} is not valid YAML: line 4, column 1: expected ',' or ']'" in message
    assert "from line 3, column 10" in message and "\n" not in message


def test_yaml_syntax_error_in_an_override_names_it():
    with pytest.raises(ConfigError, match=r"override 'train.steps=\[1' is not valid YAML: line 1, column 3"):
        load_config(TINY, ["train.steps=[1"])


@pytest.mark.parametrize(
    "files, key, lines",
    [
        ({"run.yaml": f"base: {TINY}\ntrain:\n  steps: 5\n  batch_size: 4\n  steps: 7\n"}, "steps", "lines 3 and 5"),
        ({"run.yaml": f"base: {TINY}\ntrain: {{steps: 5, steps: 7}}\n"}, "steps", "line 2, columns 9 and 19"),
        ({"run.yaml": f"base: {TINY}\ntrain:\n  steps: 5\ntrain:\n  batch_size: 4\n"}, "train", "lines 2 and 4"),
        (
            {"run.yaml": f"base: [{TINY}, model.yaml]\n", "model.yaml": "model:\n  num_layers: 2\n  num_layers: 3\n"},
            "num_layers",
            "lines 2 and 3",
        ),
    ],
    ids=["key", "flow", "section", "in-a-base"],
)
def test_a_key_given_twice_names_the_file_the_key_and_both_lines(tmp_path, capsys, files, key, lines):
    for name, text in files.items():
        write(tmp_path / name, text)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "run.yaml")
    assert str(info.value) == (
        f"config {tmp_path / list(files)[-1]}: key '{key}' is given twice in one mapping ({lines}); YAML would keep "
        "only the last: give it once"
    )
    assert main([str(tmp_path / "run.yaml")]) == 2
    assert error_line(capsys) == f"error: {info.value}"


def test_a_key_given_twice_in_an_import_s_model_yaml_is_named(tmp_path):
    imported = fake_import(tmp_path / "imported")
    model = imported / "model.yaml"
    model.write_text(model.read_text().replace("model:\n", "model:\n  num_layers: 9\n", 1))
    recipe = write(tmp_path / "recipe.yaml", f"model_from_init: true\ncheckpoint: {{init_from: {imported}}}\n")
    line = 1 + model.read_text().splitlines().index("  num_layers: 2")
    with pytest.raises(
        ConfigError,
        match=re.escape(f"config {model}: key 'num_layers' is given twice in one mapping (lines 2 and {line})"),
    ):
        load_config(recipe)


@pytest.mark.parametrize("base", ["5", "[models/tiny.yaml, 5]", "{a: 1}"])
def test_base_that_is_not_a_path_names_value_and_what_is_allowed(tmp_path, base):
    config = write(tmp_path / "run.yaml", f"base: {base}\n")
    with pytest.raises(ConfigError, match=r"base=.* is not allowed; base: is a file path or a list of file paths"):
        load_config(config)


@pytest.mark.parametrize("text", ["plain text\n", '{"architectures": ["LlamaForCausalLM"]}\n'])
def test_tokenizer_that_is_not_a_tokenizer_json_names_the_file(tmp_path, text):
    path = write(tmp_path / "tokenizer.json", text)
    with pytest.raises(DataError, match=re.escape(f"data.tokenizer: {path} is not a Hugging Face tokenizer.json")):
        make_tokenizer(str(tmp_path))


def test_tensor_from_a_fill_that_does_not_divide_the_heads_stops_before_compiling(tmp_path, capsys):
    source = write(tmp_path / "corpus.txt", "def f(x):\n    return x\n" * 200)
    output = tmp_path / "run"
    overrides = ["mesh.tensor=-1", "mesh.fsdp=1", f"data.source={source}", f"train.output_dir={output}"]
    assert main([str(TINY), *overrides]) == 2
    line = error_line(capsys)
    assert "model.num_heads=4 must be divisible by mesh.tensor=8" in line
    assert "choose a mesh.tensor that divides model.num_heads=4, model.mlp_dim=768: 1, 2, 4" in line
    assert not output.exists()


def test_tensor_size_names_the_sizes_that_divide_every_split_dimension():
    with pytest.raises(ConfigError, match=r"divides model\.num_heads=4, model\.mlp_dim=768: 1, 2, 4 "):
        load_config(TINY, ["mesh.tensor=3"])
    with pytest.raises(MeshError, match=r"model\.num_heads=6 must be divisible by mesh\.tensor=4.*: 1, 2, 3, 6 "):
        check_tensor(4, {"model.num_heads": 6})


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """A Hugging Face directory of a tiny random Llama (config.json + one model.safetensors)."""
    config = ModelConfig(vocab_size=32, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)
    path = tmp_path_factory.mktemp("hf")
    save_pretrained(models.build(config, rngs=nnx.Rngs(0)), path)
    return path


@pytest.mark.parametrize(
    "keep, problem",
    [
        (0.5, "is truncated: its tensors end at byte"),
        (0.01, "is truncated or not a safetensors file: its header needs"),
        (0.0, "is truncated or not a safetensors file: its header needs 8 bytes but the file holds 0"),
    ],
    ids=["half", "in-header", "empty"],
)
def test_hf_import_of_a_truncated_safetensors_file_names_it(tmp_path, capsys, hf_dir, keep, problem):
    for file in hf_dir.iterdir():
        data = file.read_bytes()
        (tmp_path / file.name).write_bytes(data[: int(len(data) * keep)] if file.suffix == ".safetensors" else data)
    assert hf.main(["import", str(tmp_path), str(tmp_path / "out")]) == 2
    assert error_line(capsys).startswith(f"error: {tmp_path / 'model.safetensors'} {problem}")


def test_safetensors_header_of_another_kind_is_named(tmp_path):
    header = b'{"a": 1}'
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(SafetensorsError, match="its header is not a safetensors header"):
        SafetensorsFile(path)


def test_parquet_without_the_text_column_names_file_and_columns(tmp_path, capsys):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), path)
    with pytest.raises(DataError):
        open_source(DataConfig(source=str(path)))
    assert main([str(TINY), f"data.source={path}", f"train.output_dir={tmp_path / 'run'}"]) == 2
    assert error_line(capsys) == (
        f"error: {path} has no column 'text' (data.text_field); available columns: ['id', 'body']"
    )


@pytest.mark.parametrize("where", ["under a file", "lock is a folder"])
def test_output_dir_that_cannot_be_written_is_one_line(tmp_path, capsys, where):
    """A train.output_dir that cannot be created (a file in its path) or whose .lock cannot be written is named in
    one line, before anything is written there."""
    (tmp_path / "file").write_text("")
    output = tmp_path / "file" / "run" if where == "under a file" else tmp_path / "run"
    if where == "lock is a folder":
        (output / ".lock").mkdir(parents=True)
    overrides = [f"train.output_dir={output}", "train.steps=1", "data.max_documents=4", "model.num_layers=1"]
    assert main([str(TINY), *overrides]) == 2
    line = error_line(capsys)
    assert f"train.output_dir={str(output)!r} cannot be written" in line
    assert ("NotADirectoryError" if where == "under a file" else "IsADirectoryError") in line
