"""/tokenize and /detokenize, and the token texts of logprobs: the model's tokenizer loaded in the HTTP process
(runtime.model.loader.load_tokenizer imports no torch once the model folder exists).

This is the server's second copy of the tokenizer (the tokenizer process holds the first); it is what the HTTP
process needs one for, nothing else (prompts are tokenized and checked by the backend only). It stays here because
the public protocol has no tokenize request that a router could also answer, and a logprobs answer names every
token and alternative with no round trip to the backend; its memory cost is in the README.

/tokenize {"prompt": text, "add_special_tokens": true} gives the ids the completions route would send for that text;
{"messages": [...]} the ids of the chat template, as the chat route's backend computes them. Answer:
{"count": n, "tokens": [ids]}. /detokenize {"tokens": [ids]} answers {"prompt": text} (special tokens kept).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from runtime.serve.http.errors import bad_request, unavailable
from runtime.serve.http.openai_schema import DetokenizeRequest, TokenizeRequest, chat_messages
from runtime.serve.http.responses import TokenText
from runtime.text.prompt import PromptError, encode_prompt, encode_text

logger = logging.getLogger(__name__)


class Tokenization:
    """The tokenizer of model (loaded by load(); None when it cannot be loaded: then /tokenize and /detokenize
    answer 503 and logprobs name tokens "token_id:<id>")."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.tokenizer: Any = None
        self.text = TokenText(None)

    async def load(self) -> None:
        """Loads the tokenizer on a thread (seconds on a cold cache); logs a warning when it cannot."""
        from runtime.model.loader import ModelLoadError, load_tokenizer

        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model)
        except (ModelLoadError, OSError, ValueError) as exc:
            logger.warning("no tokenizer for %r (%s): /tokenize and /detokenize answer 503", self.model, exc)
            return
        self.text = TokenText(self.tokenizer)

    def _require(self) -> Any:
        if self.tokenizer is None:
            raise unavailable(f"no tokenizer loaded for {self.model!r}")
        return self.tokenizer

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """{"count", "tokens"} of req's prompt or messages (encoded on a thread). Raises OpenAIError 400 when not
        exactly one is given or the text cannot be encoded, 503 without a tokenizer."""
        tokenizer = self._require()
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("exactly one of prompt and messages must be given", "prompt")
        try:
            if req.messages is not None:
                messages = chat_messages(req.messages)
                ids = await asyncio.to_thread(encode_prompt, tokenizer, messages=messages)
            else:
                ids = await asyncio.to_thread(encode_text, tokenizer, req.prompt, req.add_special_tokens)
        except (PromptError, TypeError, ValueError) as exc:
            raise bad_request(str(exc), "messages" if req.messages is not None else "prompt") from None
        return {"count": len(ids), "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """{"prompt": text} of req.tokens. Raises OpenAIError 400 for an id outside the vocabulary, 503 without a
        tokenizer."""
        tokenizer = self._require()
        vocab = len(tokenizer)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})", f"tokens[{i}]")
        return {"prompt": tokenizer.decode(req.tokens)}
