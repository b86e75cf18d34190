"""Scheduler against the real KVCacheManager and a fake worker that really stores "KV" in slots.

FakeRunner keeps, per slot, the (token, position) written there; a sampled token is a hash of the tokens read back
through the block table, so any wrong block table, missed copy-on-write, bad swap or premature cache entry changes
the output. `reference` is the same function on a plain token list (a cold solo run).
"""

from __future__ import annotations

import hashlib

import pytest
from forward_counts import forward_tokens_by_seq

from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.protocol import ForwardBatch, ForwardResult, Usage
from runtime.request import RequestRejected
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler

VOCAB = 1000
EOS = 7


def next_token(context: list[int], sample_index: int = 0, temperature: float = 0.0) -> int:
    """Deterministic "model": a digest of the context (and of the sample index when sampling)."""
    salt = sample_index if temperature > 0 else -1
    digest = hashlib.blake2b(repr((salt, context)).encode(), digest_size=8).digest()
    return 10 + int.from_bytes(digest, "little") % (VOCAB - 10)


def reference(prompt: list[int], max_tokens: int, sample_index: int = 0, temperature: float = 0.0) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, sample_index, temperature))
    return tokens[len(prompt) :]


class FakeRunner:
    """Applies ForwardBatch exactly as the worker contract says, with a dict as the KV cache."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.bs = block_size
        self.num_blocks = num_blocks
        self.kv: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[int, int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.meta: dict[int, tuple[SamplingParams, int, int]] = {}
        self.num_copies = 0
        self.steps: list[ForwardBatch] = []

    @property
    def forward_tokens_by_seq(self) -> dict[int, int]:
        return forward_tokens_by_seq(self.steps)

    def _move(self, src_store, dst_store, src: int, dst: int) -> None:
        for off in range(self.bs):
            if src * self.bs + off in src_store:
                dst_store[dst * self.bs + off] = src_store[src * self.bs + off]
            else:
                dst_store.pop(dst * self.bs + off, None)

    def execute(self, batch: ForwardBatch) -> ForwardResult:
        self.steps.append(batch)
        for sid in batch.drop_seq_ids:
            self.tables.pop(sid, None)
        for dev, host in batch.swap_out:
            self._move(self.kv, self.host, dev, host)
        for host, dev in batch.swap_in:
            self._move(self.host, self.kv, host, dev)
        for src, dst in batch.copies:
            self._move(self.kv, self.kv, src, dst)
            self.num_copies += 1
        seq_ids, token_ids, n_fwd = [], [], 0
        for s in batch.seqs:
            if s.sampling_params is not None:
                assert s.seq_id not in self.tables, f"seq {s.seq_id} registered twice"
                self.tables[s.seq_id] = list(s.new_block_ids)
                self.meta[s.seq_id] = (s.sampling_params, s.prompt_len, s.sample_index)
            else:
                self.tables[s.seq_id].extend(s.new_block_ids)
            table = self.tables[s.seq_id]
            assert 0 not in table, "the null block is in a block table"
            for i, tok in enumerate(s.token_ids):
                p = s.start_pos + i
                self.kv[table[p // self.bs] * self.bs + p % self.bs] = (tok, p)
            n_fwd += len(s.token_ids)
            if s.sample:
                seq_len = s.start_pos + len(s.token_ids)
                context = []
                for p in range(seq_len):
                    tok, pos = self.kv[table[p // self.bs] * self.bs + p % self.bs]
                    assert pos == p, f"seq {s.seq_id} read position {pos} at {p}"
                    context.append(tok)
                params, _, index = self.meta[s.seq_id]
                seq_ids.append(s.seq_id)
                token_ids.append(next_token(context, index, params.temperature))
        return ForwardResult(batch.step_id, seq_ids, token_ids, num_forward_tokens=n_fwd)


class Harness:
    """A Scheduler + manager + FakeRunner; run() steps until idle, checking the manager's invariants every step."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 4096, num_host_blocks: int = 0,
                 **kw) -> None:  # fmt: skip
        self.args = ServerArgs(num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks, **kw)
        self.manager = KVCacheManager(num_blocks, block_size, self.args.enable_prefix_caching, num_host_blocks,
                                      num_host_cache_blocks=self.args.num_host_cache_blocks or 0)
        self.sched = Scheduler(self.manager, self.args, max_model_len, eos_token_ids=[EOS])
        self.runner = FakeRunner(num_blocks, block_size, num_host_blocks)
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}
        self.usage: dict[tuple[str, int], object] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None, **params) -> None:
        params.setdefault("temperature", 0.0)
        self.sched.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), salt)

    def collect(self, outs) -> None:
        for o in outs:
            self.tokens.setdefault((o.rid, o.index), []).extend(o.token_ids)
            if o.usage is not None:
                self.usage[(o.rid, o.index)] = o.usage
            if o.finish_reason is not None:
                assert (o.rid, o.index) not in self.finish, f"{o.rid}/{o.index} finished twice"
                self.finish[(o.rid, o.index)] = o.finish_reason

    def step(self) -> bool:
        batch = self.sched.schedule()
        if batch is None:
            self.collect(self.sched.drain_outputs())
            return False
        self.collect(self.sched.process_result(self.runner.execute(batch)))
        self.manager.check_invariants()
        return True

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            assert self.step() or not self.sched.running, "the scheduler stalled with running sequences"
            steps += 1
            assert steps < max_steps, "did not finish"
        self.collect(self.sched.drain_outputs())
        return steps

    def assert_idle(self) -> None:
        s = self.manager.stats()
        assert s.in_use_blocks == 0 and s.free_blocks + s.evictable_blocks == s.total_blocks
        assert s.num_sequences == 0 and not self.sched.requests

    def request_metrics(self, rid: str) -> Usage:
        """A live request's tokens (prompt, cached, completion summed over its completions); test-only."""
        req = self.sched.requests[rid]
        done = [s for s in req.seqs if not s.prefill_only]
        return Usage(len(req.prompt_ids), req.cached_tokens or 0, sum(max(0, s.num_output) for s in done))


