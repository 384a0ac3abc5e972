"""How fast a compiled train step will run on the GPUs or TPUs it was compiled for, estimated from the program XLA's
compiler made (train/planning/hlo.py reads it), at the rates of parallel/targets.py (GPUs, measured) or
parallel/tpu_targets.py (TPUs, data sheets at assumed shares); nothing runs.

The schedule is walked in order on two streams, as a GPU runs it: kernels one after another on the compute stream;
collectives on a second stream, an async one from its start to its done, so the compute scheduled between them
hides it and the done waits only for what is left ("exposed"). A kernel takes the longer of its FLOPs at the
device's rate (matmuls: the dots or convolutions of a fusion, or a cuBLAS call; fused attention: the call's (query,
key) pairs that its mask leaves visible, named by parallel/kernels/visible.py, at the kernel's rate; FLOPs per
instruction in train/planning/instruction_flops.py) and its bytes (read + written) at the memory bandwidth, and at
least a kernel's latency. A collective moves its bytes as NCCL's ring algorithms do, at NVLink's rate within a host
and at the network's between hosts (a TPU's ICI for both). A loop costs its body times its trip count (one decided
at run time: the bound its scope names, parallel/kernels/visible.py); a conditional its costliest branch (run-time
fallbacks left out).

Not counted: documents (a call is costed as if its row were one document: packed rows run faster), kernels
running side by side, collectives contending with kernels for memory bandwidth and SMs, autotuned GEMM and fusion
configs (none without a device), and the host (input pipeline, Python).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from parallel.kernels.visible import BOUND, FALLBACK
from parallel.rates import Rates
from train.planning import hlo
from train.planning.flops import PEAK_FLOPS, flops_per_token
from train.planning.instruction_flops import (
    GEMMS,
    MATMUL_OPS,
    attention_flops,
    attention_multiple,
    gemm_flops,
    grouped_flops,
    grouped_share,
)

FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id", "after-all",
    "opt-barrier", "add-dependency", "copy-done", "send-done", "recv-done", "domain",
}  # fmt: skip
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
SCOPE = re.compile(r"attention_(\w+?)_visible_([0-9.]+)")
TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
BOUNDS = re.compile(BOUND.format(trips=r"(\d+)"))
ATTENTION = "attention kernels"
ATTENTION_GLUE = "attention glue (copies, pads)"
MATMULS = "matmuls"
MEMORY_BOUND = "memory-bound kernels"


@dataclasses.dataclass
class Tally:
    """Seconds of a schedule, `parts` splitting them by what the compute stream spent them on (kernels by kind,
    waits for collectives as '<collective> exposed'); `collectives` the seconds each kind of collective took on its
    stream, hidden or not; `flops` by kind; `kernels` how many kernels ran; `bounded_loops` the loops whose trip
    count is decided at run time costed at their bound, `unknown_loops` those with none (counted once)."""

    seconds: float = 0.0
    kernels: float = 0.0
    parts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    flops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    bounded_loops: int = 0
    unknown_loops: int = 0

    def add(self, other: Tally, times: float = 1.0) -> None:
        self.seconds += other.seconds * times
        self.kernels += other.kernels * times
        self.bounded_loops += other.bounded_loops
        self.unknown_loops += other.unknown_loops
        for mine, theirs in (
            (self.parts, other.parts),
            (self.collectives, other.collectives),
            (self.flops, other.flops),
        ):
            for key, value in theirs.items():
                mine[key] += value * times


def replica_groups(instruction: hlo.Instruction, partitions: int) -> list[list[int]]:
    """The partition groups of a collective, from any of XLA's forms: {{0,1},{2,3}}, iota [2,2]<=[4] (with a
    transpose T(..)), mesh['x'=2,'y'=2] {'y'} (its devices in order, or as device_ids=([..]T(..)) lists them), or {}
    (all partitions)."""
    text = instruction.attributes
    if pairs := re.search(r"source_target_pairs=\{(.*?)\}\}", text):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}", text
    )
    if mesh:
        axes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        grouped = [names.index(a) for a in re.findall(r"'(\w+)'", mesh.group(4))]
        ids = _iota(mesh.group(2), mesh.group(3)) if mesh.group(2) else np.arange(math.prod(sizes))  # its devices
        ids = np.moveaxis(ids.reshape(sizes), grouped, range(len(sizes) - len(grouped), len(sizes)))
        return ids.reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    if iota := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        return _iota(iota.group(2), iota.group(3)).reshape([int(d) for d in iota.group(1).split(",")]).tolist()
    if groups := re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", text):
        return [[int(d) for d in group.split(",") if d] for group in re.findall(r"\{([\d,]*)\}", groups.group(1))]
    return [list(range(partitions))]


def _iota(dims: str, transpose: str | None) -> np.ndarray:
    """XLA's iota device list "[dims]T(transpose)" as written ("4,2", "1,0" or None): arange over dims, transposed."""
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    return ids.transpose([int(d) for d in transpose.split(",")]) if transpose else ids


