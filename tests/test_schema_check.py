"""The JSON schema checker: each refused keyword names itself and its path, enforced schemas pass, bounds hold,
the docs' keyword table is the checker's own, and what it refuses the grammar really does not enforce."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest

from backend.structured_output.schema_check import (ANNOTATION, ENFORCED, KEYWORDS, REFUSED, SchemaLimits,
                                                    check_json_schema, check_regex, keyword_table_markdown,
                                                    with_ecma_dot)
from test_schema_enforcement import ENFORCED_CASES

INT = {"type": "integer"}
OBJ = {"type": "object", "properties": {"a": INT, "b": INT}}

# (schema, keyword named in the refusal, its path)
REFUSED_CASES = [
    ({"type": "integer", "not": {"const": 1}}, "not", "$"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "if", "$"),
    ({"type": "object", "properties": {"x": {"type": "integer", "else": {}}}}, "else", "$.properties.x"),
    ({"type": "array", "items": INT, "contains": {"const": 7}}, "contains", "$"),
    ({"type": "array", "items": INT, "minContains": 2}, "minContains", "$"),
    ({"type": "array", "items": {"type": "array", "items": INT, "uniqueItems": True}}, "uniqueItems", "$.items"),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, "dependentRequired", "$"),
    ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "$"),
    ({**OBJ, "dependencies": {"a": ["b"]}}, "dependencies", "$"),
    ({"type": "array", "items": [INT], "additionalItems": False}, "additionalItems", "$"),
    ({"type": "array", "items": [INT]}, "items", "$"),
    ({"type": "number", "multipleOf": 0.25}, "multipleOf", "$"),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf", "$"),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]}, "allOf", "$"),
    ({"oneOf": [{"type": "integer", "maximum": 10}, {"type": "integer", "minimum": 5}]}, "oneOf", "$"),
    ({"type": "integer", "anyOf": [{"type": "integer", "maximum": 5}]}, "type", "$"),
    ({"$defs": {"s": {"type": "string"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 2}}}, "maxLength", "$.properties.a"),
    ({"$ref": "https://example.com/s.json"}, "$ref", "$"),
    ({"$defs": {"x": {"$anchor": "x", "type": "integer"}}, "$ref": "#/$defs/x"}, "$anchor", "$.$defs.x"),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#x"}, "$ref", "$"),
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}, "pattern", "$"),
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern", "$"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", "$"),
    ({"type": "string", "format": "uri", "pattern": "^https://"}, "pattern", "$"),
    ({"type": "object", "properties": {"e": {"type": ["string", "null"], "format": "email", "maxLength": 6}}},
     "maxLength", "$.properties.e"),
    ({"type": "array", "items": {"type": "string", "format": "uuid", "minLength": 40}}, "minLength", "$.items"),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "date"}}}, "format",
     "$.properties.when"),
    ({"type": "string", "format": "ipv4"}, "format", "$"),
    ({"type": "string", "format": "hostname"}, "format", "$"),
    ({"type": "string", "format": "sparkly"}, "format", "$"),
    ({"type": "integer", "format": "int32"}, "format", "$"),
    ({"type": "object", "properties": {"a": INT}, "required": ["zz"]}, "required", "$"),
    ({"minimum": 5}, "minimum", "$"),
    ({"maxLength": 5}, "maxLength", "$"),
    ({"type": "string", "enum": ["a", "abc"], "maxLength": 2}, "maxLength", "$"),
    ({"type": "string", "enum": ["a", 1]}, "enum", "$"),
    ({"type": "string", "const": 1}, "const", "$"),
    ({"type": "object", "properties": {"long": INT}, "propertyNames": {"type": "string", "maxLength": 2}},
     "propertyNames", "$"),
    ({"type": "object", "patternProperties": {"^(?!x)": INT}}, "patternProperties", "$"),
    # A key two schemas match, or one written twice, is not told apart by the grammar.
    ({"type": "object", "patternProperties": {"^a": INT, "^[a-z]+$": {"type": "string"}}}, "patternProperties", "$"),
    ({"type": "object", "patternProperties": {"^n": INT}, "additionalProperties": {"type": "string"}},
     "patternProperties", "$"),
    ({"type": "object", "properties": {"x1": {"type": "string"}}, "patternProperties": {"^x[0-9]$": INT},
      "additionalProperties": False}, "patternProperties", "$"),
    ({"type": "object", "additionalProperties": INT, "minProperties": 2}, "minProperties", "$"),
    ({"type": "object", "unevaluatedProperties": INT, "maxProperties": 2}, "maxProperties", "$"),
    # An extra key may spell a listed name with escapes ("\u0061" for "a"): the grammar does not tell them apart.
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": True}, "additionalProperties", "$"),
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": {"type": "string"}},
     "additionalProperties", "$"),
    ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": True}, "unevaluatedProperties", "$"),
    # The grammar writes a character it names alone into the string unescaped.
    *[({"type": "string", "pattern": pattern}, "pattern", "$") for pattern in (
        '^say "hi"$', "^line1\\nline2$", "^\\t$", "^a\\\\b$", "^[A-Z]:\\\\[a-z]+$", "^\\x22$", "^\\u005c$",
        "^[\\n]$", "^\x01$", "^[\\n\\t]$", '^[""]$', "^a[\\u0000-\\u0008]b$", '^[\\\\"]$')],
    ({"type": "object", "patternProperties": {'^"': INT}}, "patternProperties", "$"),
    ({"type": "object", "propertyNames": {"type": "string", "pattern": "^a\\\\"}}, "pattern", "$.propertyNames"),
    # Integer bounds are whole 64-bit numbers in the grammar.
    ({"type": "integer", "minimum": 0.5}, "minimum", "$"),
    ({"type": ["integer", "null"], "exclusiveMaximum": 9.5}, "exclusiveMaximum", "$"),
    ({"type": "integer", "maximum": 2**63}, "maximum", "$"),
    ({"type": "integer", "minimum": -1e30}, "minimum", "$"),
    ({"type": "integer", "minimum": 10**400}, "minimum", "$"),  # beyond a float: no OverflowError
    ({"type": "object", "patternProperties": {"^[a-c]$": INT}, "minProperties": 3}, "minProperties", "$"),
    ({"type": "object", "propertyNames": {"type": "string", "maxLength": 2}, "minProperties": 1},
     "minProperties", "$"),
    ({"type": "integer", "nullable": True}, "nullable", "$"),
    ({"type": "integer", "minimum": 1, "exclusiveMinimum": True}, "exclusiveMinimum", "$"),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "$"),
    ({"type": "object", "properties": {"a b": {"type": "string", "maxlength": 3}}}, "maxlength", '$.properties["a b"]'),
    ({"$defs": {"d": {"$id": "https://example.com/d", "type": "integer"}}, "$ref": "#/$defs/d"}, "$id", "$.$defs.d"),
    ({"type": "thing"}, "type", "$"),
    ({"anyOf": [INT, {"type": "array", "prefixItems": [{"type": "string", "format": "time"}]}]}, "format",
     "$.anyOf[1].prefixItems[0]"),
    ({"definitions": {"n": {"type": "object", "additionalProperties": {"type": "number", "multipleOf": 2}}},
      "$ref": "#/definitions/n"}, "multipleOf", "$.definitions.n.additionalProperties"),
]


@pytest.mark.parametrize("schema, keyword, path", REFUSED_CASES, ids=[f"{k}@{p}" for _, k, p in REFUSED_CASES])
def test_refused_keyword_is_named_with_its_path(schema, keyword, path):
    with pytest.raises(ValueError) as refused:
        check_json_schema(json.dumps(schema))
    assert str(refused.value).startswith(f"{keyword} at {path}: "), str(refused.value)


ALLOWED = [
    True,
    {"type": "object", "title": "Person", "description": "d", "$schema": "https://json-schema.org/draft/2020-12/schema",
     "$id": "https://example.com/person", "$comment": "c", "examples": [{}], "default": {}, "deprecated": False,
     "properties": {"name": {"type": "string", "readOnly": True, "writeOnly": False, "maxLength": 10},
                    "age": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": None}},
     "required": ["name"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+(?:-[a-z]+)*$"}, "uniqueItems": False},
    {"oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}], "discriminator": {"propertyName": "kind"},
     "$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
               "dog": {"type": "object", "properties": {"kind": {"enum": ["dog", "puppy"]}}, "required": ["kind"]}}},
    {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
    {"type": ["string", "null"], "format": "email"},
    {"enum": ["a", 1, None]},
    # A range, a negated class or a class of several members keeps '"', '\\' and control characters out.
    {"type": "string", "pattern": '^[^"\\\\]+$'},
    {"type": "string", "pattern": '^[a"\\n]$'},
    {"type": "string", "pattern": "^[\\x1f-\\x22\\d]$"},
    {"type": "string", "pattern": "^[ -~]+\\.$"},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1.0, "maximum": 2**63 - 1}},
     "additionalProperties": False},
    {"type": "object", "additionalProperties": {"type": "number", "minimum": 0.5}},
]


@pytest.mark.parametrize("schema", ALLOWED)
def test_enforced_and_annotation_keywords_pass(schema):
    assert check_json_schema(json.dumps(schema)) == schema


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "minLength": -1}, "at $.minLength: -1 is less than the minimum of 0"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": -3}, "at $.minItems: -3 is less than"),
    ({"type": "object", "$schema": 5}, "at $.$schema: 5 is not a URI string"),
    ({"type": "object", "$schema": [1]}, "at $.$schema: [1] is not a URI string"),
    ({"type": "array", "items": {"type": "string", "maxLength": 2.5}}, "at $.items.maxLength: 2.5 is not"),
])
def test_a_document_that_is_not_a_schema_is_refused_naming_where(schema, message):
    """xgrammar answers some of these with its C++ source line, and reads others its own way."""
    with pytest.raises(ValueError, match="^not a valid JSON schema ") as refused:
        check_json_schema(json.dumps(schema))
    assert message in str(refused.value)


@pytest.mark.parametrize("text", ["ab\n{\n b", "ab\r123b", "ab\u2028123b"])
def test_a_raw_regex_dot_matches_no_line_terminator(text):
    """ECMA-262's (and Python's) '.'; xgrammar's own matches them all."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    assert _is_grammar_accept_string(Grammar.from_regex("a.{5}b"), text)  # why the rewrite is needed
    assert not _is_grammar_accept_string(Grammar.from_regex(with_ecma_dot("a.{5}b")), text)
    assert _is_grammar_accept_string(Grammar.from_regex(with_ecma_dot("a.{5}b")), "a\u00e9 x\"\\b")
    assert with_ecma_dot(r"[.]\.x") == r"[.]\.x"


