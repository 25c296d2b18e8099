"""Each step's grammar masks: which tokens each constrained sampled row may take, built from its
request's matcher (`engine/batch/grammar.py`), applied to the logits by the torch sampler or read
as they are by the native step, and the matchers advanced past the sampled tokens."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from llguidance import LLExecutor, LLMatcher

from baton.engine.batch.grammar import GrammarRow, first_error_line

logger = logging.getLogger(__name__)

BITS_PER_WORD = 32


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
        first_error_line(matcher.matcher) or "no error from llguidance",
    )
