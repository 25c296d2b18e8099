"""A request's tokens and the KV pages that hold them: the page table's every change.

Pages are pre-allocated when a step is scheduled (`_grow_page_table`) and given back newest first
(LIFO) when it is reverted or a speculative step's rejected drafts leave them unused. Computed
whole pages are shared through the radix prefix cache; `release` gives back all of them (after a
finish, or a preemption), and `reacquire` takes what the cache still holds to recompute the rest.
With a model whose every layer attends within a window, the private pages a request's window
has left are given back as it generates (`drop_pages_out_of_window`), and only its prompt's
pages are cached.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from baton.process_messages import TokenLogprob
from baton.scheduler_proc.errors import NothingScheduled, WrongState
from baton.scheduler_proc.kv_cache_manager import KVCacheManager
from baton.scheduler_proc.radix_cache import RadixNode
from baton.scheduler_proc.request_lifecycle import RequestLifecycle
from baton.scheduler_proc.sequence_state import EventKind, ScheduledStep

# What a page table names in place of a page given back out of the window: a page every kernel
# may address, whose contents none reads (the window masks its positions).
DROPPED_PAGE = 0


class SequencePages(RequestLifecycle):
    """A request's known tokens, its scheduled steps and its pages: prefix matching and caching,
    allocation, revert and release. `Sequence` adds the schedule/apply protocol."""

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        page_size: int,
        scores_prompt: bool,
        arrival_time: float | None,
        priority: int,
        deadline_ms: float | None,
    ) -> None:
        super().__init__(rid, arrival_time, priority, deadline_ms)
        self.page_size = page_size
        self.num_prompt_tokens = len(prompt_ids)
        self.tokens: list[int] = list(prompt_ids)
        self.num_placeholders = 0
        self.kv_position = 0
        # Tokens whose K/V must be computed before decoding: the prompt, or after a preemption
        # everything known so far (the last token included, so its prefill samples the next one).
        self.prefill_len = len(prompt_ids)
        self.page_table: list[int] = []
        self.prefix_node: RadixNode | None = None  # locked radix node covering page_table's head
        self.num_cached_pages = 0  # page_table's head that the prefix cache owns
        # page_table[num_cached_pages:window_dropped_end] went back to the pool: out of the
        # window, never read again (each entry then names page DROPPED_PAGE, read by no kernel).
        self.window_dropped_end = 0
        # With `prompt_logprobs` (`scores_prompt`): the scored prompt tokens' logprobs so far, the
        # prompt's second token first (the logits at position i score token i + 1). Kept across a
        # preemption, so a recomputed prefill scores nothing twice.
        self.prompt_logprobs: list[TokenLogprob] | None = [] if scores_prompt else None
        self._pending: deque[ScheduledStep] = deque()

    # --- derived state -----------------------------------------------------------------------
    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def total_tokens(self) -> int:
        """Known tokens plus in-flight placeholders."""
        return len(self.tokens) + self.num_placeholders

    @property
    def tail_tokens(self) -> int:
        """Tokens whose K/V is not yet computed (nor scheduled): 1 once prefill is done."""
        return self.total_tokens - self.kv_position

    @property
    def prefill_done(self) -> bool:
        """Every prefill token is scheduled (maybe not yet applied)."""
        return self.kv_position >= self.prefill_len

    # --- prefix matching -----------------------------------------------------------------------
    def match_and_add_prefix(self, kv: KVCacheManager) -> int:
        """Take the longest cached prefix (whole pages); returns the tokens it covers.

        At least one prefill token is left to compute, since its logits give the next token,
        and every prompt token still to score.
        """
        if self.page_table or self._pending:
            raise WrongState("prefix matching needs a sequence that holds no pages")
        matchable = self.prefill_len - 1
        scored = self.prompt_logprobs
        if scored is not None and len(scored) < self.num_prompt_tokens - 1:
            # A cached position yields no logits: those of prompt tokens still to score must
            # be computed (vLLM, too, skips the prefix cache for such requests).
            matchable = min(matchable, len(scored))
        match = kv.match_prefix(self.tokens[:matchable])
        self.prefix_node = match.node
        self.page_table = list(match.pages)
        self.num_cached_pages = len(match.pages)
        self.window_dropped_end = 0
        self.kv_position = len(match.pages) * self.page_size
        self._record(EventKind.PREFIX_MATCHED, self.kv_position)
        return self.kv_position

    def prompt_tokens_to_score(self, step: ScheduledStep) -> tuple[int, list[int]]:
        """For a prefill step of a sequence with `prompt_logprobs`: the index in its chunk of
        its first position whose logits score a prompt token not yet scored, and the prompt
        tokens those positions score ([] if none)."""
        assert self.prompt_logprobs is not None and step.is_prefill
        first = max(step.start, len(self.prompt_logprobs))
        last = min(step.start + step.num_tokens, self.num_prompt_tokens - 1)
        if first >= last:
            return 0, []
        return first - step.start, self.tokens[first + 1 : last + 1]

    def cache_computed_prefix(self, kv: KVCacheManager) -> None:
        """Share this sequence's computed whole pages through the prefix cache (after prefill).

        Only applied steps count: in-flight steps may still be writing their pages. Duplicates of
        pages another sequence cached meanwhile are freed and replaced by the cached ones; an
        in-flight batch that still reads a freed duplicate finishes before any later batch can
        write to it, because forwards run one at a time.
        """
        if not kv.prefix_caching or self.prefix_node is None:
            return
        computed = self.num_step_processed
        if kv.window is not None:  # its outputs' pages leave as the window moves on
            computed = min(computed, self.prefill_len)
        num_full_pages = computed // self.page_size
        if num_full_pages <= self.num_cached_pages:
            return
        match = kv.cache_prefix(
            self.tokens[: num_full_pages * self.page_size],
            self.page_table[:num_full_pages],
            held=self.prefix_node,
        )
        self.prefix_node = match.node
        self.page_table[:num_full_pages] = match.pages
        self.num_cached_pages = num_full_pages
        self._record(EventKind.PREFIX_CACHED, num_full_pages * self.page_size)

    def drop_pages_out_of_window(self, kv: KVCacheManager) -> None:
        """Give back the private pages wholly older than the window of the next position to
        compute (an applied step's: any step still in flight computes later positions, whose
        windows start later still), where every layer attends within `kv.window`."""
        if kv.window is None:
            return
        oldest_read = self.num_step_processed - kv.window + 1
        start = max(self.window_dropped_end, self.num_cached_pages)
        end = min(oldest_read // self.page_size, len(self.page_table))
        if end <= start:
            return
        kv.free(self.page_table[start:end])
        self.page_table[start:end] = [DROPPED_PAGE] * (end - start)
        self.window_dropped_end = end
        self._record(EventKind.WINDOW_DROPPED, (end - start) * self.page_size)

    # --- allocation and release ----------------------------------------------------------------
    def _grow_page_table(self, kv: KVCacheManager, num_tokens: int) -> int:
        needed = kv.pages_for(num_tokens) - len(self.page_table)
        if needed > 0:
            self.page_table.extend(kv.allocate(needed))
            return needed
        return 0

    def _drop_unassigned_pages(self, kv: KVCacheManager, kv_needed: int) -> None:
        """Free the pages past the `kv_needed` tokens still scheduled (LIFO), and give each
        pending step the pages its moved positions need, so a revert frees exactly those."""
        excess = len(self.page_table) - kv.pages_for(kv_needed)
        if excess > 0:
            dropped = self.page_table[-excess:]
            del self.page_table[-excess:]
            kv.free(dropped)
            self._record(EventKind.UNASSIGNED_DROPPED, len(dropped) * self.page_size)
        for index, step in enumerate(self._pending):
            end = step.start + step.num_tokens
            needed = kv.pages_for(end) - kv.pages_for(step.start)
            self._pending[index] = dataclasses.replace(step, num_pages_allocated=needed)

    def revert_schedule(self, kv: KVCacheManager) -> None:
        """Undo the newest scheduled step, releasing the pages it pre-allocated (LIFO)."""
        if not self._pending:
            raise NothingScheduled(f"{self.rid}: nothing to revert")
        step = self._pending.pop()
        self.kv_position -= step.num_tokens
        # What scheduling it added: a decode's every position is a placeholder, 1 + drafts.
        self.num_placeholders -= int(step.samples) if step.is_prefill else step.num_tokens
        if step.num_pages_allocated:
            kv.free(self.page_table[-step.num_pages_allocated :])
            del self.page_table[-step.num_pages_allocated :]
        self._record(EventKind.SCHEDULE_REVERTED, step.num_tokens)

    def release(self, kv: KVCacheManager) -> None:
        """Give back every page: computed whole pages go to the prefix cache, the rest are freed.

        Steps still scheduled are reverted first; the caller guarantees no in-flight batch still
        uses the pages (deferred freeing).
        """
        while self._pending:
            self.revert_schedule(kv)
        if self.prefix_node is None:
            return
        num_full_pages = min(self.kv_position, len(self.tokens)) // self.page_size
        private = self.page_table
        if self.window_dropped_end:  # a prefix with a gap is no prefix: the cached head only
            num_full_pages = self.num_cached_pages
            private = private[:num_full_pages] + private[self.window_dropped_end :]
        cached = kv.cache_prefix(
            self.tokens[: num_full_pages * self.page_size],
            self.page_table[:num_full_pages],
            held=self.prefix_node,
        )
        kv.unlock(cached.node)
        kv.free(private[num_full_pages:])
        self.page_table = []
        self.num_cached_pages = self.window_dropped_end = 0
        self.prefix_node = None
        self.kv_position = 0
        self._record(EventKind.RELEASED, num_full_pages * self.page_size)

    def reacquire(self, kv: KVCacheManager) -> int:
        """After a preemption: recompute everything known so far, reusing cached pages."""
        self.prefill_len = len(self.tokens)
        matched = self.match_and_add_prefix(kv)
        self._record(EventKind.REACQUIRED, matched)
        return matched
