"""The waiting queue's fairness: clients of equal rank are admitted in turn, however much one of
them queues; a more urgent rank still goes first, and each client's own order is kept. In the
scheduler, a client past its share of the queue is refused as overloaded, and no one else is."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.config import BatonConfig, SchedulingPolicy
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.request_order import RequestOrder
from baton.scheduler_proc.scheduler import Scheduler
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.waiting_queue import WaitingQueue
from baton.validation import OverloadedError

FLOOD = 100
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def sequence(
    rid: str,
    client: bytes,
    arrival: float,
    priority: int = 0,
    deadline_ms: float | None = None,
) -> Sequence:
    return Sequence(
        rid,
        [5, 6, 7],
        GREEDY,
        4,
        page_size=4,
        arrival_time=arrival,
        priority=priority,
        deadline_ms=deadline_ms,
        client=client,
    )


def queue_of(policy: SchedulingPolicy, sequences: list[Sequence]) -> WaitingQueue:
    queue = WaitingQueue(RequestOrder(policy))
    for seq in sequences:  # in arrival order, as requests come
        queue.insert(seq)
    return queue


def admission_order(queue: WaitingQueue) -> list[str]:
    """Admit until nothing admissible is left; the rids in admission order."""
    return admission_order_of(queue, len(queue))


def admission_order_of(queue: WaitingQueue, count: int) -> list[str]:
    """Admit up to `count` requests; the rids in admission order."""
    admitted = []
    while len(admitted) < count and (seq := queue.next_to_admit()) is not None:
        queue.admit(seq)
        admitted.append(seq.rid)
    return admitted


def flood_then(late: Sequence, policy: SchedulingPolicy = "fcfs") -> list[str]:
    """Client "flood" queues FLOOD requests, then `late` comes: the admission order."""
    flood = [sequence(f"flood{i}", b"flood", arrival=float(i)) for i in range(FLOOD)]
    return admission_order(queue_of(policy, [*flood, late]))


def test_a_flood_delays_another_clients_request_by_one_admission() -> None:
    """First come, first served would admit the late request last, after the whole flood: now
    the flooding client, whose turn it is, gets one admission first. The flood keeps its own
    order."""
    order = flood_then(sequence("late", b"other", arrival=FLOOD))
    assert order.index("late") == 1
    assert [rid for rid in order if rid != "late"] == [f"flood{i}" for i in range(FLOOD)]


def test_clients_of_equal_rank_take_turns() -> None:
    """Three clients in the order they started waiting; one leaves the round once it has
    nothing waiting."""
    queue = queue_of(
        "fcfs",
        [sequence(f"a{i}", b"a", arrival=i) for i in range(3)]
        + [sequence(f"b{i}", b"b", arrival=10 + i) for i in range(3)]
        + [sequence("c0", b"c", arrival=20)],
    )
    assert len(queue) == 7 and queue.count(b"a") == 3 and queue.count(b"nobody") == 0
    assert admission_order(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "b2"]
    assert len(queue) == 0


def test_a_more_urgent_rank_goes_first_whatever_the_turn() -> None:
    """Under priority, a flood of priority 0 waits for another client's priority -1, and
    delays its priority 0 by one admission, as under fcfs; it does not make way for a
    priority 1."""

    def position(priority: int) -> int:
        late = sequence("late", b"other", arrival=FLOOD, priority=priority)
        return flood_then(late, "priority").index("late")

    assert (position(-1), position(0), position(1)) == (0, 1, FLOOD)


def test_under_deadlines_equal_ranks_are_the_requests_without_one() -> None:
    """edf: deadlines in their order, whoever sent them; the requests without a deadline, all of
    one rank, in turn across clients."""
    queue = queue_of(
        "edf",
        [
            sequence("a-none0", b"a", arrival=0),
            sequence("a-none1", b"a", arrival=1),
            sequence("a-late", b"a", arrival=2, deadline_ms=5000),
            sequence("b-none", b"b", arrival=3),
            sequence("b-soon", b"b", arrival=4, deadline_ms=1000),
        ],
    )
    # Then "a", admitted from last, waits for "b"'s turn.
    assert admission_order(queue) == ["b-soon", "a-late", "b-none", "a-none0", "a-none1"]


def test_a_paused_request_is_passed_over_and_an_abort_keeps_the_turn() -> None:
    """A client's paused request waits (its client is not reading) while its next one is
    admitted; a client whose every request is paused is passed over. Removing a request (an
    abort) does not use its client's turn."""
    a0, a1 = sequence("a0", b"a", arrival=0), sequence("a1", b"a", arrival=1)
    b0, b1 = sequence("b0", b"b", arrival=2), sequence("b1", b"b", arrival=3)
    c0 = sequence("c0", b"c", arrival=4)
    queue = queue_of("fcfs", [a0, a1, b0, b1, c0])
    a0.set_paused(True)
    c0.set_paused(True)
    queue.remove(b0)
    assert b0 not in queue and a0 in queue
    assert admission_order(queue) == ["a1", "b1"]
    assert len(queue) == 2 and queue.count(b"a") == queue.count(b"c") == 1


