"""The FLOPs of a compiled program's instructions, as the speed estimate (train/planning/speed.py) costs them: dots and
the TPU compiler's convolutions as XLA's cost analysis counts them, cuBLAS calls by their dot dimensions, grouped
matmul kernels by their shapes and the share of rows a balanced load fills, and fused attention calls (cuDNN,
FlashAttention-3, Pallas, splash) as multiples of their dense forward."""

from __future__ import annotations

import math
import re

import numpy as np

from parallel.kernels.flash3 import TARGETS as FLASH3_TARGETS
from train.planning import hlo

GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
MOSAIC_TPU = "tpu_custom_call"  # a Pallas TPU kernel (its name is the instruction's)
# FLOPs of a splash attention call (parallel/kernels/splash.py) as a multiple of its forward's: the matmuls each
# kernel computes (its dq kernel recomputes the scores and dP; its dk / dv kernel both, then dV and dK)
SPLASH_CALLS = {"splash_mha_fwd": 1.0, "splash_mha_dq": 1.5, "splash_mha_dkv": 2.0}
# FLOPs of an attention call as a multiple of its forward's, counting a backward as 2.5 forwards as the measured
# rates do: cuDNN's backward is one call, Pallas' two (dK / dV, then dQ)
# (Mosaic GPU's kernels split dK / dV into dK and dV at the widest heads: parallel/kernels/mosaic.py)
ATTENTION_CALLS = {"attention_forward": 1.0, "attention_dkdv": 1.5, "attention_dq": 1.0, "attention_dk": 1.0,
                   "attention_dv": 0.5}  # fmt: skip
ROWS = re.compile(r"packed_rows_(\d+)")  # FlashAttention-3's flattened rows (parallel/kernels/flash3.py)
# a grouped-matmul kernel that skips the rows past its groups (tokamax's, parallel/grouped.py): its scope, and the
# share of its rows a balanced load fills
GROUPED = "/grouped_matmul/"
FILLED = re.compile(r"grouped_matmul_filled_([0-9.]+)")


def _dims(name: str, computation: hlo.Computation) -> tuple[int, ...]:
    """The dimensions of the instruction `name` of `computation`."""
    return computation.by_name[name].shape[0].dims


def _dot_flops(instruction: hlo.Instruction, computation: hlo.Computation) -> float:
    """2 x result elements x contracted elements of a dot."""
    contracting = instruction.attribute(r"lhs_contracting_dims=\{([\d,]*)\}") or ""
    lhs = _dims(instruction.operands[0], computation)
    contracted = math.prod(lhs[int(d)] for d in contracting.split(",") if d)
    return 2.0 * math.prod(instruction.shape[0].dims) * contracted


def _convolution_flops(instruction: hlo.Instruction, computation: hlo.Computation) -> float:
    """2 x the multiply-adds of a convolution (the TPU compiler's form of a dot) as XLA's cost analysis counts them:
    input features per group x output features x batch per batch group x, per spatial dimension, the (output, window)
    position pairs that fall inside the (dilated) input rather than its padding."""
    labels = instruction.attribute(r"dim_labels=(\w+)->\w+")
    if labels is None:
        return 0.0
    lhs_labels, rhs_labels = labels.split("_")
    lhs, rhs = (_dims(name, computation) for name in instruction.operands[:2])
    out = instruction.shape[0].dims
    out_labels = instruction.attribute(r"dim_labels=\w+->(\w+)")
    groups = int(instruction.attribute(r"feature_group_count=(\d+)") or 1)
    batch_groups = int(instruction.attribute(r"batch_group_count=(\d+)") or 1)
    window = _window(instruction.attribute(r"window=\{([^}]*)\}") or "")
    pairs = 1
    for axis, label in enumerate(d for d in rhs_labels if d.isdigit()):
        size = rhs[rhs_labels.index(label)]
        field = window[axis] if axis < len(window) else {}
        stride, (low, _) = field.get("stride", 1), field.get("pad", (0, 0))
        dilation, base = field.get("rhs_dilate", 1), field.get("lhs_dilate", 1)
        outputs, inputs = out[out_labels.index(label)], lhs[lhs_labels.index(label)]
        position = np.arange(outputs)[:, None] * stride - low + np.arange(size)[None, :] * dilation
        inside = (position >= 0) & (position % base == 0) & (position // base < inputs)
        pairs *= int(inside.sum())
    features = lhs[lhs_labels.index("f")] // groups
    batch = lhs[lhs_labels.index("b")] // batch_groups
    return 2.0 * features * rhs[rhs_labels.index("o")] * batch * pairs


def _window(text: str) -> list[dict]:
    """A convolution's window text ('size=4x1 pad=3_3x0_0 stride=2x1 rhs_reversal=1x0') -> per spatial dimension
    {size, stride, pad: (low, high), lhs_dilate, rhs_dilate}."""
    fields = dict(part.split("=") for part in text.split() if "=" in part)
    count = len(fields.get("size", "").split("x")) if "size" in fields else 0
    result = [{} for _ in range(count)]
    for key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
        for axis, value in enumerate(fields.get(key, "").split("x") if key in fields else []):
            result[axis][key] = int(value)
    for axis, value in enumerate(fields.get("pad", "").split("x") if "pad" in fields else []):
        low, high = value.split("_")
        result[axis]["pad"] = (int(low), int(high))
    return result


MATMUL_OPS = {"dot": _dot_flops, "convolution": _convolution_flops}


def gemm_flops(instruction: hlo.Instruction, computation: hlo.Computation) -> float:
    """2 x result elements x contracted elements of a cuBLAS call (its dot dimensions in the backend config)."""
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
    lhs = _dims(instruction.operands[0], computation)
    contracted = math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting.group(1))) if contracting else 1
    return 2.0 * math.prod(instruction.shape[0].dims) * contracted


