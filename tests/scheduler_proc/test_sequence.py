"""The two-phase sequence protocol: every typed error where the seed says, revert, history."""

from __future__ import annotations

import pytest

from baton.sampling_params import SamplingParams
from baton.scheduler_proc import errors
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.sequence_state import EventKind

PAGE = 4


def make(prompt_len: int = 8, max_tokens: int = 10, in_flight: int = 1, pages: int = 16):
    kv = KVCacheManager(pages, PAGE, enable_prefix_caching=True)
    seq = Sequence(
        "r", list(range(1, prompt_len + 1)), SamplingParams(), max_tokens, PAGE, in_flight
    )
    return seq, kv


def owned_pages(kv: KVCacheManager, *seqs: Sequence) -> int:
    """Pages accounted for: free + cached + held privately by the sequences (no double counting)."""
    private = {page for seq in seqs for page in seq.page_table} - set(_cached_page_ids(kv))
    return kv.allocator.num_free + kv.cache.num_cached_pages + len(private)


def _cached_page_ids(kv: KVCacheManager) -> list[int]:
    match = kv.cache.match_prefix(list(range(1, 200)))
    return list(match.pages)


def test_single_chunk_lifecycle_keeps_one_tail_token() -> None:
    seq, kv = make()
    assert seq.match_and_add_prefix(kv) == 0
    step = seq.schedule_prefill(8, kv)
    assert (step.start, step.num_tokens, step.samples) == (0, 8, True)
    assert len(seq.page_table) == 2 and kv.allocator.num_free == 14
    seq.apply_prefill(100)
    assert seq.kv_position == 8 and seq.tail_tokens == 1
    for token in (101, 102, 103):
        seq.schedule_decode(kv)
        seq.apply_decode(token)
        assert seq.tail_tokens == 1
    assert seq.output_ids == [100, 101, 102, 103]
    assert seq.kv_position == 11 and len(seq.page_table) == 3


def test_chunked_prefill_token_rules() -> None:
    seq, kv = make()
    seq.match_and_add_prefix(kv)
    assert not seq.schedule_prefill(3, kv).samples
    with pytest.raises(errors.TokenOnNonFinalChunk):
        seq.apply_prefill(5)
    seq.apply_prefill(None)
    assert seq.schedule_prefill(5, kv).samples
    with pytest.raises(errors.MissingTokenOnFinalChunk):
        seq.apply_prefill(None)
    seq.apply_prefill(9)
    assert seq.tail_tokens == 1


def test_schedule_errors_where_the_seed_says() -> None:
    seq, kv = make(max_tokens=2)
    seq.match_and_add_prefix(kv)
    with pytest.raises(errors.PrefillNotComplete):
        seq.schedule_decode(kv)
    with pytest.raises(errors.PrefillOverrun):
        seq.schedule_prefill(9, kv)
    seq.schedule_prefill(8, kv)
    with pytest.raises(errors.NotIdle):
        seq.schedule_decode(kv)
    with pytest.raises(errors.NotIdle):
        seq.schedule_prefill(1, kv)
    seq.apply_prefill(1)
    with pytest.raises(errors.PrefillComplete):
        seq.schedule_prefill(1, kv)
    seq.schedule_decode(kv)
    seq.apply_decode(2)
    with pytest.raises(errors.GenerationComplete):
        seq.schedule_decode(kv)


def test_wrong_dangling_count() -> None:
    seq, kv = make(in_flight=4)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(4, kv)  # non-final chunk: no placeholder
    seq.schedule_prefill(4, kv)  # final chunk: one placeholder
    seq.schedule_decode(kv)  # consumes the placeholder as its input
    assert seq.tail_tokens == 1
    # Two uncomputed tokens (as after appending tokens from outside the protocol): a decode step
    # computes only one, so it must refuse rather than silently skip a token's KV.
    seq.tokens.append(7)
    with pytest.raises(errors.WrongDanglingCount):
        seq.schedule_decode(kv)


