"""Router benchmark: the multi-turn chat workload of benchmarks/multi_turn_chat.py on one replica and on N replicas
behind the router with each policy, side by side: hit rate (cached prompt tokens / prompt tokens), the trace's oracle
hit rate, TTFT, and how the prompt tokens split over the replicas.

Targets: `single` (one replica, driven directly), `router=POLICY:N` (N replicas behind the router). Each target
starts fresh replicas with the same KV budget per replica, unless `--backends` names running ones (then every target
reuses them with its own cache_salt, so no target sees another's blocks; `single` uses the first backend).
Target (issue 8): cache_aware hit rate >= 0.95 x the single-replica hit rate, and above round_robin's.

    .venv/bin/python -m benchmarks.router_bench --quick       # smollm2, 12 conversations x 3 turns, 2 replicas
    .venv/bin/python -m benchmarks.router_bench --smoke --model <tiny model folder> --backends tcp://..,tcp://..
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.chat.config import Config
from benchmarks.chat.drive import drive_async
from benchmarks.chat.trace import Record, Reply, summarize
from benchmarks.chat.workload import ChatWorkload
from benchmarks.cli import apply_preset, output_path
from benchmarks.multi_turn_chat import SMOKE, default_num_blocks, parse_router_target
from runtime.text.prompt import apply_chat_template

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).parent / "results" / "router.json"
DEFAULT_TARGETS = ["single", "router=cache_aware:2", "router=round_robin:2"]
# More conversations than multi_turn_chat's --quick (4): N replicas each prefill the shared system prompt once, a
# fixed cost that 4 conversations cannot amortise (384 of 6219 prompt tokens there, 6%).
QUICK = {
    "conversations": 12,
    "turns": 3,
    "system_prompt_tokens": 384,
    "user_tokens": "32:64",
    "max_tokens": 8,
    "concurrency": 4,
}


def parse_target(name: str) -> tuple[str, int]:
    """ "single" -> ("single", 1); "router=POLICY:N" -> (POLICY, N). Raises ValueError for anything else."""
    if name == "single":
        return "single", 1
    return parse_router_target(name)


def drive_endpoint(
    endpoint: str, cfg: Config, wl: ChatWorkload, salt: str, replicas: list[str]
) -> tuple[list[Record], list[int]]:
    """Runs the workload against a public endpoint (a replica or a router) through runtime.client.AsyncClient, after
    one warm-up request. Returns the records and the prompt tokens each of `replicas` served for them."""
    from runtime.client import AsyncClient

    async def main() -> tuple[list[Record], list[int]]:
        async with AsyncClient(endpoint, timeout=600.0) as client:

            async def send(messages: list[dict[str, str]]) -> Reply:
                first, ids, text, usage, reason = None, [], "", None, None
                async for chunk in client.stream(
                    messages=messages, max_tokens=cfg.max_tokens, temperature=0.0, cache_salt=salt
                ):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter()
                    ids.extend(chunk.token_ids)
                    text += chunk.text
                    if chunk.finish_reason is not None:
                        usage, reason = chunk.usage, chunk.finish_reason
                return Reply(
                    first,
                    time.perf_counter(),
                    ids,
                    text,
                    reason,
                    usage and usage.prompt_tokens,
                    usage and usage.cached_tokens,
                )

            await client.generate(
                messages=[{"role": "user", "content": "Say hello."}], max_tokens=2, cache_salt="warm-up"
            )
            before = replica_prompt_tokens(replicas)
            records = await drive_async(wl, cfg, send, _NoBar())
            split = [a - b for a, b in zip(replica_prompt_tokens(replicas), before, strict=True)]
            return records, split

    return asyncio.run(main())


class _NoBar:
    def update(self) -> None:
        pass


def replica_prompt_tokens(endpoints: list[str]) -> list[int]:
    """prompt_tokens of each replica's own ServerStats."""
    from runtime.client import Client

    out = []
    for ep in endpoints:
        with Client(ep, timeout=60) as c:
            out.append(c.stats().prompt_tokens)
    return out


