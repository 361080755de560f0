"""What the process manager needs to know about one upstream, free of Django.

`ModelDefinition.to_upstream_spec()` builds these from the database; tests build them by hand.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

_UNRESOLVED = re.compile(r"\$\{[^}]*\}")


@dataclass(frozen=True)
class UpstreamSpec:
    model_id: str
    cmd: str
    proxy: str
    cmd_stop: str = ""
    check_endpoint: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    ttl: float = 0.0  # idle seconds before unload; 0 = never
    unload_timeout: float = 10.0  # graceful seconds before SIGKILL on unload
    health_check_timeout: float = 120.0  # seconds to become ready

    def revision(self) -> str:
        """What a running process was started from: a change here means it must restart to
        take effect. TTL and timeouts apply to the running process as they are."""
        return repr((self.cmd, self.proxy, self.cmd_stop, self.check_endpoint,
                     sorted(self.env.items())))

    def argv(self) -> list[str]:
        return split_command(self.cmd)

    def health_url(self) -> str | None:
        if self.check_endpoint.strip().lower() == "none":
            return None
        path = self.check_endpoint if self.check_endpoint.startswith("/") else (
            "/" + self.check_endpoint)
        return self.proxy.rstrip("/") + path


# The proxy's own secrets, never handed to an upstream (which runs code the operator may not
# have written, logs its environment, or serves it on a debug page). Everything else is
# inherited, as llama-swap does: GPU servers need CUDA_VISIBLE_DEVICES, LD_LIBRARY_PATH, HF_*,
# NVIDIA_*, HOME, PATH...
DENIED_ENV = frozenset({"DATABASE_URL"})
DENIED_ENV_PREFIXES = ("GPUPROXY_", "PG", "DJANGO_")


def upstream_env(own: Mapping[str, str], base: Mapping[str, str] | None = None
                 ) -> dict[str, str]:
    """The environment of an upstream's `cmd` and `cmd_stop`: the proxy's (`base`, default
    os.environ) without our secrets, plus the model's own `env`, which wins, even over the
    deny-list (an operator who writes `PGHOST` into a model's env means it)."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items()
           if k not in DENIED_ENV and not k.startswith(DENIED_ENV_PREFIXES)}
    env.update(own)
    return env


def strip_comments(cmd: str) -> str:
    """llama-swap's multi-line `cmd`: `#` comment lines dropped, a trailing `\\` joins lines."""
    kept = [line for line in cmd.splitlines() if not line.strip().startswith("#")]
    return "\n".join(kept)


def split_command(cmd: str) -> list[str]:
    """Split like a POSIX shell would, without ever running one.

    Raises ValueError with the reason on an unbalanced quote, an empty command or an
    unresolved `${...}` macro, so the caller can name the model in its message.
    """
    text = strip_comments(cmd).replace("\\\n", " ")
    argv = shlex.split(text, comments=False, posix=True)
    if not argv:
        raise ValueError("the command is empty")
    for arg in argv:
        if m := _UNRESOLVED.search(arg):
            raise ValueError(f"unresolved macro {m.group(0)} in the command")
    return argv
