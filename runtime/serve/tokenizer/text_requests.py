"""TextRequests: the answers to TokenizeRequest and DetokenizeRequest, given by the tokenizer process (and by the
router, from its own tokenizer), so a client such as the HTTP server needs no tokenizer of its own.

Two stages, each check run once, as a generate request's prompt has them (prompt_prep.py). check runs on the loop
thread and costs O(fields + messages): the request's shape (TokenizeRequest.check), the character limit of its text
(runtime.prompt_check.check_prompt_chars, the limit a GenerateRequest's text has), the count of a detokenize
request's ids (at most that same figure). answer costs the tokenizer's time, bounded by those limits: the tokenizer
process runs it on its PromptWorker thread unless cheap() (a few ms at most), the router on its loop. A prompt's
ids come from runtime.text.prompt.encode_prompt, the one path of a GenerateRequest's prompt (chat template
included), so they are the prompt tokens a GenerateRequest with the same prompt or messages gets; a detokenize
request's text is runtime.text.token_text.decode_text (special tokens kept) once every id is in the vocabulary.
"""

from __future__ import annotations

from typing import Any

from runtime import protocol as p
from runtime.prompt_check import check_prompt_chars, prompt_chars
from runtime.scheduler.request import RequestRejected
from runtime.serve.tokenizer.prompt_prep import INLINE_CHARS
from runtime.text.prompt import PromptError, encode_prompt
from runtime.text.token_text import decode_text

TextRequest = p.TokenizeRequest | p.DetokenizeRequest
TextResponse = p.TokenizeResponse | p.DetokenizeResponse


class TextRequests:
    """Tokenize and detokenize answers from one tokenizer.

    tokenizer: the model's transformers tokenizer (its len() is the vocabulary a detokenize request's ids must lie
    in). limit: the most characters a TokenizeRequest's text may have (as prompt_chars counts them: the server's
    prompt_char_limit, the router's ROUTER_TOKENIZE_CHARS), and the most ids a DetokenizeRequest may carry.
    Immutable, so answer may run on another thread than check; it touches no socket and no request table.
    """

    def __init__(self, tokenizer: Any, limit: int) -> None:
        self.tokenizer = tokenizer
        self.limit = limit

    def check(self, req: TextRequest) -> None:
        """Raises RequestRejected(ERR_INVALID) for a TokenizeRequest that is malformed (not exactly one of prompt
        and messages, empty messages), has more than MAX_CHAT_MESSAGES messages or text over limit characters, and
        for a DetokenizeRequest of more than limit ids. O(len(messages)); tokenizes nothing."""
        if isinstance(req, p.DetokenizeRequest):
            if len(req.token_ids) > self.limit:
                raise RequestRejected(
                    p.ERR_INVALID,
                    f"too many token ids: {len(req.token_ids)}, the limit is {self.limit} (max_prompt_chars)",
                )
            return
        problem = req.check()
        if problem is not None:
            raise RequestRejected(p.ERR_INVALID, problem)
        too_long = check_prompt_chars(req.prompt, req.messages, self.limit)
        if too_long is not None:
            raise RequestRejected(*too_long)

    def cheap(self, req: TextRequest) -> bool:
        """True when answering req costs a few milliseconds at most (INLINE_CHARS characters or ids), so a loop may
        answer it itself. O(len(messages)); call after check."""
        if isinstance(req, p.DetokenizeRequest):
            return len(req.token_ids) <= INLINE_CHARS
        return prompt_chars(req.prompt, req.messages) <= INLINE_CHARS

    def answer(self, req: TextRequest) -> TextResponse:
        """The answer to a request check passed (under the request's rid). Raises RequestRejected(ERR_INVALID): for a
        TokenizeRequest, encode_prompt's PromptError ("chat template failed: ...", text that is not valid Unicode);
        for a DetokenizeRequest, "token_ids[i] = t is outside the vocabulary [0, V)" naming the first such id.
        Cost: the tokenizer's, O(characters) or O(ids + characters of the text)."""
        if isinstance(req, p.DetokenizeRequest):
            ids = req.token_ids
            vocab = len(self.tokenizer)
            if ids and not 0 <= min(ids) <= max(ids) < vocab:  # min and max run in C: no per-id Python step
                i = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
                raise RequestRejected(
                    p.ERR_INVALID, f"token_ids[{i}] = {ids[i]} is outside the vocabulary [0, {vocab})"
                )
            return p.DetokenizeResponse(req.rid, decode_text(self.tokenizer, ids))
        try:
            ids = encode_prompt(
                self.tokenizer, req.prompt, req.messages, add_special_tokens=req.add_special_tokens
            )  # check bounded the characters
        except PromptError as exc:
            raise RequestRejected(p.ERR_INVALID, str(exc)) from None
        return p.TokenizeResponse(req.rid, ids)
