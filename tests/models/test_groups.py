"""Layers that differ are cut into segments that scan: Gemma 3's 5 sliding : 1 full as one group of six then the
rest as a run, GPT-OSS's alternation as pairs, windows from some layer on as two runs, layers alike as one."""

from models.config import FULL, SLIDING
from models.groups import Segment, period, segments

GEMMA3_4B = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(34))


def test_a_period_repeated_is_one_group_and_the_rest_runs():
    assert period(GEMMA3_4B) == 6
    assert segments(GEMMA3_4B) == (Segment((SLIDING,) * 5 + (FULL,), 5, 0), Segment((SLIDING,), 4, 30))
    assert segments((SLIDING, FULL) * 12) == (Segment((SLIDING, FULL), 12, 0),)
    assert Segment((SLIDING, FULL), 12, 0).layers(1) == list(range(1, 24, 2))


def test_layers_without_a_period_that_pays_are_runs():
    assert segments((FULL,) * 20 + (SLIDING,) * 8) == (Segment((FULL,), 20, 0), Segment((SLIDING,), 8, 20))
    assert segments((FULL,) * 4) == (Segment((FULL,), 4, 0),)
    # one period of six and two layers: three runs compile fewer blocks than a group of six
    assert segments(GEMMA3_4B[:8]) == (Segment((SLIDING,), 5, 0), Segment((FULL,), 1, 5), Segment((SLIDING,), 2, 6))
