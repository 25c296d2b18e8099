"""Speculative steps of the two-phase sequence protocol (no model): schedule_speculative's
pre-allocation, apply_speculative's rollback of rejected drafts and its page drops, the typed
errors where the schedulable-sequence seed puts them, DecodeOutcome, the overlap loop's second
step scheduled on the first one's optimistic end (vLLM's scenario 4), and a seeded random
property test of the placeholder arithmetic against a reference written from the seed's formulas.

The mapping to the seed's vLLM names: num_computed_tokens = `seq.kv_position`,
num_output_placeholders = `seq.num_placeholders`, the true verified position = their difference
= `len(seq.tokens) - 1` once the prefill is done (the last known token is the dangling one).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from baton.sampling_params import SamplingParams
from baton.scheduler_proc import errors
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.sequence_state import DecodeOutcome, EventKind

PAGE = 4
MAX_LENGTH = DecodeOutcome.MAX_LENGTH


def make(
    prompt_len: int = 8,
    max_tokens: int = 30,
    in_flight: int = 1,
    pages: int = 32,
    page_size: int = PAGE,
) -> tuple[Sequence, KVCacheManager]:
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=True)
    prompt = list(range(1, prompt_len + 1))
    seq = Sequence("r", prompt, SamplingParams(), max_tokens, page_size, in_flight)
    return seq, kv


def prefilled(**options: int) -> tuple[Sequence, KVCacheManager]:
    """A sequence whose whole prompt is computed and whose first token (100) is sampled."""
    seq, kv = make(**options)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(seq.prefill_len, kv)
    seq.apply_prefill(100)
    return seq, kv


def cached_page_ids(kv: KVCacheManager, seq: Sequence) -> set[int]:
    """The radix cache's pages along the sequence's tokens (the only cached text in these tests)."""
    return set(kv.cache.match_prefix(seq.tokens).pages)


def assert_pages_accounted(kv: KVCacheManager, seq: Sequence) -> None:
    """Every page is in exactly one place: free, cached, or held privately by the sequence."""
    table = seq.page_table
    assert len(set(table)) == len(table), f"a page twice in the page table: {table}"
    assert not [page for page in table if kv.allocator.is_free(page)], "a held page is free"
    private = set(table) - cached_page_ids(kv, seq)
    assert kv.allocator.num_free + kv.cache.num_cached_pages + len(private) == kv.num_pages


def assert_all_returned(kv: KVCacheManager) -> None:
    assert kv.used_pages == 0
    assert kv.allocator.num_free + kv.cache.num_cached_pages == kv.num_pages


def kinds(seq: Sequence) -> list[EventKind]:
    return [event.kind for event in seq.history]


# --- schedule_speculative / apply_speculative -----------------------------------------------------
def test_schedule_speculative_preallocates_one_plus_k_positions() -> None:
    seq, kv = prefilled()
    assert (seq.kv_position, len(seq.page_table), kv.allocator.num_free) == (8, 2, 30)
    step = seq.schedule_speculative(4, kv)
    # The tail token at 8 and drafts at 9..12: 13 positions, 4 pages, 2 of them new.
    assert (step.start, step.num_tokens, step.num_drafts) == (8, 5, 4)
    assert step.samples and not step.is_prefill and step.num_pages_allocated == 2
    assert len(seq.page_table) == 4 and kv.allocator.num_free == 28
    assert seq.kv_position == 13 and seq.num_placeholders == 5
    assert seq.tail_tokens == 1 and seq.total_tokens == 14
    assert seq.history[-1].kind is EventKind.SPECULATIVE_SCHEDULED
    assert seq.history[-1].num_tokens == 4
    assert seq.num_pending == 1 and seq.decode_budget_left == 30 - 1 - 1
    assert_pages_accounted(kv, seq)


@pytest.mark.parametrize("accepted", range(9))
def test_apply_speculative_rolls_back_the_rejected_and_drops_their_pages(accepted: int) -> None:
    seq, kv = prefilled()
    seq.schedule_speculative(8, kv)  # positions 8..16: 5 pages, 3 new
    assert len(seq.page_table) == 5 and kv.allocator.num_free == 27
    tokens = [200 + i for i in range(accepted + 1)]
    outcome = seq.apply_speculative(tokens, 8, kv)
    rejected = 8 - accepted
    assert seq.output_ids == [100, *tokens]
    assert seq.kv_position == 17 - rejected == len(seq.tokens) - 1
    assert seq.num_placeholders == 0 and seq.tail_tokens == 1 and seq.num_pending == 0
    assert (seq.num_speculative_steps, seq.num_draft_tokens, seq.num_accepted_tokens) == (
        1,
        8,
        accepted,
    )
    # The pages past the computed tokens went back to the allocator, newest first.
    held = kv.pages_for(seq.kv_position)
    dropped = 5 - held
    assert seq.page_table == [0, 1, 2, 3, 4][:held]
    assert kv.allocator.num_free == 27 + dropped
    assert seq.history[-1].kind is EventKind.SPECULATIVE_APPLIED
    assert seq.history[-1].num_tokens == accepted
    if dropped:
        assert seq.history[-2].kind is EventKind.UNASSIGNED_DROPPED
        assert seq.history[-2].num_tokens == dropped * PAGE
    else:
        assert EventKind.UNASSIGNED_DROPPED not in kinds(seq)
    assert outcome.block_completed == (seq.kv_position // PAGE > 8 // PAGE)
    assert_pages_accounted(kv, seq)
    # The next step starts where the accepted tokens end.
    assert seq.schedule_decode(kv).start == seq.kv_position - 1
    seq.release(kv)
    assert_all_returned(kv)


def test_engine_may_verify_fewer_drafts_than_scheduled() -> None:
    """An n-gram drafter may find fewer drafts (or none): the unfilled positions are rejected."""
    seq, kv = prefilled()
    seq.schedule_speculative(4, kv)
    with pytest.raises(errors.AcceptedExceedsScheduled):
        seq.apply_speculative([1, 2, 3, 4], 2, kv)  # 3 drafts accepted of 2 verified
    seq.apply_speculative([1, 2, 3], 2, kv)
    assert seq.kv_position == 11 and seq.num_draft_tokens == 2 and seq.num_accepted_tokens == 2
    seq.schedule_speculative(4, kv)
    seq.apply_speculative([9], 0, kv)  # no drafts found: the step was a plain decode
    assert seq.kv_position == 12 and seq.num_draft_tokens == 2 and seq.num_accepted_tokens == 2
    # vLLM's num_drafts counts the steps that had drafts to verify.
    assert seq.num_speculative_steps == 1 and seq.output_ids == [100, 1, 2, 3, 9]
    assert seq.tail_tokens == 1 and len(seq.page_table) == kv.pages_for(12)
    assert_pages_accounted(kv, seq)


def test_rejected_drafts_return_pages_to_the_pool_step_after_step() -> None:
    """Many all-rejected steps in a row hold no more pages than plain decoding would."""
    seq, kv = prefilled(max_tokens=40)
    for step in range(30):
        seq.schedule_speculative(6, kv)
        seq.apply_speculative([300 + step], 6, kv)
        assert len(seq.page_table) == kv.pages_for(seq.kv_position)
        assert kv.allocator.num_free == kv.num_pages - len(seq.page_table)
    assert seq.kv_position == 8 + 30 and seq.num_accepted_tokens == 0
    assert seq.num_draft_tokens == 180 and seq.num_speculative_steps == 30
    seq.release(kv)
    assert_all_returned(kv)


def test_revert_of_a_speculative_step_frees_exactly_its_pages() -> None:
    seq, kv = prefilled()
    before = (seq.kv_position, list(seq.page_table), kv.allocator.num_free)
    step = seq.schedule_speculative(8, kv)
    assert step.num_pages_allocated == 3
    seq.revert_schedule(kv)
    assert (seq.kv_position, seq.page_table, kv.allocator.num_free) == before
    assert seq.history[-1].kind is EventKind.SCHEDULE_REVERTED
    assert seq.history[-1].num_tokens == 9
    assert seq.num_pending == 0
    seq.release(kv)
    assert_all_returned(kv)


def test_revert_of_a_speculative_step_restores_placeholders_and_tail() -> None:
    seq, kv = prefilled(in_flight=2)
    before = (seq.num_placeholders, seq.total_tokens, seq.tail_tokens)
    seq.schedule_speculative(3, kv)
    seq.revert_schedule(kv)
    assert (seq.num_placeholders, seq.total_tokens, seq.tail_tokens) == before == (0, 9, 1)
    seq.schedule_decode(kv)  # raises WrongDanglingCount with the bug: 4 tail tokens


# --- errors where the seed puts them -----------------------------------------------------------
def test_accepted_exceeds_scheduled() -> None:
    seq, kv = prefilled()
    seq.schedule_speculative(3, kv)
    state = (seq.kv_position, seq.num_placeholders, list(seq.page_table), kv.allocator.num_free)
    for tokens, num_drafted in (
        ([1, 2, 3, 4, 5], 3),
        ([1, 2, 3, 4, 5], 5),
        ([1, 2, 3], 1),
        ([], 3),
    ):
        with pytest.raises(errors.AcceptedExceedsScheduled):
            seq.apply_speculative(tokens, num_drafted, kv)
        # Nothing changed: the step is still there to be applied.
        assert seq.num_pending == 1 and seq.output_ids == [100]
        assert (seq.kv_position, seq.num_placeholders, seq.page_table) == state[:3]
        assert kv.allocator.num_free == state[3]
    assert seq.num_speculative_steps == seq.num_draft_tokens == 0
    seq.apply_speculative([1, 2, 3, 4], 3, kv)  # all 3 drafts and the bonus token
    assert seq.output_ids == [100, 1, 2, 3, 4] and seq.num_accepted_tokens == 3


def test_apply_of_the_wrong_kind_is_wrong_state() -> None:
    seq, kv = make(in_flight=2)
    with pytest.raises(errors.WrongState):
        seq.apply_speculative([1], 1, kv)  # nothing scheduled
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(8, kv)
    with pytest.raises(errors.WrongState):
        seq.apply_speculative([1], 1, kv)  # the oldest is a prefill
    seq.apply_prefill(100)
    seq.schedule_speculative(2, kv)
    seq.schedule_decode(kv)
    with pytest.raises(errors.WrongState):
        seq.apply_decode(5)  # the oldest is speculative
    assert seq.num_pending == 2 and seq.output_ids == [100]
    seq.apply_speculative([5, 6], 2, kv)
    with pytest.raises(errors.WrongState):
        seq.apply_speculative([7], 1, kv)  # the oldest is a plain decode
    assert seq.num_pending == 1
    assert seq.apply_decode(7) is DecodeOutcome.CONTINUE
    assert seq.output_ids == [100, 5, 6, 7] and seq.tail_tokens == 1


def test_schedule_speculative_errors() -> None:
    seq, kv = make(max_tokens=3)
    seq.match_and_add_prefix(kv)
    with pytest.raises(errors.PrefillNotComplete):
        seq.schedule_speculative(2, kv)
    seq.schedule_prefill(4, kv)
    with pytest.raises(errors.NotIdle):
        seq.schedule_speculative(2, kv)
    seq.apply_prefill(None)
    with pytest.raises(errors.PrefillNotComplete):  # half the prompt computed
        seq.schedule_speculative(2, kv)
    seq.schedule_prefill(4, kv)
    seq.apply_prefill(100)
    free = kv.allocator.num_free
    for bad in (0, -1):
        with pytest.raises(ValueError):
            seq.schedule_speculative(bad, kv)
    assert seq.num_pending == 0 and seq.kv_position == 8 and kv.allocator.num_free == free
    seq.schedule_speculative(2, kv)
    with pytest.raises(errors.NotIdle):
        seq.schedule_speculative(2, kv)
    seq.apply_speculative([1, 2], 2, kv)  # 3 outputs: max_tokens reached
    with pytest.raises(errors.GenerationComplete):
        seq.schedule_speculative(2, kv)
    assert seq.num_pending == 0 and kv.allocator.num_free == free - 1


def test_schedule_speculative_generation_complete_counts_the_step_in_flight() -> None:
    # max_tokens 2: the prefill's token and the in-flight step's sure token use it up, however
    # many drafts that step may still bring.
    seq, kv = prefilled(max_tokens=2, in_flight=2)
    seq.schedule_speculative(4, kv)
    assert seq.decode_budget_left == 0
    with pytest.raises(errors.GenerationComplete):
        seq.schedule_speculative(1, kv)
    with pytest.raises(errors.GenerationComplete):
        seq.schedule_decode(kv)


def test_schedule_speculative_wrong_dangling_count() -> None:
    seq, kv = prefilled()
    seq.tokens.append(7)  # two tokens without K/V: one step computes only the first
    with pytest.raises(errors.WrongDanglingCount):
        seq.schedule_speculative(2, kv)
    assert seq.num_pending == 0


def test_schedule_speculative_allocation_failed_changes_nothing() -> None:
    seq, kv = prefilled(pages=3)  # 2 pages hold the prompt
    before = (seq.kv_position, list(seq.page_table), seq.num_placeholders)
    with pytest.raises(errors.AllocationFailed):
        seq.schedule_speculative(8, kv)  # needs 3 more pages
    assert (seq.kv_position, seq.page_table, seq.num_placeholders) == before
    assert seq.num_pending == 0 and kv.allocator.num_free == 1
    seq.schedule_speculative(3, kv)  # 8..11 fits in one more page
    assert kv.allocator.num_free == 0


# --- DecodeOutcome ------------------------------------------------------------------------------
def test_apply_decode_outcomes_at_page_boundaries() -> None:
    # Prompt of 6 in pages of 4: the decode at position 6 leaves page 1 half full, the one at 7
    # fills it.
    seq, kv = prefilled(prompt_len=6, max_tokens=3)
    seq.schedule_decode(kv)
    assert seq.apply_decode(1) is DecodeOutcome.CONTINUE
    seq.schedule_decode(kv)
    outcome = seq.apply_decode(2)
    assert outcome is DecodeOutcome.BLOCK_COMPLETED_AND_MAX_LENGTH and outcome.block_completed
    seq, kv = prefilled(prompt_len=6, max_tokens=4)
    seq.schedule_decode(kv)
    seq.apply_decode(1)
    seq.schedule_decode(kv)
    assert seq.apply_decode(2) is DecodeOutcome.BLOCK_COMPLETED
    seq.schedule_decode(kv)
    outcome = seq.apply_decode(3)
    assert outcome is DecodeOutcome.MAX_LENGTH and not outcome.block_completed


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "num_drafts", "accepted", "expected"),
    [
        (6, 20, 3, 0, DecodeOutcome.CONTINUE),  # computed 6 -> 7
        (6, 20, 3, 1, DecodeOutcome.BLOCK_COMPLETED),  # 6 -> 8
        (6, 20, 3, 3, DecodeOutcome.BLOCK_COMPLETED),  # 6 -> 10
        (4, 20, 2, 2, DecodeOutcome.CONTINUE),  # 4 -> 7
        (4, 20, 3, 3, DecodeOutcome.BLOCK_COMPLETED),  # 4 -> 8
        (5, 20, 8, 8, DecodeOutcome.BLOCK_COMPLETED),  # 5 -> 14: two pages filled
        (4, 3, 3, 1, DecodeOutcome.MAX_LENGTH),  # 4 -> 6, 3 outputs
        (6, 3, 3, 1, DecodeOutcome.BLOCK_COMPLETED_AND_MAX_LENGTH),  # 6 -> 8, 3 outputs
        (6, 2, 3, 0, DecodeOutcome.MAX_LENGTH),  # 6 -> 7, 2 outputs
    ],
)
def test_apply_speculative_outcomes(
    prompt_len: int, max_tokens: int, num_drafts: int, accepted: int, expected: DecodeOutcome
) -> None:
    seq, kv = prefilled(prompt_len=prompt_len, max_tokens=max_tokens)
    seq.schedule_speculative(num_drafts, kv)
    assert seq.apply_speculative(list(range(accepted + 1)), num_drafts, kv) is expected


# --- the overlap loop: a second step on the first one's optimistic end (scenario 4) -------------
@pytest.mark.parametrize(
    ("drafts_a", "drafts_b", "accepted_a", "accepted_b"),
    [
        (4, 3, 1, 2),
        (4, 3, 4, 3),  # nothing rejected: nothing moves
        (8, 4, 0, 0),  # A's rejection drops B's page and one of A's
        (4, 7, 0, 5),  # A's rejection drops one of B's two pages
        (3, 0, 0, 0),  # B a plain decode
        (1, 6, 0, 6),
        (6, 6, 2, 1),
    ],
)
@pytest.mark.parametrize("finish", ["apply", "revert", "release"])
def test_overlapping_speculative_steps(
    drafts_a: int, drafts_b: int, accepted_a: int, accepted_b: int, finish: str
) -> None:
    seq, kv = prefilled(in_flight=2, max_tokens=40)
    step_a = seq.schedule_speculative(drafts_a, kv)
    end_a = 8 + 1 + drafts_a
    step_b = seq.schedule_speculative(drafts_b, kv) if drafts_b else seq.schedule_decode(kv)
    # B computes A's last position's token: it starts at A's optimistic end.
    assert step_b.start == end_a == step_a.start + step_a.num_tokens
    end_b = end_a + 1 + drafts_b
    assert seq.kv_position == end_b and seq.num_placeholders == 2 + drafts_a + drafts_b
    assert seq.tail_tokens == 1 and len(seq.page_table) == kv.pages_for(end_b)
    assert seq.decode_budget_left == 40 - 1 - 2
    with pytest.raises(errors.NotIdle):
        seq.schedule_decode(kv)
    assert_pages_accounted(kv, seq)

    seq.apply_speculative([10 + i for i in range(accepted_a + 1)], drafts_a, kv)
    rejected = drafts_a - accepted_a
    pending_b = seq._pending[0]
    assert pending_b.start == end_a - rejected == len(seq.tokens) - 1
    assert seq.kv_position == end_b - rejected
    assert seq.num_placeholders == 1 + drafts_b and seq.tail_tokens == 1
    # The true verified position is the seed's num_computed - num_output_placeholders.
    assert seq.kv_position - seq.num_placeholders == len(seq.tokens) - 1
    # Only the pages the still-scheduled positions need are held; B gave up those it lost.
    assert len(seq.page_table) == kv.pages_for(seq.kv_position)
    dropped = kv.pages_for(end_b) - kv.pages_for(end_b - rejected)
    assert kv.allocator.num_free == kv.num_pages - kv.pages_for(end_b) + dropped
    assert (EventKind.UNASSIGNED_DROPPED in kinds(seq)) == (dropped > 0)
    # A revert of B may free only pages its own positions use.
    own_at_most = len(seq.page_table) - kv.pages_for(pending_b.start)
    assert 0 <= pending_b.num_pages_allocated <= min(own_at_most, step_b.num_pages_allocated)
    assert_pages_accounted(kv, seq)

    if finish == "apply":
        tokens = [50 + i for i in range(accepted_b + 1)]
        if drafts_b:
            outcome = seq.apply_speculative(tokens, drafts_b, kv)
        else:
            outcome = seq.apply_decode(tokens[0])
        computed = pending_b.start + len(tokens)
        assert seq.kv_position == computed == len(seq.tokens) - 1
        assert outcome.block_completed == (computed // PAGE > pending_b.start // PAGE)
        assert seq.num_placeholders == 0 and seq.tail_tokens == 1
        assert len(seq.page_table) == kv.pages_for(computed)
        assert seq.num_accepted_tokens == accepted_a + accepted_b
        assert seq.num_draft_tokens == drafts_a + drafts_b
    elif finish == "revert":
        free = kv.allocator.num_free
        seq.revert_schedule(kv)  # frees what B still holds of its own, never a page twice
        assert kv.allocator.num_free == free + pending_b.num_pages_allocated
        assert seq.kv_position == pending_b.start and seq.num_pending == 0
        assert len(seq.page_table) >= kv.pages_for(seq.kv_position)
    assert_pages_accounted(kv, seq)
    seq.release(kv)  # reverts whatever is still scheduled; a double free would raise
    assert seq.page_table == []
    assert_all_returned(kv)


def test_scenario_4_worked_example() -> None:
    """The seed's example: k=5 drafts scheduled (6 placeholders), 3 accepted, 2 rejected."""
    seq, kv = prefilled(in_flight=2, max_tokens=40)
    verified = seq.kv_position - seq.num_placeholders
    seq.schedule_speculative(5, kv)
    assert seq.kv_position == verified + 6 and seq.num_placeholders == 6
    seq.schedule_decode(kv)  # the next step, on the optimistic end
    assert seq.kv_position == verified + 7 and seq.num_placeholders == 7
    seq.apply_speculative([1, 2, 3, 4], 5, kv)  # 3 drafts accepted and the bonus token
    # num_computed rolled back by the 2 rejected; the 6 placeholders resolved (4 received).
    assert seq.kv_position == verified + 7 - 2
    assert seq.num_placeholders == 1
    assert seq.kv_position - seq.num_placeholders == verified + 4 == len(seq.tokens) - 1


