"""--slow-share K/N (tests/conftest.py): the N shares of the slow tests part them, each slow test in exactly one, and
every test not marked slow stays in each."""

import types

import pytest

from tests.conftest import _slow_share


def item(name: str, slow: bool):
    return types.SimpleNamespace(nodeid=name, get_closest_marker=lambda marker: (marker == "slow" and slow) or None)


def config(share: str | None, deselected: list):
    hook = types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items))
    return types.SimpleNamespace(getoption=lambda name: share, hook=hook)


def test_the_shares_part_the_slow_tests():
    slow = [item(f"tests/test_x.py::test_slow[{i}]", True) for i in range(60)]
    fast = [item(f"tests/test_x.py::test_fast[{i}]", False) for i in range(5)]
    shares = []
    for k in range(4):
        items, deselected = [*slow, *fast], []
        _slow_share(items, config(f"{k}/4", deselected))
        assert all(x in items for x in fast) and len(items) + len(deselected) == 65
        shares.append({x.nodeid for x in items if x in slow})
    assert sorted(name for share in shares for name in share) == sorted(x.nodeid for x in slow)
    assert all(share for share in shares)
    items = [*slow, *fast]
    _slow_share(items, config(None, []))
    assert len(items) == 65


def test_a_share_out_of_range_is_refused():
    with pytest.raises(pytest.UsageError, match=r"--slow-share 4/4: K/N needs 0 <= K < N"):
        _slow_share([], config("4/4", []))
