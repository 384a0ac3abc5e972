"""The speed estimate (train/planning/speed.py) on hand-written scheduled programs whose FLOPs, bytes and collectives
are known: each gives the time the rates imply, a collective hidden behind compute costs nothing while one waited for
at once costs its transfer, loops, conditionals and the attention kernels' visible share count as documented."""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels, tpu_targets
from parallel.kernels import visible
from parallel.kernels.arguments import Options, Tokens
from parallel.targets import H100_RATES
from train.planning import hlo, speed

RATES = H100_RATES
N = 8192
GEMM_FLOPS = 2.0 * N**3
GEMM = (
    '(bf16[8192,8192]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", '
    'backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
    '"rhs_contracting_dimensions":["0"]}}}'
)
GATHER_START = "((bf16[1024,1024]{{1,0}}), bf16[8192,1024]{{1,0}}) all-gather-start(%x), replica_groups={groups}"
GATHERED = 7 * 1024 * 1024 * 2  # bytes each device receives: 7 other shards of 2 MiB


def program(entry: str, *computations: str, parameters: str = "") -> str:
    """A scheduled module whose entry has the parameters a, b (bf16 [N, N]) and x (bf16 [1024, 1024])."""
    head = (
        "  %a = bf16[8192,8192]{1,0} parameter(0)\n  %b = bf16[8192,8192]{1,0} parameter(1)\n"
        f"  %x = bf16[1024,1024]{{1,0}} parameter(2)\n{parameters}"
    )
    body = "\n".join(computations)
    return (
        f"HloModule test, is_scheduled=true, num_partitions=8\n\n{body}\nENTRY %main () -> () {{\n{head}{entry}\n}}\n"
    )


def cost(text: str, hosts=(0,) * 8) -> speed.Tally:
    return speed.schedule_cost(text, RATES, list(hosts))


def test_a_matmul_takes_its_flops_at_the_matmul_rate():
    tally = cost(program(f"  ROOT %gemm = {GEMM}"))
    assert tally.seconds == pytest.approx(GEMM_FLOPS / RATES.matmul)
    assert tally.flops[speed.MATMULS] == GEMM_FLOPS and set(tally.parts) == {speed.MATMULS}


def test_an_all_gather_behind_a_matmul_is_hidden_and_one_waited_for_is_not():
    start = f"  %ag = {GATHER_START.format(groups='[1,8]<=[8]')}\n"
    done = "  %agd = bf16[8192,1024]{1,0} all-gather-done(%ag)\n"
    gemm = f"  %gemm = {GEMM}\n"
    transfer = GATHERED / RATES.nvlink
    hidden = cost(program(start + gemm + done))
    assert hidden.seconds == pytest.approx(GEMM_FLOPS / RATES.matmul)
    assert hidden.collectives["all-gather"] == pytest.approx(transfer) and hidden.parts["all-gather exposed"] == 0
    waited = cost(program(start + done + gemm))
    assert waited.seconds == pytest.approx(transfer + GEMM_FLOPS / RATES.matmul)
    assert waited.parts["all-gather exposed"] == pytest.approx(transfer)