def test_revert_after_a_rollback_holds_only_the_computed_tokens_pages() -> None:
    seq, kv = prefilled(prompt_len=7, in_flight=2)  # positions 0..6: pages 0, 1
    seq.schedule_speculative(3, kv)  # A: positions 7..10, page 2 allocated by A
    seq.schedule_decode(kv)  # B: position 11, page 2 (allocates nothing)
    seq.apply_speculative([1], 3, kv)  # all rejected: B moves to position 8, still page 2
    assert seq.kv_position == 9 and len(seq.page_table) == 3
    seq.revert_schedule(kv)  # B undone: 8 computed tokens, 2 pages
    assert seq.kv_position == 8 and seq.num_pending == 0
    assert len(seq.page_table) == kv.pages_for(8)  # fails: page 2 is still held


# --- property test: placeholder arithmetic against the seed's formulas --------------------------
@dataclass
class RefStep:
    start: int
    num_tokens: int
    is_prefill: bool
    samples: bool


@dataclass
class Reference:
    """vLLM's variables, updated by the seed's formulas (scenario 4)."""

    num_prompt_tokens: int
    max_tokens: int
    num_tokens: int  # known tokens: prompt and outputs
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    pending: list[RefStep] = field(default_factory=list)

    def schedule(self, num_tokens: int, is_prefill: bool, samples: bool) -> None:
        self.pending.append(RefStep(self.num_computed_tokens, num_tokens, is_prefill, samples))
        self.num_computed_tokens += num_tokens
        # A decode counts its bonus token and every draft: "1 + k placeholders".
        self.num_output_placeholders += num_tokens if not is_prefill else int(samples)

    def apply(self, num_outputs: int) -> None:
        step = self.pending.pop(0)
        self.num_tokens += num_outputs
        if step.is_prefill:
            self.num_output_placeholders -= int(step.samples)
            return
        # The output arrives: its placeholders are resolved, the rejected positions rolled back,
        # and the step scheduled after it (on the optimistic end) starts that much lower.
        rejected = step.num_tokens - num_outputs
        self.num_output_placeholders -= step.num_tokens
        self.num_computed_tokens -= rejected
        for later in self.pending:
            later.start -= rejected

    def revert(self) -> None:
        step = self.pending.pop()
        self.num_computed_tokens -= step.num_tokens
        self.num_output_placeholders -= (
            step.num_tokens if not step.is_prefill else int(step.samples)
        )

    @property
    def true_verified_position(self) -> int:
        return self.num_computed_tokens - self.num_output_placeholders

    @property
    def seed_skips(self) -> bool:
        """The seed's worst-case check: even with every draft rejected, the in-flight step's bonus
        token and the next step's would reach max_tokens."""
        return (
            self.num_output_placeholders > 0
            and self.num_computed_tokens + 2 - self.num_output_placeholders
            >= self.num_prompt_tokens + self.max_tokens
        )


