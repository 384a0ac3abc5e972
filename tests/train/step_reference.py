"""One train step's loss and gradients on packed rows, on any mesh, for comparing parallel layouts with one device.

`initial_state(model)` builds the host state once; `first_step(...)` runs the step as the training loop would
(parallelism from the parallel config, batch reordered on the host and sharded) with an optimizer that keeps the
gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from parallel.mesh import batch_sharding, make_mesh
from parallel.settings import check_context, make_parallelism, to_layout
from train.config import ComputeConfig, MeshConfig, ModelConfig, ParallelConfig
from train.state import TrainState, abstract_state, create_state
from train.step import make_eval_step, make_train_step

ROWS, LENGTH = 2, 64
COMPUTE = ComputeConfig(dtype="float32", remat_policy="none")


def keep_grads() -> optax.GradientTransformation:
    """Leaves the parameters alone and keeps the last gradients as its state (to read them off a train step)."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def packed_batch(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """[ROWS, LENGTH] rows of several documents each and trailing padding (segment 0), in original order."""
    rng = np.random.default_rng(seed)
    segment_ids, positions = np.zeros((ROWS, LENGTH), np.int32), np.zeros((ROWS, LENGTH), np.int32)
    for row in range(ROWS):
        start, end, doc = 0, LENGTH - int(rng.integers(3, 12)), 1
        while start < end:
            n = min(int(rng.integers(5, 30)), end - start)
            segment_ids[row, start : start + n], positions[row, start : start + n] = doc, np.arange(n)
            start, doc = start + n, doc + 1
    real = segment_ids > 0
    tokens = np.where(real, rng.integers(1, vocab_size, (ROWS, LENGTH)), 0).astype(np.int32)
    same_doc = real & (np.roll(segment_ids, -1, axis=1) == segment_ids)
    targets = np.where(same_doc, np.roll(tokens, -1, axis=1), 0).astype(np.int32)
    return dict(
        tokens=tokens,
        targets=targets,
        segment_ids=segment_ids,
        positions=positions,
        loss_mask=same_doc.astype(np.float32),
    )


def long_document_batch(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """`packed_batch` whose first row is one document of LENGTH tokens (longer than a context device's pieces and
    than a sliding window), with a loss on every next token."""
    batch = packed_batch(vocab_size, seed)
    tokens = np.random.default_rng(seed + 1).integers(1, vocab_size, LENGTH).astype(np.int32)
    batch["tokens"][0], batch["segment_ids"][0], batch["positions"][0] = tokens, 1, np.arange(LENGTH)
    batch["targets"][0] = np.append(tokens[1:], 0)
    batch["loss_mask"][0] = np.arange(LENGTH) < LENGTH - 1
    return batch


def initial_state(model: ModelConfig):
    """Host copy of a fresh (model, optimizer) state, to be placed on every mesh."""
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    return jax.device_get(create_state(model, keep_grads(), mesh, seed=0, compute=COMPUTE).state)


def first_step(
    host_state, model: ModelConfig, mesh_config: MeshConfig, parallel_config: ParallelConfig, devices, make_batch=None
):
    """(losses [the token loss, then the router's load-balancing loss and the indexer's loss when the model trains
    with them], {parameter path: gradient}) of one train step on `make_batch(vocab_size)` (packed_batch) as the loop
    would run it."""
    mesh = make_mesh(mesh_config, devices)
    check_context(parallel_config, mesh.shape, seq_len=LENGTH, num_heads=model.num_heads)
    parallelism = make_parallelism(parallel_config, mesh.shape)
    graphdef, _, shardings = abstract_state(model, keep_grads(), mesh, compute=COMPUTE)
    state = TrainState(graphdef, jax.device_put(host_state, shardings), shardings)
    step = make_train_step(state, mesh, chunk_size=32, accum_steps=1, parallelism=parallelism)
    batch = to_layout((make_batch or packed_batch)(model.vocab_size), parallelism, mesh.shape["context"])
    with jax.set_mesh(mesh):
        new_state, metrics = step(state.state, jax.device_put(batch, batch_sharding(mesh)))
    grads = jax.tree_util.tree_leaves_with_path(jax.device_get(new_state[1]["opt_state"]))
    losses = np.array([float(metrics[key]) for key in ("loss", "router_aux_loss", "indexer_loss") if key in metrics])
    return losses, {jax.tree_util.keystr(path): np.asarray(g) for path, g in grads}


def assert_same_step(result, reference, tolerance: float = 1e-5) -> None:
    """Losses within `tolerance` relative and every gradient within `tolerance` in relative L2 norm."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    np.testing.assert_allclose(loss, ref_loss, rtol=tolerance)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        error = np.linalg.norm(grads[name] - ref) / max(np.linalg.norm(ref), 1e-30)
        assert error <= tolerance, (name, error)


def eval_sums(
    host_state, model: ModelConfig, mesh_config: MeshConfig, parallel_config: ParallelConfig, devices, buckets
):
    """(loss sums, token counts), each [1 + len(buckets)], of the eval step on `packed_batch()` as the loop runs it."""
    mesh = make_mesh(mesh_config, devices)
    parallelism = make_parallelism(parallel_config, mesh.shape)
    graphdef, _, shardings = abstract_state(model, keep_grads(), mesh, compute=COMPUTE)
    state = TrainState(graphdef, jax.device_put(host_state, shardings), shardings)
    step = make_eval_step(state, mesh, chunk_size=32, parallelism=parallelism, buckets=buckets)
    batch = to_layout(packed_batch(model.vocab_size), parallelism, mesh.shape["context"])
    with jax.set_mesh(mesh):
        sums, counts = step(state.state, jax.device_put(batch, batch_sharding(mesh)))
    return np.asarray(sums), np.asarray(counts)


def token_losses(host_state, model: ModelConfig) -> np.ndarray:
    """[ROWS, LENGTH] next-token loss of every position of `packed_batch()`, from the model's logits on one device
    (no loss code involved)."""
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    graphdef, _, _ = abstract_state(model, keep_grads(), mesh, compute=COMPUTE)
    network, _ = nnx.merge(graphdef, jax.device_put(host_state, jax.devices()[0]))
    batch = packed_batch(model.vocab_size)
    hidden, _ = network.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
    logits = np.asarray(hidden @ network.output_kernel(), np.float64)
    picked = np.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1) - picked
