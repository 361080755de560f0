"""The fleet's routing decision (scheduling/fleet_route.py): examples, then properties over
every fleet hypothesis draws. Expected values are written out or derived from the rules as
docs/fleet.md states them, never by calling the code under test twice."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduling.fleet_route import NodeView, NoneUp, choose


def node(name: str, waiting: int = 0, loaded: tuple[str, ...] = (), status: str = "up",
         url: str | None = None) -> NodeView:
    return NodeView(name, f"http://{name}:8080" if url is None else url, status,
                    frozenset(loaded), waiting)


# ---- a model this node does not serve -----------------------------------------------------------

def test_a_model_not_served_here_goes_to_the_node_with_it_loaded_even_if_its_queue_is_longer():
    fleet = [node("a"), node("b", waiting=5, loaded=("m",)), node("c", waiting=1)]
    assert choose("m", "a", False, (), fleet, 4).node == "b"


def test_a_model_loaded_nowhere_goes_to_the_shortest_queue():
    fleet = [node("a"), node("b", waiting=5), node("c", waiting=1), node("d", waiting=3)]
    assert choose("m", "a", False, (), fleet, 4).node == "c"


def test_only_the_nodes_it_is_placed_on_are_considered():
    fleet = [node("a"), node("b", waiting=0, loaded=("m",)), node("c", waiting=9)]
    assert choose("m", "a", False, ("c",), fleet, None).node == "c"


def test_down_stopped_and_addressless_nodes_are_never_chosen_and_the_refusal_names_them():
    fleet = [node("a"), node("b", status="down"), node("c", status="stopped"),
             node("d", url=""), node("x", loaded=("m",))]
    got = choose("m", "a", False, ("b", "c", "d", "e"), fleet, 4)
    assert isinstance(got, NoneUp)
    assert got.nodes == (("b", "down"), ("c", "stopped"), ("d", "up, no address"),
                         ("e", "unknown"))
    assert "'m'" in got.message and "b (down)" in got.message and "e (unknown)" in got.message


def test_no_other_node_at_all_is_said_plainly():
    got = choose("m", "a", False, (), [node("a")], 4)
    assert isinstance(got, NoneUp) and got.nodes == ()
    assert "no node" in got.message


# ---- a model this node serves -------------------------------------------------------------------

def test_a_local_model_moves_only_when_another_queue_is_shorter_by_the_margin():
    assert choose("m", "a", True, (), [node("a", 6), node("b", 3)], 4) is None  # 3 < 4
    assert choose("m", "a", True, (), [node("a", 7), node("b", 3)], 4).node == "b"  # 4
    assert choose("m", "a", True, (), [node("a", 70), node("b", 3)], None) is None  # off


def test_a_local_model_stays_when_this_node_has_no_row_yet():
    assert choose("m", "a", True, (), [node("b", 0)], 1) is None


def test_ties_go_to_the_node_with_the_model_loaded_then_by_name():
    fleet = [node("a", 9), node("c", 2), node("b", 2), node("d", 2, loaded=("m",))]
    assert choose("m", "a", True, (), fleet, 1).node == "d"
    assert choose("z", "a", True, (), fleet, 1).node == "b"


# ---- properties ---------------------------------------------------------------------------------

NAMES = ["a", "b", "c", "d", "e"]
views = st.builds(
    NodeView, st.sampled_from(NAMES), st.sampled_from(["", "http://n:1"]),
    st.sampled_from(["up", "up", "draining", "down", "stopped"]),
    st.frozensets(st.sampled_from(["m", "n"]), max_size=2), st.integers(0, 12))
fleets = st.lists(views, max_size=6, unique_by=lambda n: n.node)
placements = st.frozensets(st.sampled_from(NAMES), max_size=4)
margins = st.one_of(st.none(), st.integers(1, 6))


@given(fleets, placements, st.booleans(), margins, st.sampled_from(NAMES))
def test_whatever_the_fleet_a_chosen_node_is_another_serving_node_that_is_up(
        fleet, serving, serves_here, margin, here):
    got = choose("m", here, serves_here, serving, fleet, margin)
    if isinstance(got, NodeView):
        assert got in fleet and got.node != here
        assert got.status == "up" and got.url
        assert not serving or got.node in serving
    elif isinstance(got, NoneUp):
        assert not serves_here


@given(fleets, placements, margins, st.sampled_from(NAMES))
def test_a_model_not_served_here_is_refused_only_when_no_serving_node_is_up(
        fleet, serving, margin, here):
    got = choose("m", here, False, serving, fleet, margin)
    candidates = [n for n in fleet if n.node != here and n.status == "up" and n.url
                  and (not serving or n.node in serving)]
    if not candidates:
        assert isinstance(got, NoneUp)
        return
    assert isinstance(got, NodeView)
    loaded = [n for n in candidates if "m" in n.loaded]
    pool = loaded or candidates
    assert got in pool and got.waiting == min(n.waiting for n in pool)


@given(fleets, placements, margins, st.sampled_from(NAMES))
def test_a_local_model_moves_only_to_a_queue_shorter_by_the_margin(
        fleet, serving, margin, here):
    got = choose("m", here, True, serving, fleet, margin)
    assert not isinstance(got, NoneUp)
    if got is None:
        return
    assert margin is not None
    mine = next(n for n in fleet if n.node == here)
    assert mine.waiting - got.waiting >= margin
    others = [n.waiting for n in fleet if n.node != here and n.status == "up" and n.url
              and (not serving or n.node in serving)]
    assert got.waiting == min(others)


@given(fleets, placements, st.integers(1, 6))
def test_two_nodes_reading_one_snapshot_never_send_a_local_request_to_each_other(
        fleet, serving, margin):
    names = [n.node for n in fleet]
    for here in names:
        got = choose("m", here, True, serving, fleet, margin)
        if isinstance(got, NodeView):
            back = choose("m", got.node, True, serving, fleet, margin)
            assert back is None or back.node != here


@given(fleets, placements, st.booleans(), margins, st.sampled_from(NAMES), st.randoms())
def test_the_order_of_the_rows_changes_nothing(fleet, serving, serves_here, margin, here,
                                               rnd):
    shuffled = list(fleet)
    rnd.shuffle(shuffled)
    assert (choose("m", here, serves_here, serving, fleet, margin)
            == choose("m", here, serves_here, serving, shuffled, margin))
