"""One request's lifecycle: the two-phase schedule/apply protocol of the schedulable-sequence seed.

`schedule_*` validates, pre-allocates KV pages and advances `kv_position` optimistically;
`apply_*` commits the sampled token; `revert_schedule` (sequence_pages.py, with the rest of the
page bookkeeping) undoes the newest scheduled step (LIFO), returning its pages. Up to
`max_in_flight` steps may be scheduled before the oldest is applied: 1 for the plain loop, 2 for
the overlap loop, where batch N+1 is scheduled while batch N still computes, one per stage for a
pipeline. A token that is scheduled to be sampled but not yet known is a *placeholder* (vLLM's
num_output_placeholders): it counts in `total_tokens` and so in `tail_tokens`. A pipeline's
stages cannot take one (`on_placeholders` False): no step is scheduled while one is pending.

Vajra's two progress counters: `num_stage_processed`, the tokens handed to the first stage (every
scheduled step's), and `num_step_processed`, those whose steps are applied, having left the last
stage; outputs, stops and the prefix cache only ever see the second.

A speculative step (`schedule_speculative(k)`) computes the tail token and k drafts, and counts
1 + k placeholders: positions advance as if every draft will be accepted (the seed's scenario 4).
`apply_speculative` rolls `kv_position` back by the rejected ones, moves any step scheduled
after it down by as much (the engine does the same when it runs that step), and drops the pages
nothing uses any more, newest first.
"""

from __future__ import annotations

import dataclasses
import time

from baton.engine.batch.grammar import GrammarMatcher
from baton.engine.batch.seeded_uniforms import SeededUniforms
from baton.sampling_params import SamplingParams
from baton.scheduler_proc.errors import (
    AcceptedExceedsScheduled,
    GenerationComplete,
    MissingTokenOnFinalChunk,
    NotIdle,
    PrefillComplete,
    PrefillNotComplete,
    PrefillOverrun,
    TokenOnNonFinalChunk,
    WrongDanglingCount,
    WrongState,
)
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.sequence_pages import SequencePages
from baton.scheduler_proc.sequence_state import DecodeOutcome, EventKind, ScheduledStep


