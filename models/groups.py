"""How a stack of layers whose kinds differ (`layer_types`) is cut into segments that scan, so compile time does not
grow with depth: the kinds' repeating period as one group of blocks scanned over its repeats, then the layers left
over (fewer than a period) as runs of one kind; kinds without a period that pays as runs of one kind. A stack of one
kind is one segment of one-block groups."""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """`repeats` groups of blocks of `kinds` (one per position, in layer order), its first layer the stack's
    `first`."""

    kinds: tuple[str, ...]
    repeats: int
    first: int

    def layer(self, group: int, position: int) -> int:
        """The stack's index of block `position` of group `group`."""
        return self.first + group * len(self.kinds) + position

    def layers(self, position: int) -> list[int]:
        """The stack's indices of block `position` of every group, in group order."""
        return [self.layer(group, position) for group in range(self.repeats)]


def period(kinds: tuple[str, ...]) -> int:
    """The smallest p >= 1 with kinds[i] == kinds[i - p] for every i >= p (len(kinds) when there is none)."""
    return next(p for p in range(1, len(kinds) + 1) if kinds[p:] == kinds[: len(kinds) - p])


def runs(kinds: tuple[str, ...], first: int = 0) -> list[Segment]:
    """Consecutive layers of one kind, each a segment of one-block groups."""
    segments = []
    for kind, run in itertools.groupby(kinds):
        count = len(list(run))
        segments.append(Segment((kind,), count, first))
        first += count
    return segments


def segments(kinds: tuple[str, ...]) -> tuple[Segment, ...]:
    """The segments of a stack of `kinds` (one per layer): a period repeated (a group of `period` blocks, scanned)
    then the rest as runs, or runs of the whole, whichever has fewer blocks to compile (the period on a tie)."""
    p = period(kinds)
    repeats = len(kinds) // p
    grouped = [Segment(kinds[:p], repeats, 0), *runs(kinds[repeats * p :], repeats * p)]
    plain = runs(kinds)
    compiled = sum(len(segment.kinds) for segment in grouped)
    return tuple(grouped if compiled <= len(plain) else plain)
