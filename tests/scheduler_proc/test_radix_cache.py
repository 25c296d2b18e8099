"""RadixCache: whole-page matching, page-boundary splits, duplicate pages, locks, LRU eviction."""

from __future__ import annotations

import pytest

from baton.scheduler_proc.page_allocator import PageAllocator
from baton.scheduler_proc.radix_cache import PrefixMatch, RadixCache, RadixNode


def make_cache(page_size: int = 4, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    allocator = PageAllocator(num_pages)
    return allocator, RadixCache(page_size, allocator)


def cache_sequence(cache: RadixCache, tokens: list[int]) -> PrefixMatch:
    """What a request does: match, lock, compute the rest in new pages, insert, move the lock."""
    matched = cache.match_prefix(tokens)
    cache.lock(matched.node)
    whole_pages = len(tokens) // cache.page_size
    new_pages = cache.allocator.allocate(whole_pages - len(matched.pages))
    inserted = cache.insert(tokens[: whole_pages * cache.page_size], matched.pages + new_pages)
    cache.lock(inserted.node)
    cache.unlock(matched.node)
    cache.unlock(inserted.node)
    return inserted


def all_nodes(cache: RadixCache) -> list[RadixNode]:
    stack, nodes = list(cache.root.children.values()), []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def cached_leaves(cache: RadixCache) -> set[tuple[int, ...]]:
    """The full token sequence of every leaf, read without touching LRU times."""
    leaves = set()
    for node in all_nodes(cache):
        if not node.children:
            tokens: tuple[int, ...] = ()
            while node is not cache.root:
                tokens, node = node.key + tokens, node.parent
            leaves.add(tokens)
    return leaves


def seq(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_match_on_empty_tree_returns_root() -> None:
    _, cache = make_cache()
    match = cache.match_prefix(seq(0, 12))
    assert match.node is cache.root
    assert match.pages == []
    assert cache.num_cached_pages == cache.num_evictable_pages == 0


def test_insert_then_match_full_and_partial_prefixes() -> None:
    allocator, cache = make_cache(page_size=4)
    tokens = seq(100, 12)
    pages = allocator.allocate(3)
    inserted = cache.insert(tokens, pages)
    assert inserted.pages == pages
    assert cache.match_prefix(tokens).pages == pages
    assert cache.match_prefix([*tokens, 7, 8]).pages == pages  # trailing partial page ignored
    assert cache.match_prefix(tokens[:11]).pages == pages[:2]  # a partial page never matches
    assert cache.match_prefix(tokens[:3]).pages == []
    diverges_in_page_two = [*tokens[:5], 999, *tokens[6:]]
    assert cache.match_prefix(diverges_in_page_two).pages == pages[:1]
    assert cache.num_cached_pages == cache.num_evictable_pages == 3
    assert allocator.num_free == 64 - 3


@pytest.mark.parametrize(("page_size", "shared_tokens"), [(1, 2), (4, 6)])
def test_branching_prefixes_split_at_page_boundaries(page_size: int, shared_tokens: int) -> None:
    allocator, cache = make_cache(page_size=page_size)
    first = seq(0, 3 * page_size)
    second = first[:shared_tokens] + seq(500, 3 * page_size - shared_tokens)
    shared_pages = shared_tokens // page_size
    first_pages = allocator.allocate(3)
    second_pages = allocator.allocate(3)
    cache.insert(first, first_pages)
    inserted = cache.insert(second, second_pages)

    assert inserted.pages == first_pages[:shared_pages] + second_pages[shared_pages:]
    assert all(allocator.is_free(page) for page in second_pages[:shared_pages])
    assert cache.num_cached_pages == 6 - shared_pages
    first_node = cache.match_prefix(first).node
    fork = first_node.parent
    assert fork is inserted.node.parent
    assert fork.pages == first_pages[:shared_pages]
    assert fork.parent is cache.root
    for node in all_nodes(cache):
        assert len(node.key) == len(node.pages) * page_size


def test_match_splits_a_node_so_the_match_can_be_locked_alone() -> None:
    allocator, cache = make_cache(page_size=4)
    pages = allocator.allocate(3)
    cache.insert(seq(0, 12), pages)
    match = cache.match_prefix(seq(0, 8) + [99] * 4)
    assert match.pages == pages[:2]
    cache.lock(match.node)
    assert cache.num_evictable_pages == 1
    assert cache.evict(10) == 1
    assert cache.match_prefix(seq(0, 12)).pages == pages[:2]


def test_children_are_keyed_by_their_whole_first_page() -> None:
    allocator, cache = make_cache(page_size=4)
    first, second = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 5, 6, 7, 8]
    first_pages, second_pages = allocator.allocate(2), allocator.allocate(2)
    cache.insert(first, first_pages)
    cache.insert(second, second_pages)
    assert len(cache.root.children) == 2
    assert cache.match_prefix(first).pages == first_pages
    assert cache.match_prefix(second).pages == second_pages
    assert cache.match_prefix([1, 2, 3, 0, 5, 6, 7, 8]).pages == []


def test_duplicate_pages_are_freed_but_the_callers_matched_pages_are_not() -> None:
    allocator, cache = make_cache(page_size=4)
    tokens = seq(0, 8)
    [first_page] = allocator.allocate(1)
    cache.insert(tokens[:4], [first_page])
    slow, fast = cache.match_prefix(tokens), cache.match_prefix(tokens)
    cache.lock(slow.node)
    cache.lock(fast.node)
    fast_page, slow_page = allocator.allocate(2)
    cache.insert(tokens, [*fast.pages, fast_page])
    # The slower request computed the same second page and inserts afterwards.
    result = cache.insert(tokens, [*slow.pages, slow_page])
    assert result.pages == [first_page, fast_page]
    assert allocator.is_free(slow_page)
    assert not allocator.is_free(first_page)
    assert not allocator.is_free(fast_page)
    assert cache.num_cached_pages == 2
    assert allocator.num_free + cache.num_cached_pages == allocator.num_pages


def test_lock_counts_and_protects_from_eviction() -> None:
    allocator, cache = make_cache(page_size=2)
    kept = cache_sequence(cache, seq(0, 6))
    cache_sequence(cache, seq(0, 2) + seq(50, 4))  # shares one page with `kept`
    assert cache.num_cached_pages == cache.num_evictable_pages == 5
    cache.lock(kept.node)
    assert cache.num_evictable_pages == 2  # kept's node and the shared parent are protected
    cache.lock(kept.node)
    assert cache.num_evictable_pages == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix(seq(0, 6)).pages == kept.pages
    cache.unlock(kept.node)
    assert cache.evict(100) == 0
    cache.unlock(kept.node)
    assert cache.num_evictable_pages == 3
    with pytest.raises(ValueError):
        cache.unlock(kept.node)
    assert cache.evict(100) == 3
    assert allocator.num_free == allocator.num_pages


def test_an_evicted_node_cannot_be_locked() -> None:
    _, cache = make_cache(page_size=2)
    stale = cache_sequence(cache, seq(0, 4)).node
    cache.evict(2)
    with pytest.raises(ValueError):
        cache.lock(stale)


def test_eviction_is_least_recently_used_first() -> None:
    _, cache = make_cache(page_size=2)
    a, b, c = seq(0, 4), seq(100, 4), seq(200, 4)
    for tokens in (a, b, c):
        cache_sequence(cache, tokens)
    cache.match_prefix(a)  # a is now the most recently used
    assert cache.evict(2) == 2
    assert cache.match_prefix(b).pages == []
    assert len(cache.match_prefix(c).pages) == 2  # touching c makes a the oldest
    assert cache.evict(2) == 2
    assert cache.match_prefix(a).pages == []
    assert len(cache.match_prefix(c).pages) == 2


def test_lru_order_survives_many_reuses_of_one_prefix() -> None:
    _, cache = make_cache(page_size=2)
    old, hot = seq(0, 4), seq(100, 4)
    cache_sequence(cache, old)
    cache_sequence(cache, hot)
    for _ in range(500):  # each use leaves a stale heap entry behind, forcing compactions
        cache.match_prefix(hot)
    cache_sequence(cache, seq(200, 4))
    assert cache.evict(2) == 2
    assert cached_leaves(cache) == {tuple(hot), tuple(seq(200, 4))}


def test_eviction_trims_a_leaf_from_its_end() -> None:
    allocator, cache = make_cache(page_size=2)
    pages = cache_sequence(cache, seq(0, 6)).pages
    assert cache.evict(1) == 1
    assert allocator.is_free(pages[2])
    assert cache.match_prefix(seq(0, 6)).pages == pages[:2]
    assert cache.num_cached_pages == cache.num_evictable_pages == 2


def test_parents_are_evicted_only_after_their_children() -> None:
    _, cache = make_cache(page_size=2)
    parent = seq(0, 4)
    cache_sequence(cache, [*parent, 10, 11])
    cache_sequence(cache, [*parent, 20, 21])
    cache_sequence(cache, seq(300, 4))  # newer than the parent's last use
    assert cache.evict(1) == 1
    assert cached_leaves(cache) == {(*parent, 20, 21), tuple(seq(300, 4))}
    assert cache.evict(1) == 1
    assert cached_leaves(cache) == {tuple(parent), tuple(seq(300, 4))}
    assert cache.evict(1) == 1  # the parent, a leaf now, was used before seq(300, 4)
    assert cached_leaves(cache) == {tuple(parent[:2]), tuple(seq(300, 4))}


def test_reset_drops_every_unlocked_node() -> None:
    allocator, cache = make_cache(page_size=2)
    locked = cache_sequence(cache, seq(0, 4))
    cache_sequence(cache, [*seq(0, 2), 7, 7])
    dropped = cache_sequence(cache, seq(100, 6))
    cache.lock(locked.node)
    cache.reset()
    assert cache.num_cached_pages == 2
    assert cache.num_evictable_pages == 0
    assert allocator.num_free == allocator.num_pages - 2
    assert cache.match_prefix(seq(0, 4)).pages == locked.pages
    assert cache.match_prefix(seq(100, 6)).pages == []
    with pytest.raises(ValueError):
        cache.lock(dropped.node)
    cache.unlock(locked.node)
    cache.reset()
    assert allocator.num_free == allocator.num_pages
    assert cache.num_cached_pages == 0


def test_insert_rejects_tokens_that_do_not_fill_the_pages() -> None:
    allocator, cache = make_cache(page_size=4)
    with pytest.raises(ValueError):
        cache.insert(seq(0, 7), allocator.allocate(2))


def test_disabled_cache_caches_nothing_and_frees_inserted_pages() -> None:
    allocator = PageAllocator(8)
    cache = RadixCache(2, allocator, enabled=False)
    pages = allocator.allocate(3)
    result = cache.insert(seq(0, 6), pages)
    assert result.node is cache.root
    assert result.pages == []
    assert allocator.num_free == 8
    match = cache.match_prefix(seq(0, 6))
    assert match.node is cache.root
    assert match.pages == []
    cache.lock(match.node)
    cache.unlock(match.node)
    with pytest.raises(ValueError):
        cache.unlock(match.node)
    assert cache.evict(4) == 0
    assert cache.num_cached_pages == cache.num_evictable_pages == 0