def test_a_preempted_request_rejoins_its_clients_queue_at_its_place() -> None:
    """A preempted request goes back in front of the rest of its client's flood (its place by
    arrival), and the client whose turn is next keeps it."""
    flood = [sequence(f"flood{i}", b"flood", arrival=float(i)) for i in range(4)]
    queue = queue_of("fcfs", flood)
    assert admission_order_of(queue, 1) == ["flood0"]
    queue.insert(sequence("other", b"other", arrival=10))
    assert admission_order_of(queue, 1) == ["flood1"]  # the flood's turn came first
    queue.insert(flood[1])  # preempted: back into the queue
    assert admission_order(queue) == ["other", "flood1", "flood2", "flood3"]


# --- in the scheduler -------------------------------------------------------------------------
def test_a_flooding_client_delays_another_by_one_admission(tiny_llama_dir: Path) -> None:
    """One request runs at a time, so the order requests finish in is the order they were
    admitted in. A client queues 12; another's request, coming once the first runs, is admitted
    after one more of the flood's (whose turn it was), not after all 11 (first come, first
    served)."""
    config = BatonConfig(model=str(tiny_llama_dir), dtype="float32", max_running_requests=1)
    scheduler = Scheduler(config)
    for index in range(12):
        scheduler.add_request(f"flood{index}", [5, 6, 7 + index], GREEDY, client=b"flood")
    finished = [output.rid for output in scheduler.step() if output.finished]
    scheduler.add_request("other", [9, 10, 11], GREEDY, client=b"other")
    while scheduler.has_unfinished_requests():
        finished += [output.rid for output in scheduler.step() if output.finished]
    assert finished[:3] == ["flood0", "flood1", "other"]
    assert finished[3:] == [f"flood{index}" for index in range(2, 12)]


def test_a_client_past_its_share_is_refused_and_the_others_are_not(tiny_llama_dir: Path) -> None:
    """Two waiting requests a client, three in all: a client's third is refused as overloaded
    (HTTP 429) while another client's is queued, until the whole queue is full; an admission
    gives its client room again."""
    config = BatonConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_running_requests=1,
        max_waiting_requests=3,
        max_queued_requests_per_client=2,
    )
    scheduler = Scheduler(config)
    scheduler.add_request("a0", [1, 2, 3], GREEDY, client=b"a")
    scheduler.add_request("a1", [1, 2, 4], GREEDY, client=b"a")
    with pytest.raises(OverloadedError, match="2 requests of this client waiting") as refused:
        scheduler.add_request("a2", [1, 2, 5], GREEDY, client=b"a")
    assert refused.value.code == "overloaded"
    scheduler.add_request("b0", [1, 2, 6], GREEDY, client=b"b")
    with pytest.raises(OverloadedError, match="3 requests waiting"):
        scheduler.add_request("b1", [1, 2, 7], GREEDY, client=b"b")
    assert scheduler.queue_refusal(b"a") is not None
    scheduler.step()  # admits a0
    assert scheduler.queue_refusal(b"a") is None
    scheduler.add_request("a2", [1, 2, 5], GREEDY, client=b"a")
    while scheduler.has_unfinished_requests():
        scheduler.step()
    assert scheduler.aggregate_stats().finished_requests == 4
