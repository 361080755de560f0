"""The `gpuproxy` console script: the project's manage.py, usable from any directory, and
llama-swap's command line: `gpuproxy -config F -listen :8080` (no subcommand, as a llama-swap
unit file calls it) runs `serve`, and `gpuproxy -version` prints this build's version."""

import os
import signal
import sys

# A first argument that is an option names no subcommand: llama-swap's command line, for
# `serve`; except these, which stay Django's (its list of commands).
_NOT_SERVE = ("-h", "--help")


def main() -> None:
    argv = sys.argv
    if argv[1:2] and argv[1] in ("-version", "--version"):
        from gpuproxy.version import version_line

        print(version_line())
        return
    if argv[1:2] and argv[1].startswith("-") and argv[1] not in _NOT_SERVE:
        argv = [argv[0], "serve", *argv[1:]]
    if argv[1:2] == ["serve"]:
        # SIGHUP means "reload the config" to serve; until its handler is in place (after
        # Django, the migrations and the import) it must not end the process, its default.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuproxy.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(argv)


if __name__ == "__main__":  # `python -m gpuproxy.cli`: how `serve --workers N` starts its processes
    main()
