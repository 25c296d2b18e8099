"""Structured outputs: a request's constraint on what it may generate, named as vLLM's
`StructuredOutputsParams` (a JSON schema, any JSON object, a regular expression, a list of
choices, or a grammar), and its translation into an llguidance grammar.

The scheduler process compiles the grammar against the model's tokenizer and the engine masks
each step's logits with it (engine/batch/grammar.py); this module needs neither, so the frontend and
the tokenizer process check a constraint here, before it reaches them. Each process translates
a constraint once (the choices of a request share it; the last few are kept), on the
large-stack worker (baton/large_stack.py): llguidance recurses once per level of a grammar.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import any_to_lark

from baton.json_values import non_json_problem
from baton.large_stack import on_large_stack

# Bounds on what one request may ask the grammar engine to build: a schema or grammar is
# compiled in three processes and its matcher advanced every step.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 1024
# Distinct constraints whose translation a process keeps (a request's n choices share one).
CACHED_GRAMMARS = 64
# What `json_object` admits: any JSON object, as vLLM's guidance backend builds it.
ANY_JSON_OBJECT = {"type": "object"}
# The whitespace JSON may hold around each separator unless a request says otherwise: none, a
# space, or a line break and indentation, so pretty-printed JSON passes, but bounded: a small
# model left free to emit whitespace tends to emit nothing else until max_tokens.
JSON_WHITESPACE = r"[ \t]?|\r?\n[ \t]{0,24}"
# llguidance's error (the first line of a matcher's) when not even a first byte can come: at the
# start, a constraint that admits no output at all.
NO_OUTPUT_ERRORS = ("NoExtension", "NoExtensionBias")
# What such a constraint has done wrong, for each kind that can admit nothing.
NO_OUTPUT_REASONS = {
    "json": "no JSON value satisfies the schema (e.g. its $refs only refer to each other or to "
    "themselves, with no base case)",
    "regex": "the regex matches no text",
    "grammar": "no text matches the grammar (e.g. its rules only refer to each other or to "
    "themselves, with no base case)",
}


class InvalidConstraint(ValueError):
    """A structured-outputs constraint that cannot be used, with why."""


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one constraint: `json` (a JSON schema, as an object or its text), `json_object`
    (any JSON object), `regex`, `choice` (one of these strings) or `grammar` (Lark, or GBNF as
    llama.cpp writes it). JSON's whitespace around separators follows `whitespace_pattern` (a
    regex; default JSON_WHITESPACE), or there is none with `disable_any_whitespace` (vLLM's
    options). An object schema that lists its properties and says nothing of others admits no
    others, as vLLM's default backend (xgrammar) and OpenAI's strict mode read it."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def constraints(self) -> list[str]:
        """The names of the constraints set."""
        return [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar; InvalidConstraint where it is malformed
        (what only the tokenizer can tell is checked when the scheduler compiles it)."""
        names = self.constraints()
        if len(names) != 1:
            raise InvalidConstraint(
                "structured outputs need exactly one constraint (json, json_object, regex, "
                f"choice or grammar), got {len(names)}" + (f": {', '.join(names)}" if names else "")
            )
        return _translated(msgspec.json.encode(self))  # JSON: any integer, refused below

    def _checked_grammar(self) -> str:
        """The translation itself (on the large-stack worker)."""
        name = self.constraints()[0]
        try:
            grammar = self._grammar(name)
        except InvalidConstraint:
            raise
        except RecursionError:
            raise InvalidConstraint(f"{name} is nested too deeply") from None
        except ValueError as error:  # llguidance's own refusals (e.g. its JSON depth limit)
            raise InvalidConstraint(f"invalid {name} constraint: {error}") from error
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidConstraint(f"invalid {name} constraint: {error.strip()}")
        if name in NO_OUTPUT_REASONS and _admits_no_output(grammar):
            raise InvalidConstraint(f"invalid {name} constraint: {NO_OUTPUT_REASONS[name]}")
        return grammar

    def _grammar(self, name: str) -> str:
        if name in ("json", "json_object"):
            schema = ANY_JSON_OBJECT if name == "json_object" else self._schema()
            options: dict[str, Any] = {"whitespace_flexible": False}
            if not self.disable_any_whitespace:
                pattern = _bounded(self.whitespace_pattern or JSON_WHITESPACE, "whitespace_pattern")
                options = {"whitespace_flexible": True, "whitespace_pattern": pattern}
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
        if name == "regex":
            return LLMatcher.grammar_from_regex(_bounded(self.regex or "", "regex"))
        if name == "choice":
            choices = self.choice or []
            if not choices or len(choices) > MAX_CHOICES:
                raise InvalidConstraint(f"choice needs 1 to {MAX_CHOICES} strings")
            _bounded("".join(choices), "choice")
            lark = "start: " + " | ".join(json.dumps(choice) for choice in choices)
            return LLMatcher.grammar_from_lark(lark)
        try:  # Lark as it is; GBNF converted to Lark
            lark = any_to_lark(_bounded(self.grammar or "", "grammar"))
        except Exception as error:  # the converter raises plain exceptions
            raise InvalidConstraint(f"invalid grammar: {error}") from error
        return LLMatcher.grammar_from_lark(lark)

    def _schema(self) -> dict[str, Any]:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(_bounded(schema, "json"))
            except ValueError as error:
                raise InvalidConstraint(f"json is not a JSON schema: {error}") from error
        if not isinstance(schema, dict):
            raise InvalidConstraint("json must be a JSON schema: an object")
        problem = non_json_problem(schema)  # e.g. an integer msgpack cannot carry
        if problem is not None:
            raise InvalidConstraint(f"json must hold JSON values: {problem}")
        _bounded(json.dumps(schema), "json")
        return _closed(schema)


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _translated(encoded: bytes) -> str:
    """The grammar of an encoded constraint (exceptions are not cached: a bad one is refused
    each time it comes)."""
    constraint = msgspec.json.decode(encoded, type=StructuredOutputsParams)
    return on_large_stack(constraint._checked_grammar)


