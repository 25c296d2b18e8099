"""Which drafts are worth verifying: the expected tokens they buy against what they cost.

A step's time grows with its rows: `fixed_s + per_row_s * rows` (measured when the engine starts).
A draft is worth its row when its chance of being accepted buys more than the row costs at the
batch's current rate of tokens per second: with T the step's time and E the tokens it is expected
to yield, a draft accepted with probability p is kept while p * T > per_row_s * E. The j-th draft
of a request counts only if the j - 1 before it are accepted, so its p is alpha ** j, where alpha
is the request's acceptance rate so far (from an optimistic prior). Drafts are taken most
likely first until one does not pay; so a lone request on a CPU, whose step is mostly fixed cost,
verifies several, while a full batch, already bound by its rows' compute, verifies few or none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from baton.engine.cpu.startup_timing import best_time
from baton.engine.speculation.drafter import Draft

# The acceptance prior, as pseudo-counts of accepted and rejected drafts: optimistic (0.8), so a
# new request gets to show what its drafts are worth even in a full batch (a pessimistic prior
# would never verify one, and never learn); a few verdicts outweigh it.
_PRIOR_ACCEPTED = 4.0
_PRIOR_REJECTED = 1.0
# A request whose drafts are all turned down keeps this much of its evidence per step, so the
# prior slowly wins back and a draft is tried again now and then: text that turns repetitive
# later is not ignored for good.
_FORGET = 0.9


@dataclass(frozen=True)
class StepCost:
    """A step's time as a function of its rows (tokens)."""

    fixed_s: float
    per_row_s: float

    @classmethod
    def measure(cls, run_rows: Callable[[int], None], many_rows: int) -> StepCost:
        """Time `run_rows(1)` and `run_rows(many_rows)` (best of three each, after a warm-up)."""
        one, many = best_time(run_rows, 1), best_time(run_rows, many_rows)
        # Noise can make the larger step look no slower: a row then costs next to nothing.
        per_row = max((many - one) / max(many_rows - 1, 1), one * 1e-3)
        return cls(fixed_s=max(one - per_row, 0.0), per_row_s=per_row)


class DraftBudget:
    """Keeps per slot its request's acceptance, and trims a batch's drafts to those that pay."""

    def __init__(self, cost: StepCost, num_slots: int, max_rows: int | None) -> None:
        self.cost = cost
        self.max_rows = max_rows  # a hard cap on the batch's rows (None: none)
        self._accepted = [0.0] * num_slots
        self._rejected = [0.0] * num_slots

    def reset(self, slot: int) -> None:
        """A new request took the slot."""
        self._accepted[slot] = self._rejected[slot] = 0.0

    def observe(self, slot: int, num_verified: int, num_accepted: int) -> None:
        """A verdict: each accepted draft counts as a success, the first rejected one (if any) as
        the failure that ended the run (the drafts after it were never tried)."""
        self._accepted[slot] += num_accepted
        self._rejected[slot] += num_accepted < num_verified

    def acceptance(self, slot: int) -> float:
        accepted = self._accepted[slot] + _PRIOR_ACCEPTED
        return accepted / (accepted + self._rejected[slot] + _PRIOR_REJECTED)

    def trim(
        self, slots: list[int], drafts: list[Draft], num_rows: int, num_outputs: int
    ) -> list[Draft]:
        """Keep of each row's drafts (its slot in `slots`) the prefix worth verifying in a batch
        of `num_rows` rows (without drafts) that yields `num_outputs` tokens for sure."""
        candidates = []  # (probability, row, index): the index-th draft of the row
        for row, (slot, draft) in enumerate(zip(slots, drafts)):
            alpha = self.acceptance(slot)
            candidates.extend(
                (alpha ** (index + 1), row, index) for index in range(len(draft.tokens))
            )
        # Most likely first; a row's drafts come in order, as each is likelier than the next.
        candidates.sort(key=lambda candidate: (-candidate[0], candidate[2], candidate[1]))
        step_s = self.cost.fixed_s + self.cost.per_row_s * num_rows
        expected = float(num_outputs)
        keep = [0] * len(drafts)
        turned_down = False  # by the value rule, not the cap on rows
        for probability, row, _ in candidates:
            if self.max_rows is not None and num_rows >= self.max_rows:
                break
            if probability * step_s <= self.cost.per_row_s * expected:
                turned_down = True
                break
            keep[row] += 1
            num_rows += 1
            step_s += self.cost.per_row_s
            expected += probability
        for slot, draft, kept in zip(slots, drafts, keep):
            if turned_down and draft.tokens and not kept:
                self._accepted[slot] *= _FORGET
                self._rejected[slot] *= _FORGET
        return [
            draft if kept == len(draft.tokens) else _prefix(draft, kept)
            for draft, kept in zip(drafts, keep)
        ]


def _prefix(draft: Draft, length: int) -> Draft:
    return Draft(draft.tokens[:length], None if draft.probs is None else draft.probs[:length])