class Estimator:
    """Costs the computations of `module` at `rates`; `hosts[p]` is the host of partition p."""

    def __init__(self, module: hlo.Module, rates: Rates, hosts: list[int]):
        self.module, self.rates, self.hosts = module, rates, hosts
        self.memo: dict[str, Tally] = {}
        # a TPU's copy-start and slice-start move data (between its memories, out of an array) on DMA engines,
        # beside the compute
        self.free = FREE | ({"copy-start", "slice-start"} if rates.platform == "tpu" else set())

    def computation(self, name: str) -> Tally:
        """The schedule of computation `name`, walked on a compute and a collective stream."""
        if name in self.memo:
            return self.memo[name]
        computation = self.module.computations[name]
        tally, clock, link, pending = Tally(), 0.0, 0.0, {}
        for instruction in computation.instructions:
            op = instruction.opcode
            if op in self.free:
                continue
            if sub := self.control(instruction, computation):
                clock += sub.seconds
                tally.add(sub)
            elif (kind := _collective(instruction, self.module)) is not None:
                seconds = self.collective(kind, instruction, computation)
                tally.collectives[kind] += seconds
                begin = max(clock, link)
                link = begin + seconds
                if op.endswith("-start"):
                    pending[instruction.name] = (link, kind)
                else:
                    tally.parts[f"{kind} exposed"] += link - clock
                    clock = link
            elif op.endswith("-done") and instruction.operands and instruction.operands[0] in pending:
                finish, kind = pending.pop(instruction.operands[0])
                tally.parts[f"{kind} exposed"] += max(0.0, finish - clock)
                clock = max(clock, finish)
            elif not op.endswith("-done"):
                part, flops, seconds = self.kernel(instruction, computation)
                tally.parts[part] += seconds
                tally.flops[part] += flops
                tally.kernels += 1
                clock += seconds
        tally.seconds = clock
        self.memo[name] = tally
        return tally

    def control(self, instruction: hlo.Instruction, computation: hlo.Computation) -> Tally | None:
        """The cost of a loop (its body x the trip count), conditional (its costliest branch that is not a
        fallback) or call; None for other instructions."""
        op = instruction.opcode
        if op == "while":
            trips, tally = self.trip_count(instruction, computation), Tally()
            if trips is None:
                bound = BOUNDS.findall(instruction.op_name)
                trips = int(bound[-1]) if bound else 1
                tally = Tally(bounded_loops=int(bool(bound)), unknown_loops=int(not bound))
            tally.add(self.computation(instruction.called("body")[0]), trips)
            return tally
        if op == "conditional":
            branches = instruction.called("branch_computations") or (
                instruction.called("true_computation") + instruction.called("false_computation")
            )
            usual = [b for b in branches if not self.fallback(b)] or branches
            return max((self.computation(b) for b in usual), key=lambda t: t.seconds)
        if op in ("call", "async-start") and not _collective(instruction, self.module):
            names = instruction.called("to_apply") or instruction.called("calls")
            return self.computation(names[0]) if names else None
        return None

    def trip_count(self, loop: hlo.Instruction, computation: hlo.Computation) -> int | None:
        """The trip count XLA's GPU compiler writes on a while loop; else (the TPU compiler's) one read from its
        condition, `counter < constant` with the counter's start a constant of the loop's initial tuple (or 0);
        None when the count is decided at run time."""
        if (known := loop.attribute(TRIPS.pattern)) is not None:
            return int(known)
        condition = self.module.computations[loop.called("condition")[0]]
        root = condition.root
        sides = [condition.by_name.get(name) for name in root.operands]
        if root.opcode != "compare" or "direction=LT" not in root.attributes or None in sides or len(sides) != 2:
            return None
        counter, limit = sides
        if counter.opcode != "get-tuple-element" or limit.opcode != "constant":
            return None
        element = int(counter.attribute(r"index=(\d+)") or 0)
        start = 0
        initial = computation.by_name.get(loop.operands[0]) if loop.operands else None
        if initial is not None and initial.opcode == "tuple" and element < len(initial.operands):
            first = computation.by_name.get(initial.operands[element])
            start = int(first.operand_text) if first is not None and first.opcode == "constant" else 0
        return max(int(limit.operand_text) - start, 0)

    def fallback(self, name: str) -> bool:
        """Whether a branch computation runs a kernel's run-time fallback (its ops in the FALLBACK scope)."""
        return any(f"/{FALLBACK}/" in i.op_name for i in self.module.computations[name].instructions)

    def kernel(self, instruction: hlo.Instruction, computation: hlo.Computation) -> tuple[str, float, float]:
        """(part, FLOPs, seconds) of one kernel: a fusion, a custom call or an unfused op."""
        rates, op = self.rates, instruction.opcode
        target = instruction.attribute(r'custom_call_target="([^"]+)"') or ""
        scope = SCOPE.findall(instruction.op_name)
        kernel, visible = (scope[-1][0], float(scope[-1][1])) if scope else (None, 1.0)
        flops, rate, part, read = 0.0, rates.matmul, MEMORY_BOUND, 1.0
        if op == "custom-call" and (share := grouped_share(instruction, target)):  # the rows it fills: read, computed
            flops, part, read = share * grouped_flops(instruction, computation), MATMULS, share
        elif op == "custom-call" and (multiple := attention_multiple(instruction, target)):
            flops = visible * multiple * attention_flops(instruction, computation, target)
            default = next(iter(rates.attention))
            rate, part = rates.attention.get(kernel or default, rates.attention[default]), ATTENTION
        else:
            if op == "custom-call" and target.startswith(GEMMS):
                flops = gemm_flops(instruction, computation)
            elif op in ("fusion", "fusion-start", *MATMUL_OPS):
                flops = self.dot_flops(instruction, computation)
            if flops and kernel:  # a kernel's own matmuls (the blockwise kernel's): at its rate, on what it sees
                flops, rate, part = visible * flops, rates.attention.get(kernel, rates.matmul), ATTENTION
            elif flops:
                part = MATMULS
        if part == MEMORY_BOUND and kernel:
            part = ATTENTION_GLUE
        seconds = max(flops / rate, read * self.bytes(instruction, computation) / rates.memory, rates.kernel)
        return part, flops, seconds

    def dot_flops(self, instruction: hlo.Instruction, computation: hlo.Computation) -> float:
        """FLOPs of the dots of an unfused dot or of a fusion's computation (2 per multiply-add)."""
        if instruction.opcode in MATMUL_OPS:
            return MATMUL_OPS[instruction.opcode](instruction, computation)
        total = 0.0
        for name in instruction.called("calls"):
            fused = self.module.computations[name]
            for inner in fused.instructions:
                if inner.opcode in MATMUL_OPS:
                    total += MATMUL_OPS[inner.opcode](inner, fused)
                elif inner.opcode == "fusion":
                    total += self.dot_flops(inner, fused)
        return total

    def bytes(self, instruction: hlo.Instruction, computation: hlo.Computation) -> float:
        """Bytes a kernel reads and writes: its operands and result, less what a fusion only slices out of an
        operand or updates in place of one."""
        operands = [computation.by_name[o] for o in instruction.operands if o in computation.by_name]
        if instruction.opcode not in ("fusion", "fusion-start") or not instruction.called("calls"):
            return sum(o.bytes for o in operands) + instruction.bytes
        fused = self.module.computations[instruction.called("calls")[0]]
        users = collections.defaultdict(list)
        for inner in fused.instructions:
            for name in inner.operands:
                users[name].append(inner)
        total = float(instruction.bytes)
        for inner in fused.instructions:
            if inner.opcode != "parameter":
                continue
            index = int(inner.operand_text)
            full, uses = (operands[index].bytes if index < len(operands) else inner.bytes), users[inner.name]
            if uses and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in uses):
                total += min(full, sum(u.bytes for u in uses))
            elif uses and all(u.opcode == "dynamic-update-slice" and u.operands[0] == inner.name for u in uses):
                written = sum(fused.by_name[u.operands[1]].bytes for u in uses if u.operands[1] in fused.by_name)
                total += written - sum(u.bytes for u in uses)  # updated in place: only the update is written
            else:
                total += full
        return max(total, 0.0)

    def collective(self, kind: str, instruction: hlo.Instruction, computation: hlo.Computation) -> float:
        """Seconds of a collective on its stream: NCCL's ring traffic per GPU at NVLink's or the network's rate,
        and at least a collective's latency."""
        operands = [computation.by_name[o] for o in instruction.operands if o in computation.by_name]
        size = sum(o.bytes for o in operands) or instruction.bytes
        groups = replica_groups(instruction, len(self.hosts))
        n = max(len(g) for g in groups)
        if n < 2:
            return 0.0
        across = any(len({self.hosts[p] for p in g if p < len(self.hosts)}) > 1 for g in groups)
        rate = self.rates.network if across else self.rates.nvlink
        traffic = {
            "all-gather": (n - 1) * size,
            "reduce-scatter": (n - 1) / n * size,
            "all-reduce": 2 * (n - 1) / n * size,
            "all-to-all": (n - 1) / n * size,
            "collective-permute": size,
        }[kind]
        return max(traffic / rate, self.rates.collective)