def test_allocation_failed_changes_nothing() -> None:
    seq, kv = make(prompt_len=8, pages=1)
    seq.match_and_add_prefix(kv)
    with pytest.raises(errors.AllocationFailed):
        seq.schedule_prefill(8, kv)
    assert seq.kv_position == 0 and seq.page_table == [] and seq.num_pending == 0
    assert kv.allocator.num_free == 1


def test_apply_errors() -> None:
    seq, kv = make()
    with pytest.raises(errors.WrongState):
        seq.apply_prefill(1)
    with pytest.raises(errors.WrongState):
        seq.apply_decode(1)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(8, kv)
    with pytest.raises(errors.WrongState):
        seq.apply_decode(1)
    seq.apply_prefill(1)
    with pytest.raises(errors.WrongState):
        seq.apply_prefill(2)


def test_revert_restores_pages_lifo() -> None:
    seq, kv = make(prompt_len=6, in_flight=2)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(6, kv)
    before = (seq.kv_position, list(seq.page_table), kv.allocator.num_free, seq.total_tokens)
    seq.schedule_decode(kv)  # overlap: decode on the placeholder, still 2 pages (pos 6 < 8)
    seq.revert_schedule(kv)
    assert (seq.kv_position, seq.page_table, kv.allocator.num_free, seq.total_tokens) == before
    seq.apply_prefill(50)
    seq.schedule_decode(kv)
    seq.apply_decode(51)
    assert seq.kv_position == 7
    seq.schedule_decode(kv)  # position 7: last slot of page 2
    seq.apply_decode(52)
    free = kv.allocator.num_free
    seq.schedule_decode(kv)  # position 8 needs a third page
    assert kv.allocator.num_free == free - 1
    seq.revert_schedule(kv)
    assert kv.allocator.num_free == free and len(seq.page_table) == 2
    with pytest.raises(errors.NothingScheduled):
        seq.revert_schedule(kv)


def test_overlap_placeholders_and_apply_order() -> None:
    seq, kv = make(prompt_len=4, in_flight=2, max_tokens=3)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(4, kv)
    seq.schedule_decode(kv)  # scheduled before the prefill's token is known
    assert seq.num_placeholders == 2 and seq.tail_tokens == 1
    with pytest.raises(errors.NotIdle):
        seq.schedule_decode(kv)
    seq.apply_prefill(10)
    seq.schedule_decode(kv)
    assert seq.decode_budget_left == 0
    seq.apply_decode(11)
    seq.apply_decode(12)
    with pytest.raises(errors.GenerationComplete):
        seq.schedule_decode(kv)
    assert seq.output_ids == [10, 11, 12] and seq.num_placeholders == 0


def test_release_caches_whole_pages_and_reacquire_reuses_them() -> None:
    seq, kv = make(prompt_len=9, max_tokens=8)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(9, kv)
    seq.apply_prefill(77)
    seq.schedule_decode(kv)
    seq.apply_decode(78)
    seq.schedule_decode(kv)  # scheduled, not applied: release reverts it first
    seq.release(kv)
    assert seq.page_table == [] and seq.num_pending == 0
    # 10 tokens computed -> 2 whole pages cached, the rest freed.
    assert kv.cache.num_cached_pages == 2 and kv.allocator.num_free == 14
    assert seq.reacquire(kv) == 8
    assert seq.prefill_len == 11 and seq.kv_position == 8
    step = seq.schedule_prefill(3, kv)
    assert step.samples  # re-prefill ends by sampling the next token
    seq.apply_prefill(79)
    assert seq.output_ids == [77, 78, 79] and seq.tail_tokens == 1
    seq.release(kv)
    assert kv.allocator.num_free + kv.cache.num_cached_pages == 16


def test_prefix_match_leaves_one_token_to_compute() -> None:
    seq, kv = make(prompt_len=8)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(8, kv)
    seq.apply_prefill(1)
    seq.release(kv)
    other = Sequence("o", list(range(1, 9)), SamplingParams(), 4, PAGE)
    # All 8 prompt tokens are cached, but the last page is withheld so logits can be computed.
    assert other.match_and_add_prefix(kv) == 4
    assert other.schedule_prefill(4, kv).samples


