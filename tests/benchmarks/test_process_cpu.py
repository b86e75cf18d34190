"""benchmarks/process_cpu.py: a child's role from its command line, and --smoke against the tiny model (the JSON's
shape and the relations every run keeps; CPU times are reported, never asserted)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks.process_cpu import main, role_of


def test_role_of_reads_the_child_spec_argument():
    child = SimpleNamespace(cmdline=lambda: ["python", "-m", "runtime.serve.launch", "--child", '{"role":"tokenizer"}'])
    other = SimpleNamespace(cmdline=lambda: ["python", "-c", "while True: pass"])
    assert role_of(child) == "tokenizer"
    assert role_of(other) is None


def test_smoke_run_writes_each_process_cpu_per_token(tiny_llama_dir, tmp_path):
    out = tmp_path / "process_cpu.json"
    assert main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 16
    cpu = result["cpu_ms"]
    assert set(cpu) == {"benchmark", "worker", "worker_main", "worker_other", "scheduler", "tokenizer", "http"}
    assert abs(cpu["worker_main"] + cpu["worker_other"] - cpu["worker"]) <= 0.002  # each rounded to 1 us
    assert abs(result["frontend_ms"] - (cpu["scheduler"] + cpu["tokenizer"] + cpu["http"])) <= 0.002
    assert cpu["worker_main"] > 0 and result["wall_ms"] > 0
    assert result["machine"]["cores"] >= 1
