"""Which JSON Schema keywords the grammar enforces while sampling, and a checker that refuses the rest.

xgrammar turns a schema into a grammar, but it silently drops what it cannot express (``uniqueItems``,
``not``, ``if``/``then``/``else``, ``contains``, lookahead in ``pattern``, the siblings of ``anyOf`` or
``$ref``, ...): the output would then not match the schema the request asked for. :func:`check_json_schema`
walks the whole schema and refuses, with the keyword and its JSON path, every keyword (or use of one) that
:data:`KEYWORDS` does not list as enforced or as an annotation.

The table is empirical, for xgrammar 0.2.9 (the pinned version): each enforced keyword was checked by
sampling at temperature 1 through the engine and validating every output with ``jsonschema``
(``tests/test_schema_enforcement.py``), and by feeding the grammar hand-picked invalid documents; a
keyword is refused when the grammar accepted a document ``jsonschema`` rejects. A grammar that is stricter
than the schema (it never writes an optional extra property, reads ``pattern`` as a whole-string match,
writes no exponent in numbers) is enforcement: every output is valid.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema

ENFORCED, REFUSED, ANNOTATION = "enforced", "refused", "annotation"

# keyword -> (status, when it is enforced / why it is refused). ``docs/openai.md`` holds this table
# (:func:`keyword_table_markdown`); a test keeps the two equal.
KEYWORDS: dict[str, tuple[str, str]] = {
    "type": (ENFORCED, "one of string, integer, number, boolean, null, object, array, or a list of them"),
    "enum": (ENFORCED, "siblings only `type` (every value of that type) and annotations"),
    "const": (ENFORCED, "siblings only `type` (the value of that type) and annotations"),
    "minimum": (ENFORCED, "with `type` integer or number"),
    "maximum": (ENFORCED, "with `type` integer or number"),
    "exclusiveMinimum": (ENFORCED, "a number (draft 4's boolean form is refused), with `type` integer or number"),
    "exclusiveMaximum": (ENFORCED, "a number (draft 4's boolean form is refused), with `type` integer or number"),
    "multipleOf": (ENFORCED, "only a positive whole number with `type` integer; on numbers it is refused"),
    "minLength": (ENFORCED, "with `type` string, not together with `pattern` or `format` (then the length is not "
                            "enforced)"),
    "maxLength": (ENFORCED, "with `type` string, not together with `pattern` or `format` (then the length is not "
                            "enforced)"),
    "pattern": (ENFORCED, "with `type` string, not together with `format` (then the pattern is not enforced); a "
                          "subset of ECMA-262 (see below); matched against the whole string; it may not name `\"`, "
                          "a backslash or a control character (the grammar would write them unescaped)"),
    "format": (ENFORCED, "with `type` string; only the formats listed below"),
    "items": (ENFORCED, "a schema or boolean, with `type` array (the draft 7 list form is refused: use `prefixItems`)"),
    "prefixItems": (ENFORCED, "with `type` array"),
    "minItems": (ENFORCED, "with `type` array"),
    "maxItems": (ENFORCED, "with `type` array"),
    "unevaluatedItems": (ENFORCED, "with `type` array"),
    "properties": (ENFORCED, "with `type` object; optional properties may be left out, and no key but those "
                             "listed is written (`additionalProperties` beside them is false or left out)"),
    "required": (ENFORCED, "with `type` object; every name listed in `properties`"),
    "additionalProperties": (ENFORCED, "with `type` object; beside `properties` only false (an extra key could spell "
                                       "a listed name with escapes, `\\u0061` for `a`, past that property's schema)"),
    "patternProperties": (ENFORCED, "with `type` object; one pattern (as for `pattern`) that no name in "
                                    "`properties` matches, `additionalProperties` false or absent (the grammar does "
                                    "not tell apart keys that two schemas match)"),
    "propertyNames": (ENFORCED, "with `type` object, not together with `properties` or `patternProperties` "
                                "(whose names it does not check)"),
    "minProperties": (ENFORCED, "with `type` object whose keys are all named in `properties` (no "
                                "`patternProperties` or `propertyNames`; `additionalProperties` and "
                                "`unevaluatedProperties` false or absent): other keys the grammar may write twice, "
                                "which counts once"),
    "maxProperties": (ENFORCED, "as for `minProperties`"),
    "unevaluatedProperties": (ENFORCED, "as for `additionalProperties`"),
    "anyOf": (ENFORCED, "siblings only annotations and `$defs`/`definitions`"),
    "oneOf": (ENFORCED, "siblings as for `anyOf`; branches that cannot overlap: different types, or objects "
                        "told apart by a required property's `const`/`enum`"),
    "allOf": (ENFORCED, "exactly one schema; siblings as for `anyOf`"),
    "$ref": (ENFORCED, "a local reference (`#`, `#/...`); siblings as for `anyOf`"),
    "$defs": (ENFORCED, "holds schemas for `$ref`"),
    "definitions": (ENFORCED, "holds schemas for `$ref`"),
    "not": (REFUSED, "not enforced: outputs matching the negated schema were accepted"),
    "if": (REFUSED, "not enforced (`if`/`then`/`else` ignored)"),
    "then": (REFUSED, "not enforced (`if`/`then`/`else` ignored)"),
    "else": (REFUSED, "not enforced (`if`/`then`/`else` ignored)"),
    "contains": (REFUSED, "not enforced: arrays without a matching item were accepted"),
    "minContains": (REFUSED, "not enforced (as `contains`)"),
    "maxContains": (REFUSED, "not enforced (as `contains`)"),
    "uniqueItems": (REFUSED, "`true` is not enforced: repeated items were accepted (`false` is allowed)"),
    "dependentRequired": (REFUSED, "not enforced: the dependent property could be left out"),
    "dependentSchemas": (REFUSED, "not enforced: the dependent schema could be ignored"),
    "dependencies": (REFUSED, "draft 7's form of `dependentRequired`/`dependentSchemas` (not enforced); "
                              "not sampled, so refused with them"),
    "additionalItems": (REFUSED, "draft 7's tuple form: use `prefixItems` and `items`"),
    "$anchor": (REFUSED, "references by anchor are not resolved"),
    "$dynamicRef": (REFUSED, "dynamic references are not resolved"),
    "$dynamicAnchor": (REFUSED, "dynamic references are not resolved"),
    "$recursiveRef": (REFUSED, "dynamic references are not resolved"),
    "$recursiveAnchor": (REFUSED, "dynamic references are not resolved"),
    "$vocabulary": (REFUSED, "vocabularies are not supported"),
    "contentEncoding": (REFUSED, "not enforced"),
    "contentMediaType": (REFUSED, "not enforced"),
    "contentSchema": (REFUSED, "not enforced"),
    "nullable": (REFUSED, "OpenAPI's, not JSON Schema's: use `\"type\": [..., \"null\"]`"),
    "title": (ANNOTATION, ""),
    "description": (ANNOTATION, ""),
    "examples": (ANNOTATION, ""),
    "default": (ANNOTATION, "not used to fill values"),
    "$comment": (ANNOTATION, ""),
    "$schema": (ANNOTATION, ""),
    "$id": (ANNOTATION, "at the root only (a nested `$id` changes what `$ref` means)"),
    "deprecated": (ANNOTATION, ""),
    "readOnly": (ANNOTATION, ""),
    "writeOnly": (ANNOTATION, ""),
    "discriminator": (ANNOTATION, "OpenAPI's hint beside `oneOf` (pydantic writes it); `oneOf`'s rule applies"),
}

# Formats whose grammar accepts only strings Python's jsonschema (with its format extras) accepts.
# Refused: date, date-time (the grammar allows 2023-02-29), time (23:59:60), hostname (labels over 63
# characters), ipv4 and ipv6 (leading zeros), idn-email, idn-hostname, iri, iri-reference, regex (not
# checked at all), relative-json-pointer (the grammar writes 20, which Python's jsonschema rejects: any 0
# after a digit), and every other name.
ENFORCED_FORMATS = ("email", "uuid", "uri", "uri-reference", "uri-template", "json-pointer", "duration")

TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
_TYPE_OF_KEYWORD = {
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    ("integer", "number")),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), ("string",)),
    **dict.fromkeys(("items", "prefixItems", "minItems", "maxItems", "unevaluatedItems"), ("array",)),
    **dict.fromkeys(("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                     "minProperties", "maxProperties", "unevaluatedProperties"), ("object",)),
}
_COMPOSITION = ("anyOf", "oneOf", "allOf", "$ref")
_BESIDE_COMPOSITION = {k for k, (status, _) in KEYWORDS.items() if status == ANNOTATION} | {"$defs", "definitions"}
# Where subschemas are: one schema, a list of schemas, a name -> schema map.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds on a JSON schema, checked before anything is compiled.

    Attributes:
        max_bytes: the schema's JSON text, UTF-8 bytes.
        max_depth: nesting of JSON objects and arrays in the schema document.
        max_keywords: keywords in all its (sub)schemas together.
    """

    max_bytes: int = 64 * 1024
    max_depth: int = 32
    max_keywords: int = 2048


