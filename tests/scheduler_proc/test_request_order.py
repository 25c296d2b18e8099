"""Scheduling policies: which waiting request runs first, and which running one is preempted."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.config import BatonConfig
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.request_order import RequestOrder, WorkCosts
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.sequence_state import EventKind, SequenceStatus

PROMPT = [5, 6, 7, 8]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def sequence(
    rid: str,
    arrival: float,
    max_tokens: int = 8,
    priority: int = 0,
    deadline_ms: float | None = None,
) -> Sequence:
    return Sequence(
        rid,
        PROMPT,
        greedy(max_tokens),
        max_tokens,
        page_size=4,
        arrival_time=arrival,
        priority=priority,
        deadline_ms=deadline_ms,
    )


def ordered(policy: str, sequences: list[Sequence]) -> list[str]:
    order = RequestOrder(policy)  # type: ignore[arg-type]
    queue: list[Sequence] = []
    for seq in sequences:  # inserted one by one, as requests arrive: the queue stays sorted
        order.insert(queue, seq)
    resorted = list(reversed(queue))
    order.sort(resorted)
    assert resorted == queue
    return [seq.rid for seq in queue]


def test_each_policy_orders_a_synthetic_workload() -> None:
    # Arrival order a..e; priorities, deadlines (ms from arrival) and lengths chosen so that
    # every policy gives a different order.
    workload = [
        sequence("a", arrival=0.0, max_tokens=2, priority=2, deadline_ms=1000),
        sequence("b", arrival=0.1, max_tokens=40, priority=1, deadline_ms=1000),
        sequence("c", arrival=0.2, max_tokens=4, priority=1, deadline_ms=None),
        sequence("d", arrival=0.5, max_tokens=4, priority=0, deadline_ms=500),
        sequence("e", arrival=0.6, max_tokens=90, priority=3, deadline_ms=1500),
    ]
    assert ordered("fcfs", workload) == ["a", "b", "c", "d", "e"]
    # Lower priority first; b and c tie at 1 and keep their arrival order.
    assert ordered("priority", workload) == ["d", "b", "c", "a", "e"]
    # Absolute deadlines: a 1.0, b 1.1, d 1.0, e 2.1; a and d tie (arrival); c has none.
    assert ordered("edf", workload) == ["a", "d", "b", "e", "c"]
    # Remaining time at the priors (0.1 ms a prompt token, 10 ms a decode step): a 0.0204 s,
    # b 0.4004, d 0.0404, e 0.9004; deadline minus that: a 0.980, b 0.700, d 0.960, e 1.200.
    assert ordered("lrs", workload) == ["b", "d", "a", "e", "c"]


def test_lrs_follows_progress_and_measured_costs() -> None:
    costs = WorkCosts(prefill_s_per_token=0.0, decode_s_per_step=0.01)
    order = RequestOrder("lrs", costs)
    long_job = sequence("long", arrival=0.0, max_tokens=50, deadline_ms=1000)  # slack 0.5 s
    short_job = sequence("short", arrival=0.0, max_tokens=10, deadline_ms=700)  # slack 0.6 s
    queue = [short_job, long_job]
    order.sort(queue)
    assert [seq.rid for seq in queue] == ["long", "short"]
    long_job.tokens.extend([1] * 30)  # 30 outputs done: 20 steps left, slack 0.8 s
    order.sort(queue)
    assert [seq.rid for seq in queue] == ["short", "long"]
    # Decode steps measured at 2 ms: the running average moves towards it.
    costs.observe(prefill_tokens=0, seconds=0.002)
    assert costs.decode_s_per_step == pytest.approx(0.01 + 0.2 * (0.002 - 0.01))
    costs.observe(prefill_tokens=100, seconds=0.05)
    assert costs.prefill_s_per_token == pytest.approx(0.2 * 0.0005)


def finish_order(scheduler: Scheduler, late: list[tuple[str, dict]]) -> list[str]:
    """Step until every request is done, adding the `late` ones after the first step; the
    order in which requests finish."""
    finished: list[str] = []
    first = True
    while scheduler.has_unfinished_requests() or late:
        finished += [output.rid for output in scheduler.step() if output.finished]
        if first:
            for rid, options in late:
                scheduler.add_request(rid, PROMPT, greedy(4), **options)
            late, first = [], False
    return finished


def one_slot_scheduler(model_dir: Path, policy: str) -> Scheduler:
    """A scheduler that runs one request at a time: the queue's order is the run order."""
    config = BatonConfig(
        model=str(model_dir), dtype="float32", max_running_requests=1, scheduling_policy=policy
    )
    return Scheduler(config)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("fcfs", ["a", "b", "c", "late"]), ("priority", ["a", "late", "b", "c"])],
)
def test_a_late_high_priority_request_overtakes_the_queue(
    tiny_llama_dir: Path, policy: str, expected: list[str]
) -> None:
    scheduler = one_slot_scheduler(tiny_llama_dir, policy)
    for rid in ("a", "b", "c"):
        scheduler.add_request(rid, PROMPT, greedy(4))
    assert finish_order(scheduler, [("late", {"priority": -1})]) == expected


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("edf", ["first", "tight", "loose", "none"]), ("lrs", ["first", "loose", "tight", "none"])],
)
def test_deadline_policies_run_the_queue_in_their_order(
    tiny_llama_dir: Path, policy: str, expected: list[str]
) -> None:
    """One slot: "first" runs at once; then edf takes the earliest deadline, while lrs takes the
    request whose deadline leaves the least slack for its work (a long one)."""
    scheduler = one_slot_scheduler(tiny_llama_dir, policy)
    scheduler.add_request("first", PROMPT, greedy(4))
    scheduler.step()
    scheduler.add_request("none", PROMPT, greedy(4))
    # Deadlines 200 s away, so the test's own speed cannot matter. "loose" has the later
    # deadline but 100 times the work: at any decode step time over 5 us its slack is the least.
    scheduler.add_request("loose", PROMPT, greedy(400), deadline_ms=200_500)
    scheduler.add_request("tight", PROMPT, greedy(4), deadline_ms=200_000)
    assert finish_order(scheduler, []) == expected


