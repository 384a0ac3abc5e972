"""Remat policies keep what they say: full only the block's inputs, save_projections the named projections,
save_attention the attention's out and lse (and its backward then runs no attention forward); a group of blocks (a
scan step of layers that differ) applies the policy to each of its blocks."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from models import deepseek, gemma3, llama
from models.config import FULL, SLIDING
from models.remat import PROJECTIONS, remat
from models.stack import Group
from parallel import kernels
from parallel.kernels import blockwise
from parallel.kernels.saved import NAMES as ATTENTION_RESULTS
from tests.tiny_models import TINY_LLAMA, TINY_MLA

LLAMA = TINY_LLAMA
DEEPSEEK = TINY_MLA
BLOCKS = {
    "llama": lambda: llama.Block(LLAMA, rngs=nnx.Rngs(0)),
    "deepseek": lambda: deepseek.Block(DEEPSEEK, moe=False, rngs=nnx.Rngs(0)),
    "gemma3": lambda: gemma3.Block(dataclasses.replace(LLAMA, family="gemma3", qk_norm=True), rngs=nnx.Rngs(0)),
}
ATTENTION = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "deepseek": {"q_a_proj", "q_proj", "kv_a_proj", "k_proj", "v_proj", "o_proj"},
    "gemma3": {"q_proj", "k_proj", "v_proj", "o_proj"},
}


def saved(make_block, policy: str, capsys) -> list[str]:
    """What the backward pass of `make_block()` under `policy` keeps for x [1, 16, 32], one entry per residual:
    its checkpoint name, 'argument' (an input or a constant), or the printed line of anything else. A Group applies
    the policy itself."""
    module = nnx.eval_shape(make_block)  # traced only: nothing is initialised or run
    graphdef, params = nnx.split(module)
    x = jax.ShapeDtypeStruct((1, 16, 32), jnp.float32)
    positions, segments = jnp.arange(16)[None], jnp.ones((1, 16), jnp.int32)

    def loss(params, x):
        if isinstance(module, Group):
            return nnx.merge(graphdef, params)(x, positions, segments, remat_policy=policy)[0].sum()
        return remat(lambda h, p: nnx.merge(graphdef, p)(h, positions, segments)[0], policy)(x, params).sum()

    capsys.readouterr()
    print_saved_residuals(loss, params, x)
    kept = []
    for line in capsys.readouterr().out.splitlines():
        named = re.search(r"named '(\w+)'", line)
        kept.append(
            named.group(1)
            if named
            else "argument"
            if "from the argument" in line or "from a constant" in line
            else line
        )
    return kept


@pytest.mark.parametrize("family", BLOCKS)
def test_full_keeps_only_the_inputs(family, capsys):
    assert set(saved(BLOCKS[family], "full", capsys)) == {"argument"}


@pytest.mark.parametrize("family", BLOCKS)
def test_save_projections_keeps_the_named_projections(family, capsys):
    kept = set(saved(BLOCKS[family], "save_projections", capsys)) - {"argument"}
    assert kept <= set(PROJECTIONS), kept
    assert ATTENTION[family] <= kept and {"mlp_gate", "mlp_up"} <= kept, kept


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_save_attention_keeps_the_attention_results(family, capsys):
    assert set(saved(BLOCKS[family], "save_attention", capsys)) == {"argument", *ATTENTION_RESULTS}


@pytest.mark.parametrize("policy, forwards", [("full", 2), ("save_attention", 1)])
def test_save_attention_runs_the_attention_forward_once(policy, forwards, monkeypatch):
    """The kernel's forward, marked by a named call, appears in the block's gradient twice under full (the forward
    and its recomputation), once when its results are saved."""

    def kernel_forward(out):
        return out

    def marked_forward(*args, **kwargs):
        out, lse = blockwise.forward(*args, **kwargs)
        return jax.jit(kernel_forward)(out), lse

    monkeypatch.setattr(kernels, "BLOCKWISE", kernels.Kernel("blockwise", marked_forward, blockwise.backward, True))
    module = BLOCKS["llama"]()
    graphdef, params = nnx.split(module)
    positions, segments = jnp.arange(16)[None], jnp.ones((1, 16), jnp.int32)
    block = remat(lambda h, p: nnx.merge(graphdef, p)(h, positions, segments)[0], policy)
    gradient = jax.make_jaxpr(jax.grad(lambda p, x: block(x, p).sum()))(params, jnp.ones((1, 16, 32)))
    assert str(gradient).count("name=kernel_forward") == forwards


def test_none_keeps_more_than_save_projections(capsys):
    counts = {policy: len(saved(BLOCKS["llama"], policy, capsys)) for policy in ("save_projections", "none")}
    assert counts["save_projections"] < counts["none"], counts


def test_a_group_applies_the_policy_to_each_block(capsys):
    config = dataclasses.replace(LLAMA, sliding_window=4)
    group = lambda: Group(lambda kind, r: llama.Block(config, kind, rngs=r), (SLIDING, FULL), nnx.Rngs(0))
    full = [entry for entry in saved(group, "full", capsys) if entry != "argument"]
    assert len(full) == 1 and "output of add" in full[0], full  # the second block's input
    kept = [entry for entry in saved(group, "save_projections", capsys) if entry in PROJECTIONS]
    assert sorted(kept) == sorted(2 * [*ATTENTION["llama"], "mlp_gate", "mlp_up"]), kept