def test_scored_prompt_positions_per_chunk_and_the_prefix_cache() -> None:
    """Position i scores prompt token i + 1: each chunk scores from the first token not yet
    scored, the final position (which samples) scores nothing, and a prompt still to score
    matches the prefix cache only over positions already scored."""
    kv = KVCacheManager(16, PAGE, enable_prefix_caching=True)
    prompt = list(range(1, 11))
    warm = Sequence("w", prompt, SamplingParams(), 4, PAGE)
    warm.match_and_add_prefix(kv)
    warm.schedule_prefill(10, kv)
    warm.apply_prefill(50)
    warm.release(kv)  # the prompt's first 8 tokens are cached now
    seq = Sequence("r", prompt, SamplingParams(prompt_logprobs=1), 8, PAGE, 2)
    assert seq.match_and_add_prefix(kv) == 0  # nothing scored: every position is computed
    first = seq.schedule_prefill(4, kv)
    second = seq.schedule_prefill(6, kv)  # scheduled while the first is in flight
    assert seq.prompt_tokens_to_score(first) == (0, prompt[1:5])
    assert seq.prompt_tokens_to_score(second) == (0, prompt[5:10])  # its last position samples
    seq.apply_prefill(None)
    seq.prompt_logprobs.extend([None] * 4)  # as apply_results does with the chunk's entries
    seq.apply_prefill(60)
    seq.prompt_logprobs.extend([None] * 5)
    for token in (61, 62, 63):
        seq.schedule_decode(kv)
        seq.apply_decode(token)
    seq.release(kv)  # a preemption after prefill: 13 tokens computed, 3 whole pages cached
    # Every prompt token is scored, so the cache serves it past the prompt (capped at the 9
    # scored positions, it would serve 2 pages).
    assert seq.reacquire(kv) == 12
    recompute = seq.schedule_prefill(2, kv)
    assert seq.prompt_tokens_to_score(recompute) == (0, [])
    # Preempted mid-prefill, with 3 tokens scored: the match stops there.
    partial = Sequence("p", prompt, SamplingParams(prompt_logprobs=0), 8, PAGE)
    partial.prompt_logprobs.extend([None] * 3)
    assert partial.match_and_add_prefix(kv) == 0  # whole pages only: 3 tokens make none
    partial.release(kv)
    partial.prompt_logprobs.extend([None] * 2)
    assert partial.match_and_add_prefix(kv) == 4
    assert partial.prompt_tokens_to_score(partial.schedule_prefill(6, kv)) == (1, prompt[6:10])


def test_history_records_every_transition() -> None:
    seq, kv = make(in_flight=2)
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(8, kv)
    seq.apply_prefill(1)
    seq.cache_computed_prefix(kv)
    seq.schedule_decode(kv)
    seq.apply_decode(2)
    seq.schedule_decode(kv)
    seq.revert_schedule(kv)
    seq.release(kv)
    seq.reacquire(kv)
    seq.finish("abort")
    history = seq.history
    kinds = [event.kind for event in history]
    assert kinds == [
        EventKind.CREATED,
        EventKind.PREFIX_MATCHED,
        EventKind.PREFILL_SCHEDULED,
        EventKind.PREFILL_APPLIED,
        EventKind.PREFIX_CACHED,
        EventKind.DECODE_SCHEDULED,
        EventKind.DECODE_APPLIED,
        EventKind.DECODE_SCHEDULED,
        EventKind.SCHEDULE_REVERTED,
        EventKind.RELEASED,
        EventKind.PREFIX_MATCHED,
        EventKind.REACQUIRED,
        EventKind.FINISHED,
    ]
    # The prompt's two whole pages reached the cache; the decode applied one token.
    assert history[4].num_tokens == 2 * PAGE and history[6].num_tokens == 1
    times = [event.time for event in seq.history]
    assert times == sorted(times)