def test_preemption_takes_the_least_urgent_request(tiny_llama_dir: Path) -> None:
    """Two running requests outgrow a small pool: under priority, the one with the larger
    priority number is preempted, though it arrived first; under fcfs, the later arrival.
    (Different prompts: identical ones would share their filled pages through the prefix
    cache, and fit.)"""
    preempted = {}
    for policy in ("priority", "fcfs"):
        config = BatonConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            page_size=4,
            num_pages=12,
            max_model_len=48,
            scheduling_policy=policy,
        )
        scheduler = Scheduler(config)
        scheduler.add_request("early-unimportant", PROMPT, greedy(36), priority=5)
        scheduler.add_request("late-important", [9, 10, 11, 12], greedy(36), priority=0)
        while scheduler.has_unfinished_requests():
            scheduler.step()
            for rid, seq in scheduler.requests.items():
                if seq.num_preemptions:
                    preempted.setdefault(policy, rid)
        assert scheduler.aggregate_stats().used_pages == 0
    assert preempted == {"priority": "early-unimportant", "fcfs": "late-important"}


@pytest.mark.parametrize("batch_order", ["prefill-first", "decode-first"])
def test_batch_order_decides_what_a_batch_holds(tiny_llama_dir: Path, batch_order: str) -> None:
    """A decoding request and a newly arrived one: prefill-first runs the prefill alone (the
    decode waits a step); decode-first puts the decode in the batch, then the prefill chunk."""
    config = BatonConfig(
        model=str(tiny_llama_dir), dtype="float32", disable_overlap=True, batch_order=batch_order
    )
    scheduler = Scheduler(config)
    scheduler.add_request("decoding", PROMPT, greedy(8))
    scheduler.step()  # its prefill: it decodes from now on
    scheduler.add_request("new", [9] * 12, greedy(8))
    rows = scheduler.policy.next_batch()
    kinds = [(row.seq.rid, "prefill" if row.step.is_prefill else "decode") for row in rows]
    if batch_order == "prefill-first":
        assert kinds == [("new", "prefill")]
    else:
        assert kinds == [("decoding", "decode"), ("new", "prefill")]


@pytest.mark.parametrize("batch_order", ["prefill-first", "decode-first"])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_the_least_urgent_decodes_wait_when_the_token_budget_is_full(
    tiny_llama_dir: Path, batch_order: str, speculative: bool
) -> None:
    """A budget of 2 tokens a batch and three requests. Prefill-first admits all three, so each
    decode step takes the two most urgent (priority) and the third is displaced until one of
    them finishes, as its history says; decode-first admits no more than the budget decodes,
    so the least urgent waits in its prefill instead. No batch exceeds the budget (drafts shrink
    to fit it first), and the outputs are unchanged."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    config = BatonConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        chunk_size=2,
        scheduling_policy="priority",
        batch_order=batch_order,  # type: ignore[arg-type]
        speculative_config=spec if speculative else None,
    )
    scheduler = Scheduler(config)
    forward = scheduler.engine.forward
    batch_tokens: list[int] = []

    def counted_forward(batch):
        batch_tokens.append(batch.num_tokens)
        return forward(batch)

    scheduler.engine.forward = counted_forward
    for rid, priority in (("low", 2), ("high", 0), ("mid", 1)):
        scheduler.add_request(rid, PROMPT, greedy(6), priority=priority)
    sequences = dict(scheduler.requests)
    finished: list[str] = []
    tokens: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        for output in scheduler.step():
            tokens.setdefault(output.rid, []).extend(output.new_token_ids)
            if output.finished:
                finished.append(output.rid)
    assert finished[-1] == "low"
    displaced = {
        rid: sum(event.kind is EventKind.DISPLACED for event in seq.history)
        for rid, seq in sequences.items()
    }
    assert displaced["high"] == 0
    assert (displaced["low"] > 0) == (batch_order == "prefill-first")
    assert batch_tokens and max(batch_tokens) <= 2
    assert all(seq.status is SequenceStatus.FINISHED for seq in sequences.values())
    reference = Scheduler(BatonConfig(model=str(tiny_llama_dir), dtype="float32"))
    for rid in ("low", "high", "mid"):
        reference.add_request(rid, PROMPT, greedy(6))
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        for output in reference.step():
            expected.setdefault(output.rid, []).extend(output.new_token_ids)
    assert tokens == expected
