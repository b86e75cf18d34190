"""The tokenizer process: the public ZeroMQ endpoint, prompt preparation off the loop, and the text path around the
scheduler's token outputs.

process.py  the process entry (load the tokenizer, wait for the scheduler, bind, serve)
loop.py     the poll loop and its guarded steps (no input can end it)
server.py   TokenizerServer: the handlers, composed of the parts below
in_flight.py  what is in flight: generate requests and control requests, under internal rids
prompt_prep.py  the prompt path of a request (prechecks, template, tokenize, the prompt check)
text_requests.py  the answers to tokenize and detokenize requests (shared with the router)
prompt_worker.py  the one tokenizing thread
frontend.py  ClientFrontend: replies and heartbeats to client identities (shared with the router)
"""
