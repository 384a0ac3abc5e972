"""MXFP4, the format of the experts in OpenAI's gpt-oss checkpoints: tensor X is stored as X_blocks (uint8, two 4-bit
values a byte) and X_scales (uint8 exponents + 127, one per block of 32 values). Dequantized with numpy exactly as
transformers' `convert_moe_packed_tensors` does (integrations/mxfp4.py)."""

from __future__ import annotations

import numpy as np

BLOCKS, SCALES = "_blocks", "_scales"
# the 4-bit code -> its value (sign bit 3, exponent bits 1-2, mantissa bit 0), transformers' FP4_VALUES
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [experts, rows, groups, 16], scales uint8 [experts, rows, groups] -> float32 [experts, groups x 32,
    rows]: value 2j of a group is the byte's low nibble, 2j + 1 its high one, times 2 ** (scale - 127); the result is
    transposed as transformers returns it (Hugging Face's gate_up_proj / down_proj layout [experts, in, out])."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} do not match their scales {scales.shape}: need [..., groups, 16]"
        )
    experts, rows, groups, size = blocks.shape
    out = np.empty((experts, rows, groups, 2 * size), np.float32)
    for expert in range(experts):  # one expert's temporaries at a time
        out[expert, ..., 0::2] = FP4_VALUES[blocks[expert] & 0x0F]
        out[expert, ..., 1::2] = FP4_VALUES[blocks[expert] >> 4]
        np.ldexp(out[expert], scales[expert].astype(np.int32)[..., None] - 127, out=out[expert])
    return out.reshape(experts, rows, groups * 2 * size).swapaxes(1, 2)


def packed(names) -> dict[str, tuple[str, str]]:
    """Tensor X -> (X_blocks, X_scales) for every X both of whose parts are among `names`."""
    names = set(names)
    return {
        name[: -len(BLOCKS)]: (name, name[: -len(BLOCKS)] + SCALES)
        for name in names
        if name.endswith(BLOCKS) and name[: -len(BLOCKS)] + SCALES in names
    }
