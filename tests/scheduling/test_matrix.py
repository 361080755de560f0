"""The matrix swapper (scheduling/core/matrix.py), against llama-swap's own cases
(`internal/matrix/dsl_test.go`, `internal/router/matrix_test.go`, its example config's
comments), and under both schedulers.

Expected values are llama-swap's, written out by hand here, not computed by our code.
"""

from __future__ import annotations

import pytest

from scheduling.core.effects import READY
from scheduling.core.events import ServeDone, UnloadDone, UnloadRequested
from scheduling.core.fifo import Fifo
from scheduling.core.matrix import MatrixError, MatrixSwapper
from scheduling.core.serial import Serial
from tests.scheduling.fakes import FakeEffects, arrive, make_config


def matrix(sets, models, variables=None, costs=None) -> MatrixSwapper:
    return MatrixSwapper.compile(list(sets.items()), variables or {}, costs or {}, models)


# ---- the DSL: each expression's combinations (dsl_test.go TestProgram_Expressions) ----------

@pytest.mark.parametrize("dsl, models, allowed, refused", [
    ("a", "a", [{"a"}], []),
    ("a & b", "ab", [{"a", "b"}], []),
    ("a | b | c", "abc", [{"a"}, {"b"}, {"c"}], [{"a", "b"}, {"b", "c"}]),
    ("(a | b) & (c | d)", "abcd", [{"a", "c"}, {"a", "d"}, {"b", "c"}, {"b", "d"}],
     [{"a", "b"}, {"c", "d"}]),
    ("a | b & c", "abc", [{"a"}, {"b", "c"}], [{"a", "c"}, {"a", "b"}]),  # & binds tighter
    ("a & a", "a", [{"a"}], []),
])
def test_expressions_allow_their_combinations_and_subsets(dsl, models, allowed, refused):
    m = matrix({"s": dsl}, list(models))
    for combo in allowed:
        assert m.can_contain_all(combo)
        for x in combo:  # every set also allows its subsets
            assert m.can_contain_all({x})
    for combo in refused:
        assert not m.can_contain_all(combo)


def test_references_inline_another_set():
    """TestProgram_References: mega = (g | q | m) & v & e, through two references."""
    m = matrix({"llms": "g | q | m", "with_tts": "+llms & v", "mega": "+with_tts & e"},
               ["g", "q", "m", "v", "e"])
    for llm in "gqm":
        assert m.can_contain_all({llm, "v", "e"})
    assert not m.can_contain_all({"g", "q"})


def test_overlapping_references_keep_everything():
    """TestProgram_OverlappingReferences."""
    m = matrix({"base": "a & b", "extended": "target & +base & b"}, ["target", "a", "b"])
    d = m.decision("target", ["a", "b"])
    assert d.evict == () and d.target_set == ("a", "b", "target")


def test_dominated_projection():
    """TestProgram_DominatedProjection: `a | (a & b)` keeps both."""
    m = matrix({"preferred": "target & (a | (a & b))"}, ["target", "a", "b"])
    d = m.decision("target", ["a", "b"])
    assert d.evict == () and d.target_set == ("a", "b", "target")


def test_target_in_no_set_runs_alone():
    """TestProgram_TargetAbsent: everything else stops."""
    m = matrix({"s": "a & b"}, ["a", "b", "missing"])
    d = m.decision("missing", ["a", "b"])
    assert d.evict == ("a", "b") and d.target_set == ("missing",) and d.set_name == ""
    assert m.eviction_for("missing", ["b", "a"]) == ["a", "b"]


def test_target_already_running_evicts_nothing():
    m = matrix({"s_a": "a", "s_b": "b"}, ["a", "b"])
    assert m.eviction_for("a", ["a", "b"]) == []


def test_large_products_are_not_expanded():
    """TestProgram_NoExpansionLimit: 10^6 combinations, solved by projection."""
    dims = [" | ".join(f"model-{d}-{c}" for c in range(10)) for d in range(6)]
    models = ["target", "outside"] + [f"model-{d}-{c}" for d in range(6) for c in range(10)]
    m = matrix({"large": "target & " + " & ".join(f"({x})" for x in dims)}, models)
    running = [f"model-{d}-9" for d in range(6)] + ["outside"]
    d = m.decision("target", running)
    assert d.evict == ("outside",) and d.set_name == "large" and len(d.target_set) == 7


