"""The multi-turn chat results shown: a table on stdout and a two-panel PNG (TTFT and hit rate per turn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def print_table(targets: dict[str, dict[str, Any]]) -> None:
    """One row per target on stdout, then TTFT p50 and hit rate / oracle per turn."""
    print(
        f"\n{'target':<20}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'TPOT':>8}{'e2e p50':>9}{'req/s':>8}"
        f"{'out tok/s':>10}{'hit':>7}{'oracle':>8}{'+inflight':>10}"
    )
    for name, t in targets.items():

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e3:.0f}ms"

        print(
            f"{name:<20}{ms(t['ttft_p50_s']):>10}{ms(t['ttft_p90_s']):>9}{ms(t['ttft_p99_s']):>9}"
            f"{ms(t['tpot_s']):>8}{t['e2e_p50_s'] or 0:>8.2f}s{t['req_per_s']:>8.2f}{t['output_tok_per_s']:>10.1f}"
            f"{t['hit_rate']:>7.3f}{t['oracle_hit_rate']:>8.3f}{t['oracle_inflight_hit_rate']:>10.3f}"
        )
    for name, t in targets.items():
        cells = "  ".join(
            f"t{p['turn']}: {(p['ttft_p50_s'] or 0) * 1e3:.0f}ms {p['hit_rate']:.2f}/{p['oracle_hit_rate']:.2f}"
            for p in t["per_turn"]
        )
        print(f"{name:<20}{cells}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Two PNG panels: TTFT p50 per turn for each target; hit rate per turn against the oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    oracles: dict[tuple, list[str]] = {}  # an oracle series -> the targets whose trace gives it
    for i, (name, t) in enumerate(result["targets"].items()):
        turns = [p["turn"] for p in t["per_turn"]]
        ax1.plot(turns, [(p["ttft_p50_s"] or 0) * 1e3 for p in t["per_turn"]], "o-", color=f"C{i}", label=name)
        ax2.plot(turns, [p["hit_rate"] for p in t["per_turn"]], "o-", color=f"C{i}", label=f"{name} hit rate")
        for key in ("oracle_hit_rate", "oracle_inflight_hit_rate"):
            oracles.setdefault((key, tuple(turns), tuple(p[key] for p in t["per_turn"])), []).append(name)
    for j, ((key, turns, values), names) in enumerate(oracles.items()):
        kind = "oracle" if key == "oracle_hit_rate" else "oracle incl. in-flight prompts"
        ax2.plot(
            turns,
            values,
            "x--" if key == "oracle_hit_rate" else ":",
            color="black",
            alpha=1 - 0.15 * j,
            label=f"{kind} ({', '.join(names)})",
        )
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({p["turn"] for t in result["targets"].values() for p in t["per_turn"]}))
    ax1.set_xlabel("turn")
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_yscale("log")
    ax1.set_title("time to first token per turn")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("turn")
    ax2.set_ylabel("cached prompt tokens / prompt tokens")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_title("prefix-cache hit rate per turn vs the trace's oracle")
    ax2.legend(fontsize=7)
    c = result["config"]
    fig.suptitle(
        f"{c['model']}: {c['conversations']} conversations x {c['turns']} turns, system "
        f"{c['system_prompt_tokens']} tokens, concurrency {c['concurrency']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
