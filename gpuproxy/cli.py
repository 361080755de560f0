"""The `gpuproxy` console script: the project's manage.py, usable from any directory."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gpuproxy.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":  # `python -m gpuproxy.cli`: how `serve --workers N` starts its processes
    main()
