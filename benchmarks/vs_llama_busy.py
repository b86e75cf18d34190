"""radixserve vs llama-server quiet and beside a busy core: benchmarks/vs_llama_server.py run twice (issue 24).

The same invocation of benchmarks/vs_llama_server.py (every flag but --out passes through: the multi-turn workload,
then single-stream decode, radixserve first, then llama-server, each on a fresh server) runs `--reps` times quiet and
`--reps` times while another process keeps one core busy (`python -c "while True: pass"`, started before the servers
and killed after both), the phases alternating (quiet, busy, quiet, busy...) so slow drift in the machine's other
load touches both alike. Per phase, the median over its repetitions of radixserve's and llama-server's multi-turn
TPOT, output tok/s and single-stream decode tok/s, and ratio = radixserve / llama-server of each.

Targets (issue 24): radixserve's busy TPOT <= 2x its quiet TPOT (tpot_busy_over_quiet), and its TPOT ratio to
llama-server busy no worse (not larger) than quiet. Writes benchmarks/results/vs_llama_busy.json: machine, the
summary with the targets, and every run's full vs_llama_server result.

    .venv/bin/python -m benchmarks.vs_llama_busy                   # one quiet and one busy run of the defaults
    .venv/bin/python -m benchmarks.vs_llama_busy --smoke --model <tiny model folder> --out /tmp/busy.json
        # seconds: vs_llama_server's --smoke (a stub llama-server); writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import vs_llama_server as vs
from benchmarks.cli import write_result

RESULTS = Path(__file__).parent / "results" / "vs_llama_busy.json"
BUSY = "while True: pass"
SETTLE_S = 0.5  # the busy process runs this long before the servers start
PHASES = ("quiet", "busy")
# figure name -> how it is read from one engine's vs_llama_server result
FIGURES = {
    "tpot_s": lambda e: e["multi_turn"]["tpot_s"],
    "output_tok_s": lambda e: e["multi_turn"]["output_tok_per_s"],
    "single_stream_decode_tok_s": lambda e: e["single_stream"]["decode_tok_s"],
}
logger = logging.getLogger(__name__)


@contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    """While inside, a process keeps one core busy (nothing when busy is False); it is killed on the way out."""
    if not busy:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        proc.kill()
        proc.wait()


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 4 places; None when either is missing or b is 0."""
    return round(a / b, 4) if a is not None and b else None


def phase_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per engine and FIGURES key the median over runs (None when a run lacks it), and radixserve / llama-server."""
    out: dict[str, Any] = {}
    for engine in vs.ENGINES:
        figures = {}
        for name, read in FIGURES.items():
            values = [read(run["engines"][engine]) for run in runs]
            figures[name] = round(statistics.median(values), 6) if None not in values else None
        out[engine] = figures
    ours, theirs = (out[engine] for engine in vs.ENGINES)
    out["ratio"] = {name: ratio(ours[name], theirs[name]) for name in FIGURES}
    return out


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The phases' figures and the two targets: busy TPOT <= 2x quiet; TPOT ratio to llama-server busy <= quiet."""
    phases = {phase: phase_figures(runs[phase]) for phase in PHASES}
    ours = [phases[phase][vs.ENGINES[0]]["tpot_s"] for phase in PHASES]
    slowdown = ratio(ours[1], ours[0])
    quiet_ratio, busy_ratio = (phases[phase]["ratio"]["tpot_s"] for phase in PHASES)
    return {
        **phases,
        "tpot_busy_over_quiet": slowdown,
        "targets": {
            "tpot_busy_over_quiet": {
                "value": slowdown,
                "rule": "<=",
                "target": 2.0,
                "met": slowdown is not None and slowdown <= 2.0,
            },
            "tpot_ratio_busy_vs_quiet": {
                "value": [quiet_ratio, busy_ratio],
                "rule": "busy <= quiet",
                "met": quiet_ratio is not None and busy_ratio is not None and busy_ratio <= quiet_ratio,
            },
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=1, help="runs per phase (quiet and busy alternate)")
    parser.add_argument("--smoke", action="store_true", help="vs_llama_server's --smoke (a stub llama-server)")
    parser.add_argument("--out", type=Path, help=f"JSON output (default {RESULTS}; none with --smoke)")
    ns, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime.model.cpu_features import machine_facts

    machine = machine_facts()
    runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
    with tempfile.TemporaryDirectory(prefix="vs-busy-") as tmp:
        for rep in range(ns.reps):
            for phase in PHASES:
                out = Path(tmp) / f"{phase}{rep}.json"
                args = rest + ["--out", str(out)] + (["--smoke", "--log-dir", tmp] if ns.smoke else [])
                with busy_core(phase == "busy"):
                    runs[phase].append(vs.main(args))
    result = {"machine": machine, "argv": rest, "reps": ns.reps, "summary": summarize(runs), "runs": runs}
    print(json.dumps(result["summary"], indent=1))
    write_result(result, ns.out, ns.smoke, RESULTS)
    return result


if __name__ == "__main__":
    main()
