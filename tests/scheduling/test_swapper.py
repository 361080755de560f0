"""The group swapper against llama-swap's rules, one table row per rule."""

import pytest

from scheduling.core.swapper import Group, GroupSwapper

SWAP_BIG = Group("big", frozenset({"a", "b"}), swap=True, exclusive=False)
KEEP_SMALL = Group("small", frozenset({"s"}), swap=False, exclusive=False, persistent=True)
EXCL = Group("excl", frozenset({"x", "y"}), swap=False, exclusive=True)
PAIR = Group("pair", frozenset({"p", "q"}), swap=False, exclusive=False)

MODELS = ["a", "b", "s", "x", "y", "p", "q", "u1", "u2"]


@pytest.mark.parametrize(
    ("target", "running", "expected"),
    [
        # swap group: the other member goes
        ("a", ["b"], ["b"]),
        # swap but not exclusive: other groups stay
        ("a", ["b", "s", "p"], ["b"]),
        # already running target: nothing to do
        ("a", ["a", "s"], []),
        # exclusive group: every non-persistent other group goes, persistent stays
        ("x", ["a", "s", "p", "q"], ["a", "p", "q"]),
        # exclusive but not swap: group mates stay
        ("x", ["y"], []),
        # non-swap, non-exclusive: co-runs with everything
        ("p", ["q", "a", "s", "x"], []),
        # ungrouped models form one swap+exclusive default group: one at a time...
        ("u1", ["u2"], ["u2"]),
        # ...which also evicts other non-persistent groups, never the persistent one
        ("u1", ["a", "s", "x"], ["a", "x"]),
        # loading into a non-exclusive group never evicts the default group (llama-swap gotcha)
        ("p", ["u1"], []),
        # a running model no longer defined anywhere is always evicted
        ("a", ["gone"], ["gone"]),
    ],
)
def test_group_eviction(target, running, expected):
    swapper = GroupSwapper([SWAP_BIG, KEEP_SMALL, EXCL, PAIR], MODELS)
    assert swapper.eviction_for(target, running) == expected


def test_default_group_when_no_groups():
    swapper = GroupSwapper([], ["m1", "m2", "m3"])
    assert swapper.eviction_for("m3", ["m1", "m2"]) == ["m1", "m2"]
    assert swapper.group_of("m1").group_id == "(default)"
