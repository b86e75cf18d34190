"""`python -m runtime.launch` and the `radixserve` console script: the launcher lives in runtime/serve/launch.py.

`--data-parallel-size N` (N > 1) serves N replicas of the whole server behind the cache-aware router from this one
command (router/launch.py: the replicas on 127.0.0.1 with free ports, the router on --host:--port, the HTTP server in
front of the router with --http-port; stats and /metrics merged across replicas by the router). This entry module is
the one place above both runtime/ and router/: nothing imports it.
"""

from __future__ import annotations

import sys

from runtime.serve.launch import Launcher, LaunchError, build_parser
from runtime.serve.launch import main as serve_main

__all__ = ["Launcher", "LaunchError", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one server (runtime.serve.launch.main), or with --data-parallel-size N > 1 the N replicas behind a
    router (router.launch.main, which also takes its flags: --policy, --balance-threshold, ...). Returns the exit
    status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["--child"]:
        known, _rest = build_parser().parse_known_args(argv)
        if known.data_parallel_size > 1:
            from router.launch import main as router_main

            return router_main(argv, ready_prefix="radixserve ready at")
    return serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