def check(seq: Sequence, ref: Reference, kv: KVCacheManager) -> None:
    assert seq.kv_position == ref.num_computed_tokens
    assert seq.num_placeholders == ref.num_output_placeholders
    assert len(seq.tokens) == ref.num_tokens
    assert [step.start for step in seq._pending] == [step.start for step in ref.pending]
    assert [step.num_tokens for step in seq._pending] == [step.num_tokens for step in ref.pending]
    mid_prefill = any(step.is_prefill for step in ref.pending)
    if seq.prefill_done and not mid_prefill:
        # (a) The seed's invariants: one dangling token, and the true verified position.
        assert seq.tail_tokens == 1
        assert ref.true_verified_position == len(seq.tokens) - 1
    if seq.num_pending == 1:
        # (b) The seed's skip check is the sequence's budget check with one step in flight.
        assert ref.seed_skips == (seq.decode_budget_left <= 0)
    if seq.num_pending == 0 and seq.prefill_done:
        assert (seq.decode_budget_left <= 0) == (seq.num_output_tokens >= seq.max_tokens)
    # (c) Pages: those the scheduled positions need, the pending steps' own among them.
    assert len(seq.page_table) == kv.pages_for(seq.kv_position)
    computed = seq.kv_position - sum(step.num_tokens for step in seq._pending)
    own = sum(step.num_pages_allocated for step in seq._pending)
    assert len(seq.page_table) - own >= kv.pages_for(computed)
    assert_pages_accounted(kv, seq)


