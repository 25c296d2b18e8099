"""One place that hands out KV pages: the free list first, then LRU eviction of the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from baton.scheduler_proc.errors import AllocationFailed
from baton.scheduler_proc.page_allocator import OutOfPagesError, PageAllocator
from baton.scheduler_proc.radix_cache import PrefixMatch, RadixCache, RadixNode


class KVCacheManager:
    """Page ownership for the scheduler.

    Every page is in exactly one place: the allocator's free list, one sequence's private page
    table, or the radix cache (shared; a sequence that uses cached pages holds a lock on their
    node, so they cannot be evicted under it).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool,
        window: int | None = None,
    ) -> None:
        self.page_size = page_size
        self.prefix_caching = enable_prefix_caching
        # The model's attention window where every layer has the same (ModelConfig
        # .uniform_window): a request's pages that leave it are never read again, and go back
        # to the free list as they do (SequencePages.drop_pages_out_of_window).
        self.window = window
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(page_size, self.allocator, enabled=enable_prefix_caching)
        self.peak_used_pages = 0  # the most `used_pages` after any allocation

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get right now: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.cache.num_evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        """`count` private pages, evicting cached prefixes if needed (AllocationFailed if not)."""
        shortfall = count - self.allocator.num_free
        if shortfall > 0:
            self.cache.evict(shortfall)
        try:
            pages = self.allocator.allocate(count)
        except OutOfPagesError as error:
            raise AllocationFailed(
                f"{count} KV pages needed, {self.allocator.num_free} free"
            ) from error
        self.peak_used_pages = max(self.peak_used_pages, self.used_pages)
        return pages

    @property
    def used_pages(self) -> int:
        """Pages held by requests: neither free nor merely cached. A cached page a request
        holds (locked in the radix tree) is used: it cannot be evicted."""
        return self.num_pages - self.allocator.num_free - self.cache.num_evictable_pages

    def free(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The longest cached whole-page prefix of `token_ids`, locked for the caller."""
        match = self.cache.match_prefix(token_ids)
        self.cache.lock(match.node)
        return match

    def cache_prefix(
        self, token_ids: Sequence[int], pages: Sequence[int], held: RadixNode
    ) -> PrefixMatch:
        """Hand a computed whole-page prefix to the cache; the caller's lock moves from `held`.

        Returns the cache's pages for the prefix: where the cache already had a page for the same
        tokens the caller's duplicate was freed, and the caller must use the cache's page instead.
        """
        match = self.cache.insert(token_ids, pages)
        self.cache.lock(match.node)
        self.cache.unlock(held)
        return match

    def unlock(self, node: RadixNode) -> None:
        self.cache.unlock(node)
