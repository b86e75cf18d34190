"""The tokenizer process: the public ZeroMQ endpoint, prompt preparation off the loop, and the text path around the
scheduler's token outputs."""
