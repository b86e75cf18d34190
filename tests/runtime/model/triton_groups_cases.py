"""The Triton paged attention with two KV cache groups, on the CPU under TRITON_INTERPRET=1 (run by
test_triton_groups.py in a subprocess, so the interpreter setting never leaks into the rest of the suite; it must be
set before triton is imported, hence the assignment above the imports).

A full-attention layer reads group 0's block table over the whole context; a sliding layer reads group 1's: a table
whose entries before the window are the null block 0 (radix/swa_group.py), over a smaller pool of its own
(runtime/model/hybrid_kv.py). Kernel level: both equal the dense oracle and the torch reference, NaN-poisoned blocks
that the window left behind (block 0 included) never read. Model level: the Engine on a tiny Gemma 3 with
kv_groups "auto" samples the same tokens with the Triton backend as with the torch one, through chunked prefill,
decodes past the window and a prefix-cache hit."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from radix.blocks import cdiv  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from tests.kernels.kernel_cases import PagedBatch, dense_attention, make_batch  # noqa: E402
from tests.runtime.engine_helpers import greedy  # noqa: E402
from tests.runtime.hybrid_helpers import save_loopy_gemma3  # noqa: E402

W = 16
B = 8


def _window_group(batch: PagedBatch, num_window_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group 1's cache and table for batch: each sequence's blocks from first_live(computed) = max(0, computed - W)
    // B on get their own block of a NaN-filled pool of num_window_blocks (reverse order: not group 0's ids); entries
    before are 0. Returns (k_cache, v_cache, block_tables)."""
    shape = (num_window_blocks, *batch.k_cache.shape[1:])
    wk = torch.full(shape, float("nan"))
    wv = torch.full(shape, float("nan"))
    tables = torch.zeros_like(batch.block_tables)
    free = list(range(1, num_window_blocks))
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        computed = seq_len - (starts[i + 1] - starts[i])
        for j in range(max(0, computed - W) // B, cdiv(seq_len, B)):
            block = free.pop()
            tables[i, j] = block
            wk[block] = batch.k_cache[batch.block_tables[i, j]]
            wv[block] = batch.v_cache[batch.block_tables[i, j]]
    return wk, wv, tables


@pytest.mark.parametrize("decode", [False, True])
def test_each_layer_kind_reads_its_group(decode: bool) -> None:
    spec = [(37, 1), (50, 1), (3, 1)] if decode else [(37, 1), (20, 9), (0, 12), (41, 16)]
    batch = make_batch(spec, B, num_kv_heads=2, group=2, head_dim=16, seed=5)
    wk, wv, wtables = _window_group(batch, 24)
    assert int((wtables[:, 0] == 0).sum()) == 2  # the two long sequences' first blocks left the window: null entries
    rest = (batch.seq_lens, batch.query_start_loc, batch.scale)
    full = kernels.paged_attention(*batch.args(), backend="triton")
    torch.testing.assert_close(full.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)
    sliding = kernels.paged_attention(batch.q, wk, wv, wtables, *rest, backend="triton", sliding_window=W)
    assert not sliding.isnan().any()
    torch.testing.assert_close(sliding.double(), dense_attention(batch, W), atol=1e-5, rtol=1e-5)
    ref = kernels.paged_attention(batch.q, wk, wv, wtables, *rest, backend="reference", sliding_window=W)
    torch.testing.assert_close(sliding, ref, atol=1e-5, rtol=1e-5)


def test_engine_with_groups_samples_the_same_tokens_on_triton(tmp_path, smollm2_tokenizer) -> None:
    folder = save_loopy_gemma3(tmp_path / "gemma3", smollm2_tokenizer)
    prompts = [list(range(3, 43)), list(range(100, 125))]  # 40 and 25 tokens: chunks of 16, past the window
    turn2 = prompts[0] + [7, 8, 9]
    outs = {}
    for backend in ("triton", "reference"):
        engine = Engine(
            model=str(folder),
            dtype="float32",
            block_size=4,
            num_blocks=64,
            num_window_blocks=24,
            chunked_prefill_size=16,
            kv_groups="auto",
            attention_backend=backend,
        )
        first = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=greedy(10))]
        hit = engine.generate(input_ids=[turn2], sampling_params=greedy(4))[0]
        assert hit.usage.cached_tokens == 40
        outs[backend] = (first, hit.token_ids)
        window = engine.manager.window_stats()  # type: ignore[attr-defined]
        assert window.in_use_blocks == 0 and window.cached_blocks > 0
    assert outs["triton"] == outs["reference"]
