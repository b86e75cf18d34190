"""`python -m runtime.launch` and the `radixserve` console script: the launcher lives in runtime/serve/launch.py."""

from __future__ import annotations

import sys

from runtime.serve.launch import Launcher, LaunchError, build_parser, main

__all__ = ["Launcher", "LaunchError", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