def test_single_request_matches_reference():
    h = Harness()
    prompt = list(range(1, 12))
    h.add("a", prompt, max_tokens=6)
    h.run()
    assert h.tokens[("a", 0)] == reference(prompt, 6)
    assert h.finish[("a", 0)] == "length"
    assert h.usage[("a", 0)] == Usage(11, 0, 6, h.usage[("a", 0)].queue_time_s)
    h.assert_idle()


def test_usage_queue_time_from_arrival_to_first_admission():
    h = Harness(max_running_requests=1)
    now = [10.0]
    h.sched.clock = lambda: now[0]
    h.add("a", list(range(1, 12)), max_tokens=3)
    h.add("b", list(range(20, 31)), max_tokens=3)  # both arrive at 10.0; b waits for a's slot
    now[0] = 10.5
    assert h.step()  # admits a only
    now[0] = 12.0
    h.run()
    assert h.usage[("a", 0)] == Usage(11, 0, 3, 0.5)
    assert h.usage[("b", 0)] == Usage(11, 0, 3, 2.0)
    h.assert_idle()


def test_c1_whole_prompt_cached():
    h = Harness(block_size=4)
    a = list(range(1, 9))
    h.add("A", a, max_tokens=1)
    h.run()
    h.add("B", a, max_tokens=1)
    h.run()
    assert h.usage[("B", 0)].cached_tokens == 4
    assert h.tokens[("B", 0)] == h.tokens[("A", 0)]
    h.add("C", list(range(1, 13)), max_tokens=1)
    h.run()
    assert h.usage[("C", 0)].cached_tokens == 8
    h.add("D", list(range(1, 10)), max_tokens=1)
    h.run()
    assert h.usage[("D", 0)].cached_tokens == 8
    d_seq = max(h.runner.forward_tokens_by_seq)
    assert h.runner.forward_tokens_by_seq[d_seq] == 1
    h.add("E", [1, 2, 3], max_tokens=1)
    h.run()
    assert h.usage[("E", 0)].cached_tokens == 0
    for rid, prompt in [("B", a), ("C", list(range(1, 13))), ("D", list(range(1, 10))), ("E", [1, 2, 3])]:
        assert h.tokens[(rid, 0)] == reference(prompt, 1)
    h.assert_idle()


def test_forward_tokens_equal_prompt_minus_cached():
    h = Harness(block_size=4)
    system = list(range(100, 120))
    for i in range(6):
        h.add(f"r{i}", system + [200 + i, 300 + i, 400 + i], max_tokens=5)
    h.run()
    for i, sid in enumerate(sorted(h.runner.forward_tokens_by_seq)):
        u = h.usage[(f"r{i}", 0)]
        assert h.runner.forward_tokens_by_seq[sid] == u.prompt_tokens - u.cached_tokens + u.completion_tokens - 1
        assert h.tokens[(f"r{i}", 0)] == reference(system + [200 + i, 300 + i, 400 + i], 5)
    assert [h.usage[(f"r{i}", 0)].cached_tokens for i in range(6)] == [0, 20, 20, 20, 20, 20]


def test_shared_uncached_prefix_is_computed_once():
    """32 requests arriving together with one 512-token system prompt: ~512 + 32 x suffix prefill tokens."""
    h = Harness(num_blocks=2048, block_size=16, max_prefill_tokens=4096, chunked_prefill_size=512)
    system = [1000 + i for i in range(512)]
    for i in range(32):
        h.add(f"q{i}", system + [5000 + 64 * i + j for j in range(64)], max_tokens=2)
    h.run()
    assert h.sched.counters.prefill_tokens_computed == 512 + 32 * 64
    assert [h.usage[(f"q{i}", 0)].cached_tokens for i in range(32)] == [0] + [512] * 31
    assert h.sched.stats().hit_rate == pytest.approx(31 * 512 / (32 * 576))


