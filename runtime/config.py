"""ServerArgs: the one typed config. The launch script's flags and the Engine's keyword arguments come from it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from runtime.speculative import InvalidSpeculativeConfig, parse_speculative_config

MIN_USABLE_BLOCKS = 4  # a pool with fewer usable KV blocks (block 0 excluded) is refused at start-up


class InvalidConfig(ValueError):
    """A ServerArgs field is out of range; the message names the field."""


# decode steps per scheduler step by default (num_scheduler_steps None): README "Multi-step decoding"
DEFAULT_SCHEDULER_STEPS = 4


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ServerArgs:
    """Every setting of a server or an Engine. Units are in the field names or the help text.

    Raises:
        InvalidConfig: from validate() (called at construction) for out-of-range values.
    """

    model: str = _opt("smollm2", "model: 'smollm2' (embedded), a Hugging Face folder, or a .gguf file")
    device: str = _opt("cpu", "torch device: cpu or cuda[:N]")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto",
        "weights, activations and KV cache dtype; auto: bfloat16 on CUDA and on CPUs with native bfloat16 "
        "dot products (AMX-BF16 or AVX512-BF16), float32 on other CPUs (runtime.model.cpu_features)",
    )
    quantization: Literal["auto", "none", "int8", "int4"] = _opt(
        "auto",
        "weight-only quantization of the linear layers on CPU, used for steps of few rows (where reading the "
        "weights bounds the step): auto (each linear keeps its file's precision: GGUF tensors stored in 4 bits run "
        "int4, in 5-8 bits int8, float weights none; none off the CPU; runtime.model.quant_plan); none; int8 (per "
        "output channel); int4 (groups of 32 along K, the lm_head int8); runtime.model.quant",
    )
    block_size: int = _opt(16, "tokens per KV block")
    kv_cache_memory: int = _opt(256 * 2**20, "bytes of KV cache on CPU (on CUDA see gpu_memory_utilization)")
    gpu_memory_utilization: float = _opt(0.85, "on CUDA: fraction of free device memory given to the KV cache")
    num_blocks: int | None = _opt(None, "KV blocks (including the null block 0); overrides the memory budget")
    num_host_blocks: int = _opt(0, "host-memory KV blocks for preemption by swapping (0: no swap pool)")
    host_cache_memory: int = _opt(
        0,
        "bytes of host memory for the prefix cache's host tier: blocks evicted from the "
        "KV pool are written there and loaded back on a hit (0: no tier; a pool apart "
        "from the swap pool of num_host_blocks)",
    )
    num_host_cache_blocks: int | None = _opt(None, "host-tier KV blocks; overrides host_cache_memory (0: no tier)")
    max_model_len: int | None = _opt(None, "context limit in tokens (None: the model's)")
    attention_backend: Literal["auto", "reference", "triton"] = _opt(
        "auto", "paged attention backend: auto (triton on CUDA, reference on CPU), reference or triton"
    )
    enable_prefix_caching: bool = _opt(True, "keep full blocks in the radix tree and reuse them across requests")
    max_running_requests: int = _opt(64, "sequences decoded together at most")
    max_prefill_tokens: int = _opt(2048, "prompt tokens computed per step at most (the step's token budget)")
    chunked_prefill_size: int = _opt(512, "longest prefill chunk of one request in one step (tokens)")
    schedule_policy: Literal["fcfs", "lpm"] = _opt("fcfs", "waiting queue order: fcfs or lpm (longest cached prefix)")
    preemption_mode: Literal["recompute", "swap"] = _opt("recompute", "when no block can be freed: recompute or swap")
    host: str = _opt("127.0.0.1", "address the public endpoint binds to")
    port: int = _opt(5557, "TCP port of the public endpoint")
    http_port: int | None = _opt(
        None, "serve the OpenAI HTTP API on host:http_port too (None: no HTTP server; 0: a free port)"
    )
    api_key: str | None = _opt(
        None,
        "the key HTTP clients must send as 'Authorization: Bearer KEY' (None: the "
        "RADIXSERVE_API_KEY environment variable, else no key)",
    )
    served_model_name: str | None = _opt(None, "the model name the HTTP API lists and accepts (None: model)")
    allowed_origins: str | None = _opt(
        None,
        "origins the HTTP API allows cross-origin requests from (CORS), comma-separated, '*' for any (None: no CORS)",
    )
    max_queued_requests: int | None = _opt(
        None,
        "HTTP requests that may wait for a running slot beyond max_running_requests; one more is answered 429 "
        "with Retry-After at once (None: no limit)",
    )
    shutdown_timeout: float = _opt(
        30.0, "seconds a SIGTERM gives the HTTP requests in flight to finish (new ones get 503) before the server stops"
    )
    events_port: int | None = _opt(
        None,
        "TCP port of the scheduler's KV events / stats PUB socket, bound on host "
        "beside the public endpoint for routers (None: ipc only; 0: a free port)",
    )
    chat_template: str | None = _opt(
        None,
        "a Jinja chat template file rendering chats instead of the model's own (vLLM's --chat-template; "
        "runtime/text/templates/chatml_tools.jinja is the shipped ChatML tool template)",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] = _opt(
        "hermes",
        "how the HTTP server reads tool calls in what the model writes (runtime/text/tool_parsers): hermes "
        "(<tool_call>{...}</tool_call>, the shipped ChatML tool template's format) or llama3_json",
    )
    seed: int = _opt(0, "seed of the server's own randomness (requests without a seed)")
    max_message_bytes: int = _opt(8 * 2**20, "largest client message accepted (bytes)")
    max_prompt_chars: int | None = _opt(
        None,
        "longest prompt text (all chat messages together) accepted, in "
        "characters, checked before tokenizing (None: 32 x max_model_len)",
    )
    log_interval_s: float = _opt(5.0, "seconds between stats log lines")
    worker_probe_timeout_s: float = _opt(
        5.0,
        "seconds a health check waits for the worker's answer (it queues "
        "behind the step in flight) before it reports 'worker unresponsive'",
    )
    control_timeout_s: float = _opt(
        10.0,
        "seconds the tokenizer waits for the scheduler's answer to a health, "
        "stats or KV snapshot request before it answers ERR_SERVER",
    )
    # kvevents (issue 27): KV events in vLLM's format, data parallelism
    kv_events_config: str | None = _opt(
        None,
        'vLLM\'s KVEventsConfig as JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"topic": "kv-events"}\': the scheduler also publishes its KV events in vLLM\'s wire format (a tcp '
        "wildcard binds --host; runtime/serve/vllm_events) (None: not published)",
    )
    data_parallel_size: int = _opt(
        1,
        "replicas of the whole server behind the cache-aware router, started by `radixserve` (python -m "
        "runtime.launch) with one endpoint for all (router/launch.py)",
    )
    data_parallel_rank: int = _opt(
        0, "this replica's rank among data_parallel_size, set per replica by the launcher (its KV events' rank, port)"
    )
    # tensor parallelism (issue 27; runtime/model/parallel/, runtime/serve/worker_rank.py)
    tensor_parallel_size: int = _opt(
        1,
        "worker ranks the model is sharded over (Megatron-style, one device each: NCCL on CUDA, gloo on CPU)",
        alias="-tp",
    )
    nnodes: int = _opt(
        1, "nodes the tensor-parallel ranks span (torchrun's --nnodes); tensor_parallel_size / nnodes per node"
    )
    node_rank: int = _opt(0, "this node's index (torchrun's --node-rank): 0 runs the scheduler and tokenizer too")
    master_addr: str = _opt("127.0.0.1", "address of node 0, where rank 0 hosts the process group's store (torchrun's)")
    master_port: int | None = _opt(None, "TCP port of that store (torchrun's; None: a free port, single node only)")
    tp_timeout_s: float = _opt(
        60.0, "seconds a rank waits in a collective (or idle for rank 0's next step) before it fails the worker"
    )

    # hybrid KV memory: a sliding-window KV cache group (radix/hybrid_manager.py, runtime/model/hybrid_kv.py)
    kv_groups: Literal["single", "auto"] = _opt(
        "auto",
        "KV cache groups: auto (a model with sliding-window layers of one window keeps only their window, in a second "
        "pool; any other model one group) or single (every layer keeps its whole KV)",
    )
    window_blocks_ratio: float = _opt(
        0.25, "with kv_groups auto: sliding-window blocks per full-attention block when sizing from the memory budget"
    )
    num_window_blocks: int | None = _opt(
        None, "with kv_groups auto: sliding-window blocks (null block included); overrides window_blocks_ratio"
    )

    # speculative decoding (issue 26): runtime/speculative.py parses it, runtime/scheduler/speculation.py uses it
    speculative_config: str | None = _opt(
        None,
        'speculative decoding as JSON in vLLM\'s names, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt lookup; optional "disable_by_batch_size": N), or '
        '{"method": "draft_model", "model": M, "num_speculative_tokens": 4} (a draft model M); None: off',
    )

    # multi-step decoding: runtime/scheduler/speculation.py reserves the slots, runtime/model/multi_step.py runs them
    num_scheduler_steps: int | None = _opt(
        None,
        "decode steps the worker runs per scheduler step while every running sequence decodes and none waits, each "
        "fed the token the last one sampled (vLLM's multi-step scheduling: one message round trip per N tokens; a "
        f"sequence that stops inside the run wastes at most N - 1 forwards); 1: off; None: {DEFAULT_SCHEDULER_STEPS}, "
        "or 1 with speculative_config or tensor_parallel_size > 1",
    )

    def scheduler_steps(self) -> int:
        """num_scheduler_steps resolved: the value set, else DEFAULT_SCHEDULER_STEPS, or 1 where speculative decoding
        or tensor parallelism is on (neither runs multi-step)."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        if self.speculative_config is not None or self.tensor_parallel_size > 1:
            return 1
        return DEFAULT_SCHEDULER_STEPS

    def _validate_parallel(self) -> None:
        checks = [
            ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
            (
                "nnodes",
                self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0,
                "a divisor of tensor_parallel_size",
            ),
            ("node_rank", 0 <= self.node_rank < self.nnodes, "in [0, nnodes)"),
            ("master_port", self.master_port is not None or self.nnodes == 1, "set when nnodes > 1"),
            ("master_port", self.master_port is None or 0 < self.master_port < 65536, "None or in (0, 65536)"),
            ("tp_timeout_s", self.tp_timeout_s > 0, "> 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise InvalidConfig(f"{name} must be {rule}, got {getattr(self, name)!r}")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check ranges; raises InvalidConfig naming the field."""
        checks = [
            ("block_size", self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "a power of two"),
            ("kv_cache_memory", self.kv_cache_memory > 0, "> 0"),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "in (0, 1]"),
            (
                "num_blocks",
                self.num_blocks is None or self.num_blocks >= MIN_USABLE_BLOCKS + 1,
                f">= {MIN_USABLE_BLOCKS + 1} (block 0 is reserved; at least {MIN_USABLE_BLOCKS} usable blocks)",
            ),
            ("num_host_blocks", self.num_host_blocks >= 0, ">= 0"),
            ("host_cache_memory", self.host_cache_memory >= 0, ">= 0"),
            (
                "num_host_cache_blocks",
                self.num_host_cache_blocks is None or self.num_host_cache_blocks >= 0,
                "None or >= 0",
            ),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, ">= 1"),
            ("max_running_requests", self.max_running_requests >= 1, ">= 1"),
            ("max_prefill_tokens", self.max_prefill_tokens >= 1, ">= 1"),
            ("chunked_prefill_size", self.chunked_prefill_size >= 1, ">= 1"),
            ("port", 0 <= self.port < 65536, "in [0, 65536)"),
            ("events_port", self.events_port is None or 0 <= self.events_port < 65536, "None or in [0, 65536)"),
            ("http_port", self.http_port is None or 0 <= self.http_port < 65536, "None or in [0, 65536)"),
            ("api_key", self.api_key is None or self.api_key.strip() != "", "None or a non-empty string"),
            (
                "served_model_name",
                self.served_model_name is None or self.served_model_name != "",
                "None or a non-empty string",
            ),
            ("max_message_bytes", self.max_message_bytes >= 1024, ">= 1024"),
            ("max_queued_requests", self.max_queued_requests is None or self.max_queued_requests >= 0, "None or >= 0"),
            ("shutdown_timeout", self.shutdown_timeout >= 0, ">= 0"),
            ("allowed_origins", self.allowed_origins is None or self.allowed_origins.strip() != "", "None or origins"),
            ("worker_probe_timeout_s", self.worker_probe_timeout_s > 0, "> 0"),
            ("control_timeout_s", self.control_timeout_s > self.worker_probe_timeout_s, "> worker_probe_timeout_s"),
            ("max_prompt_chars", self.max_prompt_chars is None or self.max_prompt_chars >= 1, "None or >= 1"),
            ("window_blocks_ratio", 0.0 < self.window_blocks_ratio <= 1.0, "in (0, 1]"),
            ("num_window_blocks", self.num_window_blocks is None or self.num_window_blocks >= 2, "None or >= 2"),
        ]
        checks.append(("data_parallel_size", self.data_parallel_size >= 1, ">= 1"))
        checks.append(
            ("data_parallel_rank", 0 <= self.data_parallel_rank < self.data_parallel_size, "in [0, data_parallel_size)")
        )
        for name, ok, rule in checks:
            if not ok:
                raise InvalidConfig(f"{name} must be {rule}, got {getattr(self, name)!r}")
        if self.kv_events_config is not None:
            from runtime.serve.vllm_events.config import parse_kv_events_config

            try:
                parse_kv_events_config(self.kv_events_config)
            except ValueError as exc:
                raise InvalidConfig(str(exc)) from None
        if self.attention_backend == "triton" and self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise InvalidConfig("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 for debugging)")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise InvalidConfig(f"chat_template must be a readable file, got {self.chat_template!r}")
        try:
            parse_speculative_config(self.speculative_config)
        except InvalidSpeculativeConfig as e:
            raise InvalidConfig(str(e)) from e
        steps = self.num_scheduler_steps
        if steps is not None and not 1 <= steps <= 64:
            raise InvalidConfig(f"num_scheduler_steps must be None or in [1, 64], got {steps!r}")
        if self.scheduler_steps() > 1 and self.speculative_config is not None:
            raise InvalidConfig("num_scheduler_steps > 1 and speculative_config both reserve a decode's next slots")
        if self.scheduler_steps() > 1 and self.tensor_parallel_size > 1:
            raise InvalidConfig("num_scheduler_steps > 1 runs on one rank (tensor_parallel_size 1)")
        if self.preemption_mode == "swap" and self.num_host_blocks == 0:
            raise InvalidConfig("preemption_mode 'swap' needs num_host_blocks > 0 (the host pool it swaps into)")
        self._validate_parallel()

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServerArgs:
        """Build from keyword arguments; raises InvalidConfig naming any unknown field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidConfig(f"unknown ServerArgs field(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
