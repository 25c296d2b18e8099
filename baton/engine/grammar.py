"""Structured outputs in the engine: each constrained request's llguidance matcher, and the
step's token masks built from them.

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

import ctypes
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from baton.checkpoint.tokenizer import Tokenizer
from baton.large_stack import on_large_stack
from baton.structured_outputs import CACHED_GRAMMARS, StructuredOutputsParams

logger = logging.getLogger(__name__)

BITS_PER_WORD = 32


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
                raise GrammarError(f"the constraint does not compile: {_first_line(compiled)}")
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


@dataclass(frozen=True)
class StepMasks:
    """One step's grammar masks: for each `rows` entry (an index into the step's sampled rows)
    `words` int32 words of `bits`, bit t of word t // 32 set where token t may come; and the
    sampled rows whose matcher cannot go on (their requests end with an error)."""

    rows: list[int]
    bits: ctypes.Array  # len(rows) * words int32, row after row
    words: int
    failed: list[int]


class GrammarMasks:
    """Masks a step's constrained rows: the tokens their grammars forbid become impossible."""

    def __init__(self) -> None:
        self._executor = LLExecutor()  # computes several rows' masks in parallel
        self._shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32)

    def compute(self, rows: Sequence[GrammarRow | None], vocab_size: int) -> StepMasks:
        """The masks of the sampled rows `rows` (None: unconstrained), over `vocab_size`
        logits. A plain ctypes buffer, no tensor: the native step reads it as it is."""
        failed: list[int] = []
        constrained: list[tuple[LLMatcher, int]] = []  # (matcher, its row of the bitmask)
        indices: list[int] = []
        for index, row in enumerate(rows):
            if row is None:
                continue
            if row.matcher.can_sample(row.num_outputs):
                if not row.matcher.constrains:
                    continue  # still reasoning: any token may come
                constrained.append((row.matcher.matcher, len(constrained)))
                indices.append(index)
            else:
                _log_failure(row, "cannot sample")
                failed.append(index)
        words = -(-vocab_size // BITS_PER_WORD)
        bits = (ctypes.c_int32 * (len(constrained) * words))()
        if constrained:
            self._executor.unsafe_compute_mask_ptr(
                constrained, ctypes.addressof(bits), words * 4, len(constrained)
            )
            # A grammar can also fail while its mask is computed (llguidance's lexer past its
            # limits, on a pathological regex): the mask it leaves allows at most the end of
            # the output, which must not pass for a grammar that completed.
            for index, (matcher, _) in zip(indices, constrained):
                if matcher.is_error():
                    _log_failure(rows[index], "failed on its mask")  # type: ignore[arg-type]
                    failed.append(index)
        return StepMasks(indices, bits, words, failed)

    def apply(self, logits: torch.Tensor, rows: Sequence[GrammarRow | None]) -> list[int]:
        """Mask `logits` [n, V] in place by each row's grammar (None: unconstrained); returns
        the rows whose matcher cannot go on (its request must end with an error)."""
        vocab_size = logits.shape[-1]
        masks = self.compute(rows, vocab_size)
        if not masks.rows:
            return masks.failed
        bitmask = torch.frombuffer(masks.bits, dtype=torch.int32).view(len(masks.rows), -1)
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        forbidden = (bits == 0).view(len(masks.rows), -1)[:, :vocab_size]
        index_tensor = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
        masked = logits.index_select(0, index_tensor)
        masked.masked_fill_(forbidden.to(logits.device), float("-inf"))
        logits.index_copy_(0, index_tensor, masked)
        return masks.failed

    @staticmethod
    def yield_to_grammars(
        logits: torch.Tensor, rows: Sequence[GrammarRow | None], suppressed: list[list[int]]
    ) -> list[list[int]]:
        """The tokens each row must not sample (min_tokens' stop tokens), less those of a
        constrained row whose mask allows nothing else: a complete grammar ends its output."""
        kept = []
        for index, (row, ids) in enumerate(zip(rows, suppressed)):
            if row is not None and ids:
                allowed = torch.isfinite(logits[index])
                allowed[ids] = False
                if not bool(allowed.any()):
                    ids = []
            kept.append(ids)
        return kept

    @staticmethod
    def advance(
        rows: Sequence[GrammarRow | None], token_ids: Sequence[int], failed: Sequence[int]
    ) -> list[int]:
        """Advance the matcher of each constrained row not `failed` already past its sampled
        token; returns the rows whose grammar refused it."""
        refused = []
        for index, (row, token) in enumerate(zip(rows, token_ids)):
            if row is None or index in failed:
                continue
            if not row.matcher.consume(token):
                _log_failure(row, f"refused token {token}")
                refused.append(index)
        return refused


def _log_failure(row: GrammarRow, what: str) -> None:
    matcher = row.matcher
    logger.error(
        "a grammar %s at output %d (it has consumed %d): %s",
        what,
        row.num_outputs,
        matcher.num_consumed,
        _first_line(matcher.matcher) or "no error from llguidance",
    )


def _first_line(matcher: LLMatcher) -> str:
    """The first line of a matcher's error (what follows is llguidance's whole parser state)."""
    return next(iter(matcher.get_error().strip().splitlines()), "")
