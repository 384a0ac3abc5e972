"""MXFP4 (gpt-oss's experts): our numpy dequantization equals transformers' convert_moe_packed_tensors bit for bit on
random blocks and scales (every code, exponents around 2 ** 0), and a checkpoint that stores X_blocks / X_scales in
different shards lists and reads X dequantized."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from models.hf.mxfp4 import dequantize
from models.hf.stored import INDEX, StoredTensors

torch = pytest.importorskip("torch")


def random_packed(experts=3, rows=10, groups=4, seed=0):
    """uint8 blocks [experts, rows, groups, 16] and scales [experts, rows, groups] (exponents -17 ... 12)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (experts, rows, groups, 16), dtype=np.uint8)
    return blocks, rng.integers(110, 140, (experts, rows, groups), dtype=np.uint8)


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_packed()
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    ours = dequantize(blocks, scales)
    assert ours.shape == (3, 4 * 32, 10) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, expected.numpy())


def test_mismatched_scales_are_refused():
    blocks, scales = random_packed()
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(3, 10, 4, 16\) do not match their scales \(3, 10, 3\)"):
        dequantize(blocks, scales[..., :3])


def test_a_checkpoint_reads_packed_tensors_dequantized(tmp_path):
    blocks, scales = random_packed()
    plain = np.arange(6, dtype=np.float32)
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({name + "_blocks": blocks, "bias": plain}, tmp_path / "a.safetensors")
    save_file({name + "_scales": scales}, tmp_path / "b.safetensors")
    weight_map = {name + "_blocks": "a.safetensors", "bias": "a.safetensors", name + "_scales": "b.safetensors"}
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    stored = StoredTensors(tmp_path)
    assert stored.files == {name: "a.safetensors", "bias": "a.safetensors"}
    np.testing.assert_array_equal(stored.get(name), dequantize(blocks, scales))
    np.testing.assert_array_equal(stored.get("bias"), plain)
