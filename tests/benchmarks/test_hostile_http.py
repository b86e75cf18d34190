"""benchmarks/hostile_http.py --smoke against the tiny model: the JSON it writes, with the figures this checkout must
show (idle connections closed by the header timeout and /health served meanwhile, oversized headers refused 431, no
stream failed through the router)."""

from __future__ import annotations

import json

import pytest

from benchmarks.hostile_http import main


@pytest.mark.slow
def test_smoke_run_writes_the_results(tiny_llama_dir, tmp_path):
    out = tmp_path / "hostile.json"
    assert main(["--smoke", "--model", str(tiny_llama_dir), "--out", str(out), "--logs", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    fd = result["fd_limit"]
    assert (fd["limit"], fd["connected"]) == (256, 300)
    assert fd["health_during_s"] is not None and fd["health_after_s"] is not None
    assert fd["closed_by_server"] == 300  # at the cap (192) or by the header timeout
    assert (result["big_header"]["status"], result["many_headers"]["status"]) == (431, 431)
    assert result["router_load"]["failed"] == 0 and result["router_load"]["complete"] == 4
    assert result["http_alive"] is True
    assert {"cpu_model", "cores", "load_average"} <= set(result["machine"])