def test_a_collective_between_hosts_runs_at_the_network_rate():
    hosts = [0] * 8 + [1] * 8
    within = cost(program(f"  %ag = {GATHER_START.format(groups='[2,8]<=[16]')}"), hosts)
    across = cost(program(f"  %ag = {GATHER_START.format(groups='[8,2]<=[2,8]T(1,0)')}"), hosts)
    assert within.collectives["all-gather"] == pytest.approx(GATHERED / RATES.nvlink)
    assert across.collectives["all-gather"] == pytest.approx(1024 * 1024 * 2 / RATES.network)  # one other shard


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("{{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("[2,2]<=[4]", [[0, 1], [2, 3]]),
        ("[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
        ("mesh['x'=2,'y'=2] {'x'}", [[0, 2], [1, 3]]),
        ("mesh['x'=2,'y'=2] {'x','y'}", [[0, 1, 2, 3]]),
        # JAX 0.10's form: the mesh's devices listed as an iota transposed
        ("mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'y'}", [[0, 2], [1, 3]]),
        ("mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'x'}", [[0, 1], [2, 3]]),
        ("mesh['x'=2,'y'=4], device_ids=([8]) {'y'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("{}", [[0, 1, 2, 3]]),
    ],
)
def test_replica_groups_in_every_form(groups, expected):
    instruction = hlo.parse_instruction(f"  %ag = {GATHER_START.format(groups=groups)}, dimensions={{0}}")
    assert speed.replica_groups(instruction, 4) == expected


def test_a_loop_costs_its_body_times_its_trips_and_a_conditional_its_costliest_usual_branch():
    body = (
        "%body (p: (bf16[8192,8192], bf16[8192,8192])) -> (bf16[8192,8192], bf16[8192,8192]) {\n"
        "  %p = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)\n"
        "  %a = bf16[8192,8192]{1,0} get-tuple-element(%p), index=0\n"
        "  %b = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1\n"
        f"  ROOT %gemm = {GEMM}\n}}\n"
    )
    cheap = "%cheap (p: bf16[8]) -> bf16[8] {\n  ROOT %p = bf16[8]{0} parameter(0)\n}\n"
    fallback = body.replace("%body", "%fallback").replace("}}}", '}}}, metadata={op_name="jit(f)/fallback/dot"}')
    loop = (
        "  %t = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) tuple(%a, %b)\n"
        "  %w = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) while(%t), condition=%cheap, body=%body, "
        'backend_config={"known_trip_count":{"n":"4"}}\n'
    )
    choice = (
        "  %i = s32[] parameter(3)\n"
        "  ROOT %c = bf16[8]{0} conditional(%i, %t, %t), branch_computations={%cheap, %fallback}\n"
    )
    one = GEMM_FLOPS / RATES.matmul
    assert cost(program(loop, body, cheap)).seconds == pytest.approx(4 * one)
    chosen = cost(program(loop + choice, body, cheap, fallback))
    assert chosen.seconds == pytest.approx(4 * one)  # the fallback branch's matmul is left out
    unknown = loop.replace('"n":"4"', '"m":"4"')
    alone = cost(program(unknown, body, cheap))
    assert alone.seconds == pytest.approx(one) and alone.unknown_loops == 1 and alone.bounded_loops == 0
    scoped = unknown.replace("}}\n", '}}, metadata={op_name="jit(f)/loop_bound_6/while"}\n')
    bounded = cost(program(scoped, body, cheap))
    assert bounded.seconds == pytest.approx(6 * one) and bounded.unknown_loops == 0 and bounded.bounded_loops == 1


def test_the_blockwise_kernels_loops_are_costed_at_their_bound_on_the_visible_pairs():
    """Its forward and backward walk each block's visible partners with a loop of run-time trips: costed at every
    block with the matmuls at the causal share, they count the visible pairs' FLOPs (the backward's five matmuls of
    the forward's size: 3.5 forwards in all)."""
    length, heads = 1024, (8, 2)
    kernel = kernels.select("blockwise", backend="cpu")

    def loss(q, k, v, ids):
        tokens = Tokens(ids, np.arange(length))
        return jnp.sum(kernels.attention(q, k, v, tokens, tokens, kernel=kernel)[0].astype(jnp.float32))

    shapes = [(1, length, heads[0], 128), *[(1, length, heads[1], 128)] * 2]
    operands = [*(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes), jnp.zeros((1, length), jnp.int32)]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*operands).lower().compile().as_text()
    tally = cost(text, hosts=(0,))
    visible_forward = 2.0 * heads[0] * (length * (length + 1) / 2) * (128 + 128)
    assert tally.unknown_loops == 0 and tally.bounded_loops == 2
    assert tally.flops[speed.ATTENTION] == pytest.approx(3.5 * visible_forward, rel=1e-3)


def test_an_attention_call_takes_its_visible_pairs_at_its_kernel_rate():
    q = "bf16[1,8192,32,128]{3,2,1,0}"
    operands = "".join(f"  %{n} = {q} parameter({i})\n" for i, n in enumerate(("q", "k", "v"), 3))
    forward = (
        f"  ROOT %fmha = ({q}, f32[1,32,8192]{{2,1,0}}) custom-call(%q, %k, %v), "
        'custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/attention_cudnn_visible_0.5000/fwd"}'
    )
    dense = 2.0 * 32 * 8192 * 8192 * (128 + 128)
    tally = cost(program(forward, parameters=operands))
    assert tally.flops[speed.ATTENTION] == pytest.approx(dense / 2)
    assert tally.seconds == pytest.approx(dense / 2 / RATES.attention["cudnn"])
    backward = forward.replace("fmhaSoftmax", "fmhaSoftmaxBackward")
    assert cost(program(backward, parameters=operands)).flops[speed.ATTENTION] == pytest.approx(2.5 * dense / 2)


