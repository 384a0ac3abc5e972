"""The end-of-run sample runs on every mesh that trains (the buffer padded to the sequence-sharding axes, the MoE
under expert parallelism) and continues the prompt exactly as on one device."""

import functools

import jax
import pytest

from parallel.mesh import make_mesh
from tests.train.tiny_run import REPO
from train.config import MeshConfig, load_config
from train.optimizer import make_optimizer
from train.sample import generate
from train.state import create_state
from train.tokenizer import make_tokenizer

PROMPT = "de"  # BOS + 2 bytes + 2 new tokens = 5 positions: padded on every mesh below


@functools.cache
def sample(name: str, mesh_config: MeshConfig, devices: int) -> str:
    config = load_config(REPO / "configs" / f"{name}.yaml", ["model.num_layers=2"])
    mesh = make_mesh(mesh_config, jax.devices()[:devices])
    state = create_state(config.model, make_optimizer(config.optimizer, 1), mesh, seed=0, compute=config.compute)
    return generate(state, mesh, make_tokenizer(config.data.tokenizer), PROMPT, max_new_tokens=2)


@pytest.mark.parametrize(
    "name, mesh_config",
    [
        ("deepseek-tiny", MeshConfig(fsdp=4, tensor=2)),
        ("deepseek-tiny", MeshConfig(fsdp=2, expert=2, context=2)),
    ],
)
def test_sample_on_a_mesh_equals_one_device(name, mesh_config):
    assert sample(name, mesh_config, devices=8) == sample(name, MeshConfig(fsdp=1), devices=1)
