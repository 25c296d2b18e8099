"""A model whose every layer attends within a window: a request's private pages that leave its
window go back to the pool as it generates (pool usage stays flat on a long generation), its
prompt's pages stay cached, and release and preemption give back exactly what is left."""

from __future__ import annotations

import pytest

from baton.sampling_params import SamplingParams
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.sequence_pages import DROPPED_PAGE

PAGE, PAGES, WINDOW = 4, 64, 8


def generate(seq: Sequence, kv: KVCacheManager, tokens: int) -> list[int]:
    """Prefill, then `tokens` decode steps applied as the scheduler applies them
    (batch_result.py); the pages the request holds privately after each step."""
    seq.match_and_add_prefix(kv)
    seq.schedule_prefill(seq.prefill_len, kv)
    seq.apply_prefill(100)
    seq.cache_computed_prefix(kv)
    held = []
    for token in range(tokens):
        seq.schedule_decode(kv)
        if seq.apply_decode(101 + token).block_completed:
            seq.cache_computed_prefix(kv)
            seq.drop_pages_out_of_window(kv)
        # (the table's head is cached, then come the pages given back, then those held)
        held.append(len(seq.page_table) - max(seq.window_dropped_end, seq.num_cached_pages))
    return held


@pytest.mark.parametrize("caching", [True, False])
def test_pages_out_of_the_window_go_back_as_a_request_generates(caching: bool) -> None:
    kv = KVCacheManager(PAGES, PAGE, caching, window=WINDOW)
    seq = Sequence("r", list(range(1, 7)), SamplingParams(), 100, PAGE)
    held = generate(seq, kv, 80)
    # The window's 8 positions span at most 3 pages, with the page being filled 4: flat.
    assert max(held) <= 4 and held[-1] >= 2
    assert seq.num_cached_pages == (1 if caching else 0)  # the prompt's whole page, cached
    assert kv.allocator.num_free == PAGES - seq.num_cached_pages - held[-1]
    dropped = seq.page_table[seq.num_cached_pages : seq.window_dropped_end]
    assert dropped and set(dropped) == {DROPPED_PAGE}
    # The window's pages are the table's last, as they were allocated.
    oldest_read = seq.num_step_processed - WINDOW + 1
    assert seq.window_dropped_end == oldest_read // PAGE
    seq.release(kv)
    # The prompt's whole page stays cached (with caching), every other page is free.
    assert kv.cache.num_cached_pages == (1 if caching else 0)
    assert kv.allocator.num_free + kv.cache.num_cached_pages == PAGES


def test_without_a_window_a_request_holds_every_page() -> None:
    kv = KVCacheManager(PAGES, PAGE, True)
    seq = Sequence("r", list(range(1, 7)), SamplingParams(), 100, PAGE)
    generate(seq, kv, 80)
    # 86 tokens (85 computed): every whole page cached as it fills, none given back.
    assert seq.window_dropped_end == 0 and seq.num_cached_pages == 85 // PAGE
    assert kv.allocator.num_free == PAGES - len(seq.page_table) == PAGES - 22


def test_a_preempted_request_recomputes_from_its_cached_prompt() -> None:
    kv = KVCacheManager(PAGES, PAGE, True, window=WINDOW)
    seq = Sequence("r", list(range(1, 11)), SamplingParams(), 100, PAGE)
    generate(seq, kv, 30)
    seq.release(kv)  # a preemption: only the prompt's two whole pages stay cached
    assert kv.cache.num_cached_pages == 2 and kv.allocator.num_free == PAGES - 2
    assert seq.reacquire(kv) == 8
    assert seq.prefill_len == 41 and seq.window_dropped_end == 0


def test_a_step_in_flight_keeps_its_window() -> None:
    """With the overlap loop a later step is scheduled before the earlier one is applied: the
    pages given back are out of the window of the oldest position still to compute."""
    kv = KVCacheManager(PAGES, PAGE, True, window=WINDOW)
    seq = Sequence("r", list(range(1, 7)), SamplingParams(), 100, PAGE, 2)
    generate(seq, kv, 20)
    seq.schedule_decode(kv)
    seq.schedule_decode(kv)  # on a placeholder: in flight
    seq.apply_decode(500)
    before = seq.window_dropped_end
    seq.drop_pages_out_of_window(kv)
    first_unread = seq.num_step_processed - WINDOW + 1
    # Every page wholly before the oldest position still read is given back, no later one.
    assert seq.window_dropped_end == first_unread // PAGE >= before > 0
    assert DROPPED_PAGE not in seq.page_table[seq.window_dropped_end :]
