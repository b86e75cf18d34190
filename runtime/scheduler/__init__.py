"""Continuous batching over the radix KV cache (pure Python, no torch): requests and sequences, admission, the step
plan, preemption, host-tier loads, finishing, n > 1 samples, beam search and the scheduler's counters.
`scheduler.Scheduler` is the entry; its module docstring maps the parts it owns."""
