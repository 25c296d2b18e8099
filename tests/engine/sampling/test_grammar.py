"""The engine's grammar masks on the byte tokenizer (token id = byte, then <|bos|> 256,
<|eos|> 257): which tokens a constrained row may sample, the matcher advanced by sampled tokens,
and rows that cannot go on reported, not raised."""

from __future__ import annotations

import pytest
import torch
from llguidance import LLMatcher

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.engine.batch.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarRow
from baton.engine.sampling.grammar_masks import GrammarMasks
from baton.structured_outputs import InvalidConstraint, StructuredOutputsParams

EOS = 257
# The model's logits are wider than the tokenizer's vocabulary, as Qwen2's padded ones are.
VOCAB = 300


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(build_byte_tokenizer(), [EOS], VOCAB)


def allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def test_masks_allow_exactly_the_grammars_next_tokens(compiler: GrammarCompiler) -> None:
    masks = GrammarMasks()
    digits = compiler.matcher(StructuredOutputsParams(regex="[0-3]x"))
    choice = compiler.matcher(StructuredOutputsParams(choice=["ab", "ac"]))
    logits = torch.zeros(3, VOCAB)
    rows = [GrammarRow(digits, 0), None, GrammarRow(choice, 0)]
    assert masks.apply(logits, rows) == []
    assert allowed(logits[0]) == {ord(c) for c in "0123"}
    assert allowed(logits[1]) == set(range(VOCAB))  # an unconstrained row is untouched
    assert allowed(logits[2]) == {ord("a")}
    assert masks.advance(rows, [ord("2"), 5, ord("a")], []) == []

    logits = torch.zeros(3, VOCAB)
    assert masks.apply(logits, [GrammarRow(digits, 1), None, GrammarRow(choice, 1)]) == []
    assert allowed(logits[0]) == {ord("x")}
    assert allowed(logits[2]) == {ord("b"), ord("c")}


def test_a_finished_grammar_allows_only_eos(compiler: GrammarCompiler) -> None:
    masks = GrammarMasks()
    matcher = compiler.matcher(StructuredOutputsParams(choice=["ok"]))
    for index, token in enumerate(b"ok"):
        masks.apply(torch.zeros(1, VOCAB), [GrammarRow(matcher, index)])
        assert masks.advance([GrammarRow(matcher, index)], [token], []) == []
    logits = torch.zeros(1, VOCAB)
    masks.apply(logits, [GrammarRow(matcher, 2)])
    assert allowed(logits[0]) == {EOS}


def test_rows_that_cannot_go_on_are_reported(compiler: GrammarCompiler) -> None:
    masks = GrammarMasks()
    matcher = compiler.matcher(StructuredOutputsParams(regex="a+"))
    other = compiler.matcher(StructuredOutputsParams(regex="b+"))
    # A row whose matcher stands elsewhere than after its outputs cannot be served.
    logits = torch.zeros(2, VOCAB)
    assert masks.apply(logits, [GrammarRow(matcher, 3), GrammarRow(other, 0)]) == [0]
    assert allowed(logits[1]) == {ord("b")}
    masks.advance([GrammarRow(other, 0)], [ord("b")], [])
    assert masks.apply(torch.zeros(1, VOCAB), [GrammarRow(other, 0)]) == [0]
    # A token the grammar forbids (a sampler that ignored the mask) leaves it in error.
    assert masks.advance(
        [GrammarRow(matcher, 0), GrammarRow(other, 0)], [ord("z"), ord("b")], []
    ) == [0]
    assert masks.apply(torch.zeros(1, VOCAB), [GrammarRow(matcher, 1)]) == [0]


def test_a_grammar_that_fails_on_its_mask_is_reported_not_taken_for_complete(
    compiler: GrammarCompiler,
) -> None:
    """A matcher can fail while its mask is computed (llguidance's lexer giving up, or a
    schema that is only a reference to itself). The mask it leaves allows only EOS, which
    would end the output as if the grammar were complete. (Validation refuses such a schema,
    and the compiler asks for the first mask itself; this matcher skips both, as a later mask
    would.)"""
    grammar = LLMatcher.grammar_from_json_schema('{"$ref": "#"}')
    matcher = GrammarMatcher(LLMatcher(compiler._llguidance(), grammar, log_level=0))
    logits = torch.zeros(1, VOCAB)
    assert GrammarMasks().apply(logits, [GrammarRow(matcher, 0)]) == [0]
    assert allowed(logits[0]) == {EOS}  # what the failure would otherwise have sampled


