"""The multi-turn chat benchmark's settings (saved with its results) and its one error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast


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
        )

    @property
    def user_range(self) -> tuple[int, int]:
        lo, _, hi = self.user_tokens.partition(":")
        return int(lo), int(hi or lo)
