"""The multi-turn chat benchmark's settings (saved with its results) and its one error type."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, cast

from benchmarks.chat.workload import ChatWorkload, build_workload


class BenchmarkError(RuntimeError):
    """A target could not be run (bad --target, a server that failed to start or answered with an error)."""


@dataclass
class Config:
    """The benchmark's settings (saved in the JSON). num_blocks: KV blocks of radixserve / engine targets."""

    model: str
    conversations: int
    turns: int
    system_prompt_tokens: int
    user_tokens: str
    max_tokens: int
    concurrency: int
    seed: int
    block_size: int
    num_blocks: int
    targets: list[str] = field(default_factory=list)
    repeats: int = 1
    dtype: str = "auto"
    quantization: str = "none"
    http_client: str = "openai"
    kv_groups: str = "single"  # our server targets' KV cache groups (ServerArgs.kv_groups)
    num_window_blocks: int | None = None  # and their sliding-window pool (ServerArgs.num_window_blocks)
    chat_template: str | None = None  # a template file for a base model (ServerArgs.chat_template)
    speculative_config: str | None = None  # our server targets' --speculative-config JSON (ServerArgs)

    @classmethod
    def from_args(cls, ns: argparse.Namespace, targets: list[str], block_size: int, **settings: Any) -> Config:
        """The workload's fields from the chat benchmarks' shared flags (ns.model, conversations, turns,
        system_prompt_tokens, user_tokens, max_tokens, concurrency, seed); num_blocks 0 (the caller sizes it);
        settings: the other fields (repeats, dtype, quantization, http_client, chat_template)."""
        return cls(
            model=ns.model,
            conversations=ns.conversations,
            turns=ns.turns,
            system_prompt_tokens=ns.system_prompt_tokens,
            user_tokens=ns.user_tokens,
            max_tokens=ns.max_tokens,
            concurrency=ns.concurrency,
            seed=ns.seed,
            block_size=block_size,
            num_blocks=0,
            targets=targets,
            **settings,
        )

    def workload(self, tokenizer: Any) -> ChatWorkload:
        """The seeded conversations these settings describe (build_workload)."""
        lo, hi = self.user_range
        return build_workload(tokenizer, self.conversations, self.turns, self.system_prompt_tokens, lo, hi, self.seed)

    def server_args(self, caching: bool = True, http: bool = False) -> Any:
        """The ServerArgs of our server targets (port 0, the HTTP server on a free port when http)."""
        from runtime.config import ServerArgs

        return ServerArgs(
            model=self.model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            port=0,
            enable_prefix_caching=caching,
            log_interval_s=3600.0,
            http_port=0 if http else None,
            dtype=cast(Any, self.dtype),
            quantization=cast(Any, self.quantization),
            kv_groups=cast(Any, self.kv_groups),
            num_window_blocks=self.num_window_blocks,
            chat_template=self.chat_template,
            speculative_config=self.speculative_config,
        )

    @property
    def user_range(self) -> tuple[int, int]:
        lo, _, hi = self.user_tokens.partition(":")
        return int(lo), int(hi or lo)