def test_chunked_prefill_splits_long_prompt_and_budget():
    h = Harness(block_size=4, max_prefill_tokens=8, chunked_prefill_size=4)
    prompt = list(range(1, 13))
    h.add("a", prompt, max_tokens=2)
    h.add("b", list(range(50, 55)), max_tokens=2)
    h.step()
    first = h.runner.steps[0]
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in first.seqs] == [(1, 0, 4), (2, 0, 4)]
    h.run()
    assert h.tokens[("a", 0)] == reference(prompt, 2)
    assert h.tokens[("b", 0)] == reference(list(range(50, 55)), 2)


def test_parallel_sampling_forks_after_one_prefill():
    h = Harness(block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: prompt[:-1] ends inside block 2, which the 4 children share
    free0 = h.manager.num_free_blocks()
    h.add("p", prompt, max_tokens=3, n=4, temperature=1.0, seed=3)
    h.run()
    parent = min(h.runner.forward_tokens_by_seq)
    assert h.runner.forward_tokens_by_seq[parent] == 9
    children = sorted(h.runner.forward_tokens_by_seq)[1:]
    assert [h.runner.forward_tokens_by_seq[c] for c in children] == [3, 3, 3, 3]  # last prompt token + 2 decodes
    assert h.runner.num_copies == 3  # the last child writes the shared block in place
    for i in range(4):
        assert h.tokens[("p", i)] == reference(prompt, 3, i, 1.0)
        assert h.finish[("p", i)] == "length"
    assert len({tuple(h.tokens[("p", i)]) for i in range(4)}) == 4
    assert h.manager.num_free_blocks() + h.manager.num_evictable_blocks() == free0
    h.assert_idle()


def test_stats_block_counts_have_one_meaning_each():
    """num_cached_blocks: every block in the tree; num_evictable_blocks: those no sequence references."""
    h = Harness(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))
    h.add("a", prompt, max_tokens=1)
    h.run()
    h.add("b", prompt, max_tokens=3)
    h.step()  # b holds the 3 cached prompt blocks and a private one
    s, kv = h.sched.stats(), h.manager.stats()
    assert (s.num_cached_blocks, s.num_evictable_blocks, s.num_used_blocks) == (kv.cached_blocks, 0, 4) == (3, 0, 4)
    assert s.num_free_blocks + s.num_evictable_blocks + s.num_used_blocks == s.num_blocks - 1 == 31
    assert (s.num_running, s.num_waiting, s.num_swapped, s.kv_usage) == (1, 0, 0, 4 / 31)
    h.run()
    s = h.sched.stats()
    assert (s.num_cached_blocks, s.num_evictable_blocks, s.num_used_blocks) == (3, 3, 0)
    assert (s.prompt_tokens, s.cached_tokens, s.generated_tokens, s.num_steps) == (26, 12, 4, 4)
    assert s.forward_tokens == sum(h.runner.forward_tokens_by_seq.values()) and s.tokens_per_s == 0.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_memory_pressure_preempts_and_outputs_are_unchanged(mode):
    h = Harness(num_blocks=13, block_size=4, num_host_blocks=64 if mode == "swap" else 0, preemption_mode=mode)
    prompts = [[i * 50 + j for j in range(1, 10)] for i in range(1, 7)]
    for i, p in enumerate(prompts):
        h.add(f"r{i}", p, max_tokens=10)
    h.run()
    assert h.sched.counters.num_preemptions > 0
    if mode == "swap":
        assert h.sched.counters.num_swaps > 0
    # the served ServerStats carries the same counters (so a user can see that swap mode swapped)
    from runtime.serve.scheduler_process import SchedulerServer

    served = SchedulerServer(h.sched, None, None, None, 5.0).server_stats()
    assert (served.num_preemptions, served.num_swaps, served.recomputed_tokens) == (
        h.sched.counters.num_preemptions, h.sched.counters.num_swaps, h.sched.counters.recomputed_tokens)
    assert (served.num_swaps > 0) == (mode == "swap") and (served.recomputed_tokens > 0) == (mode == "recompute")
    for i, p in enumerate(prompts):
        assert h.tokens[(f"r{i}", 0)] == reference(p, 10)
        assert h.finish[(f"r{i}", 0)] == "length"
    h.assert_idle()


def test_c7_prompt_that_never_fits_is_rejected_and_others_run():
    h = Harness(num_blocks=10, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="9"):
        h.add("big", list(range(1, 46)))
    h.add("small", [1, 2, 3, 4], max_tokens=2)
    h.run()
    assert h.tokens[("small", 0)] == reference([1, 2, 3, 4], 2)
    with pytest.raises(RequestRejected):
        h.add("37", list(range(100, 137)))
    h.add("36", list(range(100, 136)), max_tokens=20)
    h.run()
    assert h.finish[("36", 0)] == "length"
    assert h.tokens[("36", 0)] == reference(list(range(100, 136)), 1)  # the 37th token has no block left
    with pytest.raises(RequestRejected, match="max_model_len"):
        h.add("ctx", list(range(1, 65)))
    h.assert_idle()


def test_scheduler_and_tokenizer_modules_do_not_import_torch():
    import subprocess
    import sys

    code = "import sys, runtime.scheduler, runtime.tokenizer; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