def test_more_than_64_models():
    """TestProgram_MoreThan64RelevantModels (llama-swap's bit masks span words)."""
    models = ["target"] + [f"model-{i}" for i in range(70)]
    m = matrix({"wide": " & ".join(models)}, [*models, "outside"])
    d = m.decision("target", [*models[1:], "outside"])
    assert d.evict == ("outside",) and len(d.target_set) == 71


# ---- choosing the set: cost, then definition order -------------------------------------------

EXAMPLE_MODELS = ["gemma-model", "qwen-model", "mistral-model", "voxtral-model",
                  "reranker-model", "stable-diffusion", "llama-70B"]


def example_matrix() -> MatrixSwapper:
    """llama-swap-config.example.yaml's matrix, as written there."""
    return MatrixSwapper.compile(
        [("standard", "(g | qwen-model | m) & v"), ("with_rerank", "(g | q) & v & e"),
         ("creative", "(g | q) & stable-diffusion"), ("full", "llama-70B")],
        {"g": "gemma-model", "q": "qwen-model", "m": "mistral-model", "v": "voxtral-model",
         "e": "reranker-model"},
        {"v": 50, "llama-70B": 30}, EXAMPLE_MODELS)


def test_example_cheapest_set_keeps_the_costly_model():
    m = example_matrix()
    # qwen beside voxtral (cost 50) and the reranker: with_rerank keeps both, cost 0
    d = m.decision("qwen-model", ["voxtral-model", "reranker-model"])
    assert d.evict == () and d.set_name == "with_rerank"
    # mistral: standard keeps voxtral and stops the reranker (1) rather than voxtral (50)
    d = m.decision("mistral-model", ["voxtral-model", "reranker-model"])
    assert d.evict == ("reranker-model",) and d.set_name == "standard" and d.cost == 1
    # stable-diffusion is only in `creative`: voxtral must go, gemma stays
    d = m.decision("stable-diffusion", ["gemma-model", "voxtral-model"])
    assert d.evict == ("voxtral-model",) and d.cost == 50
    # the 70B runs alone
    assert m.eviction_for("llama-70B", ["gemma-model", "voxtral-model"]) == [
        "gemma-model", "voxtral-model"]


def test_ties_go_to_the_set_defined_first():
    m = matrix({"first": "t & a", "second": "t & b"}, ["t", "a", "b"])
    d = m.decision("t", ["a", "b"])
    assert d.evict == ("b",) and d.set_name == "first"
    m = matrix({"first": "t & b", "second": "t & a"}, ["t", "a", "b"])
    assert m.decision("t", ["a", "b"]).evict == ("a",)


def test_a_referenced_set_counts_as_defined_before_its_user():
    """llama-swap orders sets topologically (`Compile`'s topologicalOrder): `base`,
    referenced by `user`, comes before `user` even when written last, so of three sets that
    each cost 1 here, `base` wins (in written order it would be `user`)."""
    m = matrix({"user": "t & +base", "other": "t & a", "base": "t & b"}, ["t", "a", "b"])
    d = m.decision("t", ["a", "b"])
    assert d.set_name == "base" and d.evict == ("a",)


def test_explain_names_the_set_and_the_cost():
    m = example_matrix()
    text = m.explain("stable-diffusion", ["gemma-model", "voxtral-model"])
    assert "'creative'" in text and "(g | q) & stable-diffusion" in text and "cost 50" in text
    assert "runs alone" in matrix({"s": "a"}, ["a", "b"]).explain("b", ["a"])


# ---- what compile refuses (TestProgram_CompileErrors, config/matrix.go) ----------------------

