"""KV events in vLLM's wire format (``--kv-events-config``): the config (config.py), the messages (wire.py) and the
scheduler process's publisher (publisher.py)."""
