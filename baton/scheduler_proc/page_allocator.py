"""The free list of KV-pool pages.

Every page is owned by exactly one of: this allocator (free), one request's private page table,
or the radix cache. The allocator only knows free vs. not free; it refuses double frees and
unknown ids so that an ownership bug surfaces at once instead of corrupting another request's KV.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfPagesError(Exception):
    """Raised by `PageAllocator.allocate` when fewer pages are free than were asked for."""


class PageAllocator:
    """Free list of KV page ids 0..num_pages-1; O(1) per page to allocate, free or query."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_pages = num_pages
        # A stack popped from the end; stored descending so the lowest ids go out first, which
        # keeps allocation deterministic and page tables easy to read when debugging.
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        """How many pages are free right now."""
        return len(self._free_stack)

    @property
    def num_pages(self) -> int:
        """Total number of pages in the pool."""
        return self._num_pages

    def is_free(self, page: int) -> bool:
        """Whether `page` is on the free list (for ownership checks in callers and tests)."""
        self._check_id(page)
        return bool(self._is_free[page])

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages off the free list, all or nothing.

        Raises `OutOfPagesError` (allocating nothing) if fewer than `count` pages are free.
        """
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({count})")
        available = len(self._free_stack)
        if count > available:
            raise OutOfPagesError(f"asked for {count} pages, only {available} free")
        pages = self._free_stack[available - count :]
        del self._free_stack[available - count :]
        pages.reverse()
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return `pages` to the free list, all or nothing.

        Raises `ValueError` (freeing nothing) on an unknown id, a page that is already free, or a
        page listed twice: each means two owners believed they held the same page.
        """
        pages = list(pages)
        for done, page in enumerate(pages):
            if not (0 <= page < self._num_pages) or self._is_free[page]:
                # Undo the pages marked so far so a failed call leaves the allocator unchanged.
                for marked in pages[:done]:
                    self._is_free[marked] = 0
                self._check_id(page)
                raise ValueError(f"double free of page {page}")
            self._is_free[page] = 1
        self._free_stack.extend(pages)

    def _check_id(self, page: int) -> None:
        if not (0 <= page < self._num_pages):
            raise ValueError(f"page id {page} out of range 0..{self._num_pages - 1}")