class Sequence(SequencePages):
    """A request's tokens, KV pages and protocol state. Its own methods are the one place its
    state changes (the protocol's schedule/apply here, revert/release in `SequencePages`, the
    coarse transitions admit/preempt/finish in `RequestLifecycle`); the scheduler calls them."""

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        page_size: int,
        max_in_flight: int = 1,
        on_placeholders: bool = True,
        generator: SeededUniforms | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline_ms: float | None = None,
        grammar: GrammarMatcher | None = None,
        client: bytes = b"",
    ) -> None:
        scores_prompt = params.prompt_logprobs is not None
        super().__init__(
            rid, prompt_ids, page_size, scores_prompt, arrival_time, priority, deadline_ms
        )
        self.params = params
        self.max_tokens = max_tokens
        self.max_in_flight = max_in_flight
        self.on_placeholders = on_placeholders
        self.generator = generator
        # The client it came from (its ZMQ routing id; the offline LLM's are all b""): the key of
        # its client's share of the waiting queue (waiting_queue.py), read for nothing else.
        self.client = client
        # Structured outputs: built here, then the engine thread's alone (engine/batch/grammar.py).
        self.grammar = grammar
        # Speculative decoding: its steps with drafts, the drafts the engine verified for it,
        # and how many it accepted.
        self.num_speculative_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._record(EventKind.CREATED, len(prompt_ids))

    # --- derived state -----------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def can_schedule(self) -> bool:
        if not self.on_placeholders and self.num_placeholders:
            return False  # its next input token is still being sampled
        return len(self._pending) < self.max_in_flight

    @property
    def num_stage_processed(self) -> int:
        """Tokens handed to the first stage: every scheduled step's, applied or not."""
        return self.kv_position

    @property
    def num_step_processed(self) -> int:
        """Tokens whose steps are applied: through every stage, their outputs taken."""
        return self.kv_position - sum(step.num_tokens for step in self._pending)

    @property
    def decode_budget_left(self) -> int:
        """Outputs still allowed beyond those the scheduled steps are sure to yield: one each
        (a speculative step may yield more; the seed's worst-case check of scenario 4). A decode
        may be scheduled while this is positive."""
        pending_samples = sum(1 for step in self._pending if step.samples)
        return self.max_tokens - self.num_output_tokens - pending_samples

    # --- the two-phase protocol ----------------------------------------------------------------
    def schedule_prefill(self, num_tokens: int, kv: KVCacheManager) -> ScheduledStep:
        """Schedule the next prefill chunk of `num_tokens` tokens, pre-allocating its pages."""
        if not self.can_schedule:
            raise NotIdle(f"{self.rid}: {len(self._pending)} steps already scheduled")
        if self.prefill_done:
            raise PrefillComplete(f"{self.rid}: prefill already scheduled in full")
        if num_tokens < 1 or self.kv_position + num_tokens > self.prefill_len:
            raise PrefillOverrun(
                f"{self.rid}: chunk of {num_tokens} from {self.kv_position} "
                f"overruns {self.prefill_len} input tokens"
            )
        allocated = self._grow_page_table(kv, self.kv_position + num_tokens)
        is_final = self.kv_position + num_tokens == self.prefill_len
        step = ScheduledStep(self.kv_position, num_tokens, is_final, True, allocated)
        self.kv_position += num_tokens
        self.num_placeholders += int(is_final)
        self._pending.append(step)
        self._record(EventKind.PREFILL_SCHEDULED, num_tokens)
        return step

    def schedule_decode(self, kv: KVCacheManager) -> ScheduledStep:
        """Schedule one decode step: compute the tail token's K/V and sample the next token."""
        self._check_decodable()
        step = self._schedule_generation(kv, 0)
        self._record(EventKind.DECODE_SCHEDULED, 1)
        return step

    def schedule_speculative(self, num_drafts: int, kv: KVCacheManager) -> ScheduledStep:
        """Schedule a speculative step: the tail token and `num_drafts` draft tokens (proposed by
        the engine when it runs the step) are computed and verified in one forward."""
        self._check_decodable()
        if num_drafts < 1:
            raise ValueError(f"a speculative step needs drafts, got {num_drafts}")
        step = self._schedule_generation(kv, num_drafts)
        self._record(EventKind.SPECULATIVE_SCHEDULED, num_drafts)
        return step

    def _check_decodable(self) -> None:
        if not self.can_schedule:
            raise NotIdle(f"{self.rid}: {len(self._pending)} steps already scheduled")
        if not self.prefill_done:
            raise PrefillNotComplete(f"{self.rid}: prefill not fully scheduled")
        if self.decode_budget_left <= 0:
            raise GenerationComplete(f"{self.rid}: max_tokens={self.max_tokens} reached")
        if self.tail_tokens != 1:
            raise WrongDanglingCount(f"{self.rid}: {self.tail_tokens} tail tokens, need 1")

    def _schedule_generation(self, kv: KVCacheManager, num_drafts: int) -> ScheduledStep:
        num_tokens = 1 + num_drafts
        allocated = self._grow_page_table(kv, self.kv_position + num_tokens)
        step = ScheduledStep(self.kv_position, num_tokens, True, False, allocated, num_drafts)
        self.kv_position += num_tokens
        self.num_placeholders += num_tokens
        self._pending.append(step)
        return step

    def _pop_oldest(self, is_prefill: bool) -> ScheduledStep:
        if not self._pending or self._pending[0].is_prefill != is_prefill:
            wanted = "prefill" if is_prefill else "decode"
            raise WrongState(f"{self.rid}: oldest scheduled step is not a {wanted}")
        return self._pending[0]

    def apply_prefill(self, token: int | None) -> None:
        """Commit the oldest scheduled prefill chunk; the final chunk brings the sampled token."""
        step = self._pop_oldest(is_prefill=True)
        if step.samples and token is None:
            raise MissingTokenOnFinalChunk(f"{self.rid}: final chunk needs a token")
        if not step.samples and token is not None:
            raise TokenOnNonFinalChunk(f"{self.rid}: token on a non-final chunk")
        self._pending.popleft()
        if token is not None:
            self._append_output(token)
        self._record(EventKind.PREFILL_APPLIED, step.num_tokens)

    def apply_decode(self, token: int) -> DecodeOutcome:
        """Commit the oldest scheduled decode step with its sampled token."""
        step = self._pop_oldest(is_prefill=False)
        if step.num_drafts:
            raise WrongState(f"{self.rid}: oldest scheduled step is speculative")
        self._pending.popleft()
        self._append_output(token)
        self._record(EventKind.DECODE_APPLIED, 1)
        return self._outcome(step.start, step.start + 1)

    def apply_speculative(
        self,
        tokens: list[int],
        num_drafted: int,
        kv: KVCacheManager,
        num_accepted: int | None = None,
    ) -> DecodeOutcome:
        """Commit the oldest scheduled speculative step: `tokens` are its accepted drafts and
        the one token sampled after them; `num_drafted` (<= the scheduled drafts) is how many
        drafts the engine proposed and verified, `num_accepted` how many it accepted (more than
        `tokens` holds when a stop token or max_tokens cut them short; default: all of them).
        The rejected positions are rolled back."""
        step = self._pop_oldest(is_prefill=False)
        if not step.num_drafts:
            raise WrongState(f"{self.rid}: oldest scheduled step is not speculative")
        if not 1 <= len(tokens) <= 1 + min(num_drafted, step.num_drafts):
            raise AcceptedExceedsScheduled(
                f"{self.rid}: {len(tokens)} tokens from {num_drafted} verified of "
                f"{step.num_drafts} scheduled drafts"
            )
        self._pending.popleft()
        rejected = step.num_tokens - len(tokens)
        self.num_placeholders -= step.num_tokens - len(tokens)
        for token in tokens:
            self._append_output(token)
        self.kv_position -= rejected
        self.num_speculative_steps += num_drafted > 0  # vLLM counts steps with drafts
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += len(tokens) - 1 if num_accepted is None else num_accepted
        if rejected:
            # A step scheduled after this one assumed every draft accepted: it starts lower.
            for index, later in enumerate(self._pending):
                self._pending[index] = dataclasses.replace(later, start=later.start - rejected)
            self._drop_unassigned_pages(kv, kv_needed=self.kv_position)
        self._record(EventKind.SPECULATIVE_APPLIED, len(tokens) - 1)
        return self._outcome(step.start, step.start + len(tokens))

    def _outcome(self, computed_before: int, computed_after: int) -> DecodeOutcome:
        """Whether the step filled a page with computed tokens, and reached max_tokens."""
        block_completed = computed_after // self.page_size > computed_before // self.page_size
        return DecodeOutcome.of(block_completed, self.num_output_tokens >= self.max_tokens)

    def _append_output(self, token: int) -> None:
        """A sampled token replaces its placeholder; the first one stamps the first-token time."""
        self.tokens.append(token)
        self.num_placeholders -= 1
        if self.times.first_token is None:
            self.times.first_token = time.monotonic()