def check_json_schema(text: str, limits: SchemaLimits = SchemaLimits()) -> object:
    """Parses a schema and refuses it unless every keyword is enforced while sampling (or an annotation).

    Args:
        text: the schema's JSON text.
        limits: size, depth and keyword bounds.

    Returns:
        The parsed schema.

    Raises:
        ValueError: invalid JSON, a document that is not a schema, a bound exceeded, or the first keyword
            that would not be enforced, e.g. ``multipleOf at $.properties.price: ...``.
    """
    size = len(text.encode("utf-8"))
    if size > limits.max_bytes:
        raise ValueError(f"the schema is {size} bytes; at most {limits.max_bytes}")
    _check_depth(text, limits.max_depth)
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
    _Walker(schema, limits).walk(schema, "$")
    _check_against_metaschema(schema)
    return schema


def _check_against_metaschema(schema: object) -> None:
    error = metaschema_error(schema)
    if error is not None:
        raise ValueError(error)


def metaschema_error(schema: object) -> str | None:
    """Why a document is not a valid schema of its draft (``$schema``; 2020-12 when it names none), e.g. ``not a
    valid JSON schema at $.minLength: -1 is less than the minimum of 0``, or None when it is one. xgrammar
    refuses such documents with its C++ source line, or reads them its own way."""
    if isinstance(schema, dict) and "$schema" in schema and not isinstance(schema["$schema"], str):
        return f"not a valid JSON schema at $.$schema: {json.dumps(schema['$schema'])[:60]} is not a URI string"
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    except RecursionError:  # the structured-output path bounds the depth first; a tool's schema may not
        return "not a valid JSON schema: it nests too deeply to check"
    if error is None:
        return None
    where = "$" + "".join(f"[{p}]" if isinstance(p, int) else _member(p) for p in error.absolute_path)
    return f"not a valid JSON schema at {where}: {error.message[:200]}"


