"""Structured-outputs constraints as `SamplingParams` carries them: exactly one constraint,
malformed ones refused with the field named, each kind turned into a grammar, and the params
crossing the wire intact."""

from __future__ import annotations

import msgspec
import pytest

from baton.sampling_params import InvalidSamplingParam, SamplingParams
from baton.structured_outputs import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    InvalidConstraint,
    StructuredOutputsParams,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# References that lead only to each other: no value ends the chain.
LOOPING_SCHEMA = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json='{"type": "array", "items": {"type": "string"}}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-z]+@[a-z]+\.com"),
        StructuredOutputsParams(choice=["yes", "no", 'a "quoted" one']),
        StructuredOutputsParams(grammar='start: "x" NUMBER\n%import common.NUMBER'),
        StructuredOutputsParams(grammar='root ::= "yes" | "no"'),  # GBNF
    ],
    ids=["schema", "schema-text", "json-object", "regex", "choice", "lark", "gbnf"],
)
def test_each_kind_of_constraint_becomes_a_grammar(constraint: StructuredOutputsParams) -> None:
    assert constraint.llguidance_grammar()
    SamplingParams(structured_outputs=constraint).validate()


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputsParams(), "exactly one constraint .* got 0"),
        (StructuredOutputsParams(json_object=False), "got 0"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "got 2: regex, choice"),
        (StructuredOutputsParams(json="{not json"), "not a JSON schema"),
        (StructuredOutputsParams(json="[1, 2]"), "must be a JSON schema"),
        (StructuredOutputsParams(json={"type": "nonsense"}), "invalid json constraint"),
        (StructuredOutputsParams(regex="[a-"), "invalid regex constraint"),
        (StructuredOutputsParams(choice=[]), "choice needs 1 to"),
        (StructuredOutputsParams(choice=["x"] * (MAX_CHOICES + 1)), "choice needs 1 to"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid grammar constraint"),
        (StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1)), "longer than"),
        # Constraints no output satisfies, which llguidance reports only as "NoExtensionBias",
        # and only once a mask is asked for.
        (StructuredOutputsParams(regex=r"[^\s\S]"), "invalid regex constraint: .* matches no"),
        (StructuredOutputsParams(json=LOOPING_SCHEMA), "invalid json constraint: .* no base case"),
        (StructuredOutputsParams(grammar="start: a\na: a"), "invalid grammar .* no base case"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_field(
    constraint: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        constraint.llguidance_grammar()
    with pytest.raises(InvalidSamplingParam, match=message) as refused:
        SamplingParams(structured_outputs=constraint).validate()
    assert refused.value.param == "structured_outputs"


def chained_schema(levels: int) -> dict:
    definitions = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(levels)
    }
    return {"$defs": {**definitions, f"d{levels}": {"type": "integer"}}, "$ref": "#/$defs/d0"}


def test_long_chains_compile_instead_of_overflowing_the_stack() -> None:
    """llguidance recurses once per level of a chain of rules: these overflowed an 8 MB stack
    and killed the process (a segfault, which no except catches) before compiling moved to the
    large-stack worker."""
    StructuredOutputsParams(json=chained_schema(1000)).llguidance_grammar()
    rules = "".join(f'r{i}: "a" r{i + 1}?\n' for i in range(3000))
    StructuredOutputsParams(grammar=f'start: r0\n{rules}r3000: "b"\n').llguidance_grammar()


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutputsParams(json='{"a":' * 800 + "1" + "}" * 800), "invalid json"),
        (StructuredOutputsParams(json="[" * 600 + "]" * 600), "JSON schema"),
        (StructuredOutputsParams(json={"maximum": 10**24}), "integers must fit in 64 bits"),
    ],
    ids=["deep-object-text", "deep-list-text", "huge-integer"],
)
def test_what_would_have_been_a_500_is_refused(
    constraint: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(InvalidConstraint, match=message):
        constraint.llguidance_grammar()


def test_constraints_cross_the_wire_intact() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert msgspec.msgpack.decode(
        msgspec.msgpack.encode(SamplingParams()), type=SamplingParams
    ) == (SamplingParams())
