"""ModelRunner: KV sizing, the delta protocol, scattered blocks (case C10), swaps and copies, seeds, errors.

Tests that compare the outputs or KV of two runs (or of two sequences) pass dtype="float32"; the others run the
default dtype (bfloat16 on CPUs with native bfloat16)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import InvalidConfig, ServerArgs
from runtime.model.kv_cache import kv_block_bytes
from runtime.model.runner import ModelRunner
from runtime.protocol import ForwardBatch, ScheduledSeq
from runtime.sampling_params import SamplingParams
from tests.runtime.forward_counts import forward_tokens_by_seq, record_batches
from tests.runtime.model.step_logits import step_logits

GREEDY = SamplingParams(temperature=0.0)


def _new(seq_id, tokens, blocks, start_pos=0, params=GREEDY, prompt_len=None, sample=True, sample_index=0):
    prompt_len = start_pos + len(tokens) if prompt_len is None else prompt_len
    return ScheduledSeq(seq_id, list(tokens), start_pos, list(blocks), sample, params, prompt_len, sample_index)


def _delta(seq_id, tokens, start_pos, new_blocks=(), sample=True):
    return ScheduledSeq(seq_id, list(tokens), start_pos, list(new_blocks), sample)


def _step(runner, *seqs, step_id=0, **kw):
    result = runner.execute(ForwardBatch(step_id=step_id, seqs=list(seqs), **kw))
    assert result.error is None
    return result


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return str(tiny_llama_dir)


def _f32(tiny: str, **kw) -> ModelRunner:
    """A float32 runner of the tiny model: for the tests that compare numerics."""
    return ModelRunner(ServerArgs(model=tiny, dtype="float32", **kw))


def test_ready_reports_kv_sizing(tiny):
    per_block = kv_block_bytes(2, 16, 2, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    runner = _f32(tiny, kv_cache_memory=100 * per_block + 5, num_host_blocks=3)
    ready = runner.ready
    assert (ready.num_blocks, ready.block_size, ready.num_host_blocks) == (100, 16, 3)
    assert (ready.max_model_len, ready.vocab_size, ready.eos_token_ids) == (1024, 49152, [2])
    assert tuple(runner.k_cache.shape) == (2, 100, 16, 2, 16)
    assert tuple(runner.host_v_cache.shape) == (2, 3, 16, 2, 16)
    halved = ModelRunner(ServerArgs(model=tiny, dtype="bfloat16", kv_cache_memory=100 * per_block + 5))
    assert halved.ready.num_blocks == 200 and halved.k_cache.dtype == halved.host_v_cache.dtype == torch.bfloat16
    small = ModelRunner(ServerArgs(model=tiny, num_blocks=7, block_size=4, max_model_len=200)).ready
    assert (small.num_blocks, small.block_size, small.max_model_len, small.num_host_blocks) == (7, 4, 200, 0)


def test_a_kv_pool_below_four_usable_blocks_is_refused_with_its_cause(tiny):
    per_block = kv_block_bytes(2, 16, 2, 16, torch.float32)
    with pytest.raises(InvalidConfig) as info:
        _f32(tiny, kv_cache_memory=10)
    assert str(info.value) == (
        "KV pool of 0 usable blocks (kv_cache_memory 10 bytes, 8192 bytes per block); "
        "needs >= 4: raise kv_cache_memory to >= 40960 bytes or set num_blocks"
    )
    with pytest.raises(InvalidConfig, match=r"^KV pool of 1 usable block \(kv_cache_memory 16384 bytes, 8192 bytes"):
        _f32(tiny, kv_cache_memory=2 * per_block)
    with pytest.raises(InvalidConfig, match=r"^KV pool of 3 usable blocks"):
        _f32(tiny, kv_cache_memory=5 * per_block - 1)
    assert _f32(tiny, kv_cache_memory=5 * per_block).ready.num_blocks == 5


def test_a_kv_pool_below_max_model_len_logs_one_warning(tiny, caplog):
    with caplog.at_level("WARNING", logger="runtime.model.runner"):
        ModelRunner(ServerArgs(model=tiny, num_blocks=7, block_size=4, max_model_len=200))
        ModelRunner(ServerArgs(model=tiny, num_blocks=51, block_size=4, max_model_len=200))  # 200 tokens: no warning
    assert [r.getMessage() for r in caplog.records if r.name == "runtime.model.runner"] == [
        "KV pool of 24 tokens (6 usable blocks of 4) is below max_model_len 200: the longest request it can hold is "
        "24 tokens (prompt + completion)"
    ]


def test_c10_scattered_blocks_write_exactly_their_slots(tiny):
    bs = 4
    runner = _f32(tiny, num_blocks=12, block_size=bs)
    batches = record_batches(runner)
    free = [5, 2, 9, 7, 11, 3, 1, 10, 4, 8, 6]  # a shuffled free list
    a_blocks = free[:2]
    b_blocks = free[:2] + free[2:4]
    _step(runner, _new(1, range(1, 9), a_blocks))  # A = [1..8] in b5, b2
    # B = [1..14] shares A's two full blocks: an extend step of 6 tokens, then two decode steps.
    tokens = list(range(1, 15))
    result = _step(runner, _new(2, tokens[8:], b_blocks, start_pos=8), step_id=1)
    tokens.append(result.token_ids[0])
    result = _step(runner, _delta(2, tokens[-1:], 14), step_id=2)
    last = step_logits(runner, ForwardBatch(3, [_delta(2, [result.token_ids[0]], 15)]))
    tokens.append(result.token_ids[0])
    assert forward_tokens_by_seq(batches) == {1: 8, 2: 7} and last.num_tokens == 1  # B ran 6 + 1 + 1 tokens
    last_logits = last.logits[0]

    contiguous = _f32(tiny, num_blocks=12, block_size=bs)
    ref_logits = step_logits(contiguous, ForwardBatch(0, [_new(1, tokens, [1, 2, 3, 4])])).logits[0]
    torch.testing.assert_close(last_logits, ref_logits, atol=1e-4, rtol=0)
    for p in range(16):  # the contiguous runner holds position p in slot bs + p (blocks 1..4)
        slot = b_blocks[p // bs] * bs + p % bs
        for mine, ref in ((runner.k_cache, contiguous.k_cache), (runner.v_cache, contiguous.v_cache)):
            flat_mine = mine.flatten(1, 2)
            flat_ref = ref.flatten(1, 2)
            torch.testing.assert_close(flat_mine[:, slot], flat_ref[:, bs + p], atol=1e-5, rtol=0)
    untouched = sorted(set(range(12)) - set(b_blocks))
    assert not runner.k_cache[:, untouched].any() and not runner.v_cache[:, untouched].any()


def test_swaps_and_copies_run_in_order_before_the_forward(tiny):
    runner = ModelRunner(ServerArgs(model=tiny, num_blocks=10, block_size=4, num_host_blocks=2))
    _step(runner, _new(1, range(3, 7), [3]))
    original = runner.k_cache[:, 3].clone()
    # Same step: swap_out 3 -> host 1, swap_in host 1 -> 7, copy 7 -> 8, then the forward of seq 2 into block 5.
    _step(
        runner,
        _new(2, range(10, 14), [5]),
        drop_seq_ids=[1],
        swap_out=[(3, 1)],
        swap_in=[(1, 7)],
        copies=[(7, 8)],
        step_id=1,
    )
    assert torch.equal(runner.host_k_cache[:, 1], original)
    assert torch.equal(runner.k_cache[:, 7], original) and torch.equal(runner.k_cache[:, 8], original)
    assert torch.equal(runner.v_cache[:, 8], runner.v_cache[:, 3])
    assert runner.k_cache[:, 5].any()
    assert set(runner.seqs) == {2}


def test_delta_steps_append_blocks_and_drop_forgets(tiny):
    runner = ModelRunner(ServerArgs(model=tiny, num_blocks=10, block_size=4))
    batches = record_batches(runner)
    result = _step(runner, _new(1, range(20, 24), [6]))
    _step(runner, _delta(1, result.token_ids, 4, [2]), step_id=1)
    assert runner.seqs[1].block_table == [6, 2]
    _step(runner, drop_seq_ids=[1], step_id=2)
    assert list(runner.seqs) == [] and forward_tokens_by_seq(batches) == {1: 5}
    unknown = runner.execute(ForwardBatch(3, [_delta(1, [5], 5)]))
    assert (unknown.seq_ids, unknown.failed_seq_ids, unknown.error) == ([], [1], None)
    assert unknown.failed_errors == ["WorkerError: seq 1 is not known to the worker and carries no sampling_params"]
    resumed = _step(runner, _new(1, list(range(20, 24)) + result.token_ids, [6, 2]), step_id=4)
    assert resumed.seq_ids == [1] and resumed.num_forward_tokens == 5


def test_chunked_prefill_samples_only_at_the_end(tiny):
    runner = _f32(tiny, num_blocks=10, block_size=4)
    first = _step(runner, _new(1, range(30, 36), [1, 2, 3], prompt_len=10, sample=False))
    assert (first.seq_ids, first.token_ids, first.num_forward_tokens) == ([], [], 6)
    last = _step(runner, _delta(1, range(36, 40), 6), step_id=1)
    whole = _f32(tiny, num_blocks=10, block_size=4)
    assert last.token_ids == _step(whole, _new(1, range(30, 40), [4, 5, 6])).token_ids


@pytest.mark.slow
def test_seeded_sampling_is_independent_of_batch_composition(tiny):
    params = SamplingParams(temperature=1.0, seed=42, top_p=0.9)
    prompt = list(range(100, 110))

    def run(with_others: bool) -> list[int]:
        runner = _f32(tiny, num_blocks=40, block_size=4)
        batches = record_batches(runner)
        out: list[int] = []
        seqs = [_new(1, prompt, list(range(1, 6)), params=params, sample_index=1)]
        for step in range(8):
            if with_others and step in (0, 3):
                seqs.append(
                    _new(
                        10 + step,
                        range(200 + step, 207 + step),
                        range(20 + 5 * step, 25 + 5 * step),
                        params=SamplingParams(temperature=0.8),
                    )
                )
            result = _step(runner, *seqs, step_id=step)
            out.append(result.token_ids[result.seq_ids.index(1)])
            seqs = [_delta(1, out[-1:], len(prompt) + step)]
            seqs += [
                _delta(s, [t], forward_tokens_by_seq(batches)[s])
                for s, t in zip(result.seq_ids, result.token_ids, strict=True)
                if s != 1
            ]
        return out

    assert run(False) == run(True)


def test_logprobs_are_returned_where_asked(tiny):
    runner = _f32(tiny, num_blocks=10, block_size=4)
    result = _step(
        runner, _new(1, range(5, 9), [1], params=SamplingParams(temperature=0.0, logprobs=2)), _new(2, range(5, 9), [2])
    )
    assert result.logprobs[1] is None
    assert result.logprobs[0].top_token_ids[0] == result.token_ids[0]
    assert result.token_ids[0] == result.token_ids[1]


def test_errors_for_short_tables_and_long_contexts(tiny):
    runner = ModelRunner(ServerArgs(model=tiny, num_blocks=10, block_size=4, max_model_len=8))
    short = runner.execute(ForwardBatch(0, [_new(1, range(6), [1])]))
    assert (short.seq_ids, short.failed_seq_ids, short.error) == ([], [1], None)
    assert short.failed_errors == ["WorkerError: seq 1: 1 blocks of 4 cannot hold 6 tokens"]
    long = runner.execute(ForwardBatch(1, [_new(2, range(9), [1, 2, 3])]))
    assert (long.seq_ids, long.failed_seq_ids, long.error) == ([], [2], None)
    assert long.failed_errors == ["WorkerError: seq 2: context 9 exceeds max_model_len 8"]
    assert runner.seqs == {}  # a failed sequence leaves nothing behind


def test_a_sequence_with_bad_penalty_tokens_fails_alone(tiny):
    runner = ModelRunner(ServerArgs(model=tiny, num_blocks=10, block_size=4))
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    missing = _new(1, range(5, 9), [1], params=penalised)
    outside = _new(2, range(5, 9), [2], params=penalised)
    outside.penalty_token_ids = [5, 6, 49152, 8]
    good = _new(3, range(5, 9), [3], params=penalised)
    good.penalty_token_ids = [5, 6, 7, 8]
    result = _step(runner, missing, outside, good, _new(4, range(5, 9), [4]))
    assert (result.seq_ids, result.failed_seq_ids) == ([3, 4], [1, 2])
    assert result.failed_errors == [
        "WorkerError: seq 1 has penalties or structured_outputs but carries no penalty_token_ids",
        "WorkerError: seq 2: penalty_token_ids outside the vocabulary [0, 49152)",
    ]
    assert set(runner.seqs) == {3, 4} and 3 in runner.penalties and len(runner.penalties) == 1
    _step(runner, drop_seq_ids=[3], step_id=1)
    assert len(runner.penalties) == 0
