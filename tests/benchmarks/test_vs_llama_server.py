"""Tests of benchmarks/vs_llama_server.py and its helpers: the build script's options for given CPU flags and its reuse
of an up-to-date build, CMakeCache parsing, the ratios on hand-made figures (exact values), ServerProcess' start and
stop, and one --smoke run (a tiny radixserve vs the stub llama-server) read back from its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from benchmarks import llama_server as ls
from benchmarks.chat.config import BenchmarkError
from benchmarks.chat.prompt_probe import probe_chat
from benchmarks.chat.workload import ChatWorkload
from benchmarks.vs_llama_server import (
    TARGETS,
    chat_template_for,
    llama_speculation,
    main,
    ratios_and_targets,
    results_path,
)
from runtime.model.loader import load_tokenizer
from runtime.text.chat_templates import TEMPLATES

SCRIPT = str(ls.SCRIPT)
AVX2_ONLY = "fpu sse sse2 avx avx2 fma f16c bmi2"
AVX512_AMX = AVX2_ONLY + (
    " avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_bf16"
)


def _print_flags(tmp_path: Path, flags: str) -> list[str]:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: avx512f\n"
    )  # only the first processor's flags count
    out = subprocess.run(
        ["bash", SCRIPT, "--print-flags"],
        env={**os.environ, "CPUINFO": str(cpuinfo)},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def test_build_options_follow_the_cpu_flags_and_amx_is_off(tmp_path: Path):
    tail = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    avx2 = [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_AVX_VNNI=OFF",
    ]
    assert _print_flags(tmp_path, AVX2_ONLY) == [
        *avx2,
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
        *tail,
    ]
    assert _print_flags(tmp_path, AVX512_AMX) == [
        *avx2,
        "-DGGML_AVX512=ON",
        "-DGGML_AVX512_VBMI=ON",
        "-DGGML_AVX512_VNNI=ON",
        "-DGGML_AVX512_BF16=ON",
        *tail,
    ]
    # avx512f without avx512bw: ggml's AVX512 build needs both, so it and its extensions are off
    no_bw = AVX512_AMX.replace(" avx512bw", "")
    assert _print_flags(tmp_path, no_bw)[7:11] == [
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
    ]


def test_an_up_to_date_build_is_reused_and_its_options_read_back(tmp_path: Path):
    flags = _print_flags(tmp_path, AVX2_ONLY)
    out = tmp_path / "llama-server-b11434"
    (out / "build" / "bin").mkdir(parents=True)
    binary = out / "build" / "bin" / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    cache = [f"{f[2:].split('=')[0]}:BOOL={f.split('=')[1]}" for f in flags]
    (out / "build" / "CMakeCache.txt").write_text(
        "\n".join(
            [
                "# comment",
                "CMAKE_BUILD_TYPE:STRING=Release",
                "LLAMA_BUILD_NUMBER:STRING=11434",
                *cache,
                "GGML_CUDA:BOOL=OFF",
            ]
        )
        + "\n"
    )
    done = subprocess.run(
        ["bash", SCRIPT, str(out)],
        env={**os.environ, "CPUINFO": str(tmp_path / "cpuinfo")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == f"up to date: {binary}\n"
    options = ls.build_options(out)
    assert list(options) == list(ls.REPORTED_OPTIONS)
    assert options["GGML_AVX2"] == "ON" and options["GGML_AVX512"] == "OFF" and options["GGML_AMX_TILE"] == "OFF"
    assert (options["LLAMA_BUILD_NUMBER"], options["CMAKE_BUILD_TYPE"]) == ("11434", "Release")
    assert ls.build_options(tmp_path / "nothing") == {}


def test_server_command():
    assert ls.server_command("/b/llama-server", "/m.gguf", 8, 2, 8080) == [
        "/b/llama-server",
        "-m",
        "/m.gguf",
        "-np",
        "8",
        "-c",
        "16384",
        "-t",
        "2",
        "-tb",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "8080",
    ]


def _engine(out_tok_s: float, ttft: float, tpot: float | None, decode: float) -> dict:
    return {
        "multi_turn": {"output_tok_per_s": out_tok_s, "ttft_p50_s": ttft, "tpot_s": tpot},
        "single_stream": {"decode_tok_s": decode},
    }


def test_ratios_and_targets_on_hand_made_figures():
    ratios, targets = ratios_and_targets(
        {"radixserve-http": _engine(60.0, 1.0, 0.1, 50.0), "llama-server": _engine(40.0, 2.0, 0.125, 100.0)}
    )
    assert ratios == {"output_tok_s": 1.5, "ttft_p50": 0.5, "tpot": 0.8, "single_stream_decode_tok_s": 0.5}
    assert {k: (t["value"], t["rule"], t["target"], t["met"]) for k, t in targets.items()} == {
        "output_tok_s": (1.5, ">=", 1.5, True),
        "ttft_p50": (0.5, "<=", 0.7, True),
        "tpot": (0.8, "<=", 1.0, True),
        "single_stream_decode_tok_s": (0.5, ">=", 0.7, False),
    }
    ratios, targets = ratios_and_targets(
        {"radixserve-http": _engine(41.0, 2.8, None, 13.0), "llama-server": _engine(41.0, 4.0, 0.1, 104.0)}
    )
    assert ratios == {"output_tok_s": 1.0, "ttft_p50": 0.7, "tpot": None, "single_stream_decode_tok_s": 0.125}
    assert [t["met"] for t in targets.values()] == [False, True, False, False]
    _, targets = ratios_and_targets(
        {"radixserve-http": _engine(1.0, 1.0, 1.0, 70.0), "llama-server": _engine(1.0, 1.0, 1.0, 100.0)}
    )
    assert targets["single_stream_decode_tok_s"]["value"] == 0.7 and targets["single_stream_decode_tok_s"]["met"]


def test_chat_template_defaults_and_result_names(tmp_path: Path):
    gemma = str(TEMPLATES / "gemma_turns.jinja")
    assert chat_template_for("gemma3-270m", None) == gemma
    assert chat_template_for("smollm2", None) is None
    mine = tmp_path / "t.jinja"
    mine.write_text("{{ messages[0]['content'] }}")
    assert chat_template_for("gemma3-270m", str(mine)) == str(mine)
    with pytest.raises(BenchmarkError, match="--chat-template '/nope.jinja': no such file"):
        chat_template_for("smollm2", "/nope.jinja")
    assert results_path("gemma3-270m").name == "vs_llama_server_gemma3-270m.json"
    assert results_path("smollm2").name == "vs_llama_server_smollm2.json"
    assert results_path("/m/Qwen3-0.6B-Q4_K_M.gguf").name == "vs_llama_server_Qwen3-0.6B-Q4_K_M.json"


def test_server_process_waits_for_health_and_always_stops(tiny_llama_dir: Path, tmp_path: Path):
    port = ls.free_port()
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.llama_stub",
        "--port",
        str(port),
        "--tokenizer",
        str(tiny_llama_dir),
        "--load-s",
        "0.5",
    ]  # /health is 503 for the first 0.5 s
    with pytest.raises(KeyboardInterrupt):
        with ls.ServerProcess(cmd, port, tmp_path / "stub.log", cwd=ls.SCRIPT.parent.parent) as server:
            assert server.proc is not None and server.proc.poll() is None
            with urllib.request.urlopen(server.url + "/health") as resp:
                assert (resp.status, json.loads(resp.read())) == (200, {"status": "ok"})
            raise KeyboardInterrupt
    assert server.proc.poll() is not None
    failing = [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    with pytest.raises(ls.LlamaServerError, match="exited with 3:\nno such model"):
        with ls.ServerProcess(failing, ls.free_port(), tmp_path / "fail.log"):
            pass


def _gemma_turns_text(chat: list[dict[str, str]]) -> str:
    """probe_chat's chat written out by hand in Gemma 3's turn format (what gemma_turns.jinja must render)."""
    system, user1, assistant, user2 = (m["content"] for m in chat)
    return (
        f"<start_of_turn>user\n{system}\n\n{user1}<end_of_turn>\n<start_of_turn>model\n{assistant}<end_of_turn>\n"
        f"<start_of_turn>user\n{user2}<end_of_turn>\n<start_of_turn>model\n"
    )


def test_smoke_against_the_stub(tiny_llama_dir: Path, tmp_path: Path):
    out = tmp_path / "vs.json"
    template = str(TEMPLATES / "gemma_turns.jinja")
    argv = ["--smoke", "--model", str(tiny_llama_dir), "--chat-template", template]
    result = main([*argv, "--out", str(out), "--log-dir", str(tmp_path)])
    assert json.loads(out.read_text()) == result
    # both engines rendered the Gemma turn template: the probe chat's prompt tokens, counted by hand
    tok = load_tokenizer(str(tiny_llama_dir))
    chat = probe_chat(
        ChatWorkload(**{k: result["config"]["workload"][k] for k in ("system_prompt", "user_turns", "user_tokens")})
    )
    expected = len(tok.encode(tok.bos_token + _gemma_turns_text(chat), add_special_tokens=False))
    check = result["prompt_tokens_check"]
    assert check == {"tokenizer": expected, "radixserve-http": expected, "llama-server": expected, "agree": True}
    assert result["config"]["chat_template"] == template
    engines = result["engines"]
    assert list(engines) == ["radixserve-http", "llama-server"]
    for name, e in engines.items():
        m, s = e["multi_turn"], e["single_stream"]
        assert m["requests"] == 4 and m["prompt_tokens_agree"] == 4, name
        assert [row[5] for row in m["trace"]] == [4, 4, 4, 4], name  # completion tokens per request
        assert m["output_tok_per_s"] > 0 and m["ttft_p50_s"] > 0 and m["hit_rate"] > 0, name
        # a tiny model's 4 tokens may reach the client in one event: TPOT (0.1 ms resolution) can round to 0
        assert m["tpot_s"] is not None and m["tpot_s"] >= 0, name
        assert len(s["runs"]) == 2 and s["one_token_per_chunk"], name
        assert [(r["tokens"], r["chunks"]) for r in s["runs"]] == [(8, 8), (8, 8)], name
        assert s["decode_tok_s"] == round(sum(r["decode_tok_s"] for r in s["runs"]) / 2, 2) > 0, name
    ours, theirs = engines["radixserve-http"], engines["llama-server"]
    assert result["ratios"]["output_tok_s"] == round(
        ours["multi_turn"]["output_tok_per_s"] / theirs["multi_turn"]["output_tok_per_s"], 4
    )
    assert result["ratios"]["single_stream_decode_tok_s"] == round(
        ours["single_stream"]["decode_tok_s"] / theirs["single_stream"]["decode_tok_s"], 4
    )
    assert list(result["targets"]) == list(TARGETS) == list(result["ratios"])
    for name, t in result["targets"].items():
        assert t["value"] == result["ratios"][name]
        assert t["met"] == (t["value"] >= t["target"] if t["rule"] == ">=" else t["value"] <= t["target"])
    machine = result["machine"]
    assert {"cpu_model", "cpu_capability", "flags", "cores", "load_average", "radixserve_dtype"} <= set(machine)
    cmd = machine["llama_server"]["command"]
    assert cmd[1:3] == ["-m", "benchmarks.llama_stub"] and cmd[5:9] == ["-np", "1", "-c", "2048"]
    assert cmd[-2:] == ["--chat-template-file", template]
    assert machine["llama_server"]["build"] == "stub" and (tmp_path / "llama-server.log").exists()
    assert result["config"]["http_client"] == "stdlib" and result["config"]["conversations"] == 2


def test_llama_speculation_flags():
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
    assert llama_speculation(spec)["flags"] == [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "2",
        "--spec-ngram-simple-size-m",
        "4",
        "--spec-draft-n-max",
        "4",
    ]
    draft = llama_speculation('{"method": "draft_model", "model": "m", "num_speculative_tokens": 4}')
    assert draft["flags"] == [] and "radixserve only" in draft["note"]
    assert llama_speculation(None)["flags"] == []
    for bad in ("[1]", "{nope"):
        with pytest.raises(BenchmarkError, match="speculative-config"):
            llama_speculation(bad)


def test_smoke_with_speculation(tiny_llama_dir: Path, tmp_path: Path):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    argv = ["--smoke", "--model", str(tiny_llama_dir), "--speculative-config", spec, "--log-dir", str(tmp_path)]
    result = main(argv)
    assert result["config"]["speculative_config"] == spec
    assert result["config"]["llama_server_speculation"] == llama_speculation(spec)
    assert result["machine"]["llama_server"]["command"][-8:] == llama_speculation(spec)["flags"]
    for name, e in result["engines"].items():
        assert [row[5] for row in e["multi_turn"]["trace"]] == [4, 4, 4, 4], name
        assert [r["tokens"] for r in e["single_stream"]["runs"]] == [8, 8], name