def check_regex(pattern: str) -> None:
    """Refuses a regular expression that uses what the grammar does not honour.

    Allowed (ECMA-262, as JSON Schema's ``pattern``): literals, ``.``, classes ``[...]``, escapes ``\\d \\D \\w
    \\W \\s \\S \\t \\n \\r \\f \\v \\xHH \\uHHHH`` and escaped punctuation, groups ``(...)`` and ``(?:...)``,
    ``|``, quantifiers ``* + ? {n} {n,} {n,m}`` (lazy too), ``^`` at the start of an alternative and ``$`` at
    its end. xgrammar compiles lookahead but ignores it, and refuses lookbehind, backreferences and word
    boundaries; named groups and inline flags are not ECMA-262.

    Raises:
        ValueError: naming the construct and its position.
    """
    i, n = 0, len(pattern)
    after_atom = False  # a quantifier may follow
    while i < n:
        c = pattern[i]
        if c == "\\":
            i = _check_escape(pattern, i, in_class=False)
            after_atom = True
            continue
        if c == "[":
            i = _check_class(pattern, i)
            after_atom = True
            continue
        if c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
                raise ValueError(f"{_group_kind(pattern, i)} at position {i} is not supported")
            i += 3 if pattern.startswith("(?:", i) else 1
            after_atom = False
            continue
        if c in "*+?{":
            if c == "{":
                m = re.compile(r"\{(\d+)(,(\d*))?\}").match(pattern, i)
                if m is None:
                    raise ValueError(f"a '{{' that is not a quantifier at position {i}: escape it as '\\{{'")
                end = m.end()
            else:
                end = i + 1
            if not after_atom:
                raise ValueError(f"a quantifier with nothing to repeat at position {i}")
            if end < n and pattern[end] == "?":
                end += 1  # lazy: the same strings match
            elif end < n and pattern[end] == "+":
                raise ValueError(f"a possessive quantifier at position {end} is not supported")
            i = end
            after_atom = False
            continue
        if c == "^" and i > 0 and pattern[i - 1] not in "(|" and not pattern.endswith("(?:", 0, i):
            raise ValueError(f"'^' at position {i} is not at the start of an alternative")
        if c == "$" and i + 1 < n and pattern[i + 1] not in ")|":
            raise ValueError(f"'$' at position {i} is not at the end of an alternative")
        if c in "}]":
            raise ValueError(f"an unmatched '{c}' at position {i}: escape it")
        after_atom = c not in "|)^$" or c == ")"
        i += 1


