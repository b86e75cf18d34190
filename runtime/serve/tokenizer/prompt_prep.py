"""PromptPrep: what the tokenizer process does to a decoded GenerateRequest before forwarding it to the scheduler.

Two stages, each check run once. precheck runs on the loop thread and costs O(fields + messages): it rejects a
malformed request (GenerateRequest.check), one with too many messages or whose text exceeds the character limit
(runtime.prompt_check.check_prompt_chars with prompt_char_limit, which counts each message's template overhead too),
and input_ids too long for the context or the pool (check_prompt_length), before any tokenizing or any
O(len(input_ids)) work. prepare costs the tokenizer's time, bounded by that limit, and runs on the PromptWorker
thread (on the loop thread only for a request that is cheap(): a few ms at most): chat template and encode
(runtime.text.prompt.encode_prompt, the Engine's and the router's path too; the character limit is not checked again),
the rest of the prompt check (check_prompt for text, check_token_ids for input_ids, whose length precheck passed), and
the CompletionStreams (whose stop-string automaton is built there too). SamplingParams are not checked here: decoding
the frame validated them (runtime.protocol.client_frame); prepare only checks that a structured_outputs constraint
compiles (runtime.model.grammar.convert.check_compiles: ERR_INVALID naming the field), so a request with one is never
cheap(). Neither stage touches a socket or a request table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from runtime import protocol as p
from runtime.prompt_check import (
    PromptProblem,
    check_prompt,
    check_prompt_chars,
    check_prompt_length,
    check_token_ids,
    prompt_char_limit,
    prompt_chars,
)
from runtime.scheduler.request import RequestRejected
from runtime.structured_outputs import InvalidStructuredOutputs
from runtime.text.chat_templates import tool_chars
from runtime.text.completion_stream import CompletionStream
from runtime.text.prompt import PromptError, encode_prompt
from runtime.text.token_text import TokenTextCache

INLINE_CHARS = 2048  # a request this small (prompt characters as prompt_chars counts them, or ids, plus stop-string
# characters) is prepared on the loop thread in a few ms (2048 characters of CJK text: ~2-3 ms to encode; 64 empty chat
# messages, 2048 counted characters: ~0.6 ms to render and encode; 2048 stop characters: ~2 ms of automaton)


class Prepared(NamedTuple):
    """A prompt ready to forward: the scheduler's message and one CompletionStream per sample (params.n)."""

    message: p.TokenizedRequest
    completions: list[CompletionStream]


class PromptPrep:
    """The prompt path of one tokenizer process. ready: the worker's Ready (context, vocabulary, pool for
    check_prompt; EOS ids for the completions). max_prompt_chars: ServerArgs'; prompt_chars is the limit in force.
    texts: the process's TokenTextCache, handed to every completion (only its feed, on the loop thread, uses it).
    Immutable after construction, so prepare may run on another thread than precheck."""

    def __init__(self, tokenizer: Any, ready: p.Ready, max_prompt_chars: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.ready = ready
        self.prompt_chars = prompt_char_limit(max_prompt_chars, ready.max_model_len)
        self.texts = TokenTextCache(tokenizer)

    def precheck(self, req: p.GenerateRequest) -> None:
        """Raises RequestRejected: ERR_INVALID for a malformed request, more than MAX_CHAT_MESSAGES messages or text
        over prompt_chars characters (a chat's tools and tool calls counted: chat_templates.tool_chars);
        ERR_CONTEXT for input_ids that can never fit the context or the pool (the message check_prompt would give).
        O(len(messages)) (and the tools' size), O(1) for input_ids; tokenizes nothing."""
        problem = req.check()
        if problem:
            raise RequestRejected(p.ERR_INVALID, problem)
        too_long = check_prompt_chars(req.prompt, req.messages, self.prompt_chars)
        if too_long is None and req.messages is not None:
            chars = prompt_chars(req.prompt, req.messages) + tool_chars(req.messages, req.chat_options)
            if chars > self.prompt_chars:
                message = f"messages and tools too long: {chars} characters, the limit is {self.prompt_chars}"
                too_long = PromptProblem(p.ERR_INVALID, message + " (max_prompt_chars)")
        if too_long is None and req.input_ids is not None:
            r = self.ready
            too_long = check_prompt_length(len(req.input_ids), r.max_model_len, r.block_size, r.num_blocks)
        if too_long is not None:
            raise RequestRejected(*too_long)

    def cheap(self, req: p.GenerateRequest) -> bool:
        """True when preparing req costs a few milliseconds at most (INLINE_CHARS, each chat message counted with its
        template overhead), so the loop may do it itself. O(len(messages) + len(stop)); call after precheck."""
        if req.sampling_params.structured_outputs is not None:
            return False
        size = prompt_chars(req.prompt, req.messages) + len(req.input_ids or ())
        if req.messages is not None:
            size += tool_chars(req.messages, req.chat_options)
        return size + sum(len(s) for s in req.sampling_params.stop) <= INLINE_CHARS

    def prepare(self, internal: str, req: p.GenerateRequest) -> Prepared:
        """The TokenizedRequest (under the internal rid) and the completions of a request precheck passed. Raises
        RequestRejected (code, message) for a prompt this server cannot serve: PromptError -> ERR_INVALID, then
        check_prompt's problem (for input_ids: check_token_ids', the length being checked already), and a
        structured_outputs constraint that does not compile (ERR_INVALID)."""
        r = self.ready
        if req.sampling_params.structured_outputs is not None:
            from runtime.model.grammar.convert import check_compiles  # lazy: xgrammar imports torch

            try:
                check_compiles(req.sampling_params.structured_outputs)
            except InvalidStructuredOutputs as exc:
                raise RequestRejected(p.ERR_INVALID, str(exc)) from None
        if req.input_ids is not None:
            ids = req.input_ids  # typed list[int] by the decode: nothing to convert
            problem = check_token_ids(ids, r.vocab_size)
        else:
            try:
                # precheck bounded the characters
                ids = encode_prompt(self.tokenizer, req.prompt, req.messages, chat_options=req.chat_options)
            except PromptError as exc:
                raise RequestRejected(p.ERR_INVALID, str(exc)) from None
            problem = check_prompt(ids, r.max_model_len, r.vocab_size, r.block_size, r.num_blocks)
        if problem is not None:
            raise RequestRejected(*problem)
        sp = req.sampling_params
        bias_problem = sp.vocab_problem(r.vocab_size)  # logit_bias ids: the vocabulary is known here
        if bias_problem is not None:
            raise RequestRejected(p.ERR_INVALID, bias_problem)
        msg = p.TokenizedRequest(rid=internal, input_ids=ids, sampling_params=sp, cache_salt=req.cache_salt)
        return Prepared(msg, [CompletionStream(self.tokenizer, sp, r.eos_token_ids, self.texts) for _ in range(sp.n)])
