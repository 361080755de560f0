"""Issue 19's profiles side by side with the real llama-swap: one config with two profiles (a
pin to a setParamsByID id, to an alias, to another local model, to a selector, to `~` and to
`""`), the same
`GET /api/profiles`, `PUT /api/profiles/active` and chat requests sent to both, and compared.

What is compared: the profiles API's answers (statuses and bodies, values included: nothing in
them differs by run; an error's code and type, and llama-swap's message as the start of ours,
which goes on with the remedy), and for each requested name under each profile which model
served it (the fake names itself in `X-Fake-Served-By`) or that both refuse it. llama-swap's
answers are also checked against values written here from its rules, so both cannot pass
wrong the same way. A name pinned to nothing is 404 on both; the codes differ (ours is
`model_not_found`, as for any model not served, and the message names the profile).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from compat.sidebyside import Side, shape, start_gpuproxy, start_llamaswap
from tests.conftest import _worker_counts, database_url, free_port

pytestmark = pytest.mark.django_db

FAKE = f"{sys.executable} -m gpuproxy.testing.fakellm --port ${{PORT}} --model ${{MODEL_ID}}"

CONFIG = """\
healthCheckTimeout: 30
startPort: {start}
models:
  real:
    cmd: {fake}
    aliases: [realias]
    filters:
      setParamsByID:
        variant: {{temperature: 0.1}}
  other:
    cmd: {fake}
groups:
  both:
    swap: false
    members: [real, other]
selectors:
  any-chat:
    strategy: pin
    targets: [other, real]
profiles:
  coding:
    description: Coding profile
    pins:
      public: variant
      disabled: ~
      empty: ""
      real: other
      alias: realias
      chooser: any-chat
  chat:
    pins:
      public: other