def with_ecma_dot(pattern: str) -> str:
    """``pattern`` (one passed by :func:`check_regex`) with each ``.`` outside a class written as ECMA-262
    reads it, any character but a line terminator (``[^\\n\\r\\u2028\\u2029]``): xgrammar's regex lets ``.``
    match them too. Inside a JSON string the string's grammar keeps ``\\n`` and ``\\r`` out (U+2028 and U+2029
    stay, as docs/openai.md says)."""
    out, i, n, in_class = [], 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":  # check_regex refused an empty class, so the first ']' closes it
            in_class = True
        elif c == ".":
            out.append("[^\\n\\r\\u2028\\u2029]")
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def find_refused(schema: object, limits: SchemaLimits = SchemaLimits()) -> str | None:
    """The refusal message for a parsed schema, or None when every keyword is enforced."""
    try:
        _Walker(schema, limits).walk(schema, "$")
    except ValueError as exc:
        return str(exc)
    return None


def _a_name_matches(properties, patterns) -> bool:
    """Whether a name in ``properties`` matches one of ``patterns`` (one that Python cannot compile counts as
    matching: the check must not let an overlap through)."""
    for pattern in patterns or {}:
        for name in properties or {}:
            try:
                if re.search(pattern, name):
                    return True
            except re.error:
                return True
    return False


def keyword_table_markdown() -> str:
    """The keyword table of ``docs/openai.md``: one row per keyword, enforced first, then annotations, then
    refused."""
    order = {ENFORCED: 0, ANNOTATION: 1, REFUSED: 2}
    rows = ["| Keyword | Status | When / why |", "| --- | --- | --- |"]
    for name, (status, note) in sorted(KEYWORDS.items(), key=lambda kv: order[kv[1][0]]):
        rows.append(f"| `{name}` | {status} | {note} |")
    return "\n".join(rows)