def _collective(instruction: hlo.Instruction, module: hlo.Module) -> str | None:
    """The kind of collective an instruction starts or is (its async wrapper's too), else None."""
    op = instruction.opcode.removesuffix("-start")
    if op in COLLECTIVES:
        return op
    if instruction.opcode == "async-start":
        for name in instruction.called("calls"):
            root = module.computations[name].root.opcode
            if root in COLLECTIVES:
                return root
    return None


@dataclasses.dataclass(frozen=True)
class SpeedEstimate:
    """One step's estimated seconds, split as `tally` says, for `tokens` tokens over `devices` GPUs whose model FLOPs
    (train/planning/flops.py: one document per row) are `model_flops`, against a `peak` FLOP/s per GPU."""

    tally: Tally
    tokens: int
    devices: int
    model_flops: float
    peak: float
    platform: str = "gpu"

    @property
    def seconds(self) -> float:
        return self.tally.seconds

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens / self.seconds / self.devices

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.devices * self.peak)

    def top(self, count: int = 3) -> list[tuple[str, float]]:
        """The `count` largest parts of the step, as (name, share of the step)."""
        return [(name, seconds / self.seconds) for name, seconds in self.tally.parts.most_common(count)]


def schedule_cost(text: str, rates: Rates, hosts: list[int]) -> Tally:
    """The cost of the entry computation of compiled program `text` (compiled.as_text()) on GPUs of `rates`,
    partition p on host hosts[p]."""
    module = hlo.parse(text)
    return Estimator(module, rates, hosts).computation(module.entry.name)