def run_target(name: str, cfg: Config, wl: ChatWorkload, backends: list[str]) -> tuple[list[Record], list[int]]:
    """One target: (records, prompt tokens each replica served during it)."""
    from router.launch import RouterLauncher
    from runtime.config import ServerArgs
    from runtime.serve.launch import Launcher

    policy, n = parse_target(name)
    args = ServerArgs(
        model=cfg.model, block_size=cfg.block_size, num_blocks=cfg.num_blocks, port=0, log_interval_s=3600.0
    )
    if policy == "single":
        launcher = None if backends else Launcher(args)
        endpoint = backends[0] if backends else launcher.start()
        try:
            return drive_endpoint(endpoint, cfg, wl, name, [endpoint])
        finally:
            if launcher is not None:
                launcher.shutdown("benchmark finished")
    use = backends[:n] if backends else []
    with RouterLauncher(args, replicas=0 if use else n, backends=use or None, policy=policy) as rl:
        return drive_endpoint(rl.endpoint, cfg, wl, name, rl.backends)


def targets_met(targets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """cache_aware hit rate >= 0.95 x single, and > round_robin (for every replica count that ran)."""
    out: dict[str, Any] = {}
    single = targets.get("single")
    for name, t in targets.items():
        if not name.startswith("router=cache_aware"):
            continue
        if single and single["hit_rate"] > 0:
            ratio = t["hit_rate"] / single["hit_rate"]
            out[f"{name}_hit_rate_over_single"] = {"value": round(ratio, 4), "target": 0.95, "met": ratio >= 0.95}
        rr = targets.get(name.replace("cache_aware", "round_robin"))
        if rr is not None:
            out[f"{name}_hit_rate_over_round_robin"] = {
                "value": [t["hit_rate"], rr["hit_rate"]],
                "met": t["hit_rate"] > rr["hit_rate"],
            }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--target", action="append", help=f"single, router=POLICY:N (default {DEFAULT_TARGETS})")
    parser.add_argument("--backends", default="", help="comma-separated endpoints of running replicas to reuse")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", default="64:128")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (default: trace fits)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK}")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE}; writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON output (default {RESULTS})")
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, SMOKE)
    elif ns.quick:
        apply_preset(parser, ns, QUICK)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime.model.loader import load_tokenizer

    names = [v.strip() for value in (ns.target or [",".join(DEFAULT_TARGETS)]) for v in value.split(",") if v.strip()]
    for name in names:
        parse_target(name)
    cfg = Config.from_args(ns, names, ns.block_size)
    cfg.num_blocks = ns.num_blocks or default_num_blocks(cfg)
    backends = [b.strip() for b in ns.backends.split(",") if b.strip()]
    tokenizer = load_tokenizer(cfg.model)
    wl = cfg.workload(tokenizer)
    targets: dict[str, dict[str, Any]] = {}
    for name in names:
        t0 = time.perf_counter()
        records, split = run_target(name, cfg, wl, backends)
        for r in records:
            r.prompt_ids = apply_chat_template(tokenizer, r.messages)
        wall = max(r.reply.t_end for r in records) - min(r.t_submit for r in records)
        targets[name] = {
            **summarize(records, wall, cfg.block_size),
            "replica_prompt_tokens": split,
            "target_s": round(time.perf_counter() - t0, 1),
        }
        t = targets[name]
        print(
            f"{name:<24} hit rate {t['hit_rate']:.4f} (oracle {t['oracle_hit_rate']:.4f})  TTFT p50 "
            f"{t['ttft_p50_s']}s  turn>=2 p50 {t['ttft_turn2plus_p50_s']}s  replica prompt tokens {split}",
            file=sys.stderr,
        )
    machine = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    result = {
        "config": {**asdict(cfg), "backends": backends, "machine": machine},
        "targets": targets,
        "targets_met": targets_met(targets),
    }
    print(json.dumps(result["targets_met"], indent=1))
    path = output_path(ns.out, ns.smoke, RESULTS)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
