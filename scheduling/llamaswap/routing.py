"""The sections that name models: `groups` (or `routing.router`), the matrix,
`routing.scheduler` and `hooks.on_startup.preload`. Each resolves a name to a model id through
`real_id` (model ids and aliases, known once model_entries.py has run) and warns about names
that match nothing. The matrix is only read here: whether its sets compile against the models
is scheduling/routing_checks.py's, which the admin shares.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scheduling import affinity_budget
from scheduling.core.matrix import VAR_NAME
from scheduling.llamaswap.errors import ConfigError
from scheduling.llamaswap.parsed import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_SCHEDULER,
    DEFAULT_SWAP_AFFINITY_BONUS,
    IMPLICIT_GROUP,
    MAX_SWAP_AFFINITY_BONUS,
    MODEL_ID_MAX,
    SCHEDULERS,
    ParsedGroup,
)
from scheduling.llamaswap.reader import Reader
from scheduling.llamaswap.values import describe


def read_groups(r: Reader, real_id: Callable[[str], str | None]
                ) -> tuple[tuple[ParsedGroup, ...], dict[str, str]]:
    """Top-level `groups:` or `routing.router.settings.groups`; returns model -> group."""
    data = r.data
    routing = r.mapping(data.get("routing"), "routing")
    r.known_keys(routing, "routing", frozenset({"router", "scheduler"}))
    router = r.mapping(routing.get("router"), "routing.router")
    r.known_keys(router, "routing.router", frozenset({"use", "settings"}))
    settings = r.mapping(router.get("settings"), "routing.router.settings")
    r.known_keys(settings, "routing.router.settings", frozenset({"groups", "matrix"}))
    top_level = [key for key in ("groups", "matrix") if data.get(key)]
    in_routing = bool(router.get("use") or settings.get("groups") or settings.get("matrix"))
    if top_level and in_routing:
        raise ConfigError(top_level[0], "the top-level groups:/matrix: keys cannot be "
                                        "combined with routing.router; move them under "
                                        "routing.router.settings and remove the top-level "
                                        "key")
    use = r.text(router.get("use"), "routing.router.use", "group") or "group"
    if use not in ("group", "matrix"):
        raise ConfigError("routing.router.use", f"unknown router {use!r} (valid: group, "
                                                "matrix)")
    if data.get("groups") and data.get("matrix"):
        raise ConfigError("matrix", "config cannot use both 'groups' and 'matrix'; keep one "
                                    "(or move both under routing.router.settings and pick "
                                    "one with routing.router.use)")
    if data.get("groups"):
        raw_groups, base = r.mapping(data["groups"], "groups"), "groups"
    else:
        raw_groups = r.mapping(settings.get("groups"), "routing.router.settings.groups")
        base = "routing.router.settings.groups"
    groups: list[ParsedGroup] = []
    group_of: dict[str, str] = {}
    for group_id, raw in raw_groups.items():
        path = f"{base}.{group_id}"
        if not group_id or group_id != group_id.strip() or len(group_id) > MODEL_ID_MAX:
            raise ConfigError(path, "a group id must be 1..255 characters without "
                                    "surrounding spaces")
        if group_id == IMPLICIT_GROUP:
            raise ConfigError(path, f"{IMPLICIT_GROUP} is the name of the implicit group of "
                                    "models in no group; rename this group")
        raw = r.mapping(raw, path)
        r.known_keys(raw, path, frozenset({"swap", "exclusive", "persistent",
                                           "members"}))
        if "members" not in raw:
            raise ConfigError(f"{path}.members", "required: the model ids in this group")
        members: list[str] = []
        for i, name in enumerate(r.strings(raw["members"], f"{path}.members")):
            where = f"{path}.members[{i}]"
            r.no_macros(name, where)
            model_id = real_id(name)
            if model_id is None:
                r.warn(where, f"{r.not_a_model(name)}; skipped (define the model "
                              "under models:, or remove it from the group)")
                continue
            if model_id != name:
                r.warn(where, f"{name!r} is an alias; using its model {model_id!r} "
                              "(group members should be model ids)")
            if model_id in members:
                raise ConfigError(where, f"{model_id!r} is listed twice in this group")
            if model_id in group_of:
                raise ConfigError(where, f"{model_id!r} is already a member of group "
                                         f"{group_of[model_id]!r}; a model may belong to "
                                         "only one group")
            members.append(model_id)
            group_of[model_id] = group_id
        groups.append(ParsedGroup(
            group_id=group_id,
            swap=r.boolean(raw.get("swap"), f"{path}.swap", True),
            exclusive=r.boolean(raw.get("exclusive"), f"{path}.exclusive", True),
            persistent=r.boolean(raw.get("persistent"), f"{path}.persistent", False),
            members=tuple(members),
        ))
    return tuple(groups), group_of


def read_matrix(r: Reader) -> tuple[str, dict[str, str], dict[str, int],
                                    tuple[tuple[str, str], ...]]:
    """The router in force and the matrix: (use, vars, evict_costs, sets in order).

    A top-level `matrix:` (legacy) means `use: matrix`, as in llama-swap. With `use: group` a
    matrix under `routing.router.settings` is read for its shape only, stored and exported
    again, never used (llama-swap does not validate it either)."""
    data = r.data
    routing = r.mapping(data.get("routing"), "routing")
    router = r.mapping(routing.get("router"), "routing.router")
    settings = r.mapping(router.get("settings"), "routing.router.settings")
    use = r.text(router.get("use"), "routing.router.use", "group") or "group"
    if data.get("matrix") is not None:
        raw, base, use = data["matrix"], "matrix", "matrix"
    else:
        raw, base = settings.get("matrix"), "routing.router.settings.matrix"
        if use == "matrix" and raw is None:
            raise ConfigError("routing.router.use", "is 'matrix' but "
                                                    "routing.router.settings.matrix is not set; "
                                                    "add the matrix's sets, or use: group")
    matrix = r.mapping(raw, base)
    r.known_keys(matrix, base, frozenset({"vars", "evict_costs", "sets"}))
    variables: dict[str, str] = {}
    for key, value in r.mapping(matrix.get("vars"), f"{base}.vars").items():
        where = f"{base}.vars.{key}"
        variables[key] = r.text(value, where)
        r.no_macros(variables[key], where)
        if use == "matrix" and not VAR_NAME.match(key):
            raise ConfigError(where, f"var key {key!r} must contain only alphanumeric, '-' or "
                                     "'.' characters and be 1-32 characters long")
    costs: dict[str, int] = {}
    for key, value in r.mapping(matrix.get("evict_costs"), f"{base}.evict_costs").items():
        where = f"{base}.evict_costs.{key}"
        costs[key] = r.integer(value, where, 1)
        if use == "matrix" and costs[key] <= 0:
            raise ConfigError(where, f"evict_cost for {key!r} must be a positive integer, got "
                                     f"{costs[key]}")
    if matrix.get("sets") is not None and not isinstance(matrix.get("sets"), dict):
        raise ConfigError(f"{base}.sets", "sets must be a mapping of a name to an expression, "
                                          "e.g. `standard: \"(g | q) & v\"`")
    sets: list[tuple[str, str]] = []
    for name, dsl in r.mapping(matrix.get("sets"), f"{base}.sets").items():
        where = f"{base}.sets.{name}"
        if not name.strip() or len(name) > MODEL_ID_MAX:
            raise ConfigError(where, "a set name must be 1..255 characters, not blank")
        sets.append((name, r.text(dsl, where)))
        r.no_macros(sets[-1][1], where)
    if use == "matrix" and not sets:
        raise ConfigError(f"{base}.sets", "matrix must define at least one set (a set names "
                                          "models that may run together, e.g. `a & b`)")
    return use, variables, costs, tuple(sets)


def read_routing_scheduler(r: Reader, real_id: Callable[[str], str | None]
                           ) -> tuple[str, float, int, dict[str, int], str]:
    """`routing.scheduler`: (use, agingDivisor, swapAffinityBonus, {model: fifo priority},
    affinityBudget as the settings page stores it)."""
    base = "routing.scheduler"
    routing = r.mapping(r.data.get("routing"), "routing")
    scheduler = r.mapping(routing.get("scheduler"), base)
    r.known_keys(scheduler, base, frozenset({"use", "settings"}))
    use = r.text(scheduler.get("use"), f"{base}.use", DEFAULT_SCHEDULER)
    if use not in SCHEDULERS:
        raise ConfigError(f"{base}.use", f"unknown scheduler {use!r}; use serial "
                                         "(gpuproxy's default) or fifo")
    settings = r.mapping(scheduler.get("settings"), f"{base}.settings")
    r.known_keys(settings, f"{base}.settings", frozenset({"fifo", "serial"}))

    fifo_path = f"{base}.settings.fifo"
    fifo = r.mapping(settings.get("fifo"), fifo_path)
    r.known_keys(fifo, fifo_path, frozenset({"priority"}))
    priority: dict[str, int] = {}
    given_as: dict[str, str] = {}
    for name, value in r.mapping(fifo.get("priority"), f"{fifo_path}.priority").items():
        where = f"{fifo_path}.priority.{name}"
        level = r.integer(value, where, 0)
        model_id = real_id(name)
        if model_id is None:
            r.warn(where, f"{r.not_a_model(name)}; ignored (define the model, or "
                          "remove the entry)")
            continue
        if model_id in priority:
            raise ConfigError(where, f"model {model_id!r} already has a priority (given as "
                                     f"{given_as[model_id]!r}); give it once")
        priority[model_id] = level
        given_as[model_id] = name

    serial_path = f"{base}.settings.serial"
    serial = r.mapping(settings.get("serial"), serial_path)
    r.known_keys(serial, serial_path,
                 frozenset({"agingDivisor", "swapAffinityBonus", "affinityBudget"}))
    aging = serial.get("agingDivisor", DEFAULT_AGING_DIVISOR)
    if aging is None:
        aging = DEFAULT_AGING_DIVISOR
    if isinstance(aging, bool) or not isinstance(aging, int | float):
        raise ConfigError(f"{serial_path}.agingDivisor",
                          f"expected a number of seconds, got {describe(aging)}")
    if not math.isfinite(aging) or aging <= 0:
        raise ConfigError(f"{serial_path}.agingDivisor",
                          f"must be a positive number of seconds, got {aging}: at 0 or "
                          "below, waiting never raises a request's score and low "
                          "priorities could starve")
    bonus = r.integer(serial.get("swapAffinityBonus"), f"{serial_path}.swapAffinityBonus",
                      DEFAULT_SWAP_AFFINITY_BONUS, minimum=0)
    if bonus > MAX_SWAP_AFFINITY_BONUS:
        r.warn(f"{serial_path}.swapAffinityBonus",
               f"{bonus} is above the maximum of {MAX_SWAP_AFFINITY_BONUS}; using "
               f"{MAX_SWAP_AFFINITY_BONUS} (100 or more would lift a request into the "
               "next priority band)")
        bonus = MAX_SWAP_AFFINITY_BONUS
    try:
        budget = affinity_budget.parse_budget(serial.get("affinityBudget")).text()
    except ValueError as exc:
        raise ConfigError(f"{serial_path}.affinityBudget", str(exc)) from None
    return use, float(aging), bonus, priority, budget


def read_preload(r: Reader, real_id: Callable[[str], str | None]) -> tuple[str, ...]:
    hooks = r.mapping(r.data.get("hooks"), "hooks")
    r.known_keys(hooks, "hooks", frozenset({"on_startup"}))
    startup = r.mapping(hooks.get("on_startup"), "hooks.on_startup")
    r.known_keys(startup, "hooks.on_startup", frozenset({"preload"}))
    path = "hooks.on_startup.preload"
    preload: list[str] = []
    for i, name in enumerate(r.strings(startup.get("preload"), path)):
        name = name.strip()
        if not name:
            continue
        r.no_macros(name, f"{path}[{i}]")
        model_id = real_id(name)
        if model_id is None:
            r.warn(f"{path}[{i}]", f"{r.not_a_model(name)}; skipped (define the "
                                   "model, or remove it from preload)")
            continue
        preload.append(model_id)
    return tuple(preload)
