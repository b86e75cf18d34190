"""A stand-in for llama.cpp's llama-server in --smoke runs of benchmarks/vs_llama_server.py (no build, no model).

    python -m benchmarks.llama_stub -m GGUF -np C -c CTX -t N -tb N --host 127.0.0.1 --port P --tokenizer MODEL
        [--chat-template-file FILE]

It takes llama-server's command line (only --host, --port and -np matter) and answers the way llama-server b11434
does (read from its tools/server/server-task.cpp): GET /health is 503 {"error": ...} for `--load-s` seconds, then
200 {"status": "ok"}; POST /v1/chat/completions and /v1/completions stream Server-Sent Events with one token per
chunk (chat: a first delta with the role, then delta.content per token; completions: choices[0].text per token),
then a chunk with finish_reason, usage {prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens} and
timings {cache_n, prompt_n, predicted_n}, then [DONE]. Non-streamed requests get a 400.

The prompt is tokenized with MODEL's tokenizer (for chat: the chat template, FILE's in its place when given, as
llama-server's --chat-template-file). The reply is a fixed sentence's tokens,
repeated up to n_predict (else max_tokens, default 16) tokens, `--token-delay-s` apart, finish_reason "length".
cache_n is the longest common prefix of the prompt with an earlier request's prompt + reply tokens, at most
prompt length - 1 (as a llama.cpp slot keeps its last sequence).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REPLY = "The reading room is open from nine to eight on weekdays, and the desk can help you find a book."


class Stub:
    """The stub's state: tokenizer, the sequences seen (for cache_n), when it becomes healthy."""

    def __init__(self, tokenizer: Any, load_s: float, token_delay_s: float) -> None:
        self.tokenizer = tokenizer
        self.token_delay_s = token_delay_s
        self.healthy_at = time.monotonic() + load_s
        self.reply_ids: list[int] = tokenizer.encode(REPLY, add_special_tokens=False)
        self.seen: list[list[int]] = []
        self.lock = threading.Lock()

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids: the chat template of body["messages"], or body["prompt"] (text or ids)."""
        from runtime.text.prompt import apply_chat_template

        if path.endswith("/chat/completions"):
            return apply_chat_template(self.tokenizer, body["messages"])
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt, add_special_tokens=False)

    def answer(self, prompt: list[int], n: int) -> tuple[list[int], int]:
        """(reply ids, cache_n) of one request; remembers prompt + reply for the next ones."""
        reply = (self.reply_ids * (n // len(self.reply_ids) + 1))[:n]
        with self.lock:
            cached = max((_common_prefix(prompt, s) for s in self.seen), default=0)
            self.seen.append(prompt + reply)
        return reply, min(cached, len(prompt) - 1)

    def events(self, path: str, body: dict[str, Any]) -> Any:
        """The SSE payloads (dicts, then the string "[DONE]") of one streamed request, yielded as they are due."""
        chat = path.endswith("/chat/completions")
        prompt = self.prompt_ids(path, body)
        n = int(body.get("n_predict", body.get("max_tokens", 16)))
        reply, cached = self.answer(prompt, n)
        head = {
            "id": "chatcmpl-stub",
            "model": body.get("model", "stub"),
            "created": int(time.time()),
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        if chat:
            yield {
                **head,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}],
            }
        for token in reply:
            time.sleep(self.token_delay_s)
            text = self.tokenizer.decode([token])
            part = {"delta": {"content": text}} if chat else {"text": text}
            yield {**head, "choices": [{"index": 0, **part, "finish_reason": None}]}
        usage = {
            "completion_tokens": len(reply),
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        timings = {"cache_n": cached, "prompt_n": len(prompt) - cached, "predicted_n": len(reply)}
        if chat:
            yield {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            yield {**head, "choices": [], "usage": usage, "timings": timings}
        else:
            yield {
                **head,
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                "usage": usage,
                "timings": timings,
            }
        yield "[DONE]"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def make_handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    """The request handler class serving stub."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _json(self, status: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/health":
                self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
            elif time.monotonic() < stub.healthy_at:
                self._json(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            else:
                self._json(200, {"status": "ok"})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
                return
            if not body.get("stream"):
                self._json(400, {"error": {"code": 400, "message": "the stub streams only"}})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for event in stub.events(self.path, body):
                payload = event if isinstance(event, str) else json.dumps(event)
                self.wfile.write(f"data: {payload}\n\n".encode())
                self.wfile.flush()
            self.close_connection = True

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    spec = ("--spec-type", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m", "--spec-draft-n-max")
    for flag in ("-m", "-np", "-c", "-t", "-tb", *spec):
        parser.add_argument(flag)  # llama-server's flags, accepted and ignored
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokenizer", required=True, help="model whose tokenizer counts tokens (runtime.model)")
    parser.add_argument("--chat-template-file", help="a Jinja chat template in place of the model's")
    parser.add_argument("--load-s", type=float, default=0.3, help="seconds /health answers 503")
    parser.add_argument("--token-delay-s", type=float, default=0.002, help="seconds between streamed tokens")
    ns = parser.parse_args(argv)
    from runtime.model.loader import load_tokenizer
    from runtime.text.chat_templates import override_chat_template

    tokenizer = override_chat_template(load_tokenizer(ns.tokenizer), ns.chat_template_file)
    stub = Stub(tokenizer, ns.load_s, ns.token_delay_s)
    server = ThreadingHTTPServer((ns.host, ns.port), make_handler(stub))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
