"""The text path (no torch, no sockets): prompt encoding through the chat template, incremental detokenization, stop
strings, and the one CompletionStream the Engine and the tokenizer process share."""
