"""The server's processes: the launcher, the tokenizer / scheduler / worker loops, the client frontend."""