@pytest.mark.parametrize("keywords, schema", ENFORCED_CASES, ids=[k for k, _ in ENFORCED_CASES])
def test_every_sampled_schema_passes_the_checker(keywords, schema):
    check_json_schema(json.dumps(schema))


def test_every_enforced_keyword_is_sampled_through_the_engine():
    sampled = set()

    def collect(node):
        if isinstance(node, dict):
            sampled.update(k for k in node if k in KEYWORDS)
            for key, value in node.items():
                if key not in ("properties", "patternProperties", "$defs", "definitions", "const", "enum"):
                    collect(value)
                elif key != "const" and key != "enum":
                    for sub in value.values():
                        collect(sub)
        elif isinstance(node, list):
            for item in node:
                collect(item)

    for _, schema in ENFORCED_CASES:
        collect(schema)
    enforced = {k for k, (status, _) in KEYWORDS.items() if status == ENFORCED}
    assert enforced - sampled == set()


@pytest.mark.parametrize("pattern, construct", [
    ("a(?<=b)", "lookbehind"), ("(?!a)b", "lookahead"), ("(?P<x>a)", "named group"), ("(?i)a", "group modifier"),
    ("\\bword", "word boundary"), ("(a)\\1", "backreference"), ("\\p{L}", "Unicode property"), ("a++", "possessive"),
    ("a{", "not a quantifier"), ("a^b", "'^'"), ("a$b", "'$'"), ("[]a]", "empty class"), ("[a", "not closed"),
    ("\\q", "escape"), ("*a", "nothing to repeat")])
