"""Expert parallelism (parallel/experts.py): an MoE block on 8 devices equals the one-device MoE in outputs, expert
counts, summed router probabilities and gradients (both router kinds and GPT-OSS's biased experts, capacity and
ragged dispatch, chunked); drops equal a NumPy reference; the ragged dispatch's offsets and sizes move the right rows
under ragged all-to-all's documented semantics."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from layers.moe import MoE
from parallel import experts
from parallel.experts import COMMON_LOAD, capacity, expert_axes, ragged_as_capacity, ragged_layout, receive_rows
from parallel.mesh import MeshError, make_mesh, state_shardings
from parallel.parallelism import Parallelism, use_parallelism
from parallel.settings import expert_dispatch
from parallel.tensor import residual_spec
from train.config import MeshConfig, ParallelConfig

EMBED, MLP, EXPERTS, K = 16, 8, 8, 2
BATCH, LENGTH = 8, 16
DROPLESS = EXPERTS / K  # capacity factor whose buffers hold every assignment of a device
DROPLESS_PLAN = Parallelism(expert_capacity=DROPLESS)


def make_moe(score: str) -> MoE:
    """score sigmoid or softmax (with a gated shared expert); clamped: GPT-OSS's experts (softmax routing with a
    logit bias, clamped SwiGLU experts with biases), every bias random, so that a bias sent to the wrong expert
    shows."""
    sigmoid, clamped = score == "sigmoid", score == "clamped"
    moe = MoE(
        EMBED,
        num_experts=EXPERTS,
        experts_per_token=K,
        moe_mlp_dim=MLP,
        num_shared_experts=0 if clamped else 1,
        n_group=4 if sigmoid else 1,
        topk_group=2 if sigmoid else 1,
        norm_topk_prob=sigmoid or clamped,
        routed_scaling_factor=1.0 if clamped else 2.5,
        router_score="sigmoid" if sigmoid else "softmax",
        router_logit_bias=clamped,
        expert_mlp="clamped_swiglu" if clamped else "swiglu",
        swiglu_limit=1.0,
        shared_gate=score == "softmax",
        rngs=nnx.Rngs(0),
    )
    if sigmoid:
        moe.bias[...] = 0.1 * jax.random.normal(jax.random.key(2), (EXPERTS,))
    if clamped:
        for index, name in enumerate(("router_bias", "experts_gate_up_bias", "experts_down_bias")):
            param = getattr(moe, name)
            param[...] = 0.5 * jax.random.normal(jax.random.key(10 + index), param.shape)
    return moe


def tokens() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, LENGTH, EMBED))


def run(
    moe: MoE,
    x,
    mesh_config: MeshConfig | None = None,
    parallelism: Parallelism = Parallelism(expert_capacity=DROPLESS),
    x_spec: PartitionSpec | None = None,
):
    """(y, counts, dropped, d loss / d x, d loss / d params, router probabilities summed per expert) of the MoE on
    `mesh_config` (None: one device), x placed as the residual stream (or by `x_spec`); the loss reads y and the
    probabilities."""
    graphdef, state = nnx.split(moe)
    cotangent = jax.random.normal(jax.random.key(7), x.shape)

    def forward(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * cotangent) + jnp.sum(stats["probabilities"] * jnp.arange(EXPERTS)), (y, stats)

    step = jax.grad(forward, argnums=(0, 1), has_aux=True)
    with use_parallelism(parallelism):
        if mesh_config is None:
            (grad_state, grad_x), (y, stats) = jax.jit(step)(state, x)
        else:
            mesh = make_mesh(mesh_config)
            with jax.set_mesh(mesh):
                shardings = (
                    nnx.state(state_shardings(state, mesh)),
                    NamedSharding(mesh, residual_spec() if x_spec is None else x_spec),
                )
                (grad_state, grad_x), (y, stats) = jax.jit(step, in_shardings=shardings)(state, x)
    grads = {
        jax.tree_util.keystr(path): np.asarray(g)
        for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grad_state, nnx.Param))
    }
    stats = {key: np.asarray(value) for key, value in stats.items()}
    return np.asarray(y), stats["counts"], float(stats["dropped"]), np.asarray(grad_x), grads, stats["probabilities"]


def assert_close(actual, expected, what: str = "", tolerance=1e-5):
    """Relative error (Frobenius) of `actual` against `expected` at most `tolerance`; a failure names `what`."""
    error = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    assert error <= tolerance, f"{what}: relative error {error}"


@pytest.fixture(scope="module")
def one_device():
    """router score -> the one-device (dropless) result, computed on first use."""
    cache = {}

    def get(score):
        if score not in cache:
            cache[score] = run(make_moe(score), tokens())
        return cache[score]

    return get


MESHES = {
    "context8": (MeshConfig(fsdp=1, context=8), DROPLESS_PLAN),
    "expert2-context4": (MeshConfig(fsdp=1, expert=2, context=4), DROPLESS_PLAN),
    "context2-tensor4": (MeshConfig(fsdp=1, context=2, tensor=4), DROPLESS_PLAN),
    "fsdp2-expert2-tensor2": (MeshConfig(fsdp=2, expert=2, tensor=2), DROPLESS_PLAN),
    "data2-context2-ulysses2": (MeshConfig(data=2, fsdp=1, context=2, ulysses=2), DROPLESS_PLAN),
    "tensor4-fsdp2-replicated": (MeshConfig(fsdp=2, tensor=4), dataclasses.replace(DROPLESS_PLAN, scatter=False)),
    "expert2-context4-chunked": (
        MeshConfig(fsdp=1, expert=2, context=4),
        dataclasses.replace(DROPLESS_PLAN, expert_chunk=3),
    ),
    "fsdp8-no-expert-axis": (MeshConfig(fsdp=8), DROPLESS_PLAN),
}


# the router kind does not interact with the mesh: softmax runs on three meshes, GPT-OSS's experts on two, sigmoid on
# all
CAPACITY_CASES = (
    [(name, "sigmoid") for name in MESHES]
    + [(name, "softmax") for name in ("context8", "expert2-context4", "context2-tensor4")]
    + [(name, "clamped") for name in ("expert2-context4", "fsdp2-expert2-tensor2")]
)


@pytest.mark.parametrize("name, score", CAPACITY_CASES)
def test_capacity_dispatch_equals_one_device(one_device, name, score):
    mesh_config, parallelism = MESHES[name]
    y, counts, dropped, grad_x, grads, probabilities = run(make_moe(score), tokens(), mesh_config, parallelism)
    ref_y, ref_counts, _, ref_grad_x, ref_grads, ref_probabilities = one_device(score)
    assert_close(y, ref_y, "output")
    np.testing.assert_array_equal(counts, ref_counts)
    assert_close(probabilities, ref_probabilities, "router probabilities")
    assert dropped == 0
    assert_close(grad_x, ref_grad_x, "input gradient")
    assert grads.keys() == ref_grads.keys()
    for key, ref in ref_grads.items():
        assert_close(grads[key], ref, f"gradient of {key}")


def test_expert_axes_are_those_that_divide_the_experts():
    def axes(num_experts, **sizes):
        return expert_axes(make_mesh(MeshConfig(**{"fsdp": -1, **sizes})), num_experts)

    assert axes(8, context=8) == ("context",)
    assert axes(8, expert=2, context=4) == ("expert", "context")
    assert axes(4, expert=2, tensor=4) == ("expert",)  # tensor=4 does not divide 4 / 2: data parallel
    assert axes(64, context=2, ulysses=2, tensor=2) == ("context", "ulysses", "tensor")
    assert axes(8, fsdp=8) == ()


def test_ragged_dispatch_sums_no_rows_gradient_over_devices():
    """The real ragged_all_to_all (traced: XLA:CPU cannot compile it; the emulation above has its own typing) types its
    result by its output buffer: from an invariant buffer, JAX summed the received rows' gradient over every device
    (psum_invariant) before sending it home. No sum in the gradient has the shape of a receive buffer."""
    mesh_config, parallelism = MESHES["expert2-context4"]
    graphdef, state = nnx.split(make_moe("sigmoid"))

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0])

    with (
        use_parallelism(dataclasses.replace(parallelism, expert_dispatch="ragged")),
        jax.set_mesh(make_mesh(mesh_config)),
    ):
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, tokens()))
    buffers = set(re.findall(r"(\w+\[[\d,]+\])(?:\{[^}]*\})? = ragged_all_to_all\[", jaxpr))
    summed = set(re.findall(r"(\w+\[[\d,]+\])(?:\{[^}]*\})? = psum(?:_invariant)?\[", jaxpr))
    assert buffers and not buffers & summed, (buffers, summed)


def numpy_capacity_reference(moe: MoE, x: np.ndarray, devices: int, factor: float):
    """The MoE's routed output with, per source device (its piece of the length axis, context only) and expert,
    the first C assignments in (token, k) order kept: (routed y without the shared expert, dropped count)."""
    p = {
        name: np.asarray(getattr(moe, name)[...], np.float64) for name in ("experts_gate", "experts_up", "experts_down")
    }
    y, dropped = np.zeros(x.shape), 0
    for device in range(devices):
        piece = slice(device * LENGTH // devices, (device + 1) * LENGTH // devices)
        local = x[:, piece].reshape(-1, EMBED)
        weights, experts = (np.asarray(a) for a in jax.jit(lambda t: moe.route(t))(jnp.asarray(local)))
        cap = capacity(len(local), K, EXPERTS, factor)
        seen = np.zeros(EXPERTS, int)
        out = np.zeros(local.shape)
        for n in range(len(local)):
            for j in range(K):
                e = experts[n, j]
                seen[e] += 1
                if seen[e] > cap:
                    dropped += 1
                    continue
                pre = local[n] @ p["experts_gate"][e]
                out[n] += weights[n, j] * (
                    (pre / (1 + np.exp(-pre)) * (local[n] @ p["experts_up"][e])) @ p["experts_down"][e]
                )
        y[:, piece] = out.reshape(BATCH, -1, EMBED)
    return y, dropped


def test_capacity_drops_equal_numpy_reference():
    moe = make_moe("sigmoid")
    moe.shared = None
    x = tokens()
    y, counts, dropped, *_ = run(moe, x, MeshConfig(fsdp=1, context=8), Parallelism(expert_capacity=0.5))
    expected, expected_dropped = numpy_capacity_reference(moe, np.asarray(x, np.float64), 8, 0.5)
    assert expected_dropped > 0 and dropped == expected_dropped
    assert counts.sum() == BATCH * LENGTH * K
    assert_close(y, expected)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """jax.lax.ragged_all_to_all by its documented semantics, from all-gathers (XLA:CPU cannot compile the real
    one): slice i of every sender goes to device i // slices_per_device at that sender's output_offsets[i]."""
    devices = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    per_device = input_offsets.shape[0] // devices
    everything = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes, output_offsets)]
    operands, starts, sizes, landings = everything
    rows = jnp.arange(output.shape[0])
    result = output
    for source in range(devices):
        for j in range(per_device):
            i = me * per_device + j
            start, size, landing = starts[source, i], sizes[source, i], landings[source, i]
            inside = (rows >= landing) & (rows < landing + size)
            picked = jnp.take(operands[source], jnp.clip(rows - landing + start, 0, operand.shape[0] - 1), axis=0)
            result = jnp.where(inside.reshape(-1, *[1] * (output.ndim - 1)), picked, result)
    return result


