"""llama-swap's profiles API: `GET /api/profiles` and `PUT /api/profiles/active`.

A profile pins requested model names to other targets (or to nothing: 404) while it is active;
`Catalog.route` applies the pins. llama-swap keeps the active profile in memory, so a restart
forgets it; ours is a database setting (`ProxySettings.active_profile`), so it survives a
restart, reaches every request process of `serve --workers N` with the catalog the hub pushes,
and is the same value the admin edits.

Who may call: any valid key may read the profiles (the pins name only models, which
`/v1/models` lists anyway); switching changes what every client's requests reach, so only
admin keys may (llama-swap has one kind of key, which may do both).

The switch answers once the catalog this process routes by shows it, so the next request
after the answer routes by the new profile (docs/llama-swap.md, "Profiles").
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse
from django.urls import path

from gpuproxy.api.decorators import ApiRequest, api_view, json_error
from gpuproxy.shell import runtime
from scheduling.catalog import Catalog
from scheduling.models import ProxySettings

logger = logging.getLogger("gpuproxy.api.profiles")

#: How long a switch waits for the running proxy to reload its catalog. A reload is a few
#: database reads (milliseconds); this bound only matters while the database is failing.
APPLY_WITHIN = 10.0
#: How often the wait looks at the catalog in force: it is replaced, not announced, in a
#: request process (the hub's push), so the wait reads it rather than subscribing.
APPLY_POLL = 0.005


def active_in(catalog: Catalog) -> str | None:
    """The profile whose pins apply, None for none: as `Catalog.route` sees it, so a setting
    naming a profile since deleted reads as none, which is what routing does with it."""
    name = catalog.active_profile
    return name if name and name in catalog.profiles else None


@api_view(("GET",), admin=False)
async def profiles(request: ApiRequest) -> HttpResponse:
    """llama-swap's shape: `{"active": name|null, "profiles": [{"id", "description",
    "pins"}]}`, sorted by id, a pin to nothing written `""` (Go's map of strings)."""
    catalog = (await runtime.port()).catalog
    listed = [{"id": p.name, "description": p.description,
               "pins": {name: target or "" for name, target in sorted(p.pins.items())}}
              for p in sorted(catalog.profiles.values(), key=lambda p: p.name)]
    return JsonResponse({"active": active_in(catalog), "profiles": listed})


def _requested_name(body: bytes) -> str | HttpResponse:
    """The body's `name` ("" for none), or llama-swap's 400 for what it refuses, in its
    words, with what to send instead."""
    usage = 'send {"name": "<profile>"}, or {"name": null} for none'
    try:
        data: Any = json.loads(body)
    except ValueError:
        return json_error(400, f"invalid profile request: the body is not JSON; {usage}",
                          code="bad_request")
    if data is None:
        data = {}  # Go decodes `null` into an empty map: then `name` is missing
    if not isinstance(data, dict):
        return json_error(400, f"invalid profile request: the body is not a JSON object; "
                               f"{usage}", code="bad_request")
    if "name" not in data:
        return json_error(400, f"profile name is required: {usage}", code="bad_request")
    name = data["name"]
    if name is None:
        return ""
    if not isinstance(name, str):
        return json_error(400, f"profile name must be a string or null: {usage}",
                          code="bad_request")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):  # no profile has one; the database
        return json_error(404, "profile names hold no control characters: GET /api/profiles "
                               "lists the profiles", code="not_found")  # would refuse a NUL
    return name


async def _in_force(name: str, version: int) -> bool:
    """`runtime.profile_in_force` for this process's catalog, within APPLY_WITHIN seconds."""
    return await runtime.profile_in_force(await runtime.port(), name, version,
                                          within=APPLY_WITHIN, poll=APPLY_POLL)


@api_view(("PUT",))
async def set_active(request: ApiRequest) -> HttpResponse:
    """`{"name": "<profile>"}` activates a profile, `{"name": null}` or `""` selects none;
    the answer is `{"active": name|null}`, as llama-swap's."""
    name = _requested_name(request.body)
    if isinstance(name, HttpResponse):
        return name
    try:
        found, before, version = await runtime.run_db(
            lambda: ProxySettings.set_active_profile(name))
    except (OperationalError, InterfaceError) as exc:
        detail = (str(exc) if isinstance(exc, runtime.DatabaseUnavailable)
                  else f"database error ({type(exc).__name__})")
        return json_error(503, f"the active profile cannot be changed: {detail}; retry later",
                          type_="server_error", code="database_unavailable",
                          headers={"Retry-After": "5"})
    if not found:
        return json_error(404, f'profile "{name}" not found: GET /api/profiles lists the '
                               "profiles (`profiles:` in the config, or the admin)",
                          code="not_found")
    if before != name:
        who = request.caller.name if request.caller is not None else "no key"
        logger.info("active profile changed from %r to %r (PUT /api/profiles/active, %s)",
                    before, name, who)
    if not await _in_force(name, version):
        return json_error(503, f"the active profile is saved as {name or 'none'!r}, but the "
                               f"running proxy did not reload its definitions within "
                               f"{APPLY_WITHIN:g} s (is the database reachable? GET /health "
                               "says); it applies at the next reload", type_="server_error",
                          code="profile_not_applied", headers={"Retry-After": "5"})
    return JsonResponse({"active": name or None})


urlpatterns = [
    path("api/profiles", profiles),
    path("api/profiles/active", set_active),
]
