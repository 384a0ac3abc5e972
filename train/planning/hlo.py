"""The text of a compiled (optimised, scheduled) XLA program read into computations of instructions, in schedule
order, with what costing them needs: result shapes, operands, called computations and attributes.

    module = parse(compiled.as_text())
    for instruction in module.entry.instructions: ...
"""

from __future__ import annotations

import dataclasses
import math
import re

# bytes per element of each XLA element type
ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "s4": 1, "s8": 1, "u2": 1, "u4": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
F8 = re.compile(r"f8e\w+|f4e\w+")
HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
CLOSING = re.compile(r"^\}(, [a-z_]+=\S+)?\s*$")  # a computation's end: '}', or '}, execution_thread="sparsecore"'
INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a result or operand: XLA element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.prod(self.dims) * (1 if F8.fullmatch(self.dtype) else ELEMENT_BYTES.get(self.dtype, 4))


@dataclasses.dataclass
class Instruction:
    """`name = shape opcode(operands), attributes`: `shape` every array of the result (a tuple's leaves in order),
    `operands` the operands' names, `operand_text` the text between the parentheses (a parameter's number),
    `attributes` the text after them."""

    name: str
    opcode: str
    shape: tuple[Array, ...]
    operands: tuple[str, ...]
    operand_text: str
    attributes: str

    @property
    def bytes(self) -> int:
        """Bytes of the whole result (every leaf of a tuple)."""
        return sum(array.bytes for array in self.shape)

    def called(self, key: str) -> list[str]:
        """Names of the computations attribute `key` names (calls, body, condition, branch_computations, to_apply)."""
        match = re.search(rf"\b{key}=\{{?([^}},]+(?:, ?%[\w.\-]+)*)\}}?", self.attributes)
        return [name.strip().lstrip("%") for name in match.group(1).split(",")] if match else []

    def attribute(self, pattern: str) -> str | None:
        """Group 1 of regex `pattern` searched in the attributes, or None."""
        match = re.search(pattern, self.attributes)
        return match.group(1) if match else None

    @property
    def op_name(self) -> str:
        return self.attribute(r'op_name="([^"]*)"') or ""


@dataclasses.dataclass
class Computation:
    """A computation's instructions in the order the text gives them (a scheduled module's: the schedule)."""

    name: str
    instructions: list[Instruction]

    def __post_init__(self):
        self.by_name = {instruction.name: instruction for instruction in self.instructions}

    @property
    def root(self) -> Instruction:
        return self.instructions[-1]


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: Computation


def arrays(text: str) -> tuple[Array, ...]:
    """Every array in a shape's text: 'f32[4,64]{1,0}' or a tuple '(s32[2]{0}, (bf16[8]{0}))'."""
    return tuple(Array(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in ARRAY.findall(text))


def _closing(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {text[:200]!r}")


def parse_instruction(line: str) -> Instruction | None:
    """One instruction line, or None for a line that is not one."""
    match = INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.group(2), match.group(3)
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 2 :]
    else:
        shape, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _closing("(" + rest, 0) - 1  # the operands' closing parenthesis, in rest
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    return Instruction(name, opcode.strip(), arrays(shape), operands, rest[:end], rest[end + 1 :])


def parse(text: str) -> Module:
    """The module in `text` (`compiled.as_text()` of a jitted program). An instruction may span lines (a Pallas TPU
    kernel's metadata holds newlines): a line that starts no instruction and is not a computation's closing brace
    continues the one before."""
    computations, entry, current, lines = {}, None, None, []
    for line in text.splitlines():
        if current is None:
            header = HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = Computation(header.group(2), [])
                entry = current.name if header.group(1) else entry
            continue
        if CLOSING.match(line):
            current.instructions.extend(filter(None, map(parse_instruction, lines)))
            current.__post_init__()
            computations[current.name] = current
            current, lines = None, []
        elif INSTRUCTION.match(line) or not lines:
            lines.append(line)
        else:
            lines[-1] += " " + line.strip()
    if entry is None:
        raise ValueError("no ENTRY computation in the program text")
    return Module(computations, computations[entry])
