"""What the load benchmarks (benchmarks/soak.py over ZeroMQ, benchmarks/http_load.py over HTTP) share: the outcome
of their clients and its checks (outcome), watching the server (probes), and http_load's idle TTFT phase."""
