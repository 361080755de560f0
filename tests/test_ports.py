"""The one `${PORT}` rule (scheduling/ports.py) that the llama-swap import and the catalog share.

Expected ports are written out by hand, never computed with the code under test.
"""

from __future__ import annotations

import pytest

from scheduling.ports import MAX_PORT, NoPortLeft, allocate_ports


def test_ports_count_up_from_the_start_in_sorted_id_order():
    assert allocate_ports(["b", "c", "a"], 5800) == {"a": 5800, "b": 5801, "c": 5802}


def test_the_order_is_the_ids_string_order_not_their_numbers():
    assert allocate_ports(["m2", "m10", "m1"], 9000) == {"m1": 9000, "m10": 9001, "m2": 9002}


def test_no_models_no_ports():
    assert allocate_ports([], 5800) == {}


def test_taken_ports_are_skipped():
    ports = allocate_ports(["a", "b", "c"], 5800, taken={5800, 5802})
    assert ports == {"a": 5801, "b": 5803, "c": 5804}


def test_taken_ports_below_the_start_change_nothing():
    assert allocate_ports(["a", "b"], 5800, taken={80, 443}) == {"a": 5800, "b": 5801}


def test_an_id_given_twice_gets_one_port():
    assert allocate_ports(["a", "b", "a"], 5800) == {"a": 5800, "b": 5801}


def test_any_iterable_of_ids_will_do():
    assert allocate_ports((i for i in ("y", "x")), 7000) == {"x": 7000, "y": 7001}


def test_the_last_port_may_be_handed_out():
    assert MAX_PORT == 65535
    ports = allocate_ports(["a", "b"], 65534, last=MAX_PORT)
    assert ports == {"a": 65534, "b": 65535}


def test_past_the_last_port_the_first_model_without_one_is_named():
    with pytest.raises(NoPortLeft) as info:
        allocate_ports(["z", "y", "x"], 65535, last=MAX_PORT)
    assert info.value.model_id == "y"


def test_taken_ports_count_against_the_range():
    with pytest.raises(NoPortLeft) as info:
        allocate_ports(["a", "b"], 65534, taken={65535}, last=MAX_PORT)
    assert info.value.model_id == "b"


def test_a_start_already_past_the_last_port_fails_on_the_first_model():
    with pytest.raises(NoPortLeft) as info:
        allocate_ports(["b", "a"], 70000, last=MAX_PORT)
    assert info.value.model_id == "a"


def test_without_a_last_port_the_numbers_keep_counting():
    # The catalog's use (models added in admin): it sets no upper bound.
    assert allocate_ports(["a", "b"], 65535) == {"a": 65535, "b": 65536}