@pytest.mark.parametrize("sets, variables, costs, message", [
    ({"s": ""}, {}, {}, "set 's': empty expression"),
    ({"s": "(a"}, {}, {}, "missing closing parenthesis"),
    ({"s": "a)"}, {}, {}, "unexpected token"),
    ({"s": "()"}, {}, {}, "unexpected token"),
    ({"s": "a @ b"}, {}, {}, "unexpected character '@'"),
    ({"s": "+"}, {}, {}, "expected set name after '+'"),
    ({"s": "missing"}, {}, {}, "set 's': unknown var or model 'missing'"),
    ({"s": "+missing"}, {}, {}, "references undefined set 'missing'"),
    ({"a": "+b", "b": "+a"}, {}, {}, "circular reference"),
    ({"s": "a"}, {"bad name!": "a"}, {}, "var key 'bad name!'"),
    ({"s": "a"}, {"x": "nope"}, {}, "var key 'x' references unknown model 'nope'"),
    ({"s": "a"}, {}, {"a": 0}, "evict_cost for 'a' must be a positive integer"),
    ({"s": "a"}, {}, {"zzz": 3}, "evict_costs: unknown var or model 'zzz'"),
])
def test_compile_refuses_with_a_message_naming_the_culprit(sets, variables, costs, message):
    with pytest.raises(MatrixError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("+", r"\+")):
        MatrixSwapper.compile(list(sets.items()), variables, costs, ["a", "b"])


def test_a_var_wins_over_a_model_of_the_same_name():
    m = matrix({"s": "a & b"}, ["a", "b", "c"], variables={"a": "c"})
    assert m.can_contain_all({"c", "b"}) and not m.can_contain_all({"a", "b"})


# ---- under the schedulers --------------------------------------------------------------------

def test_fifo_co_resident_models_load_in_parallel_without_evicting():
    """TestMatrix_CoexistingSetParallel: a & b load together, nothing stops."""
    m = matrix({"s_ab": "a & b"}, ["a", "b"])
    fx = FakeEffects()
    s = Fifo(make_config(("a", "b"), swapper=m), fx)
    arrive(s, "a")
    arrive(s, "b")
    assert fx.swaps == [("a", []), ("b", [])]


def test_fifo_incompatible_request_queues_behind_the_loading_one():
    """TestMatrix_IncompatibleQueues: b cannot run beside a, which is loading: b waits,
    then evicts a once a's requests are done."""
    m = matrix({"s_a": "a", "s_b": "b"}, ["a", "b"])
    fx = FakeEffects()
    s = Fifo(make_config(("a", "b"), swapper=m), fx)
    ra = arrive(s, "a")
    rb = arrive(s, "b")
    assert fx.swaps == [("a", [])] and s.queued() == [rb]
    s.on_swap_done(fx.finish_swap("a"))
    assert [r for r, _ in fx.grants] == [ra] and fx.swaps == [("a", [])]  # a is busy
    fx.closed.add(ra)
    s.on_serve_done(ServeDone(ra, 1.0))
    assert fx.swaps[-1] == ("b", ["a"])


@pytest.mark.parametrize("kind", [Fifo, Serial])
def test_the_cheaper_eviction_is_the_one_started(kind):
    """Loaded: gemma beside voxtral and the reranker. mistral stops the reranker (cost 1),
    not voxtral (cost 50), under either scheduler."""
    fx = FakeEffects({"gemma-model": READY, "voxtral-model": READY, "reranker-model": READY})
    s = kind(make_config(EXAMPLE_MODELS, swapper=example_matrix()), fx)
    arrive(s, "mistral-model")
    assert fx.swaps == [("mistral-model", ["gemma-model", "reranker-model"])]


def test_serial_lower_request_does_not_change_which_set_a_higher_one_keeps():
    """h (higher, held by an unload) can load beside a, evicting nothing. A lower request
    for t could load beside a too, but with t loaded, h's cheapest set becomes h & t and h
    would have to stop a (stopping t costs 5, a 1): t must wait. With groups this cannot
    happen (a load only ever adds itself to another's eviction); it is the matrix's case
    of "a lower request runs beside a higher one only where it does not make the higher
    one's load stop more"."""
    m = matrix({"ha": "h & a", "ta": "t & a", "ht": "h & t"}, ["h", "t", "a"], costs={"t": 5})
    fx = FakeEffects({"a": READY})
    s = Serial(make_config(("h", "t", "a"), swapper=m), fx)
    s.on_unload(UnloadRequested(("h",), 0.0, handle="x"))
    arrive(s, "h", priority=100)
    arrive(s, "t", priority=0)
    assert fx.swaps == []  # h is held; t would change h's set
    s.on_unload_done(UnloadDone(("h",), 1.0))
    assert fx.swaps[0] == ("h", [])  # h first, beside a, as it could before
