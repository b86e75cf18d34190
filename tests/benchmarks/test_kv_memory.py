"""Smoke test of benchmarks/kv_memory.py: exact accounting on a small pool, JSON and PNG written."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kv_memory import main, parallel_sampling
from benchmarks.kv_replay import ContiguousAllocator, draw_requests


def test_contiguous_allocator_first_fit_and_merge():
    alloc = ContiguousAllocator(capacity=100, reserve=30)
    assert [alloc.allocate(i) for i in range(4)] == [True, True, True, False]
    assert alloc.holes == [(90, 10)]
    alloc.free(1)
    assert alloc.holes == [(30, 30), (90, 10)]
    alloc.free(2)
    assert alloc.holes == [(30, 70)]
    assert alloc.allocate(7) and alloc.owned[7] == 30
    assert alloc.free_slots() == 40 and alloc.free_slots(min_hole=30) == 40


def test_draw_requests_is_seeded_and_has_the_mean():
    a, b = draw_requests(500, 300, 2048, seed=3), draw_requests(500, 300, 2048, seed=3)
    assert a == b
    assert abs(sum(length for _, length in a) / 500 - 300) < 1.0
    assert all(1 <= p < length <= 2048 for p, length in a)


def test_parallel_sampling_copy_on_write_counts():
    # prompt 512 = 32 blocks; prompt[:-1] leaves block 31 partial: 3 of the 4 children copy it, the last writes in
    # place. After the prompt: 32 + 3 blocks shared vs 4 * 32 full copies; after 16 more tokens each: + 4 * 1.
    out = parallel_sampling(n=4, prompt_len=512, gen_tokens=16, block_size=16)
    assert out["cow_block_copies"] == 3
    assert out["after_prompt"] == {
        "shared_blocks": 35,
        "full_copy_blocks": 128,
        "saved_fraction": round(1 - 35 / 128, 4),
    }
    assert out["end_of_generation"]["shared_blocks"] == 39
    assert out["end_of_generation"]["full_copy_blocks"] == 132


def test_smoke_writes_json_and_png(tmp_path: Path):
    out = tmp_path / "kv_memory.json"
    result = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert out.with_suffix(".png").stat().st_size > 0
    static, dyn = result["static"], result["dynamic"]
    # 100 blocks x 16 slots, 512-slot reservations: exactly 3 contiguous sequences fit, 64 slots are a hole.
    assert static["contiguous"]["concurrent_sequences"] == 3
    assert dyn["contiguous"]["concurrent_sequences_max"] == 3
    assert dyn["contiguous"]["waste_fraction"]["external"] == round(64 / 1600, 4)
    assert dyn["paged"]["waste_fraction"]["reservation"] == 0 and dyn["paged"]["waste_fraction"]["external"] == 0
    assert dyn["paged"]["waste_per_seq_tokens"]["max"] <= 15
    for name in ("contiguous", "paged"):
        d = dyn[name]
        total = d["live_fraction"] + sum(d["waste_fraction"].values()) + d["free_fraction"]
        assert abs(total - 1.0) < 1e-3
    (beam,) = result["beam_search"]  # the embedded model, 2 beams, 8 tokens: the real scheduler's forks
    (row,) = beam["rows"]
    assert (row["width"], row["generated_tokens"], row["registrations"]) == (2, 8, 1)
    assert row["forks"] >= 1 and 0 < row["peak_shared_blocks"] < row["peak_private_blocks"]
    assert beam["by_width"]["2"]["saving"] == round(1 - row["peak_shared_blocks"] / row["peak_private_blocks"], 4)


def test_hybrid_rows_match_the_formula_on_gemma3_270m_shapes():
    from benchmarks.kv_hybrid import formula_fraction, hybrid_rows

    out = hybrid_rows([256, 1024, 8192], 64 * 2**20, 16, 512)
    short, mid, long = out["rows"]
    # 256 tokens, inside the 512-token window: every layer keeps everything, as all-full does
    assert short["kv_bytes_per_seq"] == {"all_full": 16 * 18 * 16 * 1024, "hybrid": 16 * 18 * 16 * 1024}
    # 1024 = 64 blocks: the 3 full layers keep 64, the 15 sliding ones cdiv(512, 16) = 32 (block-aligned context)
    assert mid["kv_bytes_per_seq"]["hybrid"] == (3 * 64 + 15 * 32) * 16 * 1024
    assert mid["hybrid_fraction"] == round(formula_fraction(1024), 4) == round((3 + 15 * 0.5) / 18, 4)
    assert long["window_blocks_per_seq"] == 32 and long["fraction_vs_formula"] == 1.0
    # 64 MiB: an 8k sequence needs 8192 x 18 KiB = 144 MiB all-full, 31.5 MiB hybrid
    assert long["concurrent_sequences"] == {"all_full": 0, "hybrid": 1}
    assert mid["concurrent_sequences"] == {"all_full": 64 * 2**20 // (1024 * 18 * 1024), "hybrid": 5}
    assert short["concurrent_sequences"] == {"all_full": 14, "hybrid": 14}


def test_kv_hybrid_smoke_writes_json(tmp_path: Path):
    from benchmarks.kv_hybrid import main as hybrid_main

    out = tmp_path / "kv_memory_hybrid.json"
    result = hybrid_main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["context"] for r in result["rows"]] == [256, 1024] and "cpu" in json.dumps(result["machine"]).lower()