def test_regex_constructs_the_grammar_does_not_honour_are_refused(pattern, construct):
    with pytest.raises(ValueError, match=re.escape(construct)):
        check_regex(pattern)


@pytest.mark.parametrize("pattern", ["^[A-Z]{2}-\\d{3}$", "a+?b|c*", "(?:ab){1,3}", "[^\\]\\-a-z]\\.\\u00e9\\x41",
                                     "^\\s\\S\\w\\W\\d\\D$", "^$", "(a|b)?c"])
def test_ecma_regex_subset_passes(pattern):
    check_regex(pattern)


def test_bounds_refuse_huge_deep_and_keyword_heavy_schemas_quickly():
    start = time.monotonic()
    deep = '{"type": "array", "items": ' * 2000 + '{"type": "integer"}' + "}" * 2000
    with pytest.raises(ValueError, match="nests deeper than 32"):
        check_json_schema(deep)
    wide = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer", "minimum": 0}
                                                        for i in range(1100)}})
    with pytest.raises(ValueError, match="over 2048 keywords"):
        check_json_schema(wide)
    with pytest.raises(ValueError, match="bytes; at most 1000"):
        check_json_schema(wide, SchemaLimits(max_bytes=1000))
    with pytest.raises(ValueError, match="nests deeper than 3"):
        check_json_schema(json.dumps({"type": "object", "properties": {"a": {"type": "array", "items": INT}}}),
                          SchemaLimits(max_depth=3))
    assert time.monotonic() - start < 2.0


