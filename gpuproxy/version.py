"""What build this is, said one way for `gpuproxy --version`, `/api/version` and the metrics.

The version is the installed package's (pyproject.toml). The commit and its date are read once
from the checkout's git metadata when there is one (an editable install, `make run`); a wheel
installed elsewhere has none, and says "unknown", as llama-swap's own dev builds do.
"""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def version_info() -> dict[str, str]:
    """`{version, commit, build_date}`: llama-swap's `/api/version` shape."""
    try:
        version = metadata.version("gpuproxy")
    except metadata.PackageNotFoundError:
        version = "unknown"
    commit, date = "unknown", "unknown"
    if (_ROOT / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(_ROOT), "log", "-1", "--format=%h %cI"],
                                 capture_output=True, text=True, timeout=5, check=True)
            commit, date = out.stdout.split()
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return {"version": version, "commit": commit, "build_date": date}


def version_line() -> str:
    """One line for `--version`: llama-swap prints `version: V (commit), built at D`."""
    info = version_info()
    return f"gpuproxy version: {info['version']} ({info['commit']}), built at {info['build_date']}"
