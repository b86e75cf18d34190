"""The scheduler test harness: the real Scheduler and KVCacheManager driven against FakeRunner, a fake worker that
really stores "KV" in slots. FakeRunner keeps, per slot, the (token, position) written there; a sampled token is a
hash of the tokens read back through the block table, so any wrong block table, missed copy-on-write, bad swap or
premature cache entry changes the output. `reference` is the same function on a plain token list (a cold solo run)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from radix.blocks import cdiv
from radix.manager import KVCacheManager
from runtime.config import ServerArgs
from runtime.protocol import ForwardBatch, ForwardResult, Usage
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from tests.runtime.forward_counts import forward_tokens_by_seq

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

    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, eos_token_ids: Sequence[int] = (EOS,)
    ) -> None:
        self.bs = block_size
        self.eos = set(eos_token_ids)
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
        seq_ids = []
        token_ids = []
        accepted: dict[int, list[int]] = {}
        n_fwd = 0
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
                run = self._run_steps(s, table, context, params, index)
                n_fwd += len(run) - 1
                if s.num_draft_slots:
                    accepted[s.seq_id] = run[:-1]
                seq_ids.append(s.seq_id)
                token_ids.append(run[-1])
        runs = accepted or None
        return ForwardResult(
            batch.step_id, seq_ids, token_ids, num_forward_tokens=n_fwd, accepted_token_ids=runs, draft_token_ids=runs
        )

    def _run_steps(self, s, table: list[int], context: list[int], params: SamplingParams, index: int) -> list[int]:
        """The token s samples, and, for a multi-step decode (num_draft_slots = k), up to k more, each after writing
        the one before into the next slot, as runtime/model/multi_step.py does: the run stops at an EOS (unless
        ignore_eos) or a stop id; the table is cut to the blocks of the tokens written."""
        run = [next_token(context, index, params.temperature)]
        for j in range(s.num_draft_slots):
            tok = run[-1]
            if (tok in self.eos and not params.ignore_eos) or tok in (params.stop_token_ids or ()):
                break
            p = s.start_pos + len(s.token_ids) + j
            self.kv[table[p // self.bs] * self.bs + p % self.bs] = (tok, p)
            context.append(tok)
            run.append(next_token(context, index, params.temperature))
        if s.num_draft_slots:
            del table[cdiv(s.start_pos + len(s.token_ids) + len(run) - 1, self.bs) :]
        return run


class Harness:
    """A Scheduler + manager + FakeRunner; run() steps until idle, checking the manager's invariants every step."""

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_model_len: int = 4096,
        num_host_blocks: int = 0,
        eos_token_ids: Sequence[int] = (EOS,),
        clock: Callable[[], float] = time.monotonic,
        **kw,
    ) -> None:
        self.args = ServerArgs(num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks, **kw)
        self.manager = KVCacheManager(
            num_blocks,
            block_size,
            self.args.enable_prefix_caching,
            num_host_blocks,
            num_host_cache_blocks=self.args.num_host_cache_blocks or 0,
        )
        self.sched = Scheduler(self.manager, self.args, max_model_len, eos_token_ids=eos_token_ids, clock=clock)
        self.runner = FakeRunner(num_blocks, block_size, num_host_blocks, eos_token_ids)
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