# -- the walk -----------------------------------------------------------------------------------------------
class _Walker:
    def __init__(self, root: object, limits: SchemaLimits) -> None:
        self.root = root
        self.limits = limits
        self.num_keywords = 0

    def walk(self, schema: object, path: str) -> None:
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            raise ValueError(f"the schema at {path} is a {type(schema).__name__}; a schema is an object or a "
                             f"boolean")
        self.num_keywords += len(schema)
        if self.num_keywords > self.limits.max_keywords:
            raise ValueError(f"the schema has over {self.limits.max_keywords} keywords")
        for keyword in schema:
            status, note = KEYWORDS.get(keyword, (None, ""))
            if status is None:
                _refuse(keyword, path, "not a JSON Schema keyword the grammar knows (an unknown keyword would "
                                       "be ignored)")
            if status == REFUSED and not (keyword == "uniqueItems" and schema[keyword] is False):
                _refuse(keyword, path, note)
        self._check_conditions(schema, path)
        for keyword in _ONE:
            if keyword in schema:
                self.walk(schema[keyword], f"{path}.{keyword}")
        for keyword in _LIST:
            if keyword in schema:
                value = schema[keyword]
                if not isinstance(value, list) or not value:
                    _refuse(keyword, path, "must be a non-empty list of schemas")
                for i, sub in enumerate(value):
                    self.walk(sub, f"{path}.{keyword}[{i}]")
        for keyword in _MAP:
            if keyword in schema:
                value = schema[keyword]
                if not isinstance(value, dict):
                    _refuse(keyword, path, "must be an object whose values are schemas")
                for name, sub in value.items():
                    self.walk(sub, f"{path}.{keyword}{_member(name)}")

    def _check_conditions(self, schema: dict, path: str) -> None:
        if "$id" in schema and path != "$":
            _refuse("$id", path, KEYWORDS["$id"][1])
        types = self._types(schema, path)
        for keyword, applies_to in _TYPE_OF_KEYWORD.items():
            if keyword in schema and not (types and set(types) & set(applies_to)):
                _refuse(keyword, path, f"needs \"type\": {' or '.join(applies_to)} beside it (without it the "
                                       f"grammar does not apply it)")
        for keyword in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(schema.get(keyword), bool):
                _refuse(keyword, path, "draft 4's boolean form is not supported: give the bound as a number")
        if "integer" in types:
            for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                value = schema.get(keyword)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                        -2**63 <= value < 2**63 and (isinstance(value, int) or value.is_integer())):
                    _refuse(keyword, path, f"{value!r}: with type integer a bound is a whole number within 64 bits "
                                           f"(the grammar's integers)")
        if "multipleOf" in schema:
            value = schema["multipleOf"]
            if set(types) != {"integer"} or not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _refuse("multipleOf", path, KEYWORDS["multipleOf"][1])
        # The grammar gives a string one rule: a format's, else a pattern's, else a length's; the others beside it
        # would be dropped.
        if "format" in schema:
            for keyword in ("pattern", "minLength", "maxLength"):
                if keyword in schema:
                    _refuse(keyword, path, "not enforced together with format: give the format alone, or a pattern "
                                           "(with the length in it) without the format")
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                _refuse("minLength" if "minLength" in schema else "maxLength", path,
                        "not enforced together with pattern: put the length into the pattern")
            self._check_pattern(schema["pattern"], "pattern", path)
        if "format" in schema and schema["format"] not in ENFORCED_FORMATS:
            _refuse("format", path, f"{schema['format']!r} is not enforced; enforced formats: "
                                    f"{', '.join(ENFORCED_FORMATS)}")
        if "items" in schema and not isinstance(schema["items"], (dict, bool)):
            _refuse("items", path, KEYWORDS["items"][1])
        for name in schema.get("patternProperties", {}) if isinstance(schema.get("patternProperties"), dict) else ():
            self._check_pattern(name, "patternProperties", path)
        if "propertyNames" in schema and ("properties" in schema or "patternProperties" in schema):
            _refuse("propertyNames", path, KEYWORDS["propertyNames"][1])
        if "patternProperties" in schema and (len(schema["patternProperties"] or {}) > 1
                                              or schema.get("additionalProperties", False) is not False
                                              or _a_name_matches(schema.get("properties"), schema["patternProperties"])):
            _refuse("patternProperties", path, KEYWORDS["patternProperties"][1])
        if schema.get("properties"):
            for keyword in ("additionalProperties", "unevaluatedProperties"):
                if schema.get(keyword, False) is not False:
                    _refuse(keyword, path, "only false (or left out) beside properties: an extra key may spell a "
                                           "listed name with JSON escapes (\"\\u0061\" for \"a\"), which the grammar "
                                           "does not tell apart, and its value would escape that property's schema")
        open_keys = ("patternProperties" in schema or "propertyNames" in schema
                     or schema.get("additionalProperties", False) is not False
                     or schema.get("unevaluatedProperties", False) is not False)
        for keyword in ("minProperties", "maxProperties"):
            if keyword in schema and open_keys:
                _refuse(keyword, path, KEYWORDS["minProperties"][1])
        if "required" in schema:
            required = schema["required"]
            properties = schema.get("properties", {})
            if not isinstance(required, list) or not isinstance(properties, dict):
                _refuse("required", path, "must be a list of property names")
            missing = [name for name in required if name not in properties]
            if missing:
                _refuse("required", path, f"{missing[0]!r} is not in properties, and the grammar only requires "
                                          f"listed properties")
        for keyword in ("enum", "const"):
            if keyword in schema:
                self._check_values(schema, keyword, types, path)
        composed = [k for k in _COMPOSITION if k in schema]
        if composed:
            others = sorted(set(schema) - _BESIDE_COMPOSITION - {composed[0]})
            if others:
                _refuse(others[0], path, f"not enforced beside {composed[0]} (the grammar follows {composed[0]} "
                                         f"alone): move it into the subschemas")
        if "allOf" in schema and isinstance(schema["allOf"], list) and len(schema["allOf"]) != 1:
            _refuse("allOf", path, "more than one schema is not enforced (the grammar does not intersect them)")
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                _refuse("$ref", path, f"{ref!r} is not a local reference ('#' or '#/...')")
        if "oneOf" in schema and isinstance(schema["oneOf"], list):
            self._check_one_of(schema["oneOf"], path)

    def _types(self, schema: dict, path: str) -> tuple[str, ...]:
        if "type" not in schema:
            return ()
        value = schema["type"]
        types = tuple(value) if isinstance(value, list) else (value,)
        if not types or any(t not in TYPES for t in types):
            _refuse("type", path, f"{value!r} is not one of {', '.join(TYPES)} (or a list of them)")
        return types

    def _check_pattern(self, pattern: object, keyword: str, path: str) -> None:
        if not isinstance(pattern, str):
            _refuse(keyword, path, "a pattern is a string")
        try:
            check_regex(pattern)
        except ValueError as exc:
            _refuse(keyword, path, f"{pattern!r}: {exc}")
        literal = _json_escaped_literal(pattern)
        if literal is not None:
            position, char = literal
            _refuse(keyword, path, f"{pattern!r}: the character {char!r} at position {position} must be escaped in "
                                   f"a JSON string, and the grammar would write it unescaped (invalid JSON): a "
                                   f"pattern cannot require '\"', a backslash or a control character")

    def _check_values(self, schema: dict, keyword: str, types: tuple[str, ...], path: str) -> None:
        others = sorted(set(schema) - _BESIDE_COMPOSITION - {"type", keyword})
        if others:
            _refuse(others[0], path, f"not enforced beside {keyword} (the grammar writes the {keyword} values "
                                     f"as they are)")
        values = schema[keyword]
        if keyword == "enum" and (not isinstance(values, list) or not values):
            _refuse("enum", path, "must be a non-empty list")
        for value in values if keyword == "enum" else [values]:
            if types and not set(_json_types(value)) & set(types):
                _refuse(keyword, path, f"value {json.dumps(value)[:60]} is not of type {' or '.join(types)}, "
                                       f"and the grammar would write it anyway")

    def _check_one_of(self, branches: list, path: str) -> None:
        resolved = [self._resolve(b) for b in branches]
        for i in range(len(resolved)):
            for j in range(i + 1, len(resolved)):
                if not _disjoint(resolved[i], resolved[j]):
                    _refuse("oneOf", path, f"branches {i} and {j} may both match a value, and the grammar does not "
                                           f"stop a value matching two (it reads oneOf as anyOf): use anyOf, or "
                                           f"branches of different types or told apart by a required const "
                                           f"property")

    def _resolve(self, schema: object, seen: int = 0) -> object:
        """Follows local ``$ref`` chains (at most 16) to the schema they name; None when it cannot."""
        while isinstance(schema, dict) and "$ref" in schema and seen < 16:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                return None
            node = self.root
            for part in [p for p in ref[1:].split("/") if p]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    return None
            schema, seen = node, seen + 1
        return schema


