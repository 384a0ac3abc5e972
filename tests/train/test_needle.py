"""Needle haystacks put the asked needle at the requested depth and end with the question and answer; teacher-forced
scoring gives an oracle 100%, a uniform model 0% and a model that recalls only the first needle of a row the share
of rows whose asked needle comes first."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from parallel.mesh import make_mesh
from parallel.settings import make_parallelism
from tests.tiny_models import TINY_LLAMA
from tests.train.step_reference import COMPUTE, initial_state, keep_grads
from train.config import MeshConfig, ParallelConfig
from train.data.haystack import TASKS, answer_positions, build, score
from train.data.tokenizer import ByteTokenizer
from train.needle import model_predictor
from train.state import abstract_model, abstract_state

TOKENIZER = ByteTokenizer()
FILLER = TOKENIZER.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
LENGTH = 2000


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_the_asked_needle_sits_at_its_depth(task, depth):
    haystack = build(task, FILLER, TOKENIZER, LENGTH, depth, np.random.default_rng(0))
    tokens, start = haystack.tokens, haystack.needles[0]
    assert tokens.shape == (LENGTH,) and tokens[0] == TOKENIZER.bos_id
    assert TOKENIZER.decode(tokens[start:]).startswith(" The special magic number for ")
    needle_tokens = sum(len(TOKENIZER.decode(tokens[s:]).split(". ")[0]) + 2 for s in haystack.needles)
    question = TOKENIZER.decode(tokens).rsplit(" What", 1)[1]
    budget = LENGTH - 1 - needle_tokens - len(" What" + question)
    others_before = sum(s < start for s in haystack.needles)
    assert abs(start - 1 - round(depth * budget)) <= others_before * 60, (start, budget)
    assert list(haystack.answer) == list(range(LENGTH - len(haystack.answer), LENGTH))
    answer = TOKENIZER.decode(tokens[haystack.answer]).strip()
    values = [TOKENIZER.decode(tokens[s:]).split(" is ")[1].split(".")[0] for s in haystack.needles]
    in_row_order = [values[i] for i in np.argsort(haystack.needles)]
    assert answer == (", ".join(in_row_order) if task == "multi_value" else values[0])


def haystacks(task, count=12):
    rng = np.random.default_rng(1)
    return [build(task, FILLER, TOKENIZER, LENGTH, depth, rng) for depth in np.linspace(0, 1, count)]


def oracle(tokens, at):
    return np.take_along_axis(tokens, at + 1, axis=1)


def test_an_oracle_scores_all_and_a_uniform_model_none():
    for task in TASKS:
        rows = haystacks(task)
        assert score(oracle, rows) == 1.0
        assert score(lambda tokens, at: np.zeros_like(at), rows) == 0.0  # argmax of uniform logits: token 0


def test_a_model_that_recalls_only_the_first_needle_scores_the_rows_where_it_was_asked():
    rows = haystacks("multi_key")
    first_asked = [h.needles[0] == min(h.needles) for h in rows]
    assert 0 < sum(first_asked) < len(rows)

    def first_needle_only(tokens, at):
        return np.where(np.asarray(first_asked)[:, None], oracle(tokens, at), 0)

    assert score(first_needle_only, rows) == pytest.approx(np.mean(first_asked))


MODEL = dataclasses.replace(TINY_LLAMA, vocab_size=264, num_heads=8)


@pytest.fixture(scope="module")
def host_state():
    return initial_state(MODEL)


def predictor(host_state, mesh_config, parallel_config, devices):
    mesh = make_mesh(mesh_config, jax.devices()[:devices])
    graphdef, abstract = abstract_model(MODEL, mesh, compute=COMPUTE)
    state = jax.device_put(host_state[0], jax.tree.map(lambda a: a.sharding, abstract))
    return functools.partial(model_predictor(graphdef, mesh, make_parallelism(parallel_config, mesh.shape)), state)


def test_model_predictions_are_the_argmax_of_the_full_logits_on_any_mesh(host_state):
    """One device and ring attention over 8 context devices (balanced order) predict what the full logits say."""
    rows = [build(task, FILLER, TOKENIZER, 512, 0.5, np.random.default_rng(2)) for task in TASKS]
    tokens, at = np.stack([h.tokens for h in rows]), answer_positions(rows) - 1
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    graphdef, _, _ = abstract_state(MODEL, keep_grads(), mesh, compute=COMPUTE)
    network, _ = nnx.merge(graphdef, jax.device_put(host_state, jax.devices()[0]))
    hidden, _ = network.hidden(tokens, np.broadcast_to(np.arange(512), tokens.shape), np.ones_like(tokens))
    expected = np.take_along_axis(np.argmax(hidden @ network.output_kernel(), -1), at, axis=1)
    one = predictor(host_state, MeshConfig(fsdp=1), ParallelConfig(), 1)
    ring = predictor(host_state, MeshConfig(fsdp=1, context=8), ParallelConfig(context_strategy="ring"), 8)
    np.testing.assert_array_equal(one(tokens, at), expected)
    np.testing.assert_array_equal(ring(tokens, at), expected)
    assert score(ring, rows) == 0.0  # a random model retrieves nothing