@pytest.mark.parametrize(
    "name, score",
    [
        ("expert2-context4", "sigmoid"),
        ("context2-tensor4", "sigmoid"),
        ("expert2-context4-chunked", "sigmoid"),
        ("expert2-context4", "clamped"),
    ],
)
def test_ragged_dispatch_equals_one_device(monkeypatch, one_device, name, score):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    mesh_config, parallelism = MESHES[name]
    parallelism = dataclasses.replace(parallelism, expert_dispatch="ragged")
    # factor = devices: a receive buffer of every device's assignments; EXPERTS / K >= 4 expert-parallel devices
    y, counts, dropped, grad_x, grads, probabilities = run(make_moe(score), tokens(), mesh_config, parallelism)
    ref_y, ref_counts, _, ref_grad_x, ref_grads, ref_probabilities = one_device(score)
    assert_close(y, ref_y, "output")
    np.testing.assert_array_equal(counts, ref_counts)
    assert_close(probabilities, ref_probabilities, "router probabilities")
    assert dropped == 0
    assert_close(grad_x, ref_grad_x, "input gradient")
    for key, ref in ref_grads.items():
        assert_close(grads[key], ref, f"gradient of {key}")


@pytest.mark.parametrize("common_load", [0.25, experts.COMMON_LOAD])
def test_dropless_ragged_dispatch_runs_the_worst_case_buffer_only_when_one_overflows(
    monkeypatch, one_device, common_load
):
    """Dropless, the ragged dispatch's usual buffer holds common_load x the balanced load: at 0.25 the fullest device
    overflows it and the step runs the worst-case buffer, at the default it fits and the step keeps the usual one;
    both equal one device with nothing dropped (a step left in the overflowed buffer would drop rows)."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    monkeypatch.setattr(experts, "COMMON_LOAD", common_load)
    mesh_config, parallelism = MESHES["expert2-context4"]  # 8 expert devices, one expert each
    parallelism = dataclasses.replace(parallelism, expert_dispatch="ragged", expert_capacity=math.inf)
    y, counts, dropped, grad_x, grads, _ = run(make_moe("sigmoid"), tokens(), mesh_config, parallelism)
    n = BATCH * LENGTH // 8
    usual = receive_rows(n, K, common_load, 8, 1)
    assert usual < receive_rows(n, K, math.inf, 8, 1)  # the run-time branch is there
    assert (counts.max() > usual) == (common_load < 1)  # which buffer the step ran
    ref_y, ref_counts, _, ref_grad_x, ref_grads, _ = one_device("sigmoid")
    assert dropped == 0
    np.testing.assert_array_equal(counts, ref_counts)
    assert_close(y, ref_y, "output")
    assert_close(grad_x, ref_grad_x, "input gradient")
    for key, ref in ref_grads.items():
        assert_close(grads[key], ref, f"gradient of {key}")


def simulate_ragged_all_to_all(operands, input_offsets, send_sizes, output_offsets, recv_sizes, output_rows):
    """NumPy: ragged all-to-all as documented, over lists indexed by device; checks the send/recv size contract."""
    devices = len(operands)
    per_device = len(input_offsets[0]) // devices
    results = [np.full((output_rows, *operands[0].shape[1:]), -1, operands[0].dtype) for _ in range(devices)]
    for sender in range(devices):
        for i in range(len(input_offsets[sender])):
            receiver, size = i // per_device, send_sizes[sender][i]
            assert recv_sizes[receiver][sender * per_device + i % per_device] == size
            chunk = operands[sender][input_offsets[sender][i] : input_offsets[sender][i] + size]
            results[receiver][output_offsets[sender][i] : output_offsets[sender][i] + size] = chunk
    return results


@pytest.mark.parametrize("rows", [1000, 30, 7])
def test_ragged_layout_moves_the_right_rows(rows):
    devices, num_experts = 4, 8
    local = num_experts // devices
    table = np.random.default_rng(rows).integers(0, 9, (devices, num_experts))
    layouts = [
        jax.tree.map(np.asarray, jax.jit(ragged_layout, static_argnums=2)(jnp.asarray(table), me, rows))
        for me in range(devices)
    ]
    # each device's rows sorted by expert, labelled (source, expert, index within the expert)
    sent = [
        np.array([(s, e, i) for e in range(num_experts) for i in range(table[s, e])]).reshape(-1, 3)
        for s in range(devices)
    ]
    received = simulate_ragged_all_to_all(
        sent,
        [lay.send_offsets for lay in layouts],
        [lay.send_sizes for lay in layouts],
        [lay.remote_offsets for lay in layouts],
        [lay.recv_sizes for lay in layouts],
        rows,
    )
    for me, (layout, buffer) in enumerate(zip(layouts, received, strict=True)):
        used = int(layout.group_sizes.sum())
        assert used <= rows and np.all(buffer[used:] == -1)
        experts = me * local + np.repeat(np.arange(local), layout.group_sizes)
        np.testing.assert_array_equal(buffer[:used, 1], experts)  # grouped by local expert, in order
        for e in range(me * local, (me + 1) * local):  # (source, index) order within an expert: a prefix kept
            got = buffer[:used][buffer[:used, 1] == e][:, [0, 2]]
            full = np.array([(s, i) for s in range(devices) for i in range(table[s, e])]).reshape(-1, 2)
            np.testing.assert_array_equal(got, full[: len(got)])
        assert used == min(rows, table[:, me * local : (me + 1) * local].sum())
    homes = simulate_ragged_all_to_all(
        received,
        [lay.recv_offsets for lay in layouts],
        [lay.recv_sizes for lay in layouts],
        [lay.home_offsets for lay in layouts],
        [lay.send_sizes for lay in layouts],
        max(len(s) for s in sent),
    )
    for source, layout in enumerate(layouts):  # the return trip puts every kept row back where it was sent from
        kept = np.concatenate(
            [np.arange(start, start + size) for start, size in zip(layout.send_offsets, layout.send_sizes, strict=True)]
        ).astype(int)
        np.testing.assert_array_equal(homes[source][kept], sent[source][kept])
        assert np.all(homes[source][np.setdiff1d(np.arange(len(sent[source])), kept)] == -1)


def test_ragged_dispatch_is_refused_on_cpu_before_compiling():
    with pytest.raises(MeshError, match="expert_dispatch=ragged needs a GPU or TPU: XLA:CPU cannot compile"):
        expert_dispatch(ParallelConfig(expert_dispatch="ragged"), "cpu")
    assert expert_dispatch(ParallelConfig(expert_dispatch="auto"), "cpu") == "capacity"
    assert expert_dispatch(ParallelConfig(expert_dispatch="auto"), "gpu") == "ragged"
    assert expert_dispatch(ParallelConfig(expert_dispatch="ragged"), "tpu") == "ragged"


def test_a_shape_that_does_not_split_runs_dropless_on_every_token():
    """E.g. sampling: 3 rows of 7 tokens on expert=2 x context=4; the partitioner places a dropless MoE."""
    moe = make_moe("sigmoid")
    x = tokens()[:3, :7]
    small = Parallelism(expert_capacity=0.1)  # a capacity this small would drop
    y, counts, dropped, *_ = run(moe, x, MeshConfig(fsdp=1, expert=2, context=4), small, x_spec=PartitionSpec())
    ref_y, ref_counts, *_ = run(moe, x)
    assert_close(y, ref_y, "output")
    np.testing.assert_array_equal(counts, ref_counts)
    assert dropped == 0


def test_kernels_are_stored_split_over_the_expert_axes():
    moe = make_moe("sigmoid")
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    spec = state_shardings(nnx.state(moe), mesh)["experts_gate"].get_value().spec
    assert spec == PartitionSpec(("expert", "tensor"), "fsdp", None)


@pytest.mark.parametrize("n, k, experts, sources", [(1024, 8, 256, 16), (4096, 8, 128, 16), (2048, 4, 32, 8)])
def test_a_cpu_plan_of_the_ragged_dispatch_holds_its_buffers(n, k, experts, sources):
    """Dropless and with a factor, the capacity dispatch that stands in for the ragged one in a CPU memory plan receives
    as many rows per device: experts x C = the ragged receive buffer (dropless: its usual one, which its passes do not
    exceed)."""
    local = experts // sources
    for factor, rows in (
        (math.inf, min(receive_rows(n, k, COMMON_LOAD, sources, local), receive_rows(n, k, math.inf, sources, local))),
        (1.25, receive_rows(n, k, 1.25, sources, local)),
    ):
        stand_in = capacity(n, k, experts, ragged_as_capacity(factor, k, experts, sources))
        assert experts * stand_in == pytest.approx(rows, rel=1e-3)
