"""Do two chat servers see the same tokens? One fixed chat (every role a template renders) is sent to each server
with max_tokens 1; its usage.prompt_tokens is compared with our tokenizer's count under the same chat template.
benchmarks/vs_llama_server.py runs it on radixserve and llama-server given one template file."""

from __future__ import annotations

from typing import Any

from benchmarks.chat.openai_client import openai_request
from benchmarks.chat.workload import ChatWorkload
from runtime.text.prompt import apply_chat_template

ASSISTANT_TURN = "The reading room is open from nine to eight on weekdays."


def probe_chat(wl: ChatWorkload) -> list[dict[str, str]]:
    """The probe: the workload's system prompt, its first and its last user turn, a fixed assistant turn between."""
    return [
        {"role": "system", "content": wl.system_prompt},
        {"role": "user", "content": wl.user_turns[0][0]},
        {"role": "assistant", "content": ASSISTANT_TURN},
        {"role": "user", "content": wl.user_turns[-1][-1]},
    ]


def server_prompt_tokens(url: str, model: str, wl: ChatWorkload) -> int | None:
    """The server's usage.prompt_tokens for probe_chat(wl) (one streamed chat request, max_tokens 1); None when its
    answer has no usage. Raises BenchmarkError on a non-200 answer."""
    return openai_request(url, model, probe_chat(wl), max_tokens=1).prompt_tokens


def prompt_tokens_check(server_counts: dict[str, int | None], tokenizer: Any, wl: ChatWorkload) -> dict[str, Any]:
    """{"tokenizer": our count of probe_chat(wl) (apply_chat_template with tokenizer's template), each server's
    count by name, "agree": all equal}."""
    counts: dict[str, int | None] = {"tokenizer": len(apply_chat_template(tokenizer, probe_chat(wl)))}
    counts.update(server_counts)
    return {**counts, "agree": len(set(counts.values())) == 1}
