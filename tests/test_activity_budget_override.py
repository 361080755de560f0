"""The activity row's `score_parts` says when serial's affinity budget gave a request's model
its affinity (issue 23), and says nothing more when it did not: rows stay as they were."""

from __future__ import annotations

from dataclasses import replace

from activity.record import RequestRecord
from scheduling.core.events import Dispatch

LIFTED = Dispatch(band="normal", score=10.5, priority=0, affinity=10.0, aging=0.5, seq=3,
                  queue_wait=30.0, budget_override=True)


def test_score_parts_flags_a_grant_the_budget_decided() -> None:
    rec = RequestRecord("POST", "/v1/chat/completions", "10.0.0.7", "ua")
    rec.dispatch = LIFTED
    assert rec.row()["score_parts"] == {"priority": 0, "affinity": 10.0, "aging": 0.5,
                                        "seq": 3, "budget_override": True}


def test_score_parts_without_the_budget_are_unchanged() -> None:
    rec = RequestRecord("POST", "/v1/chat/completions", "10.0.0.7", "ua")
    rec.dispatch = replace(LIFTED, budget_override=False)
    assert rec.row()["score_parts"] == {"priority": 0, "affinity": 10.0, "aging": 0.5,
                                        "seq": 3}
