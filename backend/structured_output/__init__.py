"""Structured outputs: a grammar per request, enforced by a token bitmask in the batched sampler.

``params`` says what the output must match (vLLM's ``StructuredOutputsParams``: a JSON schema, any JSON
object, a regex, a choice of strings, an EBNF grammar); ``compiler`` compiles it once per distinct
constraint, with xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models", MLSys 2025), on the thread that adds the request; ``grammar`` follows one
completion's tokens and masks what may come next.
"""

from backend.structured_output.compiler import GrammarCompiler
from backend.structured_output.grammar import Grammar, apply_grammar_bitmask
from backend.structured_output.params import StructuredOutputsParams

__all__ = ["Grammar", "GrammarCompiler", "StructuredOutputsParams", "apply_grammar_bitmask"]
