"""A request's coarse state (Vajra's sequence states) and what the scheduler knows of it beyond
its tokens: its slot, the batches in flight that hold it, its urgency, times and history.

WAITING -> RUNNING -> FINISHED; RUNNING -> WAITING_PREEMPT -> RUNNING (pages given back,
recomputed); RUNNING <-> PAUSED (pages kept, not scheduled). Only the methods here write status,
slot and these counters; `SequencePages` adds the tokens and pages, `Sequence` the schedule/apply
protocol.
"""

from __future__ import annotations

import time

from baton.messages import FinishReason
from baton.process_messages import PauseHolder
from baton.scheduler_proc.sequence_state import (
    EventKind,
    RequestTimes,
    ScheduledStep,
    SequenceEvent,
    SequenceStatus,
)


class RequestLifecycle:
    """The coarse transitions of a request, each recorded in its append-only history."""

    def __init__(
        self, rid: str, arrival_time: float | None, priority: int, deadline_ms: float | None
    ) -> None:
        self.rid = rid
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.slot: int | None = None  # row of the engine's sampled-token buffer while admitted
        self.in_flight_batches = 0  # batches launched but not yet processed that contain it
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        # Who holds it paused (process_messages.PauseHolder): not scheduled (nor admitted) while
        # any does; each hold is lifted only by its holder.
        self._pause_holders: set[PauseHolder] = set()
        self.times = RequestTimes(arrival_time if arrival_time is not None else time.monotonic())
        # How urgent it is, for the scheduling policy (request_order.py): lower priority first;
        # the deadline is absolute (monotonic clock), None when the request gave none.
        self.priority = priority
        self.deadline = None if deadline_ms is None else self.times.arrival + deadline_ms / 1000
        self._history: list[SequenceEvent] = []

    @property
    def num_output_tokens(self) -> int:
        raise NotImplementedError  # the tokens are SequencePages'

    @property
    def history(self) -> tuple[SequenceEvent, ...]:
        return tuple(self._history)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def paused(self) -> bool:
        """Its client or the server holds it paused (its client is not reading)."""
        return bool(self._pause_holders)

    def set_paused(self, paused: bool, holder: PauseHolder = "client") -> bool:
        """Place or lift `holder`'s hold: the first hold pauses (RUNNING -> PAUSED: pages kept,
        no step scheduled), lifting the last resumes; a waiting sequence that is paused is not
        admitted, and becomes RUNNING only once resumed. True if `paused` changed."""
        if self.status is SequenceStatus.FINISHED:
            return False
        was_paused = self.paused
        if paused:
            self._pause_holders.add(holder)
        else:
            self._pause_holders.discard(holder)
        if self.paused == was_paused:
            return False
        if paused and self.status is SequenceStatus.RUNNING:
            self.status = SequenceStatus.PAUSED
        elif not paused and self.status is SequenceStatus.PAUSED:
            self.status = SequenceStatus.RUNNING
        self._record(EventKind.PAUSED if paused else EventKind.RESUMED, self.num_output_tokens)
        return True

    def displace(self) -> None:
        """Skipped for one step: more urgent work took the batch's token budget. Its status
        stays RUNNING (PAUSED lasts until a resume); the history records it."""
        self._record(EventKind.DISPLACED, self.num_output_tokens)

    def admit(self, slot: int, first_step: ScheduledStep) -> None:
        """WAITING or WAITING_PREEMPT -> RUNNING, sampling into `slot`. A first admission fixes
        the prompt tokens the prefix cache served and when the request was first scheduled."""
        if self.status is SequenceStatus.WAITING:
            self.num_cached_tokens = first_step.start
            self.times.first_scheduled = time.monotonic()
        self.status = SequenceStatus.RUNNING
        self.slot = slot

    def preempt(self) -> None:
        """RUNNING or PAUSED -> WAITING_PREEMPT; its pages and slot go back once no in-flight
        batch uses it (`release`, `vacate_slot`)."""
        self.status = SequenceStatus.WAITING_PREEMPT
        self.num_preemptions += 1

    def vacate_slot(self) -> int | None:
        """Give up its slot (None if it had none)."""
        slot, self.slot = self.slot, None
        return slot

    def enter_batch(self) -> None:
        """A launched batch contains it: its pages may not be freed until `leave_batch`."""
        self.in_flight_batches += 1

    def leave_batch(self) -> None:
        """A batch containing it was processed."""
        self.in_flight_batches -= 1

    def finish(self, reason: FinishReason) -> None:
        """Mark finished (stop, length, abort, error); pages are released separately, once."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.times.finished = time.monotonic()
        self._record(EventKind.FINISHED, self.num_output_tokens)

    def _record(self, kind: EventKind, num_tokens: int) -> None:
        self._history.append(SequenceEvent(kind, num_tokens, time.monotonic()))