def test_min_tokens_yields_to_a_complete_grammar(compiler: GrammarCompiler) -> None:
    """A grammar that allows only a stop token ends the output, min_tokens or not (else the
    row would have no token at all); a grammar with other tokens left keeps the suppression."""
    masks = GrammarMasks()
    done = compiler.matcher(StructuredOutputsParams(choice=["a"]))
    going = compiler.matcher(StructuredOutputsParams(regex="a+"))
    for matcher in (done, going):
        masks.advance([GrammarRow(matcher, 0)], [ord("a")], [])
    rows = [GrammarRow(done, 1), GrammarRow(going, 1), None]
    logits = torch.zeros(3, VOCAB)
    masks.apply(logits, rows)
    assert masks.yield_to_grammars(logits, rows, [[EOS], [EOS], [EOS]]) == [[], [EOS], [EOS]]


def test_a_reply_in_reasoning_is_constrained_only_after_the_reasoning_ends(
    compiler: GrammarCompiler,
) -> None:
    """Under --reasoning-parser: free tokens (the reasoning) until the end token, counted as
    outputs; the grammar then starts at its beginning."""
    end = 258  # <|pad|> stands for </think>
    masks = GrammarMasks()
    matcher = compiler.matcher(StructuredOutputsParams(regex="[0-3]x"), reasoning_end=end)
    for index, token in enumerate([ord("h"), ord("m"), end]):
        logits = torch.zeros(1, VOCAB)
        assert masks.apply(logits, [GrammarRow(matcher, index)]) == []
        assert allowed(logits[0]) == set(range(VOCAB))
        assert masks.advance([GrammarRow(matcher, index)], [token], []) == []
    logits = torch.zeros(1, VOCAB)
    assert masks.apply(logits, [GrammarRow(matcher, 3)]) == []
    assert allowed(logits[0]) == {ord(c) for c in "0123"}
    # Still counted: a row that stands elsewhere than after its outputs cannot be served.
    assert masks.apply(torch.zeros(1, VOCAB), [GrammarRow(matcher, 2)]) == [0]


def test_a_failed_row_is_not_advanced(compiler: GrammarCompiler) -> None:
    masks = GrammarMasks()
    matcher = compiler.matcher(StructuredOutputsParams(regex="a+"))
    assert masks.advance([GrammarRow(matcher, 0)], [ord("a")], [0]) == []
    assert matcher.num_consumed == 0


def test_a_grammar_the_tokenizer_cannot_serve_is_a_grammar_error(
    compiler: GrammarCompiler,
) -> None:
    """Checked where the tokenizer is known: a token-level grammar naming a token this
    vocabulary lacks."""
    with pytest.raises(GrammarError, match="does not compile"):
        compiler.matcher(StructuredOutputsParams(grammar="start: <[99999]>"))
    # A schema that is only a reference to itself admits no output: refused in words before
    # it is compiled, by the validation every constraint passes.
    with pytest.raises(InvalidConstraint, match="no JSON value satisfies the schema"):
        compiler.matcher(StructuredOutputsParams(json={"$ref": "#"}))


@pytest.mark.parametrize(
    ("constraint", "text", "accepted"),
    [
        (StructuredOutputsParams(json_object=True), '{"a": 1}', True),
        (StructuredOutputsParams(json_object=True), '{\n  "a": [\n    1, 2\n  ]\n}', True),
        # Whitespace is bounded: a model cannot loop on it.
        (StructuredOutputsParams(json_object=True), '{\n\n\n"a": 1}', False),
        (StructuredOutputsParams(json_object=True), '{"a":' + " " * 30 + "1}", False),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), '{"a":1}', True),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), '{"a": 1}', False),
        (StructuredOutputsParams(json_object=True, whitespace_pattern=" *"), '{"a":    1}', True),
    ],
)
def test_json_whitespace(
    compiler: GrammarCompiler, constraint: StructuredOutputsParams, text: str, accepted: bool
) -> None:
    matcher = compiler.matcher(constraint).matcher
    assert matcher.consume_tokens(list(text.encode())) == accepted
    assert matcher.is_accepting() == accepted


def test_listed_properties_admit_no_others_unless_the_schema_says(
    compiler: GrammarCompiler,
) -> None:
    """As vLLM's default backend reads a schema: an object listing its properties is closed."""
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    nested = {"type": "object", "properties": {"o": listed}, "required": ["o"]}
    open_ = {**listed, "additionalProperties": True}
    # Objects combined with others stay open: closing one would refuse what the others add.
    combined = {
        "type": "object",
        "allOf": [
            {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ],
    }
    # Data is never rewritten, even where it looks like a schema.
    constant = {"const": {"properties": 1}}
    for schema, text, accepted in [
        (listed, '{"a": 1}', True),
        (listed, '{"a": 1, "b": 2}', False),
        (nested, '{"o": {"a": 1, "b": 2}}', False),
        (open_, '{"a": 1, "b": 2}', True),
        ({"type": "object"}, '{"b": 2}', True),  # no properties listed: any object
        (combined, '{"a": 1, "b": 2}', True),
        (constant, '{"properties": 1}', True),
    ]:
        matcher = compiler.matcher(StructuredOutputsParams(json=schema)).matcher
        assert matcher.consume_tokens(list(text.encode())) == accepted, (schema, text)
