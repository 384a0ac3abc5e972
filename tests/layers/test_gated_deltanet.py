"""Gated DeltaNet equals Hugging Face's Qwen3.5 layer (float32, one document a row, which is all it knows), and over 8
context devices (ring, dual_chunk) equals itself on one device on packed rows, outputs and parameter gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from layers.gated_deltanet import GatedDeltaNet
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced, to_balanced
from tests.parallel.attention_reference import packed_segments, relative_error

SIZES = dict(key_heads=2, heads=4, key_dim=8, value_dim=16, taps=4)
EMBED = 32


def layer(seed=0):
    return GatedDeltaNet(EMBED, **SIZES, rngs=nnx.Rngs(seed))


def copy_into_hf(ours: GatedDeltaNet, theirs) -> None:
    """Our parameters into transformers' Qwen3_5GatedDeltaNet (its in_proj_qkv rows are [q | k | v], its conv1d
    channels alike)."""
    import torch

    t = lambda x: torch.tensor(np.asarray(x[...], np.float32))
    flat = lambda w: w[...].reshape(EMBED, -1).T  # [embed, heads, d] -> [heads * d, embed]
    with torch.no_grad():
        theirs.in_proj_qkv.weight.copy_(t(jnp.concatenate([flat(ours.q), flat(ours.k), flat(ours.v)])))
        theirs.in_proj_z.weight.copy_(t(flat(ours.z)))
        theirs.in_proj_b.weight.copy_(t(ours.b[...].T))
        theirs.in_proj_a.weight.copy_(t(ours.a[...].T))
        taps = lambda w: w[...].reshape(SIZES["taps"], -1).T  # [taps, heads, d] -> [channels, taps]
        conv = jnp.concatenate([taps(ours.conv_q), taps(ours.conv_k), taps(ours.conv_v)])
        theirs.conv1d.weight.copy_(t(conv[:, None, :]))
        theirs.A_log.copy_(t(ours.a_log))
        theirs.dt_bias.copy_(t(ours.dt_bias))
        theirs.norm.weight.copy_(t(ours.norm_scale))
        theirs.out_proj.weight.copy_(t(ours.out[...].reshape(-1, EMBED).T))


def test_equals_transformers_qwen3_5_layer():
    torch = pytest.importorskip("torch")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        hidden_size=EMBED,
        linear_num_key_heads=SIZES["key_heads"],
        linear_num_value_heads=SIZES["heads"],
        linear_key_head_dim=SIZES["key_dim"],
        linear_value_head_dim=SIZES["value_dim"],
        linear_conv_kernel_dim=SIZES["taps"],
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    theirs = qwen3_5.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    ours = layer()
    ours.a_log[...] = jnp.log(jnp.linspace(0.5, 4.0, SIZES["heads"]))  # decays that keep 150 tokens of memory
    copy_into_hf(ours, theirs)
    x = np.random.default_rng(0).normal(size=(2, 150, EMBED)).astype(np.float32)  # not a multiple of 64
    expected = theirs(torch.tensor(x)).detach().numpy()
    actual = ours(jnp.asarray(x), None, None)
    assert relative_error(actual, expected) <= 1e-5


@pytest.mark.slow  # the kernel split: tests/parallel/test_gated_delta.py; the model: tests/models/test_families.py
@pytest.mark.parametrize("layout", ["dual_chunk"])
def test_ring_over_8_devices_equals_one_device(layout):
    batch, length, shards = 2, 128, 8
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    ours = layer(1)
    graph, params = nnx.split(ours)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(batch, length, EMBED)), jnp.float32)
    seg = jnp.asarray(packed_segments(batch, length, seed=4))
    w = jnp.asarray(np.random.default_rng(2).normal(size=(batch, length, EMBED)), jnp.float32)
    order = dict(layout=layout, axis=1)

    def loss(params, x, seg, split):
        model = nnx.merge(graph, params)
        if not split:
            return jnp.sum(model(x, None, seg) * w)
        out = model(to_balanced(x, shards, **order), None, to_balanced(seg, shards, **order))
        return jnp.sum(from_balanced(out, shards, **order) * w)

    expected = jax.value_and_grad(loss)(params, x, seg, False)
    with jax.set_mesh(mesh), use_parallelism(Parallelism(strategy="ring", layout=layout, mesh=mesh)):
        actual = jax.jit(jax.value_and_grad(loss), static_argnums=3)(params, x, seg, True)
    assert relative_error(actual[0], expected[0]) <= 2e-5
    for a, e in zip(jax.tree.leaves(actual[1]), jax.tree.leaves(expected[1]), strict=True):
        assert relative_error(a, e) <= 2e-5
