"""Structured outputs in the worker: xgrammar behind one small interface.

convert.py turns a StructuredOutputs into an xgrammar Grammar (also the front door's compile check), compiler.py
compiles it for the model's vocabulary on a thread pool with a cache, state.py keeps one matcher per live sequence
and fills the step's token bitmask, bitmask.py is the sampler's stage that applies it.
"""

from runtime.model.grammar.bitmask import GrammarRows, apply_token_bitmask
from runtime.model.grammar.compiler import GrammarCache
from runtime.model.grammar.convert import to_grammar
from runtime.model.grammar.state import GrammarState

__all__ = ["GrammarCache", "GrammarRows", "GrammarState", "apply_token_bitmask", "to_grammar"]