def grouped_share(instruction: hlo.Instruction, target: str) -> float:
    """The share of its rows a grouped-matmul kernel computes under a balanced load (1 where its scope names none),
    or 0 for a call that is not one."""
    if not (target.startswith("mosaic_gpu") and GROUPED in instruction.op_name):
        return 0.0
    return float((FILLED.findall(instruction.op_name) or ["1"])[-1])


def grouped_flops(instruction: hlo.Instruction, computation: hlo.Computation) -> float:
    """2 x rows x a x b of a grouped matmul over all its rows: of its floating operands and result, two are 2-D,
    [rows, a] and [rows, b] either way round (x and out; x and dout for dw), and one [groups, a, b] (w, or dw): the
    product of the two's sizes and a x b is (rows x a x b) squared."""
    arrays = [computation.by_name[o].shape[0] for o in instruction.operands if o in computation.by_name]
    floating = [a.dims for a in (*arrays, instruction.shape[0]) if a.dtype[0] in "fb"]
    (first, second), weights = [d for d in floating if len(d) == 2], next(d for d in floating if len(d) == 3)
    return 2.0 * math.sqrt(math.prod(first) * math.prod(second) * math.prod(weights[1:]))


def attention_multiple(instruction: hlo.Instruction, target: str) -> float:
    """The call's FLOPs in forwards (ATTENTION_CALLS; cuDNN's and FlashAttention-3's backward 2.5), or 0 for a call
    that is not attention."""
    if target.startswith("__cudnn$fmha"):
        return 2.5 if "Backward" in target else 1.0
    if target in FLASH3_TARGETS:
        return 2.5 if target == FLASH3_TARGETS[1] else 1.0
    if target == MOSAIC_TPU:
        return next((m for name, m in SPLASH_CALLS.items() if instruction.name.startswith(name + "_")), 0.0)
    for name, multiple in ATTENTION_CALLS.items():
        if f"/{name}/" in instruction.op_name:
            return multiple
    return 0.0


def attention_flops(instruction: hlo.Instruction, computation: hlo.Computation, target: str) -> float:
    """Dense forward FLOPs of an attention call on q [b, tq, h, dqk], k [b, tk, hk, dqk], v [b, tk, hk, dv]:
    QK^T and PV, 2 per multiply-add. A FlashAttention-3 call holds its b rows flattened, q [b tq, h, d] (its operand
    0 is dout in the backward: the same shape), and names b in its scope (parallel/kernels/flash3.py). A splash call
    takes its block tables first and q, k, v heads first, [b, h, t, d] ([h, t, d] for one row): its first three
    floating operands."""
    if target == MOSAIC_TPU:
        arrays = [computation.by_name[o].shape[0] for o in instruction.operands if o in computation.by_name]
        q, k, v = [a.dims for a in arrays if a.dtype[0] in "fb" and len(a.dims) >= 3][:3]  # [(b,) h, t, d]
        return 2.0 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    shapes = [_dims(o, computation) for o in instruction.operands[:3]]
    if len(shapes[0]) == 3:
        rows = int((ROWS.findall(instruction.op_name) or ["1"])[-1])
        (tokens, heads, width), keys = shapes[0], shapes[2 if target == FLASH3_TARGETS[1] else 1][0]
        return 2.0 * heads * tokens * keys / rows * 2 * width
    (b, tq, h, dqk), (_, tk, _, _), v = shapes
    return 2.0 * b * h * tq * tk * (dqk + v[-1])
