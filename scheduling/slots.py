"""How many requests a model's upstream serves at once (its slots), read from its command the
way the server itself will read it. Pure: no Django, no asyncio (import and the admin share it).

The serial scheduler hands a model at most `parallel` requests at once and keeps the rest in
its own queue, where priority orders them. Too low a number leaves slots idle (a `-np 2`
server running one request at a time); too high a number lets the upstream queue requests in
arrival order, out of the scheduler's hands. So when `parallel` is not set it comes from here:

- llama-server: `-np N` / `--parallel N` (the last one given), else `LLAMA_ARG_N_PARALLEL` in
  the environment, else its own default. That default is -1, "auto" (llama.cpp
  `common/arg.cpp`, `common_params_parser_init`: `params.n_parallel = -1; // auto by default`
  for the server), which the server turns into **4 slots** over one unified KV cache
  (`tools/server/server.cpp`: `if (params.n_parallel < 0) { n_parallel = 4; kv_unified =
  true; }`). Read in llama.cpp b11549, the build xllamacpp 2026.10.11549 ships (its version
  is year.month.llama.cpp-build; the wheel's server carries the same help text and the same
  "n_parallel is set to auto, using n_parallel = 4" branch), and seen running:
  tests/test_llamacpp_slots.py. Any negative N means auto as well; 0 makes it refuse to start.
- `python -m gpuproxy.testing.llama_server` (our llama-server look-alike over xllamacpp) reads
  the same flags, but fills llama.cpp's parameter struct itself, whose default is 1 slot.
- vLLM: `--max-num-seqs N`. Without it vLLM picks a number from the GPU and the usage
  context, which a command line cannot tell, so 1 (set the flag, or `parallel`).
- SGLang: `--max-running-requests N`; without it SGLang sizes it from memory: 1 here too.
- Anything else: 1. Flags are read only for a server recognised by its program: whisper.cpp's
  `-np` means "no prints", not slots.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduling.spec import split_command

#: llama-server's slots when `-np` is absent or negative ("auto"), llama.cpp b11549
LLAMA_SERVER_AUTO_SLOTS = 4
#: what gpuproxy.testing.llama_server runs with no -np: llama.cpp's `common_params` default
LOOKALIKE_DEFAULT_SLOTS = 1
LOOKALIKE_MODULE = "gpuproxy.testing.llama_server"

_LLAMA_PROGRAMS = ("llama-server", "llama-server.exe")
# llama.cpp's own server images (ghcr.io/ggml-org/llama.cpp:server, :server-cuda, ...)
_LLAMA_IMAGE = re.compile(r"(^|/)llama\.cpp:server")
_LLAMA_FLAGS = ("-np", "--parallel")
_LLAMA_ENV = "LLAMA_ARG_N_PARALLEL"
_VLLM_FLAG = "--max-num-seqs"
_SGLANG_FLAG = "--max-running-requests"


@dataclass(frozen=True)
class Slots:
    """A number of slots and, in words for the admin and the import, where it came from."""

    parallel: int
    source: str


def resolve_parallel(explicit: int | None, cmd: str, env: Iterable[str] = ()) -> Slots:
    """An explicit `parallel` as it is; else what the command gives (`derive_parallel`)."""
    if explicit is not None:
        return Slots(explicit, "`parallel` set explicitly")
    return derive_parallel(cmd, env)


def derive_parallel(cmd: str, env: Iterable[str] = ()) -> Slots:
    """The slots the server `cmd` starts will have; `env` is the model's "NAME=value" list.

    A value the server would refuse (0, not a number) gives 1 and says so: that server
    does not start anyway, and the start failure will name the flag.
    """
    try:
        argv = split_command(cmd.replace("${PORT}", "0").replace("${MODEL_ID}", "m"))
    except ValueError as exc:
        return Slots(1, f"cmd cannot be split into arguments ({exc}): 1")
    for i, arg in enumerate(argv):
        if os.path.basename(arg) in _LLAMA_PROGRAMS or _LLAMA_IMAGE.search(arg):
            return _llama(argv[i + 1:], _environment(argv[:i], env), "llama-server",
                          LLAMA_SERVER_AUTO_SLOTS)
        if arg == LOOKALIKE_MODULE and i > 0 and argv[i - 1] == "-m":
            # argparse, not llama.cpp's parser: LLAMA_ARG_* variables mean nothing to it
            return _llama(argv[i + 1:], {}, LOOKALIKE_MODULE, LOOKALIKE_DEFAULT_SLOTS)
    for flag in (_VLLM_FLAG, _SGLANG_FLAG):
        found = _last_flag(argv, (flag,))
        if found is not None:
            return _read(found, auto=None)
    if _is_vllm(argv):
        return Slots(1, f"vLLM without {_VLLM_FLAG}: 1 (vLLM sizes its batch from the GPU, "
                        "which a command line cannot tell; set the flag, or `parallel`)")
    if _is_sglang(argv):
        return Slots(1, f"SGLang without {_SGLANG_FLAG}: 1 (SGLang sizes it from memory; set "
                        "the flag, or `parallel`)")
    return Slots(1, "not llama-server, vLLM or SGLang: 1 (set `parallel` to the server's slots)")


def _llama(args: Sequence[str], env: dict[str, str], program: str, default: int) -> Slots:
    found = _last_flag(args, _LLAMA_FLAGS)
    if found is None and _LLAMA_ENV in env:
        found = _Found(f"{_LLAMA_ENV}={env[_LLAMA_ENV]} in env", env[_LLAMA_ENV])
    if found is not None:
        return _read(found, auto=LLAMA_SERVER_AUTO_SLOTS)
    if default == LLAMA_SERVER_AUTO_SLOTS:
        return Slots(default, f"{program}'s default: -np auto = {default} slots")
    return Slots(default, f"{program}'s default: {default} slot")


@dataclass(frozen=True)
class _Found:
    where: str  # "`-np 4` in cmd", "LLAMA_ARG_N_PARALLEL=4 in env"
    value: str | None  # None: the flag ends the command, with no value


def _read(found: _Found, auto: int | None) -> Slots:
    """The number `found` gives. `auto`: what a negative number means (llama-server's auto),
    None where a number below 1 is refused."""
    if found.value is None:
        return Slots(1, f"{found.where} has no value: 1")
    try:
        n = int(found.value)
    except ValueError:
        return Slots(1, f"{found.where} is not a number: 1")
    if n < 0 and auto is not None:
        return Slots(auto, f"{found.where}: auto = {auto} slots")
    if n == 0 and auto is not None:
        return Slots(1, f"{found.where}: llama-server refuses 0 and does not start: 1")
    if n < 1:
        return Slots(1, f"{found.where} is below 1: the server refuses it: 1")
    return Slots(n, found.where)


def _last_flag(args: Sequence[str], names: Sequence[str]) -> _Found | None:
    """The last `NAME VALUE` or `NAME=VALUE` among `args` (servers parse flags in order, so
    a later one wins)."""
    found: _Found | None = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in names:
            continue
        if eq:
            found = _Found(f"`{arg}` in cmd", value)
        elif i + 1 < len(args):
            found = _Found(f"`{arg} {args[i + 1]}` in cmd", args[i + 1])
        else:
            found = _Found(f"`{arg}` in cmd", None)
    return found


def _environment(before: Sequence[str], env: Iterable[str]) -> dict[str, str]:
    """The server's environment: the model's `env`, then `docker run -e/--env NAME=value`
    (which comes before the image), later entries winning as they do there."""
    out = dict(entry.split("=", 1) for entry in env if "=" in entry)
    if before and os.path.basename(before[0]) in ("docker", "podman"):
        for i, arg in enumerate(before):
            value = None
            if arg in ("-e", "--env") and i + 1 < len(before):
                value = before[i + 1]
            elif arg.startswith("--env="):
                value = arg[len("--env="):]
            if value and "=" in value:
                name, _, v = value.partition("=")
                out[name] = v
    return out


def _is_vllm(argv: Sequence[str]) -> bool:
    return any(
        (os.path.basename(a) == "vllm" and i + 1 < len(argv) and argv[i + 1] == "serve")
        or a.startswith("vllm.entrypoints") or "vllm-openai" in a or a.startswith("vllm/vllm")
        for i, a in enumerate(argv))


def _is_sglang(argv: Sequence[str]) -> bool:
    return any(a.startswith("sglang.launch_server") or a.startswith("lmsysorg/sglang")
               or (os.path.basename(a) == "sglang" and i + 1 < len(argv)
                   and argv[i + 1] == "serve")
               for i, a in enumerate(argv))
