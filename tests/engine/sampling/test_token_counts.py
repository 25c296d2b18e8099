"""The penalties' token counts: distinct tokens and output occurrences, extended step by step,
starting over when a request enters a slot."""

from __future__ import annotations

from baton.engine.batch.forward_batch import ForwardBatch, TokenHistory
from baton.engine.sampling.token_counts import SlotTokenCounts, TokenCounts
from baton.sampling_params import SamplingParams

PENALIZED = SamplingParams(repetition_penalty=1.2)


def test_counts_hold_each_distinct_token_and_its_occurrences_in_the_output() -> None:
    counts = TokenCounts.of(TokenHistory([1, 3, 3, 5, 2, 2, 2, 9], prompt_len=4))
    assert list(counts.ids) == [1, 3, 5, 2, 9]
    assert list(counts.output_counts) == [0, 0, 0, 3, 1]
    assert counts.has_output and counts.length == 8


def test_extending_counts_only_the_tokens_added_since() -> None:
    counts = TokenCounts(prompt_len=2)
    counts.extend([4, 4])
    assert not counts.has_output
    counts.extend([4, 4, 4])
    counts.extend([4, 4, 4, 7])
    assert (list(counts.ids), list(counts.output_counts)) == ([4, 7], [1, 1])
    assert counts.length == 4


def one_row(slot: int, entered: bool, params: SamplingParams) -> ForwardBatch:
    return ForwardBatch(
        input_ids=[5],
        kv_starts=[3],
        q_lens=[1],
        page_tables=[[0]],
        slots=[slot],
        sample_rows=[0],
        sampling_params=[params],
        generators=[None],
        entered_slot=[entered],
    )


def test_a_slot_keeps_its_requests_counts_until_another_request_enters_it() -> None:
    store = SlotTokenCounts()
    first = store.update(one_row(2, True, PENALIZED), [TokenHistory([7, 8], prompt_len=2)])
    assert first is not None and list(first[0].ids) == [7, 8]
    again = store.update(one_row(2, False, PENALIZED), [TokenHistory([7, 8, 8], prompt_len=2)])
    assert again is not None and again[0] is first[0]
    assert list(first[0].output_counts) == [0, 1]
    # A request without penalties enters the slot: nothing to count, but the slot starts over.
    assert store.update(one_row(2, True, SamplingParams()), None) is None
    fresh = store.update(one_row(2, False, PENALIZED), [TokenHistory([9], prompt_len=1)])
    assert fresh is not None and fresh[0] is not first[0]
    assert list(fresh[0].ids) == [9]


def test_rows_that_do_not_penalize_have_no_counts() -> None:
    store = SlotTokenCounts()
    biased = SamplingParams(logit_bias={3: 1.0})
    assert store.update(one_row(0, True, biased), [TokenHistory([1, 2], prompt_len=2)]) is None