# Where a JSON schema holds schemas: keywords whose value is one, a list of them, or a map of
# names to them. Anything else (const, enum, default, examples...) is data, never rewritten.
_SCHEMA_VALUED = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object combined with others: closing it would refuse what its partners add.
_COMBINING = ("allOf", "anyOf", "oneOf")


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose object schemas that list their properties, say nothing of
    others and are not combined with other schemas (`allOf` members, or beside `allOf`,
    `anyOf`, `oneOf`), admit no others."""
    root = dict(schema)
    pending: list[tuple[dict[str, Any], bool]] = [(root, False)]
    while pending:  # a loop, not recursion: a deep schema is llguidance's to refuse
        node, combined = pending.pop()
        listed = "properties" in node or "patternProperties" in node
        alone = not combined and not any(key in node for key in _COMBINING)
        if listed and alone and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key, value in list(node.items()):
            children: list[Any] = []
            if key in _SCHEMA_VALUED and isinstance(value, dict):
                node[key] = dict(value)
                children = [node[key]]
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                node[key] = children = [_copied(item) for item in value]
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                node[key] = {name: _copied(item) for name, item in value.items()}
                children = list(node[key].values())
            pending.extend((child, key == "allOf") for child in children if isinstance(child, dict))
    return root


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an end token, as llguidance's TokenizerWrapper reads
    one: it spells any text, so a grammar it cannot start admits no output under any
    tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = (*(bytes([byte]) for byte in range(256)), b"")
    special_token_ids = (eos_token_id,)

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_ByteVocabulary()))


def _admits_no_output(grammar: str) -> bool:
    """Whether no output, not even a first byte, satisfies `grammar`. llguidance tells only
    once a mask is asked for, which validate_grammar does not do: asked here, over bytes, the
    refusal comes where the request is validated and names its field. A grammar that names
    tokens may not compile over bytes: the scheduler judges it against the model's vocabulary."""
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    first_line = next(iter(matcher.get_error().splitlines()), "")
    return first_line in NO_OUTPUT_ERRORS


def _copied(item: Any) -> Any:
    return dict(item) if isinstance(item, dict) else item


def _bounded(text: str, name: str) -> str:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidConstraint(f"{name} is longer than {MAX_CONSTRAINT_CHARS} characters")
    return text
