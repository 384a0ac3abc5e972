"""The end-of-run sample is the greedy continuation (each next token the argmax of the model's logits over the
prompt and the tokens so far, computed here by hand), and runs on every mesh that trains (the buffer padded to the
sequence-sharding axes, the MoE under expert parallelism) continuing the prompt exactly as on one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from parallel.mesh import make_mesh
from tests.train.tiny_run import REPO
from train.config import MeshConfig, load_config
from train.data.tokenizer import make_tokenizer
from train.optimizer import make_optimizer
from train.sample import generate
from train.state import create_state

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
        pytest.param("deepseek-tiny", MeshConfig(fsdp=2, expert=2, context=2), marks=pytest.mark.slow),
    ],
)
def test_sample_on_a_mesh_equals_one_device(name, mesh_config):
    assert sample(name, mesh_config, devices=8) == sample(name, MeshConfig(fsdp=1), devices=1)


@pytest.mark.parametrize("name", ["tiny", pytest.param("deepseek-tiny", marks=pytest.mark.slow)])
def test_greedy_sample_is_the_argmax_continuation(name):
    config = load_config(REPO / "configs" / f"{name}.yaml", ["model.num_layers=2"])
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    state = create_state(config.model, make_optimizer(config.optimizer, 1), mesh, seed=0, compute=config.compute)
    tokenizer = make_tokenizer(config.data.tokenizer)
    with jax.set_mesh(mesh):
        text = generate(state, mesh, tokenizer, PROMPT, max_new_tokens=6)
        model, _ = nnx.merge(state.graphdef, state.state)
        ids = [tokenizer.bos_id, *tokenizer.encode(PROMPT)]
        new = []
        for _ in range(6):  # the whole row so far, unpadded, one forward pass per token
            token = int(np.argmax(np.asarray(model(jnp.asarray([ids + new]))[0, -1])))
            if token == tokenizer.eos_id:
                break
            new.append(token)
    assert len(new) >= 2 and text == tokenizer.decode(new)
