"""The worker's per-step fast paths (issue 14): block-table rows kept from deltas, the decode-only metadata, the
chunked row argmax, the worker's thread count, and that none of them changes what a step computes."""

from __future__ import annotations

import pytest
import torch

from runtime.config import ServerArgs
from runtime.model.models.batch import BlockTableRows, decode_metadata, varlen_metadata
from runtime.model.runner import ModelRunner
from runtime.model.sampler import row_argmax
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _new(seq_id: int, tokens: list[int], start: int, blocks: list[int], sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(seq_id, tokens, start, blocks, sample, GREEDY, start + len(tokens))


# ---------------------------------------------------------------------------------------------- BlockTableRows
def test_rows_hold_each_table_padded_with_the_null_block_and_grow():
    rows = BlockTableRows(width=2)
    a = rows.add([5, 6, 7])  # 3 blocks in width 2: the columns grow to max(3, 4)
    b = rows.add([9])
    assert (a, b) == (0, 1) and rows.table.shape == (8, 4)
    rows.extend(b, [10, 11])
    rows.extend(a, [])
    assert rows.gather([b, a], 3).tolist() == [[9, 10, 11], [5, 6, 7]]
    assert rows.gather([a, b], 4).tolist() == [[5, 6, 7, 0], [9, 10, 11, 0]]
    assert rows.gather([a], 1).dtype == torch.int32
    more = [rows.add([100 + i]) for i in range(7)]  # 9 rows in 8: the rows double, the old rows keep their ids
    assert more == [2, 3, 4, 5, 6, 7, 8] and rows.table.shape == (16, 4)
    assert rows.gather([a, 8], 2).tolist() == [[5, 6], [106, 0]]


def test_a_freed_row_is_reused_zeroed():
    rows = BlockTableRows(width=4)
    a = rows.add([1, 2, 3, 4])
    rows.add([8])
    rows.free(a)
    assert rows.add([7]) == a
    assert rows.gather([a], 4).tolist() == [[7, 0, 0, 0]]  # no stale block of the previous owner


# ---------------------------------------------------------------------------------------------- metadata
def test_decode_metadata_equals_the_varlen_metadata_of_the_same_decode_step():
    tables = torch.tensor([[3, 4, 0], [7, 8, 9]], dtype=torch.int32)
    positions = [21, 40]  # block size 16: slots 4 * 16 + 5 and 9 * 16 + 8
    dec = decode_metadata(positions, [4 * 16 + 5, 9 * 16 + 8], tables, [0, 1], torch.device("cpu"))
    var = varlen_metadata(positions, [1, 1], tables, [0, 1], 16, torch.device("cpu"))
    for name in ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices"):
        got = getattr(dec, name)
        want = getattr(var, name)
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name
    assert (dec.max_query_len, dec.max_seq_len) == (var.max_query_len, var.max_seq_len) == (1, 41)
    assert dec.slot_mapping.tolist() == [69, 152] and dec.seq_lens.tolist() == [22, 41]


def test_varlen_metadata_of_a_mixed_step():
    tables = torch.tensor([[2, 5], [6, 0]], dtype=torch.int32)  # block size 4
    meta = varlen_metadata([3, 0], [3, 2], tables, [4], 4, torch.device("cpu"))
    assert meta.positions.tolist() == [3, 4, 5, 0, 1]
    assert meta.slot_mapping.tolist() == [2 * 4 + 3, 5 * 4 + 0, 5 * 4 + 1, 6 * 4 + 0, 6 * 4 + 1]
    assert meta.seq_lens.tolist() == [6, 2] and meta.query_start_loc.tolist() == [0, 3, 5]
    assert (meta.max_query_len, meta.max_seq_len, meta.logits_indices.tolist()) == (3, 6, [4])


# ---------------------------------------------------------------------------------------------- the runner
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return str(tiny_llama_dir)


def _runner(tiny: str) -> ModelRunner:
    return ModelRunner(ServerArgs(model=tiny, dtype="float32", num_blocks=24, block_size=4))


def test_prepare_builds_the_block_tables_from_the_deltas(tiny):
    runner = _runner(tiny)
    runner.execute(ForwardBatch(0, [_new(1, [5, 6, 7, 8, 9], 0, [3, 4]), _new(2, [11, 12], 0, [7])]))
    step = runner.apply_structure(
        ForwardBatch(1, [ScheduledSeq(2, [13], 2, [], True), ScheduledSeq(1, [14], 5, [], True)])
    )
    inputs = runner.prepare(step.runnable)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [13, 14]
    assert meta.block_tables.tolist() == [[7, 0], [3, 4]]
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 4 * 4 + 1] and meta.positions.tolist() == [2, 5]
    assert meta.seq_lens.tolist() == [3, 6] and meta.logits_indices.tolist() == [0, 1]
    step = runner.apply_structure(
        ForwardBatch(2, [ScheduledSeq(1, [15, 16, 17], 6, [9], True), ScheduledSeq(2, [18], 3, [], False)])
    )
    meta = runner.prepare(step.runnable).meta  # mixed: 3 tokens, then 1 that does not sample
    assert meta.block_tables.tolist() == [[3, 4, 9], [7, 0, 0]]
    assert meta.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 7 * 4 + 3]
    assert meta.logits_indices.tolist() == [2] and meta.query_start_loc.tolist() == [0, 3, 4]


