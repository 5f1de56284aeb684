"""What a request's output must match: vLLM's ``structured_outputs`` (formerly ``guided_decoding``) fields."""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_CONSTRAINT_CHARS = 64 * 1024  # a regex, grammar or choice list (the compile cost grows with it)
# A schema's outer bound; the engine's own, smaller by default, is ``structured_outputs_max_schema_bytes``.
MAX_SCHEMA_CHARS = 1 << 20
MAX_CHOICES = 256
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# vLLM fields that choose among its backends, accepted and passed over: xgrammar always enforces the constraint
# here, JSON compiled without free whitespace between tokens (what disable_any_whitespace asks vLLM for).
IGNORED_FIELDS = ("backend", "disable_fallback", "disable_any_whitespace")
# vLLM fields that would change what is enforced, which this server does not do: refused when set.
UNSUPPORTED_FIELDS = {"whitespace_pattern": "JSON is compiled without free whitespace",
                      "structural_tag": "send the constraint as json, regex, choice or grammar",
                      "disable_additional_properties": "set additionalProperties false in the schema itself"}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on a request's output text.

    Attributes:
        json: a JSON schema (an object, or its JSON text): the output is one JSON value valid against it.
        json_object: the output is one JSON object (OpenAI's ``response_format`` ``json_object``).
        regex: the output matches this regular expression as a whole.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's / GBNF dialect, start rule ``root``).

    Raises:
        ValueError: none or more than one constraint, a value of the wrong type, an empty or oversized
            one (``MAX_CONSTRAINT_CHARS``, ``MAX_SCHEMA_CHARS``, ``MAX_CHOICES``). Whether a schema, regex or grammar is valid
            is found when it is compiled (:class:`~backend.structured_output.GrammarCompiler`).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            text = self.json
            if isinstance(text, dict):
                text = json.dumps(text)
            if not isinstance(text, str) or not text.strip():
                raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
            object.__setattr__(self, "json", text)
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            if len(choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(choice)} strings; at most {MAX_CHOICES}")
            object.__setattr__(self, "choice", tuple(choice))
        size, limit = len(self.spec), MAX_SCHEMA_CHARS if self.kind == "json" else MAX_CONSTRAINT_CHARS
        if size > limit:
            raise ValueError(f"structured_outputs.{self.kind} is {size} characters; at most {limit}")

    @property
    def kind(self) -> str:
        """Which constraint: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a choice list as its JSON array): with ``kind``, the compile cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return json.dumps(list(value), ensure_ascii=False)
        return "" if value is True else value

    @classmethod
    def from_value(cls, value: object) -> "StructuredOutputsParams":
        """From the wire: an object (or its JSON text) with vLLM's field names. Fields set to null or false and
        vLLM's backend choices (``IGNORED_FIELDS``) are passed over.

        Raises:
            ValueError: not an object, an unknown field, a vLLM option this server does not enforce
                (``UNSUPPORTED_FIELDS``), or what the constructor refuses.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs is not valid JSON: {exc}") from None
            except RecursionError:  # text nested past the interpreter's stack
                raise ValueError("structured_outputs is nested too deeply") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        for name, instead in UNSUPPORTED_FIELDS.items():
            if value.get(name) not in (None, False):
                raise ValueError(f"structured_outputs.{name} is not supported: {instead}")
        fields = {k: v for k, v in value.items()
                  if v is not None and k not in IGNORED_FIELDS and k not in UNSUPPORTED_FIELDS}
        unknown = sorted(set(fields) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s) {', '.join(unknown)[:200]}; known: {', '.join(KINDS)}")
        return cls(**fields)
