"""Which sequences run in the next batch: admission, chunked prefill, decode and preemption."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from baton.config import BatonConfig
from baton.scheduler_proc.errors import AllocationFailed
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.request_order import RequestOrder
from baton.scheduler_proc.sequence import Sequence
from baton.scheduler_proc.sequence_state import ScheduledStep, SequenceStatus
from baton.scheduler_proc.waiting_queue import WaitingQueue


@dataclass
class ScheduledRow:
    """One sequence's part of a batch."""

    seq: Sequence
    step: ScheduledStep
    entered_slot: bool = False  # its sequence's first step since it was given its slot


class BatchPolicy:
    """Builds the next batch from the running and waiting sequences.

    prefill-first (default, mini-SGLang): a batch of prefill chunks under the token budget when
    any prefill work exists, else a decode batch of every running sequence. decode-first (vLLM's
    chunked prefill): every decodable sequence, then prefill chunks in the remaining budget.
    Admission takes the waiting queue in the policy's order (`RequestOrder`: both are kept most
    urgent first), clients of equal rank in turn (`WaitingQueue`), and stops at the first
    request whose chunk does not fit in the pages that remain after a one-page reserve per
    decoding sequence. When a decode cannot get a page the least urgent running sequence is
    preempted (`preempt` callback), which may be the sequence itself. A paused sequence (its
    client stopped reading) goes first, for a decode and for an admission alike: it holds pages
    it is not using, and its client may never read again, so one slow reader must not keep the
    pages every other request waits for.

    With speculative decoding a decode becomes a speculative step of up to
    `num_speculative_tokens` drafts, fewer near max_tokens or the context's end or the token
    budget's (which decodes respect too: the least urgent past it wait a step); a sequence whose
    stop tokens (EOS, stop_token_ids) are still suppressed (min_tokens) decodes plainly.
    When the pages for the drafts are not there it decodes plainly before anyone is preempted.

    With pipeline stages, a decode micro-batch takes at most its share of the decoding
    sequences (1 / stages, rounded up): the others wait for the next micro-batch, so that every
    stage gets work; all in one micro-batch would leave the other stages idle while it ran.
    """

    def __init__(
        self,
        config: BatonConfig,
        kv: KVCacheManager,
        order: RequestOrder,
        running: list[Sequence],
        waiting: WaitingQueue,
        free_slots: list[int],
        preempt: Callable[[Sequence], bool],
        max_model_len: int,
    ) -> None:
        self.max_model_len = max_model_len
        spec = config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        self.chunk_size = config.chunk_size
        self.micro_batches = config.pipeline_parallel_size
        self.max_running = config.max_running_requests
        self.decode_first = config.batch_order == "decode-first"
        self.kv = kv
        self.order = order
        self.running = running
        self.waiting = waiting
        self.free_slots = free_slots
        self.preempt = preempt

    def next_batch(self) -> list[ScheduledRow]:
        """Schedule the next batch's rows (empty when there is nothing to run)."""
        if self.order.changes_as_requests_run:
            self.waiting.sort()
            self.order.sort(self.running)
        if self.decode_first:
            rows = self._schedule_decodes(self.chunk_size)
            decode_tokens = sum(row.step.num_tokens for row in rows)
            return rows + self._schedule_prefills(self.chunk_size - decode_tokens)
        return self._schedule_prefills(self.chunk_size) or self._schedule_decodes(self.chunk_size)

    def _schedule_prefills(self, budget: int) -> list[ScheduledRow]:
        rows: list[ScheduledRow] = []
        for seq in self.running:
            if budget <= 0:
                return rows
            if seq.prefill_done or not seq.can_schedule or seq.paused:
                continue
            num_tokens = min(budget, seq.prefill_len - seq.kv_position)
            try:
                rows.append(ScheduledRow(seq, seq.schedule_prefill(num_tokens, self.kv)))
            except AllocationFailed:
                return rows
            budget -= num_tokens
        while budget > 0 and self.free_slots and len(self.running) < self.max_running:
            seq = self.waiting.next_to_admit()
            if seq is None:
                break
            row = self._admit(seq, budget)
            if row is None:
                break
            rows.append(row)
            budget -= row.step.num_tokens
        return rows

    def _admit(self, seq: Sequence, budget: int) -> ScheduledRow | None:
        if seq.status is SequenceStatus.WAITING_PREEMPT:
            seq.reacquire(self.kv)
        else:
            seq.match_and_add_prefix(self.kv)
        num_tokens = min(budget, seq.prefill_len - seq.kv_position)
        pages_needed = self.kv.pages_for(seq.kv_position + num_tokens) - len(seq.page_table)
        while True:
            reserve = sum(1 for running in self.running if running.prefill_done)
            if pages_needed + reserve <= self.kv.available_pages:
                break
            if not self._preempt_paused():
                seq.release(self.kv)  # drops the prefix lock taken above; nothing was computed
                return None
        row = ScheduledRow(seq, seq.schedule_prefill(num_tokens, self.kv), entered_slot=True)
        self.waiting.admit(seq)
        seq.admit(self.free_slots.pop(), row.step)
        self.order.insert(self.running, seq)
        return row

    def _schedule_decodes(self, budget: int) -> list[ScheduledRow]:
        """Decode every running sequence that can, most urgent first, within `budget` tokens:
        those past it are displaced for this step (and drafts shrink to fit first)."""
        rows: list[ScheduledRow] = []
        share = len(self.running)  # (one stage: every decodable sequence)
        if self.micro_batches > 1:
            share = -(-sum(1 for seq in self.running if seq.prefill_done) // self.micro_batches)
        for seq in list(self.running):
            if len(rows) >= share:
                break  # the next micro-batch's
            if seq.status is not SequenceStatus.RUNNING:
                continue  # paused, or preempted earlier in this loop
            if not (seq.prefill_done and seq.can_schedule and seq.decode_budget_left > 0):
                continue
            if seq.kv_position >= self.max_model_len:
                # Past the context only by drafts still in flight: wait for their verdict.
                continue
            if budget < 1:
                seq.displace()
                continue
            num_drafts = min(self._num_drafts(seq), budget - 1)
            while True:
                try:
                    if num_drafts:
                        step = seq.schedule_speculative(num_drafts, self.kv)
                    else:
                        step = seq.schedule_decode(self.kv)
                    rows.append(ScheduledRow(seq, step))
                    budget -= step.num_tokens
                    break
                except AllocationFailed:
                    if num_drafts:
                        num_drafts = 0
                        continue
                    # A paused sequence first (none is in this batch), else from the back:
                    # never a sequence already in this batch (they are all in front of
                    # `seq`), possibly `seq` itself.
                    if self._preempt_paused():
                        continue
                    victim = self.running[-1]
                    pages_freed_now = self.preempt(victim)
                    if victim is seq or not pages_freed_now:
                        break
        return rows

    def _preempt_paused(self) -> bool:
        """Preempt the least urgent paused running sequence whose pages come back now (it is
        in no batch in flight); False if there is none."""
        for seq in reversed(self.running):
            if seq.paused and not seq.in_flight_batches:
                return self.preempt(seq)
        return False

    def _num_drafts(self, seq: Sequence) -> int:
        """How many drafts `seq`'s next decode verifies (0: a plain decode). Each draft may
        become an output, so they stay within max_tokens (counting the one token the step
        yields anyway) and within the context."""
        if not self.num_speculative_tokens:
            return 0
        params = seq.params
        suppresses = params.stop_token_ids or not params.ignore_eos  # before min_tokens
        if seq.num_output_tokens < params.min_tokens and suppresses:
            return 0
        room = min(seq.decode_budget_left - 1, self.max_model_len - 1 - seq.kv_position)
        return max(0, min(self.num_speculative_tokens, room))