def test_drops_failures_and_re_registration_free_or_replace_rows(tiny):
    runner = _runner(tiny)
    runner.execute(ForwardBatch(0, [_new(1, [5, 6], 0, [3]), _new(2, [7], 0, [5])]))
    row1 = runner.seqs[1].row
    runner.execute(ForwardBatch(1, [], drop_seq_ids=[1]))
    assert 1 not in runner.seqs
    assert runner.live.block_tables.gather([row1], 1).tolist() == [[0]]  # a freed row is zeroed: its padding is block 0
    runner.execute(ForwardBatch(1, [_new(3, [4], 0, [9])]))
    assert runner.seqs[3].row == row1  # and the next sequence takes it
    runner.execute(ForwardBatch(1, [], drop_seq_ids=[3]))
    runner.execute(ForwardBatch(2, [_new(2, [7, 8, 9, 10, 11], 0, [6, 8])]))  # seq 2 again in full: its new table
    assert runner.seqs[2].block_table == [6, 8]
    assert runner.live.block_tables.gather([runner.seqs[2].row], 3).tolist() == [[6, 8, 0]]
    result = runner.execute(ForwardBatch(3, [_new(4, [1, 2], 0, [99])]))  # block 99 outside the pool
    assert result.failed_seq_ids == [4] and 4 not in runner.seqs
    assert len(runner.seqs) == 1


def test_decode_steps_give_the_tokens_of_a_full_prefill(tiny):
    """Decoding through the fast path (one token per sequence, block tables from the deltas) ends where one prefill
    of the same tokens ends: the same greedy token after each."""
    runner = _runner(tiny)
    ref = _runner(tiny)
    prompts = {1: [100, 101, 102], 2: [200, 201, 202, 203, 204, 205]}
    tables = {1: [1, 2, 3], 2: [4, 5, 6]}
    result = runner.execute(ForwardBatch(0, [_new(s, prompts[s], 0, tables[s][:2]) for s in (1, 2)]))
    seqs = dict(
        zip(
            result.seq_ids,
            ([*prompts[s], t] for s, t in zip(result.seq_ids, result.token_ids, strict=True)),
            strict=True,
        )
    )
    for step in range(1, 5):
        batch = [
            ScheduledSeq(s, [seqs[s][-1]], len(seqs[s]) - 1, tables[s][2:] if step == 2 else [], True) for s in (2, 1)
        ]
        result = runner.execute(ForwardBatch(step, batch))
        for s, t in zip(result.seq_ids, result.token_ids, strict=True):
            seqs[s].append(t)
    for s in (1, 2):
        full = ref.execute(ForwardBatch(10 + s, [_new(10 + s, seqs[s][:-1], 0, tables[s])]))
        assert full.token_ids == [seqs[s][-1]]


# ---------------------------------------------------------------------------------------------- row_argmax
@pytest.mark.parametrize("width", [49152, 512, 192, 100, 256])
def test_row_argmax_equals_argmax_with_ties_nan_and_infinities(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=g).bfloat16().float()  # bfloat16 values: many ties
    top = x.max()
    x[0, [3, width - 1]] = top + 1  # a tie for the maximum: the first index wins
    x[1] = float("-inf")
    x[2, [width // 2, 7]] = float("nan")  # a NaN counts as the maximum, the first NaN wins
    x[3, [width - 2, 1]] = float("inf")
    x[4] = 0.0
    want = x.argmax(dim=-1)
    assert torch.equal(row_argmax(x), want)
    assert want[:5].tolist() == [3, 0, 7, 1, 0]
    assert torch.equal(row_argmax(x.t().contiguous().t()), want)  # a non-contiguous view
