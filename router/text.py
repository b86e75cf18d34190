"""RouterTokenizer: the router's own copy of the replicas' tokenizer. It gives the prompt ids a request is routed by
(its full blocks hashed as the replica hashes them) and the answers to tokenize and detokenize requests (the
replicas' rule: runtime.serve.tokenizer.text_requests), so an HTTP server in front of the router needs no tokenizer.
Both run on the router's loop, bounded by ROUTER_TOKENIZE_CHARS.
"""

from __future__ import annotations

from typing import Any

from runtime import protocol as p
from runtime.scheduler.request import RequestRejected
from runtime.serve.tokenizer.text_requests import TextRequest, TextRequests
from runtime.text.prompt import PromptError, encode_prompt

# The router tokenizes prompts on its own loop to match prefixes: a longer text (characters) is not tokenized here, so
# one huge prompt cannot stall routing (the replica applies its own max_prompt_chars). A tokenize request's text, and
# a detokenize request's ids, have the same limit.
ROUTER_TOKENIZE_CHARS = 262_144


class RouterTokenizer:
    """tokenizer: a transformers tokenizer (runtime.model.loader.load_tokenizer(args.model)), or None: then no prompt
    is tokenized (requests are forwarded as given) and tokenize / detokenize requests are answered ERR_INVALID.
    Immutable."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = None if tokenizer is None else TextRequests(tokenizer, ROUTER_TOKENIZE_CHARS)

    def prompt_ids(self, req: p.GenerateRequest) -> list[int] | None:
        """The prompt's token ids as the replica's tokenizer process computes them; None when the router cannot
        (no tokenizer, the template fails, or the text is over ROUTER_TOKENIZE_CHARS: the replica then applies its
        own checks and answers with the same error it would give; such a request is routed without a prefix match)."""
        if req.input_ids is None and self.tokenizer is None:
            return None
        try:
            return encode_prompt(
                self.tokenizer,
                req.prompt,
                req.messages,
                req.input_ids,
                max_chars=ROUTER_TOKENIZE_CHARS,
                chat_options=req.chat_options,
            )
        except PromptError:  # too long to tokenize here, or malformed: the replica answers with its own error
            return None

    def answer(self, req: TextRequest) -> p.TokenizeResponse | p.DetokenizeResponse | p.ErrorResponse:
        """The answer to a tokenize / detokenize request (the text bounded by ROUTER_TOKENIZE_CHARS, as a generate
        request's is, the ids by the same figure), or the ErrorResponse(ERR_INVALID) a replica would give for the
        same fault; without a tokenizer ErrorResponse(ERR_INVALID, "this router has no tokenizer ...")."""
        if self.text is None:
            return p.ErrorResponse(req.rid, p.ERR_INVALID, "this router has no tokenizer; ask a replica's endpoint")
        try:
            self.text.check(req)
            return self.text.answer(req)
        except RequestRejected as exc:
            return p.ErrorResponse(req.rid, exc.code, str(exc))