def _disjoint(a: object, b: object) -> bool:
    """True when no value can match both schemas, by their types or a required property's const/enum."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    types_a, types_b = _schema_types(a), _schema_types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = _const_values(a), _const_values(b)
    if values_a is not None and values_b is not None and not values_a & values_b:
        return True
    if types_a == {"object"} and types_b == {"object"}:
        props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
        for name in set(a.get("required") or ()) & set(b.get("required") or ()):
            va, vb = _const_values(props_a.get(name)), _const_values(props_b.get(name))
            if va is not None and vb is not None and not va & vb:
                return True
    return False


def _schema_types(schema: dict) -> set[str] | None:
    """The JSON types a schema allows (integer inside number), or None when it does not say."""
    if "type" in schema:
        value = schema["type"]
        types = set(value) if isinstance(value, list) else {value}
    else:
        values = _const_values(schema)
        if values is None:
            return None
        types = {t for v in values for t in _json_types(json.loads(v))}
    if "number" in types:
        types.add("integer")
    if "integer" in types:
        types.add("number")  # 1 is both
    return types


def _const_values(schema: object) -> set[str] | None:
    """A schema's const/enum values as canonical JSON texts, or None when it has neither."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {json.dumps(schema["const"], sort_keys=True)}
    if isinstance(schema.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in schema["enum"]}
    return None