def random_run(seed: int, reverts: bool) -> dict[str, int]:
    """One sequence driven by random schedule/apply/revert/preempt steps, as the overlap loop
    (max_in_flight 2) with speculative decoding would; returns what happened, by kind."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 3, 4, 5])
    prompt_len = rng.randint(1, 14)
    max_tokens = rng.randint(1, 14)
    chunk = rng.choice([prompt_len, rng.randint(1, prompt_len)])
    pages = -(-(prompt_len + 3 * max_tokens + 24) // page_size)
    kv = KVCacheManager(pages, page_size, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=max_tokens)
    prompt = [rng.randrange(9) for _ in range(prompt_len)]
    seq = Sequence("p", prompt, params, max_tokens, page_size, max_in_flight=2)
    ref = Reference(prompt_len, max_tokens, prompt_len)
    seq.match_and_add_prefix(kv)
    counts = dict.fromkeys(["spec", "decode", "rejected", "revert", "preempt", "overlap"], 0)
    finished = False
    for _ in range(200):
        options = []
        if seq.can_schedule and (not seq.prefill_done or seq.decode_budget_left > 0):
            options += ["schedule"] * 3
        if seq.num_pending:
            options += ["apply"] * 3
            if reverts:
                options.append("revert")
        if not seq.num_pending and seq.prefill_done and rng.random() < 0.3:
            options.append("preempt")
        op = rng.choice(options)
        if op == "schedule":
            if not seq.prefill_done:
                num_tokens = min(chunk, seq.prefill_len - seq.kv_position)
                step = seq.schedule_prefill(num_tokens, kv)
                ref.schedule(num_tokens, True, step.samples)
            elif rng.random() < 0.25:
                seq.schedule_decode(kv)
                ref.schedule(1, False, True)
                counts["decode"] += 1
            else:
                num_drafts = rng.randint(1, 6)
                seq.schedule_speculative(num_drafts, kv)
                ref.schedule(1 + num_drafts, False, True)
                counts["spec"] += 1
            counts["overlap"] += seq.num_pending == 2
        elif op == "apply":
            step = seq._pending[0]
            if step.is_prefill:
                token = rng.randrange(9) if step.samples else None
                seq.apply_prefill(token)
                ref.apply(int(step.samples))
                if token is not None:
                    seq.cache_computed_prefix(kv)  # as the scheduler does after a prefill
                    finished = seq.num_output_tokens >= max_tokens
            else:
                # The engine verifies up to the scheduled drafts, accepts a prefix; the scheduler
                # keeps up to max_tokens and up to a stop token (kept_tokens).
                num_drafted = rng.randint(0, step.num_drafts)
                tokens = [rng.randrange(9) for _ in range(1 + rng.randint(0, num_drafted))]
                room = seq.max_tokens - seq.num_output_tokens
                assert room > 0  # a sequence at max_tokens finished already
                stop = rng.random() < 0.03
                kept = tokens[: rng.randint(1, min(room, len(tokens)))] if stop else tokens[:room]
                if step.num_drafts:
                    outcome = seq.apply_speculative(kept, num_drafted, kv)
                    counts["rejected"] += step.num_tokens - len(kept)
                else:
                    outcome = seq.apply_decode(kept[0])
                ref.apply(len(kept))
                assert outcome.block_completed == (
                    (step.start + len(kept)) // page_size > step.start // page_size
                )
                max_length = outcome in (MAX_LENGTH, DecodeOutcome.BLOCK_COMPLETED_AND_MAX_LENGTH)
                assert max_length == (seq.num_output_tokens >= max_tokens)
                if outcome.block_completed:
                    seq.cache_computed_prefix(kv)
                finished = stop or seq.num_output_tokens >= max_tokens
        elif op == "revert":
            step = seq._pending[-1]
            seq.revert_schedule(kv)
            ref.revert()
            counts["revert"] += 1
        else:  # preempt: everything back, then recompute what is known
            seq.release(kv)
            assert seq.page_table == [] and seq.kv_position == 0
            matched = seq.reacquire(kv)
            assert matched % page_size == 0 and matched < len(seq.tokens)
            ref.num_computed_tokens = matched
            counts["preempt"] += 1
        check(seq, ref, kv)
        if finished:
            break
    seq.release(kv)  # steps still scheduled are reverted, as for a finished request
    assert seq.page_table == [] and seq.num_pending == 0
    assert_all_returned(kv)
    return counts


def run_many(reverts: bool, runs: int) -> dict[str, int]:
    totals: dict[str, int] = {}
    for seed in range(runs):
        try:
            counts = random_run(seed, reverts)
        except AssertionError as error:
            raise AssertionError(f"seed {seed}: {error}") from error
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    return totals


def test_placeholder_arithmetic_matches_the_seed_property() -> None:
    totals = run_many(reverts=False, runs=400)
    # The runs did exercise what they are meant to.
    assert totals["spec"] > 1000 and totals["decode"] > 300 and totals["rejected"] > 1000
    assert totals["overlap"] > 500 and totals["preempt"] > 20


def test_placeholder_arithmetic_with_reverts_property() -> None:
    totals = run_many(reverts=True, runs=300)
    assert totals["revert"] > 100