def estimate_plan(plan, rates: Rates) -> SpeedEstimate:
    """The speed estimate of a memory plan's compiled step (train.planning.memory.MemoryPlan) at `rates`."""
    config = plan.config
    tokens = config.train.batch_size * config.data.seq_len
    peak = next((f for kind, f in PEAK_FLOPS.items() if plan.device_kind.startswith(kind)), PEAK_FLOPS["NVIDIA H100"])
    return SpeedEstimate(
        tally=schedule_cost(plan.compiled.as_text(), rates, list(plan.hosts)),
        tokens=tokens,
        devices=plan.devices,
        model_flops=flops_per_token(config.model, config.data.seq_len) * tokens,
        peak=peak,
        platform=rates.platform,
    )


def _number(value: float) -> str:
    """Three significant digits, or a whole number with thousands separators from 100 on."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def format_estimate(estimate: SpeedEstimate, target: str) -> str:
    """The estimate as the plan prints it: step time, tokens/s per GPU and MFU, the top three costs, the collectives'
    time hidden and exposed, and what was not counted."""
    tally = estimate.tally
    top = ", ".join(f"{name} {share:.0%}" for name, share in estimate.top())
    collectives = ", ".join(
        f"{kind} {_number(seconds * 1e3)} ms ({_number(tally.parts[f'{kind} exposed'] * 1e3)} exposed)"
        for kind, seconds in tally.collectives.most_common()
    )
    unknown = f"; {tally.unknown_loops} loops whose trip count is decided at run time, counted once" * bool(
        tally.unknown_loops
    )
    bounded = (
        f"  loops whose trip count is decided at run time: {tally.bounded_loops}, each costed at its bound (the "
        "blockwise kernel's walks over a block's visible partners: their matmuls at the visible share, the rest of "
        "their work at every block)"
    )
    rates = (
        f"{target} rates, parallel/targets.py"
        if estimate.platform == "gpu"
        else f"{target}: data-sheet rates at assumed shares, parallel/tpu_targets.py; not measured on a TPU"
    )
    device = "GPU" if estimate.platform == "gpu" else "device"
    return "\n".join(
        [
            f"speed estimate ({rates}; from the compiled schedule): step "
            f"{estimate.seconds:.3g} s, {estimate.tokens_per_second_per_device:,.0f} tokens/s per {device}, MFU "
            f"{estimate.mfu:.1%} (model FLOPs of one document per row, peak {estimate.peak / 1e12:.0f} TFLOP/s)",
            f"  where the step goes: {top}",
            f"  collectives (on their own stream): {collectives or 'none'}",
            f"  counted: {tally.kernels:,.0f} kernels; matmuls {_number(tally.flops[MATMULS] / 1e12)} TFLOP, attention "
            f"{_number(tally.flops[ATTENTION] / 1e12)} TFLOP (the (query, key) pairs its masks leave), the rest by the "
            "bytes they move",
            "  not counted: documents (rows costed as one document each: packed rows run faster), kernels side by "
            f"side, collectives slowing kernels, autotuning, the host{unknown}",
            *[bounded] * bool(tally.bounded_loops),
        ]
    )
