"""Structured outputs: a grammar per request, enforced by a token bitmask in the batched sampler.

``params`` says what the output must match (vLLM's ``StructuredOutputsParams``: a JSON schema, any JSON
object, a regex, a choice of strings, an EBNF grammar); ``schema_check`` refuses the JSON schema keywords
(and regex constructs) the grammar would not enforce; ``compiler`` compiles a constraint once per distinct
constraint, with xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models", MLSys 2025), in a worker process killed at its deadline (``compile_worker``) while the thread that adds the
request waits; ``grammar`` follows one completion's tokens and masks what may come next.
"""

from backend.structured_output.compiler import GrammarCompiler
from backend.structured_output.grammar import Grammar, apply_grammar_bitmask
from backend.structured_output.params import StructuredOutputsParams
from backend.structured_output.schema_check import SchemaLimits, check_json_schema, check_regex

__all__ = ["Grammar", "GrammarCompiler", "SchemaLimits", "StructuredOutputsParams", "apply_grammar_bitmask",
           "check_json_schema", "check_regex"]