def test_a_grouped_matmul_kernel_takes_the_rows_a_balanced_load_fills_at_the_matmul_rate():
    """tokamax's grouped matmul (parallel/grouped.py) over a receive buffer of 65536 rows, 1/4 of them filled by a
    balanced load: forward (x [rows, 2048] x w [16, 2048, 768]) and the weight gradient (its [16, 2048, 768] result)
    each cost 2 x rows/4 x 2048 x 768; the same call outside the grouped scope is not costed as one."""
    operands = (
        "  %rows = bf16[65536,2048]{1,0} parameter(3)\n  %w = bf16[16,2048,768]{2,1,0} parameter(4)\n"
        "  %dout = bf16[65536,768]{1,0} parameter(5)\n  %groups = s32[16]{0} parameter(6)\n"
    )
    scope = "jit(f)/grouped_matmul_filled_0.2500/grouped_matmul/ragged_dot_sm90/mpmd_map"
    forward = (
        '  ROOT %call = bf16[65536,768]{1,0} custom-call(%rows, %w, %groups), custom_call_target="mosaic_gpu_v2", '
        f'metadata={{op_name="{scope}"}}'
    )
    weights = (
        '  ROOT %call = bf16[16,2048,768]{2,1,0} custom-call(%groups, %rows, %dout), custom_call_target="mosaic_gpu_v2"'
        f', metadata={{op_name="{scope}"}}'
    )
    flops = 2.0 * 65536 / 4 * 2048 * 768
    for call in (forward, weights):
        tally = cost(program(call, parameters=operands))
        assert tally.flops[speed.MATMULS] == pytest.approx(flops) and set(tally.parts) == {speed.MATMULS}
        assert tally.seconds == pytest.approx(flops / RATES.matmul)
    unscoped = forward.replace("grouped_matmul_filled_0.2500/grouped_matmul/", "")
    assert cost(program(unscoped, parameters=operands)).flops[speed.MATMULS] == 0


def test_a_fusion_that_slices_an_operand_reads_the_slice():
    fused = (
        "%fused (p0: bf16[8192,8192], p1: s32[]) -> bf16[1,8192] {\n"
        "  %p0 = bf16[8192,8192]{1,0} parameter(0)\n  %p1 = s32[] parameter(1)\n  %z = s32[] constant(0)\n"
        "  ROOT %ds = bf16[1,8192]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,8192}\n}\n"
    )
    entry = "  %i = s32[] parameter(3)\n  ROOT %f = bf16[1,8192]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused\n"
    module = hlo.parse(program(entry, fused))
    estimator = speed.Estimator(module, RATES, [0])
    assert estimator.bytes(module.entry.by_name["f"], module.entry) == 2 * 8192 * 2 + 4  # row read, row written, index


@pytest.mark.parametrize(
    "q_index, kv_index, window, expected",
    [
        (np.arange(4), np.arange(4), None, 10 / 16),  # the causal diagonal
        (np.arange(4, 8), np.arange(4), None, 1.0),  # keys all before the queries
        (np.arange(4), np.arange(4, 8), None, 0.0),
        (np.arange(8), np.arange(8), 2, 15 / 64),  # a window of 2 keys
    ],
)
def test_visible_share_of_static_calls(q_index, kv_index, window, expected):
    options = Options(causal=True, window=window)
    assert visible.share(Tokens(None, q_index), Tokens(None, kv_index), options) == pytest.approx(expected)
    assert visible.share(Tokens(None, q_index), Tokens(None, kv_index), Options(causal=False)) == 1.0


def test_estimate_reports_step_tokens_and_mfu():
    tally = speed.Tally(seconds=2.0, parts=collections.Counter({speed.ATTENTION: 1.5, speed.MATMULS: 0.5}))
    estimate = speed.SpeedEstimate(tally, tokens=1_000_000, devices=8, model_flops=4e15, peak=1e15)
    assert estimate.tokens_per_second_per_device == 62_500 and math.isclose(estimate.mfu, 0.25)
    text = speed.format_estimate(estimate, "h100")
    assert "step 2 s, 62,500 tokens/s per GPU, MFU 25.0%" in text and "attention kernels 75%, matmuls 25%" in text


TPU = tpu_targets.TPU_TARGETS["v5p"].rates


def test_a_convolution_the_tpu_compiler_makes_of_a_dot_counts_the_dot_flops():
    """A plain dot as a convolution; and a batched one whose batch is a padded, reversed window (each output
    position meets one input position of its window), as libtpu writes `abte,eaf->btaf`."""
    plain = "  ROOT %c = bf16[8192,8192]{1,0} convolution(%a, %b), dim_labels=bf_io->bf"
    assert cost(program(plain)).flops[speed.MATMULS] == GEMM_FLOPS
    operands = "  %l = bf16[256,768,1]{2,1,0} parameter(3)\n  %r = bf16[4,64,256]{2,1,0} parameter(4)\n"
    batched = (
        "  ROOT %c = bf16[768,4,64]{2,1,0} convolution(%l, %r), window={size=4 pad=3_3 rhs_reversal=1}, "
        "dim_labels=fb0_0oi->b0f"
    )
    assert cost(program(batched, parameters=operands)).flops[speed.MATMULS] == 2.0 * 768 * 4 * 64 * 256


