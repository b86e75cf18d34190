"""GrammarCache: StructuredOutputs -> xgrammar CompiledGrammar for the model's vocabulary, compiled on a thread pool and
kept by constraint.

A compile builds the grammar's adaptive token-mask cache over the whole vocabulary (xgrammar, Dong et al. 2024,
section 3.1): milliseconds to a second for a JSON schema, so it never runs on the step. The first sequence of a
constraint starts it when the worker registers the sequence (its prefill runs meanwhile); later sequences of the same
constraint get the finished grammar at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from runtime.model.grammar.convert import to_grammar
from runtime.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2  # concurrent compiles (each also uses xgrammar's own threads)


def constraint_key(so: StructuredOutputs) -> tuple[str, str]:
    """The cache key of a constraint: its kind and its text (choice: the strings' JSON). The tokenizer is fixed per
    GrammarCache (one per worker), so it is not part of the key."""
    if so.choice is not None:
        return ("choice", "\x00".join(so.choice))
    if so.json_object:
        return ("json_object", "")
    text = getattr(so, so.kind)
    return (so.kind, text)


class GrammarCache:
    """Compiles constraints for one tokenizer, off the caller's thread, with an LRU cache of the results.

    Args:
        tokenizer: a transformers tokenizer whose ids are the model's (the worker's model folder's).
        vocab_size: the logits' width (the model's vocab_size, which may exceed the tokenizer's).
        stop_token_ids: the model's EOS ids: the grammar allows them exactly when the completion is complete.

    get() is thread-safe; the compiled grammars are immutable and shared by every matcher of their constraint.
    Memory: at most MAX_CACHED_GRAMMARS compiled grammars (a JSON schema's is a few MB for a 49k vocabulary).
    """

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()

    def get(self, so: StructuredOutputs) -> Future[xgr.CompiledGrammar]:
        """The compile of so: a finished Future when cached, else one running on the pool (its exception, if any:
        runtime.structured_outputs.InvalidStructuredOutputs naming the field). O(1) plus, on a miss, the submit."""
        key = constraint_key(so)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, so)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return future

    def compile_now(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        """get(so)'s result, waiting for it (benchmarks and tests). Raises InvalidStructuredOutputs."""
        return self.get(so).result()

    def clear(self) -> None:
        """Forget every cached grammar (running compiles finish for their waiters)."""
        with self._lock:
            self._cache.clear()

    def _compile(self, so: StructuredOutputs) -> xgr.CompiledGrammar:
        compiled = self._compiler.compile_grammar(to_grammar(so))
        logger.debug("compiled a %s grammar (%d bytes)", so.kind, compiled.memory_size_bytes)
        return compiled
