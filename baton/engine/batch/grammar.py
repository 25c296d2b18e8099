"""Structured outputs on the request's side: each constrained request's llguidance matcher,
compiled when the scheduler admits the request and carried by its batch rows (the step's masks
built from the matchers are `engine/sampling/grammar_masks.py`'s).

Who touches a matcher: the scheduler builds it when it admits the request, and from then on
only the engine thread reads or advances it, in the order batches run. So the engine, not the
scheduler, advances it with each sampled token, and batch N+1 (scheduled by the overlap loop
before batch N's token is known) finds it already past that token when it samples. Every token
it consumes becomes the request's next output, or ends the request (a stop token, max_tokens,
an error): each sampled row says how many outputs precede its token, and a matcher that stands
elsewhere fails its row rather than mask by the wrong state.

A reply that opens in the model's reasoning (--reasoning-parser) reasons freely: its matcher
counts those outputs without constraining them, and constrains the ones after the token that
ends the reasoning, as vLLM's structured outputs do.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from llguidance import LLMatcher, LLTokenizer

from baton.checkpoint.tokenizer import Tokenizer
from baton.large_stack import on_large_stack
from baton.structured_outputs import CACHED_GRAMMARS, StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A constraint that does not compile against this model's tokenizer."""


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next. While
    `reasoning_end` is set, the output is the model's reasoning, which the grammar does not
    constrain, until that token comes."""

    def __init__(self, matcher: LLMatcher, reasoning_end: int | None = None) -> None:
        self.matcher = matcher
        self.num_consumed = 0
        self.reasoning_end = reasoning_end

    @property
    def constrains(self) -> bool:
        """Whether the grammar constrains the next token (the reasoning is over)."""
        return self.reasoning_end is None

    def can_sample(self, num_outputs: int) -> bool:
        """Whether it stands right after the request's first `num_outputs` outputs, in a state
        that allows some token."""
        return self.num_consumed == num_outputs and not self.matcher.is_error()

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False where the grammar does not allow it."""
        self.num_consumed += 1
        if self.reasoning_end is not None:
            if token == self.reasoning_end:
                self.reasoning_end = None
            return True
        return self.matcher.consume_token(token)


@dataclass(frozen=True)
class GrammarRow:
    """A constrained sampled row of a batch: its matcher, and how many of the request's outputs
    come before the token this row samples (the overlap loop's placeholders included)."""

    matcher: GrammarMatcher
    num_outputs: int


class GrammarCompiler:
    """Compiles constraints against one model's tokenizer. Its llguidance tokenizer (a pass
    over the vocabulary: ~0.25 s for 49k tokens) is built on the first constrained request, so
    servers that never see one pay nothing. A compiled grammar is kept (the last few): the n
    choices of a request, and requests that repeat a schema, each get a copy of it."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self._llguidance_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def matcher(
        self, constraint: StructuredOutputsParams, reasoning_end: int | None = None
    ) -> GrammarMatcher:
        """A fresh matcher at the constraint's start (once `reasoning_end` has come, where it
        is given); GrammarError if it does not compile."""
        grammar = constraint.llguidance_grammar()
        compiled = self._compiled.get(grammar)
        if compiled is None:
            tokenizer = self._llguidance()
            compiled = on_large_stack(lambda: LLMatcher(tokenizer, grammar, log_level=0))
            # Some grammars fail only once a mask is asked for (a schema referring only to
            # itself): the first one, which the request's first step needs anyway, is asked
            # for here, so that they are the request's error, not a failed generation.
            if not compiled.is_error():
                compiled.compute_bitmask()
            if compiled.is_error():
                raise GrammarError(f"the constraint does not compile: {first_error_line(compiled)}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return GrammarMatcher(compiled.deep_copy(), reasoning_end)

    def _llguidance(self) -> LLTokenizer:
        if self._llguidance_tokenizer is None:
            started = time.perf_counter()
            self._llguidance_tokenizer = LLTokenizer(
                self._tokenizer.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self._eos_token_ids or None,
            )
            logger.info(
                "structured outputs: tokenizer ready in %.2f s", time.perf_counter() - started
            )
        return self._llguidance_tokenizer


def first_error_line(matcher: LLMatcher) -> str:
    """The first line of a matcher's error (what follows is llguidance's whole parser state)."""
    return next(iter(matcher.get_error().strip().splitlines()), "")