def _json_types(value: object) -> tuple[str, ...]:
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("boolean",)
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return ("integer", "number")
    if isinstance(value, float):
        return ("number",)
    if isinstance(value, str):
        return ("string",)
    return ("array",) if isinstance(value, list) else ("object",)


def _refuse(keyword: str, path: str, why: str) -> None:
    raise ValueError(f"{keyword} at {path}: {why}")


def _member(name: str) -> str:
    return f".{name}" if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$-]*", name) else f"[{json.dumps(name)}]"


_SIMPLE_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}


def _must_escape(char: str) -> bool:
    """A character JSON writes only escaped inside a string."""
    return char in '"\\' or ord(char) < 0x20


def _all_must_escape(first: str, last: str) -> bool:
    """Whether every character from ``first`` to ``last`` is one JSON writes only escaped."""
    return ord(last) < 0x20 or (first == last and _must_escape(first))


def _json_escaped_literal(pattern: str) -> tuple[int, str] | None:
    """The first literal character of a pattern (one already passed by :func:`check_regex`) that a JSON string
    holds only escaped (``"``, a backslash, a control character), with its position, or None.

    xgrammar keeps such a character out of a string when it comes from a negated class, ``.``, a class escape,
    or a class that also holds other characters (stricter, so still valid), but writes it as it is (not
    escaped: invalid JSON, or another string) when the pattern names it as a literal, an escape (``\\"``,
    ``\\\\``, ``\\n``, ``\\x22``, ``\\u005c``) or in a class of nothing but such characters (``[\\n\\t]``,
    ``[\\x00-\\x08]``)."""

    def escaped(i: int) -> tuple[str | None, int]:  # the character an escape at i names (None: a class)
        c = pattern[i + 1]
        if c in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[c], i + 2
        if c == "x":
            return chr(int(pattern[i + 2:i + 4], 16)), i + 4
        if c == "u":
            return chr(int(pattern[i + 2:i + 6], 16)), i + 6
        if c in "dDwWsS":
            return None, i + 2
        return c, i + 2

    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            char, end = escaped(i)
            if char is not None and _must_escape(char):
                return i, char
            i = end
        elif c == "[":
            j = i + 1 + pattern.startswith("^", i + 1)
            members: list[tuple[str, str] | None] = []  # (first, last) of each character or range; None: \d, ...
            while pattern[j] != "]":
                first, j = escaped(j) if pattern[j] == "\\" else (pattern[j], j + 1)
                last = first
                if pattern.startswith("-", j) and not pattern.startswith("-]", j):
                    last, j = escaped(j + 1) if pattern[j + 1] == "\\" else (pattern[j + 1], j + 2)
                members.append(None if first is None or last is None else (first, last))
            if not pattern.startswith("^", i + 1) and all(m is not None and _all_must_escape(*m) for m in members):
                return i, members[0][0]
            i = j + 1
        else:
            if _must_escape(c):
                return i, c
            i += 1
    return None


