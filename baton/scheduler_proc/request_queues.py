"""Where the scheduler's requests are, and deferred freeing.

A finished, aborted or preempted sequence leaves `running` at once, so it is never scheduled
again, but its pages and slot are released only once no in-flight batch contains it
(`in_flight_batches == 0`), exactly once, in `_release_ready`.
"""

from __future__ import annotations

from baton.messages import FinishReason
from baton.process_messages import PauseHolder, StepOutput, TokenLogprob
from baton.scheduler_proc.held_outputs import HeldOutputs
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.request_order import RequestOrder
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.stats import StatsCollector
from baton.scheduler_proc.waiting_queue import WaitingQueue


class RequestQueues:
    """The requests by where they are (waiting, running, releasing) and the free slots: the one
    place a request leaves `running` (`_finish`, `_preempt`) and its pages and slot go back
    (`_release_ready`). `Scheduler` adds admission and the loop."""

    def __init__(
        self,
        kv: KVCacheManager,
        order: RequestOrder,
        max_running_requests: int,
        stream_interval: int,
    ) -> None:
        self.kv = kv
        self.order = order
        # Both kept most urgent first (request_order.py), the waiting queue per client and taken
        # round-robin across clients (waiting_queue.py).
        self.waiting = WaitingQueue(order)
        self.running: list[Sequence] = []
        self.releasing: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.free_slots = list(range(max_running_requests - 1, -1, -1))
        self.stats = StatsCollector()
        self._held = HeldOutputs(stream_interval)
        self._num_paused = 0  # of `requests`: a loop with only paused ones waits for messages

    def set_paused(self, rid: str, paused: bool, holder: PauseHolder = "client") -> None:
        """Place or lift `holder`'s pause of a request (its client is not reading; paused, it
        keeps its pages but gets no steps); unknown ids are ignored, as for aborts."""
        seq = self.requests.get(rid)
        if seq is not None and seq.set_paused(paused, holder):
            self._num_paused += 1 if paused else -1

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        new_tokens: list[int] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> StepOutput:
        """Finish `seq` (it may be running or draining after a preemption) and report it."""
        if seq in self.running:
            self.running.remove(seq)
        if seq not in self.releasing:
            self.releasing.append(seq)
        seq.finish(reason)
        new_tokens, logprobs = self._held.take(seq.rid, new_tokens or [], logprobs)
        return self.stats.final_output(seq, new_tokens, logprobs)

    def _preempt(self, seq: Sequence) -> bool:
        """Move a running sequence back to the waiting queue; True if its pages are free now."""
        self.running.remove(seq)
        seq.preempt()
        self.stats.preemptions += 1
        self.releasing.append(seq)
        self._release_ready()
        return seq not in self.releasing

    def _release_ready(self) -> None:
        """Release sequences no in-flight batch uses any more (the one place pages are freed)."""
        still_busy = []
        for seq in self.releasing:
            if seq.in_flight_batches:
                still_busy.append(seq)
                continue
            seq.release(self.kv)
            slot = seq.vacate_slot()
            if slot is not None:
                self.free_slots.append(slot)
            if seq.is_finished:
                del self.requests[seq.rid]
                self._num_paused -= seq.paused
            else:  # preempted: back into its client's queue at its place in the policy's order
                self.waiting.insert(seq)
        self.releasing[:] = still_busy
