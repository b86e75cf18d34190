"""Engine: the public in-process API. The same Scheduler, ModelRunner, prompt check and CompletionStream as the
server's processes, wired together in one process with no sockets (the Engine's step loop is the scheduler loop), so
the Engine and the server give the same text, token_ids and finish_reason for the same request.

    engine = Engine(model="smollm2", block_size=16, enable_prefix_caching=True)   # any ServerArgs field
    outs = engine.generate(input_ids=[[...]], sampling_params=SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].usage.cached_tokens, outs[0].outputs
    for chunk in engine.stream(prompts=["..."]): chunk.text, chunk.token_ids
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

from runtime.config import InvalidConfig, ServerArgs
from runtime.prompt_check import prompt_char_limit
from runtime.protocol import (
    ERR_INVALID,
    ChatOptions,
    ForwardResult,
    PromptChunk,
    PromptLogprobs,
    ServerStats,
    StreamChunk,
    TokenOutput,
    Usage,
    input_problem,
)
from runtime.results import Choice, CompletionFold
from runtime.sampling_params import SamplingParams
from runtime.scheduler.kv_groups import make_manager
from runtime.scheduler.request import RequestRejected
from runtime.scheduler.scheduler import Scheduler
from runtime.text.completion_stream import CompletionStream
from runtime.text.prompt import PromptError, encode_prompt
from runtime.text.token_text import TokenTextCache

logger = logging.getLogger(__name__)

__all__ = ["Engine", "RequestOutput", "CompletionOutput", "EngineError", "RequestRejected"]


class EngineError(RuntimeError):
    """The engine cannot continue (the scheduler stalled, a step failed as a whole, or text input without a
    tokenizer)."""


CompletionOutput = Choice
"""One completion of a request: the Choice that runtime.results.CompletionFold folds from the request's chunks, as
the client's and the HTTP server's are (index, text, token_ids, finish_reason "stop" / "length" / "abort",
logprobs and the texts of their tokens aligned with token_ids when asked, usage, score). EOS, stop token ids and stop
strings follow CompletionStream's rule (runtime/text/): an EOS / stop id stays in token_ids but not in text; a stop
string cuts text before it and token_ids to the tokens that cover that text. score: a beam search completion's
length-penalised cumulative logprob (SamplingParams.use_beam_search: the outputs come best first), else None."""


class RequestOutput(msgspec.Struct, kw_only=True):
    """A finished request, as CompletionFold folded its chunks: every completion (outputs, by index), usage
    (CompletionFold.usage: every field of the prompt's usage, completion_tokens summed over completions), ttft_s
    (seconds from add_request to the first chunk with tokens; None when none had any). text, token_ids and
    finish_reason are outputs[0]'s. What only the Engine knows rides beside the fold's result (the client's
    runtime.results.Completion has no place for it): prompt_token_ids, prompt_logprobs (SamplingParams.
    prompt_logprobs: the fold's, from position 0), and error: None, or why the request failed
    (the worker could not run one of its sequences, or its step failed as a whole): then every completion that had
    not finished ends with finish_reason "abort" and keeps the tokens produced before the failure."""

    rid: str
    prompt_token_ids: list[int]
    outputs: list[Choice]
    usage: Usage
    ttft_s: float | None = None
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class _Live:
    """A request the Engine is serving: its prompt ids, one CompletionStream per completion, and the fold of the
    chunks the Engine hands out for it (time.monotonic() seconds)."""

    def __init__(self, prompt_ids: list[int], streams: list[CompletionStream]) -> None:
        self.prompt_ids = prompt_ids
        self.streams = streams
        self.fold = CompletionFold(len(streams), time.monotonic())
        self.error: str | None = None


class Engine:
    """In-process serving engine. Keyword arguments are ServerArgs fields (InvalidConfig names an unknown one).

    Attributes: args (ServerArgs), runner (ModelRunner), manager (KVCacheManager), scheduler (Scheduler),
    tokenizer (transformers tokenizer, or None when the model folder has none: then only input_ids work and text is
    ""). Not thread-safe: one caller drives it. The Engine keeps a request from add_request until its RequestOutput is
    handed out (generate / stream / result / abort), and nothing of it afterwards.
    Raises (at construction): runtime.model.loader.ModelLoadError subclasses, runtime.config.InvalidConfig.
    """

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        from runtime.model.loader import ModelLoadError, load_tokenizer
        from runtime.model.runner import ModelRunner
        from runtime.text.chat_templates import override_chat_template

        self.args = ServerArgs.from_kwargs(model=model, **kwargs)
        if self.args.tensor_parallel_size != 1:  # the ranks are processes: runtime/serve/worker_rank.py
            raise InvalidConfig(
                "tensor_parallel_size > 1 needs the server (radixserve -tp N); the Engine runs one rank"
            )
        self.runner = ModelRunner(self.args)
        ready = self.runner.ready
        self.manager = make_manager(ready, self.args)
        self.scheduler = Scheduler(
            self.manager, self.args, ready.max_model_len, ready.eos_token_ids, vocab_size=ready.vocab_size
        )
        try:
            self.tokenizer = override_chat_template(load_tokenizer(model), self.args.chat_template)
        except ModelLoadError as e:
            logger.warning("no tokenizer for %s (%s): input_ids only, no text", model, e)
            self.tokenizer = None
        self._texts = None if self.tokenizer is None else TokenTextCache(self.tokenizer)  # shared by every completion
        self._eos = tuple(ready.eos_token_ids)
        self._max_prompt_chars = prompt_char_limit(self.args.max_prompt_chars, ready.max_model_len)
        self._rids = itertools.count()
        self._live: dict[str, _Live] = {}
        self._done: dict[str, RequestOutput] = {}

    # ------------------------------------------------------------------ high level
    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        messages: Sequence[list[dict[str, Any]]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run requests to completion; one RequestOutput per prompt, in order. Exactly one of prompts, input_ids,
        messages (chat template applied). sampling_params / cache_salt: one for all, or one per prompt. A request
        the worker could not run comes back with finish_reason "abort" and RequestOutput.error set; the others are
        unaffected. Raises RequestRejected (nothing queued) when a prompt can never run, EngineError."""
        rids = self._submit(prompts, input_ids, messages, sampling_params, cache_salt)
        while not all(r in self._done for r in rids):
            self.step()
        return [self._done.pop(r) for r in rids]

    def stream(
        self,
        prompts: str | Sequence[str] | None = None,
        *,
        input_ids: Sequence[Sequence[int]] | None = None,
        messages: Sequence[list[dict[str, Any]]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None | Sequence[str | None] = None,
    ) -> Iterator[StreamChunk]:
        """Like generate, but yields StreamChunks (rid, index, new text, new token_ids, finish_reason, usage on the
        last chunk of each completion) as steps finish. Abandoning the iterator aborts the unfinished requests."""
        rids = self._submit(prompts, input_ids, messages, sampling_params, cache_salt)
        mine = set(rids)
        try:
            while not all(r in self._done for r in rids):
                for chunk in self.step():
                    if chunk.rid in mine:
                        yield chunk
        finally:
            for r in rids:
                if r in self._live:
                    self.abort(r)
            for r in rids:
                self._done.pop(r, None)

    # ------------------------------------------------------------------ low level
    def add_request(
        self,
        *,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling_params: SamplingParams | None = None,
        cache_salt: str | None = None,
        rid: str | None = None,
        chat_options: ChatOptions | None = None,
    ) -> str:
        """Queue one request (exactly one of prompt, input_ids, messages; chat_options: how messages are rendered,
        tools included); returns its rid. Drive with step(). Raises RequestRejected, ValueError, EngineError (text
        without a tokenizer)."""
        ids = self._encode(prompt, input_ids, messages, chat_options)
        params = sampling_params or SamplingParams()
        if params.structured_outputs is not None:
            from runtime.model.grammar.convert import check_compiles  # lazy: xgrammar imports torch

            check_compiles(params.structured_outputs)  # InvalidStructuredOutputs (a ValueError) naming the field
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        self.scheduler.add_request(rid, ids, params, cache_salt)
        streams = [CompletionStream(self.tokenizer, params, self._eos, self._texts) for _ in range(params.n)]
        self._live[rid] = _Live(ids, streams)
        return rid

    def step(self) -> list[StreamChunk]:
        """Run one scheduler step (schedule, forward, process) and return the StreamChunks it produced.

        A request whose sequence the worker could not run (ForwardResult.failed_seq_ids) ends with "abort" and
        RequestOutput.error set; step() does not raise for it and the step's other requests go on unchanged.
        Raises EngineError when requests remain but nothing can run, or when the step fails as a whole (execute
        raised: that step's requests end with "abort" and error set, their blocks are released; the engine keeps
        serving)."""
        batch = self.scheduler.schedule()
        if batch is None:
            outs = self.scheduler.drain_outputs()
            if not outs and self.scheduler.has_unfinished():
                raise EngineError(f"scheduler stalled: {self.scheduler.stats()}")
        else:
            try:
                result = self.runner.execute(batch)
            except Exception as exc:  # the step's requests end with "abort" and release their blocks
                logger.exception("step %d failed", batch.step_id)
                error = f"{type(exc).__name__}: {exc}"
                for o in self._process(ForwardResult(batch.step_id, [], [], error=error)):
                    self._on_output(o)
                raise EngineError(f"step {batch.step_id} failed ({exc!r}); its requests were aborted") from exc
            outs = self._process(result)
        chunks = self._feed(outs)
        chunks.extend(self._feed(self.scheduler.drain_outputs()))  # what _feed's stops produced
        return chunks

    def abort(self, rid: str) -> RequestOutput:
        """Abort a queued or running request: its unfinished completions end with "abort". Returns its RequestOutput
        (what it produced so far) and keeps nothing of it: a later result(rid) raises KeyError.
        Raises UnknownRequestError when rid is not live (finished, never added, or already aborted)."""
        self.scheduler.abort(rid)
        for o in self.scheduler.drain_outputs():
            self._on_output(o)
        return self._done.pop(rid)

    def result(self, rid: str) -> RequestOutput:
        """The RequestOutput of a request that finished (or failed) through step(), removed once taken; finished
        requests are kept until taken. Raises KeyError (not finished yet, already taken, or aborted: abort()
        returned it)."""
        return self._done.pop(rid)

    def stats(self) -> ServerStats:
        """The scheduler's ServerStats (the same Struct the server answers StatsRequest with; see its fields), e.g.
        num_used_blocks, num_free_blocks, num_running, hit_rate. tokens_per_s is 0.0 here (no stats interval)."""
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Abort everything and release the model and KV cache. The engine is unusable afterwards."""
        for rid in list(self._live):
            self.abort(rid)
        if hasattr(self, "runner"):  # a second shutdown is a no-op
            del self.runner  # the model and KV tensors go with it
        logger.info("engine shut down")

    # ------------------------------------------------------------------ internals
    def _process(self, result: ForwardResult) -> list[TokenOutput]:
        """scheduler.process_result, then the error of each request it failed onto that request's record."""
        outs = self.scheduler.process_result(result)
        for failure in self.scheduler.drain_failures():
            live = self._live.get(failure.rid)
            if live is not None:
                live.error = failure.message
        return outs

    def _feed(self, outs: list[TokenOutput]) -> list[StreamChunk]:
        """_on_output of each delta in order; the chunks there are to send."""
        chunks = []
        for o in outs:
            chunk = self._on_output(o)
            if chunk is not None:
                chunks.append(chunk)
        return chunks

    def _on_output(self, o: TokenOutput) -> StreamChunk | None:
        """Feed one scheduler delta to its CompletionStream and fold the chunk it makes into the request's result; a
        stop string tells the scheduler how many tokens to keep (its final delta then comes out of drain_outputs and
        is ignored). None when there is nothing to send."""
        live = self._live.get(o.rid)
        if live is None:
            return None
        delta = live.streams[o.index].feed(o)
        if delta.stop_keep_tokens is not None:
            self.scheduler.stop(o.rid, delta.stop_keep_tokens, o.index)
        if delta.empty:
            return None
        prompt = None
        if delta.prompt_logprobs is not None:
            prompt = PromptChunk(delta.prompt_logprobs, delta.prompt_token_texts)
        chunk = StreamChunk(
            rid=o.rid,
            index=o.index,
            text=delta.text,
            token_ids=delta.token_ids,
            logprobs=delta.logprobs,
            token_texts=delta.token_texts,
            finish_reason=delta.finish_reason,
            usage=delta.usage,
            score=o.score,
            prompt_logprobs=prompt,
        )
        if live.fold.add(chunk, time.monotonic()):
            self._finish_request(o.rid)
        return chunk

    def _finish_request(self, rid: str) -> None:
        live = self._live.pop(rid)
        self._done[rid] = RequestOutput(
            rid=rid,
            prompt_token_ids=live.prompt_ids,
            outputs=live.fold.choices(),
            usage=live.fold.usage(),
            ttft_s=live.fold.ttft_s,
            error=live.error,
            prompt_logprobs=live.fold.prompt_logprobs,
        )

    def _encode(
        self,
        prompt: str | None,
        input_ids: Sequence[int] | None,
        messages: list[dict[str, Any]] | None,
        chat_options: ChatOptions | None = None,
    ) -> list[int]:
        """The prompt's ids through the server's own path (input_problem, encode_prompt): the same errors, as
        RequestRejected(ERR_INVALID, message). Raises EngineError for text without a tokenizer."""
        problem = input_problem(
            prompt, None if messages is None else list(messages), None if input_ids is None else list(input_ids)
        )
        if problem is not None:
            raise RequestRejected(ERR_INVALID, problem)
        if input_ids is None and self.tokenizer is None:
            raise EngineError(f"model {self.args.model!r} has no tokenizer: pass input_ids")
        try:
            return encode_prompt(
                self.tokenizer, prompt, messages, input_ids, max_chars=self._max_prompt_chars, chat_options=chat_options
            )
        except PromptError as exc:
            raise RequestRejected(ERR_INVALID, str(exc)) from None

    def _submit(self, prompts, input_ids, messages, sampling_params, cache_salt) -> list[str]:
        if isinstance(prompts, str):
            prompts = [prompts]
        given = [
            (k, v) for k, v in (("prompt", prompts), ("input_ids", input_ids), ("messages", messages)) if v is not None
        ]
        if len(given) != 1:
            raise ValueError("pass exactly one of prompts, input_ids, messages")
        kind, items = given[0]
        items = list(items)
        params = _per_item(sampling_params, len(items), SamplingParams)
        salts = _per_item(cache_salt, len(items), str)
        encoded = [
            self._encode(**{kind: x, **{k: None for k in ("prompt", "input_ids", "messages") if k != kind}})
            for x in items
        ]
        rids: list[str] = []
        for i, (ids, p, s) in enumerate(zip(encoded, params, salts, strict=True)):
            try:
                rids.append(self.add_request(input_ids=ids, sampling_params=p or SamplingParams(), cache_salt=s))
            except RequestRejected as exc:
                self._withdraw(rids)
                raise RequestRejected(exc.code, f"prompt {i}: {exc}") from None
        return rids

    def _withdraw(self, rids: list[str]) -> None:
        """Take back requests of a call that another prompt of it made fail: they were queued, never scheduled, so
        nothing of them remains (no block, no output)."""
        for rid in rids:
            self.abort(rid)


def _per_item(value: Any, n: int, single: type) -> list[Any]:
    if value is None or isinstance(value, single):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {len(values)} values for {n} prompts")
    return values
