"""A tiny local OpenAI-style chat completions server for the tests of benchmarks/multi_turn_chat.py.

POST /v1/chat/completions with "stream": true answers Server-Sent Events like OpenAI's API: text deltas in
choices[0].delta.content, then a chunk with finish_reason, then (stream_options.include_usage) a chunk with usage
{prompt_tokens, completion_tokens, prompt_tokens_details: {cached_tokens}}, then "data: [DONE]". Under the path
prefix /llamacpp it reports llama.cpp's way instead: no usage, a final chunk with timings {prompt_n, cache_n}.

The prompt is the chat template of the messages (the given tokenizer); the reply is a fixed sentence numbered by
request, cut to max_tokens tokens. cached_tokens is what a block-level prefix cache of 16-token blocks would hold: the
longest prefix of the prompt in whole blocks (at most prompt length - 1) equal to a prefix of an earlier request's
prompt + reply ids (the reply text re-encoded). Binds 127.0.0.1 on a free port; runs in a daemon thread.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from runtime.text.prompt import apply_chat_template

BLOCK_SIZE = 16


class OpenAIStub:
    """start() -> base URL; requests: the (prompt_tokens, cached_tokens, reply text) of every request, in order."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: list[tuple[int, int, str]] = []
        self._cached_blocks: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self.path.endswith("/v1/chat/completions") or not body.get("stream"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in stub.answer(body, llamacpp=self.path.startswith("/llamacpp/")):
                    self.wfile.write(f"data: {event}\n\n".encode())
                    self.wfile.flush()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    def start(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, body: dict[str, Any], llamacpp: bool) -> list[str]:
        """The SSE payloads of one streamed answer (and the cache update it implies)."""
        tok = self.tokenizer
        prompt = apply_chat_template(tok, body["messages"])
        with self._lock:
            n = len(self.requests)
            limit = (len(prompt) - 1) // BLOCK_SIZE
            cached = 0
            while cached < limit and tuple(prompt[: (cached + 1) * BLOCK_SIZE]) in self._cached_blocks:
                cached += 1
            cached *= BLOCK_SIZE
            ids = tok.encode(f"Answer {n}: the desk is open from nine to eight on weekdays.", add_special_tokens=False)
            text = tok.decode(ids[: body["max_tokens"]])
            full = prompt + tok.encode(text, add_special_tokens=False)
            self._cached_blocks.update(tuple(full[: k * BLOCK_SIZE]) for k in range(1, len(full) // BLOCK_SIZE + 1))
            self.requests.append((len(prompt), cached, text))
        half = len(text) // 2
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}]}
            for part in (text[:half], text[half:])
        ]
        last: dict[str, Any] = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        completion = len(tok.encode(text, add_special_tokens=False))
        if llamacpp:
            last["timings"] = {"prompt_n": len(prompt) - cached, "cache_n": cached, "predicted_n": completion}
            events = [*chunks, last]
        else:
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            events = [*chunks, last, {"choices": [], "usage": usage}]
        return [json.dumps(e) for e in events] + ["[DONE]"]
