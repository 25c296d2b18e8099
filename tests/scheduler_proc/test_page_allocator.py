"""Page ownership: the allocator alone (all-or-nothing, loud double frees, consistent counts), then
allocator + radix cache + request page tables under random operations, where every page must have
exactly one owner at every moment."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from baton.scheduler_proc.page_allocator import OutOfPagesError, PageAllocator
from baton.scheduler_proc.radix_cache import RadixCache, RadixNode


def test_fresh_allocator_has_every_page_free() -> None:
    allocator = PageAllocator(8)
    assert allocator.num_pages == 8
    assert allocator.num_free == 8
    assert all(allocator.is_free(page) for page in range(8))


def test_allocate_hands_out_distinct_pages_in_range() -> None:
    allocator = PageAllocator(10)
    first = allocator.allocate(4)
    second = allocator.allocate(6)
    assert sorted(first + second) == list(range(10))
    assert allocator.num_free == 0
    assert not any(allocator.is_free(page) for page in range(10))


def test_allocate_is_all_or_nothing() -> None:
    allocator = PageAllocator(5)
    held = allocator.allocate(3)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(3)
    assert allocator.num_free == 2
    assert allocator.allocate(0) == []
    rest = allocator.allocate(2)
    assert set(rest).isdisjoint(held)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)


def test_negative_count_is_rejected() -> None:
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(-1)


def test_freed_pages_are_reused() -> None:
    allocator = PageAllocator(6)
    pages = allocator.allocate(6)
    allocator.free(pages[1:3])
    assert allocator.num_free == 2
    assert sorted(allocator.allocate(2)) == sorted(pages[1:3])


def test_double_free_raises() -> None:
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages[:1])
    with pytest.raises(ValueError):
        allocator.free(pages[:1])
    with pytest.raises(ValueError):
        allocator.free([3])  # never allocated
    assert allocator.num_free == 3


@pytest.mark.parametrize("bad_id", [-1, 4, 100])
def test_unknown_page_id_raises(bad_id: int) -> None:
    allocator = PageAllocator(4)
    allocator.allocate(4)
    with pytest.raises(ValueError):
        allocator.free([bad_id])
    assert allocator.num_free == 0


def test_failed_free_changes_nothing() -> None:
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    # The first two pages are valid; the repeated one must make the whole call fail.
    with pytest.raises(ValueError):
        allocator.free([pages[0], pages[1], pages[0]])
    assert allocator.num_free == 0
    assert not allocator.is_free(pages[0])
    assert not allocator.is_free(pages[1])
    allocator.free(pages)
    assert allocator.num_free == 4


def test_random_allocations_keep_counts_consistent() -> None:
    rng = random.Random(0)
    allocator = PageAllocator(32)
    held: set[int] = set()
    for _ in range(500):
        if rng.random() < 0.5:
            count = rng.randint(0, 12)
            if count > allocator.num_free:
                with pytest.raises(OutOfPagesError):
                    allocator.allocate(count)
            else:
                pages = allocator.allocate(count)
                assert len(pages) == len(set(pages)) == count
                assert held.isdisjoint(pages)
                held.update(pages)
        elif held:
            released = rng.sample(sorted(held), rng.randint(1, len(held)))
            allocator.free(released)
            held.difference_update(released)
        assert allocator.num_free == 32 - len(held)
        assert all(allocator.is_free(page) != (page in held) for page in range(32))


def all_nodes(cache: RadixCache) -> list[RadixNode]:
    stack, nodes = list(cache.root.children.values()), []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def path_of(cache: RadixCache, node: RadixNode) -> tuple[tuple[int, ...], list[int]]:
    """Tokens and pages from the root down to `node`."""
    tokens: tuple[int, ...] = ()
    pages: list[int] = []
    while node is not cache.root:
        tokens, pages, node = node.key + tokens, node.pages + pages, node.parent
    return tokens, pages


def brute_force_match(cache: RadixCache, tokens: list[int]) -> list[int]:
    size, best = cache.page_size, []
    for node in all_nodes(cache):
        path_tokens, path_pages = path_of(cache, node)
        whole = 0
        while whole < len(path_pages) and (whole + 1) * size <= len(tokens):
            if path_tokens[whole * size : (whole + 1) * size] != tuple(
                tokens[whole * size : (whole + 1) * size]
            ):
                break
            whole += 1
        best = max(best, path_pages[:whole], key=len)
    return best


@dataclass
class SimRequest:
    tokens: list[int]
    node: RadixNode  # locked
    table: list[int]  # table[:shared] belong to the tree, the rest are private
    shared: int


class Simulation:
    """Requests driving the cache the way the scheduler does, checked by brute-force recounts."""

    def __init__(self, page_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.size = page_size
        self.allocator = PageAllocator(40)  # small, so eviction and failed allocations happen
        self.cache = RadixCache(page_size, self.allocator)
        self.running: list[SimRequest] = []
        self.kv: dict[int, tuple[int, ...]] = {}  # page -> the token prefix its KV was made for
        self.bases = [[self.rng.randrange(3) for _ in range(8 * page_size)] for _ in range(3)]

    def tokens(self) -> list[int]:
        base = self.rng.choice(self.bases)
        tail = [self.rng.randrange(3) for _ in range(self.rng.randint(0, 2 * self.size))]
        return base[: self.rng.randint(0, len(base))] + tail

    def grab(self, count: int) -> list[int] | None:
        if count > self.allocator.num_free + self.cache.num_evictable_pages:
            return None
        self.cache.evict(count - self.allocator.num_free)
        return self.allocator.allocate(count)

    def compute(self, req: SimRequest, extra: list[int]) -> None:
        pages = self.grab(-(-(len(req.tokens) + len(extra)) // self.size) - len(req.table))
        if pages is None:
            return
        req.tokens += extra
        req.table += pages
        for i in range(req.shared, len(req.table)):  # KV is only ever written to private pages
            self.kv[req.table[i]] = tuple(req.tokens[: (i + 1) * self.size])

    def start(self) -> None:
        tokens = self.tokens()
        match = self.cache.match_prefix(tokens)
        assert match.pages == brute_force_match(self.cache, tokens)
        assert path_of(self.cache, match.node)[1] == match.pages
        self.cache.lock(match.node)
        req = SimRequest([], match.node, list(match.pages), len(match.pages))
        whole = len(match.pages) * self.size
        req.tokens = tokens[:whole]
        self.running.append(req)
        self.compute(req, tokens[whole:])

    def insert(self, req: SimRequest) -> None:
        whole = len(req.tokens) // self.size
        result = self.cache.insert(req.tokens[: whole * self.size], req.table[:whole])
        self.cache.lock(result.node)
        self.cache.unlock(req.node)
        req.node, req.table[:whole], req.shared = result.node, result.pages, whole

    def finish(self, req: SimRequest) -> None:
        self.cache.unlock(req.node)
        self.allocator.free(req.table[req.shared :])
        self.running.remove(req)

    def evict(self) -> None:
        count, evictable = self.rng.randint(0, 6), self.cache.num_evictable_pages
        free = self.allocator.num_free
        freed = self.cache.evict(count)
        assert freed == min(count, evictable)
        assert self.allocator.num_free == free + freed

    def step(self) -> None:
        roll, req = self.rng.random(), self.rng.choice(self.running) if self.running else None
        if req is None or (roll < 0.25 and len(self.running) < 8):
            self.start()
        elif roll < 0.45:
            self.compute(req, [self.rng.randrange(3) for _ in range(self.rng.randint(1, 6))])
        elif roll < 0.6:
            self.insert(req)
        elif roll < 0.75:
            if roll < 0.7:
                self.insert(req)
            self.finish(req)
        elif roll < 0.9:
            self.evict()
        elif roll < 0.98:
            tokens = self.tokens()
            assert self.cache.match_prefix(tokens).pages == brute_force_match(self.cache, tokens)
        else:
            self.cache.reset()
            assert self.cache.num_evictable_pages == 0

    def check(self) -> None:
        locks: Counter[int] = Counter()
        for req in self.running:
            tokens, pages = path_of(self.cache, req.node)
            assert pages == req.table[: req.shared]
            for i, page in enumerate(req.table):
                assert self.kv[page] == tuple(req.tokens[: (i + 1) * self.size])
            node = req.node
            while node is not self.cache.root:
                locks[id(node)] += 1
                node = node.parent
        nodes = all_nodes(self.cache)
        tree_pages = [page for node in nodes for page in node.pages]
        for node in nodes:
            assert node.lock_ref == locks[id(node)]
            assert len(node.key) == len(node.pages) * self.size > 0
            first_page = node.key[0] if self.size == 1 else node.key[: self.size]
            assert node.parent.children[first_page] is node
            tokens, pages = path_of(self.cache, node)
            for i in range(len(pages) - len(node.pages), len(pages)):
                assert self.kv[pages[i]] == tokens[: (i + 1) * self.size]
        assert self.cache.num_cached_pages == len(tree_pages)
        unlocked = [page for node in nodes if node.lock_ref == 0 for page in node.pages]
        assert self.cache.num_evictable_pages == len(unlocked)
        owned = tree_pages + [page for req in self.running for page in req.table[req.shared :]]
        assert len(set(owned)) == len(owned), "a page has two owners"
        assert not any(self.allocator.is_free(page) for page in owned)
        assert self.allocator.num_free + len(owned) == self.allocator.num_pages


@pytest.mark.parametrize(("page_size", "seed"), [(1, 0), (1, 1), (4, 2), (4, 3)])
def test_random_operations_keep_ownership_and_counters_consistent(
    page_size: int, seed: int
) -> None:
    sim = Simulation(page_size, seed)
    for _ in range(400):
        sim.step()
        sim.check()
    while sim.running:
        sim.finish(sim.running[0])
    sim.cache.reset()
    assert sim.allocator.num_free == sim.allocator.num_pages