"""

#: llama-swap's list for CONFIG, written from its rules (ids sorted, `~` written as "").
PROFILES = [
    {"id": "chat", "description": "", "pins": {"public": "other"}},
    {"id": "coding", "description": "Coding profile",
     "pins": {"alias": "realias", "chooser": "any-chat", "disabled": "", "empty": "",
              "public": "variant", "real": "other"}},
]

#: Who serves each name under each profile ("" none), by llama-swap's rules: a pin first,
#: then ids and aliases; 404 for a name pinned to nothing or defined nowhere.
ROUTES: dict[str, dict[str, str | int]] = {
    "coding": {"public": "real", "real": "other", "realias": "real", "alias": "real",
               "other": "other", "variant": "real", "chooser": "other", "disabled": 404,
               "empty": 404, "nothere": 404},
    "chat": {"public": "other", "real": "real", "alias": 404, "disabled": 404},
    "": {"public": 404, "real": "real", "variant": "real", "disabled": 404},
}


@dataclass
class Pair:
    ours: Side
    theirs: Side

    def both(self, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, ...]:
        return tuple(side.http.request(method, path, **kwargs)
                     for side in (self.ours, self.theirs))


@pytest.fixture(scope="module", params=_worker_counts(), ids=lambda n: f"workers{n}")
def pair(request, llamaswap_bin: Path, tmp_path_factory, django_db_setup,
         django_db_blocker) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp(f"profiles-{request.param}")
    with django_db_blocker.unblock():
        url = database_url()
    theirs = start_llamaswap(llamaswap_bin, CONFIG.format(start=free_port(), fake=FAKE),
                             folder / "llama-swap", free_port())
    try:
        ours = start_gpuproxy(CONFIG.format(start=free_port(), fake=FAKE),
                              folder / "gpuproxy", free_port(), request.param, url)
    except BaseException:
        theirs.stop()
        raise
    yield Pair(ours, theirs)
    ours.stop()
    theirs.stop()


def activate(pair: Pair, name: str | None) -> None:
    for r in pair.both("PUT", "/api/profiles/active", json={"name": name}):
        assert (r.status_code, r.json()) == (200, {"active": name or None}), r.text


def test_the_list_is_llamaswaps(pair: Pair) -> None:
    activate(pair, None)  # ours is kept in the database, across the module's two runs
    mine, theirs = pair.both("GET", "/api/profiles")
    assert theirs.json() == {"active": None, "profiles": PROFILES}
    assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json())
    activate(pair, "coding")
    mine, theirs = pair.both("GET", "/api/profiles")
    assert theirs.json()["active"] == "coding"
    assert mine.json() == theirs.json()


@pytest.mark.parametrize(("body", "status", "active"), [
    ('{"name": "coding"}', 200, "coding"),
    ('{"name": "missing"}', 404, None),
    ('{"name": null}', 200, None),
    ('{"name": "chat"}', 200, "chat"),
    ('{"name": ""}', 200, None),
    ('{"name": "coding", "extra": 1}', 200, "coding"),
    ("{}", 400, None),
    ("null", 400, None),
    ("[]", 400, None),
    ("", 400, None),
    ("not json", 400, None),
    ('{"name": 5}', 400, None),
])
def test_a_switch_answers_as_llamaswaps(pair: Pair, body: str, status: int,
                                        active: str | None) -> None:
    mine, theirs = pair.both("PUT", "/api/profiles/active", content=body,
                             headers={"Content-Type": "application/json"})
    assert theirs.status_code == status, theirs.text
    assert mine.status_code == status, mine.text
    if status == 200:
        assert theirs.json() == mine.json() == {"active": active}
        return
    ours_error, their_error = mine.json()["error"], theirs.json()["error"]
    assert {k: v for k, v in shape(theirs.json()).items() if k != "src"} == shape(mine.json())
    assert (ours_error["type"], ours_error["code"]) == (their_error["type"], their_error["code"])
    assert ours_error["message"].startswith(their_error["message"]), (ours_error, their_error)


def served(r: httpx.Response) -> str | int:
    if r.status_code != 200:
        return r.status_code
    return r.headers["x-fake-served-by"].split(":")[0]


@pytest.mark.parametrize("profile", list(ROUTES))
def test_pins_route_as_llamaswaps(pair: Pair, profile: str) -> None:
    activate(pair, profile or None)
    for name, expected in ROUTES[profile].items():
        chat = {"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        mine, theirs = pair.both("POST", "/v1/chat/completions", json=chat)
        assert served(theirs) == expected, (profile, name, theirs.text)
        assert served(mine) == expected, (profile, name, mine.text)


#: `/upstream/<name>/v1/models` under each profile: the longest pin leading the path is
#: replaced by its target (llama-swap's `upstreamProfilePin`); a pin to nothing is 404.
UPSTREAM: dict[str, dict[str, str | int]] = {
    "coding": {"public": "real", "real": "other", "realias": "real", "disabled": 404,
               "empty": 404},
    "": {"public": 404, "real": "real"},
}


@pytest.mark.parametrize("profile", list(UPSTREAM))
def test_upstream_paths_are_pinned_as_llamaswaps(pair: Pair, profile: str) -> None:
    activate(pair, profile or None)
    for name, expected in UPSTREAM[profile].items():
        mine, theirs = pair.both("GET", f"/upstream/{name}/v1/models")
        assert served(theirs) == expected, (profile, name, theirs.text)
        assert served(mine) == expected, (profile, name, mine.text)


def listed(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return {m["id"]: m.get("meta", {}).get("llamaswap", {}).get("type")
            for m in r.json()["data"]}


@pytest.mark.parametrize("profile", ["coding", ""])
def test_models_lists_the_pins_as_llamaswap(pair: Pair, profile: str) -> None:
    """The active profile's pins are listed as `type: profile`, but not one pinned to nothing
    nor one that is a model's own id (internal/server/api.go `handleListModels`)."""
    activate(pair, profile or None)
    mine, theirs = pair.both("GET", "/v1/models")
    pins = {"public": "profile", "alias": "profile", "chooser": "profile"} if profile else {}
    assert listed(theirs) == {"real": "model", "other": "model", "any-chat": "selector",
                              **pins}
    assert listed(mine) == listed(theirs)
