"""Everything that depends on JAX's version, in one place: the supported range and its check, JAX's private cuDNN
attention primitives (their module, their binds' keyword parameters, whether packed K / V keep their own heads), the
Pallas Triton compiler parameters, the CUDA plugin's module for each CUDA major, and the distributed runtime's
coordination client. Each use is found by what the installed JAX has, not by its version number, so a patch release
that keeps an API keeps working; the range says what CI has tested (the floor on Python 3.11, the newest on Python
3.12+).

Importing this module checks the installed JAX (parallel/__init__.py imports it before any other module of the
package); nothing here imports JAX's private modules until it is used.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import re

FLOOR = (0, 10, 2)  # the oldest JAX tested
CEILING = (0, 13)  # the first minor not tested (excluded)
SUPPORTED = f"jax>={'.'.join(map(str, FLOOR))},<{'.'.join(map(str, CEILING))}"
# JAX's CUDA plugins by CUDA major, newest first: the module that holds XLA's GPU compiler
CUDA_PLUGINS = {"13": "jax_plugins.xla_cuda13", "12": "jax_plugins.xla_cuda12"}


class UnsupportedJax(ImportError):
    """The installed JAX is outside the tested range; the message is one line naming it and the range (the
    commands print it alone: train/__init__.py)."""


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.12.0.1' / '0.11.2.dev20260101' -> (0, 12, 0, 1) / (0, 11, 2): the leading numeric release parts."""
    parts = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)


def check_version(version: str | None = None) -> None:
    """Raises UnsupportedJax when JAX `version` (default: the installed one) is outside FLOOR .. CEILING."""
    if version is None:
        import jax

        version = jax.__version__
    found = version_tuple(version)
    if not FLOOR <= found < CEILING:
        raise UnsupportedJax(
            f"longctx supports {SUPPORTED} (tested: the floor on Python 3.11, the newest on 3.12+), not JAX "
            f"{version}: pip install '{SUPPORTED}' (with the CUDA plugin: the project's cuda12 or cuda13 extra)"
        )


def cuda_plugin() -> str | None:
    """The module of the installed CUDA plugin (CUDA 13's first), None when neither is installed."""
    for module in CUDA_PLUGINS.values():
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except ModuleNotFoundError:  # no jax_plugins package at all
            return None
    return None


def stack() -> str:
    """The installed JAX, jaxlib and accelerator plugins with their versions ('jax 0.11.2, jaxlib 0.11.2,
    jax-cuda13-plugin 0.11.2'): what a compile depends on, named before one that may crash the process."""
    found = []
    for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def cudnn_attention():
    """JAX's private cuDNN fused-attention module (jax._src.cudnn.fused_attention_stablehlo): its MaskType,
    AttentionLayout, binds and checks."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


@functools.cache
def cudnn_bind_parameters() -> dict:
    """Keyword parameters the cuDNN binds take in this JAX beyond the ones every supported version has: JAX 0.12
    added `score_mod` (flex attention's score function; None = plain attention)."""
    fa = cudnn_attention()
    impl = inspect.signature(fa._dot_product_attention_fwd_impl).parameters
    return {"score_mod": None} if "score_mod" in impl else {}


@functools.cache
def cudnn_packed_gqa() -> bool:
    """Whether JAX's packed cuDNN binding strides key / value offsets by the KEY heads, so that K / V may keep their
    own heads under GQA (JAX 0.11 on; 0.10.2 strides them by the query heads). Found by running the binding's offset
    fix-up (`_fix_seqlen_offsets`) on a packed GQA call of two segments (2 query heads, 1 key head, width 8), in a
    thread of its own: JAX's trace and mesh contexts are per thread, so it runs eagerly on the host even when asked
    inside a trace over compile-only devices."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_key_offsets_per_key_head).result()


def _key_offsets_per_key_head() -> bool:
    """cudnn_packed_gqa's check, run eagerly."""
    import numpy as np

    fa = cudnn_attention()
    query, key = np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 4, 1, 8), np.float32)
    seqlen, offsets = np.array([[2, 2]], np.int32), np.array([[0, 2, -1]], np.int32)
    kv_offsets = fa._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, query, key)[3]
    return int(np.asarray(kv_offsets).reshape(-1)[1]) == 2 * key.shape[2] * key.shape[3]


def cudnn_binds() -> tuple:
    """(forward, backward): the cuDNN primitives' binds taking the operands and the parameters every supported
    version has (scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length; the forward
    also is_training), the version's extra ones filled in."""
    fa, extra = cudnn_attention(), cudnn_bind_parameters()
    forward = functools.partial(fa._dot_product_attention_fwd_p_wrapper.bind, **extra)
    backward = functools.partial(fa._dot_product_attention_bwd_p_wrapper.bind, **extra)
    return forward, backward


def triton_compiler_params(num_warps: int, num_stages: int):
    """A pallas_call's compiler params naming the Triton backend (else JAX lowers it to Mosaic GPU)."""
    from jax.experimental.pallas import triton

    return triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def distributed_state():
    """JAX's distributed runtime state of this process: `.client` (the coordination service's key-value store) and
    `.coordinator_address`."""
    from jax._src import distributed

    return distributed.global_state


check_version()