def test_docs_keyword_table_is_the_checkers_own():
    docs = (Path(__file__).parent.parent / "docs" / "openai.md").read_text()
    assert keyword_table_markdown() in docs, ("paste into docs/openai.md the output of: python -c 'from backend.structured_output.schema_check "
                                        "import keyword_table_markdown as t; print(t())'")
    statuses = {status for status, _ in KEYWORDS.values()}
    assert statuses == {ENFORCED, REFUSED, ANNOTATION}


# A refused keyword the grammar ignores: compiled without the checker, the grammar accepts a document
# jsonschema rejects. When a new xgrammar starts enforcing one, this fails: move it to the enforced side.
IGNORED_BY_THE_GRAMMAR = [
    ({"type": "integer", "minimum": 0, "maximum": 3, "not": {"const": 1}}, 1),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}, "else": {"maximum": 2}}, 9),
    ({"type": "array", "items": INT, "contains": {"const": 7}}, [1]),
    ({"type": "array", "items": INT, "uniqueItems": True}, [1, 1]),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    ({"type": "number", "multipleOf": 0.25}, 0.3),
    ({"allOf": [{"type": "integer", "minimum": 0, "maximum": 20}, {"type": "integer", "minimum": 10}]}, 5),
    ({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "integer", "minimum": 5}]}, 7),
    ({"type": "integer", "minimum": 0, "anyOf": [{"type": "integer", "maximum": 5}]}, -3),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "abcd"),
    ({"type": "string", "pattern": "^(?=a)[ab]$"}, "b"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "aaaa"),
    ({"type": "string", "format": "uri", "pattern": "^https://"}, "http://a.b"),
    ({"type": "string", "format": "email", "maxLength": 6}, "abcdef@example.com"),
    ({"type": "string", "format": "email", "minLength": 30}, "a@b.co"),
    ({"type": "string", "format": "date"}, "2023-02-29"),
    ({"type": "string", "format": "date-time"}, "2024-02-30T00:00:00Z"),
    ({"type": "string", "format": "ipv4"}, "01.2.3.4"),
    ({"type": "string", "format": "hostname"}, "a" * 64 + ".com"),
    ({"type": "string", "format": "regex"}, "(("),
    ({"type": "object", "properties": {"a": INT}, "required": ["zz"]}, {"a": 1}),
    ({"minimum": 5}, 4),
    ({"type": "string", "enum": ["a", "abc"], "maxLength": 2}, "abc"),
    ({"type": "object", "properties": {"long": INT}, "propertyNames": {"maxLength": 2}}, {"long": 1}),
]


@pytest.fixture(scope="module")
def xgrammar_compiler(tokenizer):
    import xgrammar

    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer), max_threads=1)


@pytest.mark.parametrize("schema, invalid", IGNORED_BY_THE_GRAMMAR, ids=[str(i) for i in range(len(IGNORED_BY_THE_GRAMMAR))])
def test_refused_keywords_are_really_ignored_by_the_grammar(xgrammar_compiler, tokenizer, schema, invalid):
    import xgrammar

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(invalid, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    with pytest.raises(ValueError):
        check_json_schema(json.dumps(schema))
    compiled = xgrammar_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string(json.dumps(invalid)) and matcher.accept_token(tokenizer.eos_token_id)
