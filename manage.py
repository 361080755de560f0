#!/usr/bin/env python
"""Django's command-line utility; the installed `gpuproxy` console script is the same thing."""

from gpuproxy.cli import main

if __name__ == "__main__":
    main()
