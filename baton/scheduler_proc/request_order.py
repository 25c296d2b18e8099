"""The order of requests under a scheduling policy (`--scheduling-policy`): the waiting queue is
kept most urgent first, so admission takes its head; the running list too, so decodes are
scheduled most urgent first and memory pressure preempts from its tail, the least urgent.

- fcfs: arrival order (vLLM's default).
- priority: the request's `priority`, lower first, ties by arrival (vLLM's).
- edf: earliest deadline first; a request's deadline is its arrival plus its `deadline_ms`, and
  requests without one come after every request with one (Vajra's).
- lrs: least remaining slack first (Vajra's). Slack is the deadline minus now minus the time the
  request still needs: its prompt tokens not yet computed times the measured prefill cost per
  token, plus its outputs still to come times the measured decode step time (`WorkCosts`). "Now"
  is the same for every request, so the order is by deadline minus remaining time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

from baton.config import SchedulingPolicy
from baton.scheduler_proc.sequence import Sequence

# Weight of a new measurement in the running averages of WorkCosts.
COST_SMOOTHING = 0.2


class WorkCosts:
    """What a token of work costs on this machine, as measured on the batches run so far."""

    def __init__(self, prefill_s_per_token: float = 1e-4, decode_s_per_step: float = 1e-2) -> None:
        # Priors until the first batches are measured: a small model on a few CPU cores.
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_step = decode_s_per_step

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """Fold in one batch: with prefill work, its time per prefill token; else (decode
        only) its time, which every row of it waited."""
        if prefill_tokens:
            self.prefill_s_per_token += COST_SMOOTHING * (
                seconds / prefill_tokens - self.prefill_s_per_token
            )
        else:
            self.decode_s_per_step += COST_SMOOTHING * (seconds - self.decode_s_per_step)

    def remaining_s(self, seq: Sequence) -> float:
        """The time `seq` still needs at the measured costs."""
        prefill_left = seq.prefill_len - seq.kv_position
        outputs_left = seq.max_tokens - seq.num_output_tokens
        return prefill_left * self.prefill_s_per_token + outputs_left * self.decode_s_per_step


class RequestOrder:
    """Sorts sequences most urgent first under one policy; `insert` keeps a sorted list so."""

    def __init__(self, policy: SchedulingPolicy, costs: WorkCosts | None = None) -> None:
        self.policy = policy
        self.costs = costs or WorkCosts()
        # Every key ends with the arrival time, so ties keep arrival order and `rank` is the key
        # without it.
        keys: dict[SchedulingPolicy, Callable[[Sequence], tuple[float, ...]]] = {
            "fcfs": lambda seq: (seq.times.arrival,),
            "priority": lambda seq: (seq.priority, seq.times.arrival),
            "edf": lambda seq: (_deadline(seq), seq.times.arrival),
            "lrs": lambda seq: (_deadline(seq) - self.costs.remaining_s(seq), seq.times.arrival),
        }
        self.key = keys[policy]

    @property
    def changes_as_requests_run(self) -> bool:
        """Whether a sorted list goes out of order as requests progress (lrs: remaining time)."""
        return self.policy == "lrs"

    def rank(self, seq: Sequence) -> tuple[float, ...]:
        """How urgent `seq` is, arrival aside: requests of equal rank are equals under the policy
        (all of them under fcfs; one priority, one deadline, or none, under the others), which
        admission takes round-robin across clients (waiting_queue.py)."""
        return self.key(seq)[:-1]

    def insert(self, sequences: list[Sequence], seq: Sequence) -> None:
        """Put `seq` into the sorted `sequences`, after those as urgent (ties keep arrival)."""
        bisect.insort_right(sequences, seq, key=self.key)

    def sort(self, sequences: list[Sequence]) -> None:
        """Most urgent first (stable)."""
        sequences.sort(key=self.key)


def _deadline(seq: Sequence) -> float:
    return math.inf if seq.deadline is None else seq.deadline