def _check_depth(text: str, max_depth: int) -> None:
    """Refuses JSON nested deeper than ``max_depth`` objects/arrays (counted on the text, before parsing, so
    a deep document cannot exhaust the parser's recursion)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                raise ValueError(f"the schema nests deeper than {max_depth} objects/arrays")
        elif ch in "]}":
            depth -= 1


def _group_kind(pattern: str, i: int) -> str:
    rest = pattern[i:]
    if rest.startswith(("(?=", "(?!")):
        return "a lookahead"
    if rest.startswith(("(?<=", "(?<!")):
        return "a lookbehind"
    if rest.startswith(("(?<", "(?P")):
        return "a named group"
    return "a group modifier (inline flags, atomic group)"


def _check_escape(pattern: str, i: int, in_class: bool) -> int:
    """Checks the escape at ``pattern[i]`` (a backslash); returns the index after it."""
    if i + 1 >= len(pattern):
        raise ValueError("a trailing backslash")
    c = pattern[i + 1]
    if c in "dDwWsStnrfv":
        return i + 2
    if c == "x" and re.fullmatch(r"[0-9A-Fa-f]{2}", pattern[i + 2:i + 4]):
        return i + 4
    if c == "u" and re.fullmatch(r"[0-9A-Fa-f]{4}", pattern[i + 2:i + 6]):
        return i + 6
    if c in "bB":
        raise ValueError(f"'\\{c}' at position {i} (a word boundary{', or backspace in a class' if in_class else ''}) "
                         f"is not supported")
    if c.isdigit() or c == "k":
        raise ValueError(f"a backreference '\\{c}' at position {i} is not supported")
    if c in "pP":
        raise ValueError(f"a Unicode property escape '\\{c}' at position {i} is not supported")
    if c.isalnum():
        raise ValueError(f"the escape '\\{c}' at position {i} is not supported")
    return i + 2  # an escaped punctuation character: itself


def _check_class(pattern: str, i: int) -> int:
    """Checks the class starting at ``pattern[i]`` ('['); returns the index after its ']'."""
    j = i + 1
    if pattern.startswith("^", j):
        j += 1
    if pattern.startswith("]", j):
        raise ValueError(f"an empty class at position {i} (ECMA-262 reads '[]' and '[^]' differently from "
                         f"other dialects): escape the ']'")
    while j < len(pattern):
        c = pattern[j]
        if c == "\\":
            j = _check_escape(pattern, j, in_class=True)
            continue
        if c == "[":
            raise ValueError(f"a '[' inside a class at position {j}: escape it")
        if c == "]":
            return j + 1
        j += 1
    raise ValueError(f"the class at position {i} is not closed")
