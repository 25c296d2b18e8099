"""Which drafts are worth verifying: the cost model and the acceptance it learns per slot."""

from __future__ import annotations

import pytest
import torch

from baton.engine.cpu import startup_timing
from baton.engine.speculation.draft_budget import DraftBudget, StepCost
from baton.engine.speculation.drafter import Draft

# A CPU step like SmolLM2's on two Zen 3 cores: 13 ms fixed, 4.3 ms a row.
CPU_COST = StepCost(fixed_s=0.013, per_row_s=0.0043)


def drafts(*lengths: int) -> list[Draft]:
    return [Draft(list(range(100, 100 + n))) for n in lengths]


def learned(budget: DraftBudget, slot: int, accepted: int, rejected: int) -> None:
    """Teach `slot` an acceptance history: runs of all-accepted drafts, and rejections."""
    for _ in range(accepted):
        budget.observe(slot, 1, 1)
    for _ in range(rejected):
        budget.observe(slot, 1, 0)


def test_a_lone_request_verifies_more_drafts_the_more_it_accepts() -> None:
    budget = DraftBudget(CPU_COST, num_slots=4, max_rows=None)
    # Prior alpha 0.8: three drafts pay (the third: 0.512 * 25.9 ms > 4.3 ms * 2.44 tokens),
    # the fourth does not (0.41 * 30.2 < 4.3 * 2.95).
    assert [len(d.tokens) for d in budget.trim([0], drafts(4), 1, 1)] == [3]
    learned(budget, 0, accepted=36, rejected=1)  # alpha = 40 / 42
    assert [len(d.tokens) for d in budget.trim([0], drafts(4), 1, 1)] == [4]
    learned(budget, 1, accepted=0, rejected=20)  # alpha = 4 / 25: not even one pays
    assert [len(d.tokens) for d in budget.trim([1], drafts(4), 1, 1)] == [0]


def test_a_full_batch_on_a_compute_bound_cpu_verifies_none() -> None:
    """16 rows: a row costs as much as the tokens it stands to buy, so no draft pays."""
    budget = DraftBudget(CPU_COST, num_slots=16, max_rows=32)
    for slot in range(16):
        learned(budget, slot, accepted=6, rejected=4)  # alpha 2/3, a good rate for n-grams
    kept = budget.trim(list(range(16)), drafts(*[4] * 16), 16, 16)
    assert all(not d.tokens for d in kept)
    # Requests that nearly always accept still make their first drafts pay.
    for slot in range(16):
        learned(budget, slot, accepted=200, rejected=0)
    kept = budget.trim(list(range(16)), drafts(*[4] * 16), 16, 16)
    assert any(d.tokens for d in kept)


def test_an_accelerator_verifies_every_likely_draft_up_to_the_cap() -> None:
    """Rows that cost almost nothing: drafts are kept most likely first, up to max_rows."""
    budget = DraftBudget(StepCost(fixed_s=0.01, per_row_s=1e-6), num_slots=8, max_rows=12)
    learned(budget, 0, accepted=20, rejected=1)  # likely
    learned(budget, 1, accepted=1, rejected=20)  # unlikely
    kept = budget.trim([1, 0], drafts(4, 4), 4, 2)
    # 8 spare rows: the likely row's 4 drafts first, then the other's, each row a prefix.
    assert [len(d.tokens) for d in kept] == [4, 4]
    kept = budget.trim([1, 0], drafts(4, 4), 6, 2)  # 6 spare rows
    assert [d.tokens for d in kept] == [[100, 101], [100, 101, 102, 103]]


def test_reset_forgets_the_previous_request_and_probs_follow_their_tokens() -> None:
    budget = DraftBudget(CPU_COST, num_slots=2, max_rows=None)
    learned(budget, 0, accepted=0, rejected=40)
    assert budget.acceptance(0) < 0.1
    budget.reset(0)
    assert budget.acceptance(0) == 0.8
    probs = torch.rand(4, 7)
    (kept,) = budget.trim([0], [Draft([1, 2, 3, 4], probs)], 1, 1)
    assert kept.tokens == [1, 2, 3] and torch.equal(kept.probs, probs[:3])


def test_observe_counts_the_run_and_the_rejection_that_ended_it() -> None:
    budget = DraftBudget(CPU_COST, num_slots=1, max_rows=None)
    budget.observe(0, 4, 4)  # all four accepted: no rejection seen
    budget.observe(0, 4, 1)  # one accepted, then a rejection (the other two never tried)
    assert budget.acceptance(0) == pytest.approx((5 + 4) / (5 + 4 + 1 + 1))


def test_step_cost_from_two_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixed cost and per-row cost from steps of 1 and of 16 rows (best of three each)."""
    clock = [0.0]
    durations = {1: [0.02, 0.017, 0.018, 0.019], 16: [0.09, 0.0815, 0.083, 0.082]}

    def run_rows(rows: int) -> None:
        clock[0] += durations[rows].pop(0)

    monkeypatch.setattr(startup_timing.time, "perf_counter", lambda: clock[0])
    cost = StepCost.measure(run_rows, 16)
    assert cost.per_row_s == pytest.approx((0.0815 - 0.017) / 15)
    assert cost.fixed_s == pytest.approx(0.017 - cost.per_row_s)


def test_step_cost_never_makes_a_row_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise that makes 16 rows look faster than one still leaves a row a positive cost."""
    clock = [0.0]

    def run_rows(rows: int) -> None:
        clock[0] += 0.01 if rows == 1 else 0.009

    monkeypatch.setattr(startup_timing.time, "perf_counter", lambda: clock[0])
    cost = StepCost.measure(run_rows, 16)
    assert cost.per_row_s > 0 and cost.fixed_s >= 0


def test_a_request_turned_down_gets_a_draft_tried_again_later() -> None:
    """Each step its drafts are all turned down, a request forgets some of its poor record, so
    after a few steps one draft is verified again (and a new verdict counts in full)."""
    budget = DraftBudget(CPU_COST, num_slots=1, max_rows=None)
    learned(budget, 0, accepted=0, rejected=20)
    kept_per_step = [len(budget.trim([0], drafts(4), 1, 1)[0].tokens) for _ in range(12)]
    assert kept_per_step[0] == 0 and max(kept_per_step) >= 1
    first_retry = next(step for step, kept in enumerate(kept_per_step) if kept)
    assert 3 <= first_retry <= 10


def test_drafts_cut_by_the_row_cap_forget_nothing() -> None:
    """A request whose drafts did not fit the batch's rows has shown nothing: it keeps its
    record (only the value rule's refusals make a request forget)."""
    budget = DraftBudget(StepCost(fixed_s=0.01, per_row_s=1e-6), num_slots=2, max_rows=4)
    learned(budget, 1, accepted=3, rejected=3)
    before = budget.acceptance(1)
    kept = budget.trim([0, 1], drafts(4, 4), 4, 2)  # no spare row at all
    assert [len(d.tokens) for d in kept] == [0, 0]
    assert budget.acceptance(1) == before
