"""A grammar still compiling holds up only its own request: the worker does not sample a sequence whose compile has
not finished within GRAMMAR_WAIT_S, the scheduler requeues it from its cached prefix, and the other requests of the
batch decode meanwhile. The compile is held by a gate the test opens, so nothing depends on the machine's speed."""

from __future__ import annotations

import re
import threading

from runtime.engine import Engine
from runtime.model.grammar.compiler import GrammarCache
from runtime.sampling_params import SamplingParams
from runtime.structured_outputs import StructuredOutputs
from tests.runtime.engine_helpers import assert_idle, greedy

REGEX = r"[a-z]{4}-[0-9]{3}"
PROMPT = list(range(7, 47))
OTHER = list(range(50, 70))


def test_a_compiling_grammar_does_not_stall_the_batch(tiny_llama_dir, monkeypatch):
    engine = Engine(model=str(tiny_llama_dir), num_blocks=128, block_size=4, dtype="float32")
    constrained = SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=StructuredOutputs(regex=REGEX))
    solo = engine.generate(input_ids=[PROMPT], sampling_params=constrained)[0]  # compiled and cached now
    assert re.fullmatch(REGEX, solo.text)
    engine.runner.grammars.cache.clear()
    gate = threading.Event()
    compile_grammar = GrammarCache._compile

    def held(self: GrammarCache, so: StructuredOutputs):
        assert gate.wait(60), "the test never opened the gate"
        return compile_grammar(self, so)

    monkeypatch.setattr(GrammarCache, "_compile", held)
    slow = engine.add_request(input_ids=PROMPT, sampling_params=constrained)
    fast = engine.add_request(input_ids=OTHER, sampling_params=greedy(12))
    done: dict[str, object] = {}
    steps = 0
    while fast not in done:
        steps += 1
        assert steps < 200, "the unconstrained request did not finish while the grammar compiled"
        for chunk in engine.step():
            if chunk.finish_reason is not None:
                done[chunk.rid] = chunk
    assert slow not in done and not gate.is_set()  # the batch went on without the constrained request
    assert len(engine.result(fast).token_ids) == 12
    gate.set()
    while slow not in done:
        steps += 1
        assert steps < 400
        for chunk in engine.step():
            if chunk.finish_reason is not None:
                done[chunk.rid] = chunk
    out = engine.result(slow)
    assert (out.text, out.finish_reason) == (solo.text, "stop")  # the same tokens as when nothing waited
    assert engine.stats().num_preemptions == 0  # a requeue for a compile is no preemption
    engine.generate(input_ids=[[1, 2, 3]], sampling_params=greedy(1))  # carries the last drops to the worker
    assert_idle(engine)
    assert len(engine.runner.grammars) == 0