def test_a_loop_the_tpu_compiler_leaves_uncounted_takes_its_trips_from_its_condition():
    body = (
        "%body (p: (s32[], bf16[8192,8192], bf16[8192,8192])) -> (s32[], bf16[8192,8192], bf16[8192,8192]) {\n"
        "  %p = (s32[], bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)\n"
        "  %a = bf16[8192,8192]{1,0} get-tuple-element(%p), index=1\n"
        "  %b = bf16[8192,8192]{1,0} get-tuple-element(%p), index=2\n"
        f"  ROOT %gemm = {GEMM}\n}}\n"
    )
    condition = (
        "%condition (p: (s32[], bf16[8192,8192], bf16[8192,8192])) -> pred[] {\n"
        "  %limit = s32[] constant(5)\n  %p = (s32[], bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) parameter(0)\n"
        "  %i = s32[] get-tuple-element(%p), index=0\n  ROOT %lt = pred[] compare(%i, %limit), direction=LT\n}\n"
    )
    loop = (
        "  %one = s32[] constant(1)\n"
        "  %t = (s32[], bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) tuple(%one, %a, %b)\n"
        "  ROOT %w = (s32[], bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}) while(%t), condition=%condition, body=%body\n"
    )
    tally = cost(program(loop, body, condition))
    assert tally.seconds == pytest.approx(4 * GEMM_FLOPS / RATES.matmul) and tally.unknown_loops == 0
    unknown = cost(program(loop, body, condition.replace("%limit)", "%i)")))
    assert unknown.unknown_loops == 1


def test_a_splash_call_takes_the_matmuls_it_computes_on_its_visible_pairs_at_the_splash_rate():
    """A splash dq kernel (1.5 forwards: it recomputes the scores), its metadata on a line of its own as libtpu
    prints a Pallas TPU kernel."""
    q, kv = "bf16[1,32,8192,128]{3,2,1,0}", "bf16[1,8,8192,128]{3,2,1,0}"
    operands = "  %m = s8[1,32,32]{2,1,0} parameter(3)\n" + "".join(
        f"  %{n} = {shape} parameter({i})\n" for i, (n, shape) in enumerate((("q", q), ("k", kv), ("v", kv)), 4)
    )
    call = (
        f"  ROOT %splash_mha_dq_segmented_no_residuals.3 = {q} custom-call(%m, %q, %k, %v), "
        'custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={"a":\n'
        '}}, metadata={op_name="jit(f)/attention_splash_visible_0.5000/splash_mha_dq/pallas_call"}'
    )
    tally = speed.schedule_cost(program(call, parameters=operands), TPU, [0] * 8)
    flops = 0.5 * 1.5 * 2.0 * 32 * 8192 * 8192 * (128 + 128)
    assert tally.flops[speed.ATTENTION] == pytest.approx(flops)
    assert tally.seconds == pytest.approx(flops / TPU.attention["splash"])


def test_a_tpu_estimate_says_its_rates_are_not_measured():
    tally = speed.Tally(seconds=1.0, parts=collections.Counter({speed.MATMULS: 1.0}))
    estimate = speed.SpeedEstimate(tally, tokens=16_000, devices=16, model_flops=1e15, peak=459e12, platform="tpu")
    text = speed.format_estimate(estimate, "v5p")
    assert "v5p: data-sheet rates at assumed shares, parallel/tpu_targets.py; not measured on a TPU" in text
    assert "1,000 tokens/s per device" in text


def test_a_tpu_copy_or_slice_on_its_dma_engines_costs_no_compute_time():
    copies = (
        "  %c = (bf16[8192,8192]{1,0}, bf16[8192,8192]{1,0}, u32[]) copy-start(%a)\n"
        "  %s = ((bf16[8192,8192]{1,0}), bf16[1,8192]{1,0}, s32[]) slice-start(%b), slice={[0:1], [0:8192]}\n"
    )
    assert speed.schedule_cost(program(copies), TPU, [0] * 8).seconds == 0.0
    assert cost(program(copies)).seconds > 0.0  # a GPU's copy-start is a kernel
