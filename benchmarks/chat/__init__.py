"""The multi-turn chat workload and the parts of benchmarks/multi_turn_chat.py: its settings (config), the
conversations driven concurrently (drive), the in-tree targets (targets) and OpenAI-compatible servers
(openai_client), the trace and its statistics (trace), and the table and plot (report). The workload (workload) is
shared by the soak, HTTP load, host-tier, router and llama-server benchmarks."""
