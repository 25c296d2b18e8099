"""Radix prefix cache over token ids at page granularity, owning the KV pages of cached prefixes.

Ownership: a page handed to `RadixCache.insert` belongs to the tree from then on; the tree gives
pages back to the `PageAllocator` only when it evicts them (or drops a duplicate on insert).

Locking protocol for callers:
  * `match_prefix` returns a node; lock it at once (before anything can evict) for as long as
    the request uses the matched pages. An unlocked node may be trimmed or dropped by `evict`.
  * A request that matched and locked node A, then inserts a longer prefix, gets node B back:
    it must `lock(B)` and then `unlock(A)`, and from then on use the pages `insert` returned.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from baton.scheduler_proc.page_allocator import PageAllocator


class RadixNode:
    """One edge of the tree: a run of whole pages of tokens, and the pages holding their KV.

    `key` is the tokens of this node only (len(key) == len(pages) * page_size). A node object
    always stands for the same prefix end: a split creates the new node above it.
    """

    __slots__ = ("children", "detached", "key", "last_access", "lock_ref", "pages", "parent", "uid")

    def __init__(
        self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None, uid: int
    ) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[Hashable, RadixNode] = {}
        self.lock_ref = 0  # locks on this node or any descendant (the root: all locks)
        self.last_access = 0
        self.detached = False  # set once evicted, so a stale reference cannot be locked
        self.uid = uid  # heap tie-breaker: nodes are not orderable

    def __repr__(self) -> str:
        return f"RadixNode(pages={self.pages}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix: its deepest node (the root if none) and its pages, in order."""

    node: RadixNode
    pages: list[int]


class RadixCache:
    """Radix tree over token ids at page granularity, owning the KV pages of cached prefixes.

    Only whole pages are cached or matched. Eviction is LRU over unlocked leaves, via a heap of
    (last access, node) entries that are checked when popped instead of updated in place.
    With `enabled=False` nothing is ever cached: `match_prefix` returns (root, []) and `insert`
    frees every page it is given and returns (root, []).
    """

    def __init__(self, page_size: int, allocator: PageAllocator, enabled: bool = True) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.enabled = enabled
        self._uids = itertools.count()
        self.root = RadixNode((), [], None, next(self._uids))
        self._clock = 0
        self._heap: list[tuple[int, int, RadixNode]] = []
        self._num_nodes = 0
        self._num_cached = 0
        self._num_evictable = 0

    @property
    def num_evictable_pages(self) -> int:
        """Pages held by the tree in unlocked nodes (all of which `evict` can free)."""
        return self._num_evictable

    @property
    def num_cached_pages(self) -> int:
        """All pages held by the tree."""
        return self._num_cached

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of `token_ids` made of whole pages; marks its path as used."""
        if not self.enabled:
            return PrefixMatch(self.root, [])
        tokens = tuple(token_ids[: len(token_ids) // self.page_size * self.page_size])
        node, pages, pos = self.root, [], 0
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            matched = self._matched_pages(child.key, tokens, pos)
            if matched < len(child.pages):
                child = self._split(child, matched)
            node = child
            pages.extend(node.pages)
            pos += len(node.key)
        self._touch(node)
        return PrefixMatch(node, pages)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> PrefixMatch:
        """Hand the KV pages of `token_ids` (whole pages) to the tree; returns the tree's copy.

        Where the tree already holds a different page for the same tokens, the caller's page is a
        duplicate and is freed; a page the caller got from `match_prefix` is the tree's own and
        stays. The caller must switch its page table to the returned pages (see module docstring
        for the locking protocol). A disabled cache frees all `pages` and returns (root, []), so
        there only pages the caller no longer needs may be inserted.
        """
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(
                f"{len(token_ids)} tokens do not fill {len(pages)} pages of {self.page_size}"
            )
        if not self.enabled:
            self.allocator.free(pages)
            return PrefixMatch(self.root, [])
        tokens, pages = tuple(token_ids), list(pages)
        node, tree_pages, duplicates, done = self.root, [], [], 0
        while done < len(pages):
            pos = done * self.page_size
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                child = self._add_leaf(node, tokens[pos:], pages[done:])
            else:
                matched = self._matched_pages(child.key, tokens, pos)
                if matched < len(child.pages):
                    child = self._split(child, matched)
                mine = pages[done : done + len(child.pages)]
                duplicates += [p for p, q in zip(mine, child.pages, strict=True) if p != q]
            node = child
            tree_pages.extend(node.pages)
            done += len(node.pages)
        self._touch(node)
        if duplicates:
            self.allocator.free(duplicates)
        return PrefixMatch(node, tree_pages)

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction until the matching `unlock`."""
        if node.detached:
            raise ValueError("cannot lock a node that was evicted")
        while node is not self.root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent
        self.root.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`; raises if `node` is not locked."""
        # Ancestors carry at least the node's count, so checking the node guards the whole path.
        if node.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        start = node
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.pages)
            node = node.parent
        self.root.lock_ref -= 1
        self._push_if_evictable(start)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages of unlocked leaves, least recently used first.

        A leaf is trimmed from its end when only part of it is needed; a parent becomes
        evictable once its children are gone. Returns min(num_pages, num_evictable_pages).
        """
        freed: list[int] = []
        while len(freed) < num_pages and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if last_access != node.last_access or not self._is_evictable_leaf(node):
                continue  # stale entry: the node was used, locked, extended or evicted since
            take = min(num_pages - len(freed), len(node.pages))
            if take < len(node.pages):
                freed += node.pages[-take:]
                del node.pages[-take:]
                node.key = node.key[: -take * self.page_size]
                heapq.heappush(self._heap, (node.last_access, node.uid, node))
            else:
                freed += node.pages
                self._remove_leaf(node)
            self._num_cached -= take
            self._num_evictable -= take
        self.allocator.free(freed)
        return len(freed)

    def reset(self) -> None:
        """Drop every unlocked node, freeing its pages; locked paths stay."""
        freed: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in list(node.children.items()):
                if child.lock_ref:
                    stack.append(child)
                    continue
                # An unlocked node has no locked descendant (locks count upwards): drop it whole.
                del node.children[key]
                for dropped in self._iter_nodes(child):
                    freed += dropped.pages
                    dropped.detached = True
                    self._num_nodes -= 1
        self._num_cached -= len(freed)
        self._num_evictable -= len(freed)
        self._heap.clear()  # no unlocked node is left, so no entry could be live
        self.allocator.free(freed)

    def _child_key(self, tokens: Sequence[int], pos: int) -> Hashable:
        if self.page_size == 1:
            return tokens[pos]
        return tuple(tokens[pos : pos + self.page_size])

    def _matched_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        """How many leading whole pages of `key` equal `tokens[pos:]`."""
        size = self.page_size
        limit = min(len(key), len(tokens) - pos)
        if key[:limit] == tokens[pos : pos + limit]:
            return limit // size  # the common case, compared in one C-level slice compare
        matched = 0
        while (
            key[matched * size : (matched + 1) * size]
            == tokens[pos + matched * size : pos + (matched + 1) * size]
        ):
            matched += 1
        return matched

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cut `node` after `num_pages` pages; the new upper node is returned, `node` goes below."""
        cut = num_pages * self.page_size
        upper = RadixNode(node.key[:cut], node.pages[:num_pages], node.parent, next(self._uids))
        # Every lock through `node` also passes through the upper part, so the counts agree.
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[self._child_key(node.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[self._child_key(node.key, 0)] = node
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: RadixNode, key: tuple[int, ...], pages: list[int]) -> RadixNode:
        leaf = RadixNode(key, pages, parent, next(self._uids))
        parent.children[self._child_key(key, 0)] = leaf
        self._num_nodes += 1
        self._num_cached += len(pages)
        self._num_evictable += len(pages)
        return leaf

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        node.detached = True
        self._num_nodes -= 1
        self._push_if_evictable(parent)

    def _touch(self, node: RadixNode) -> None:
        """Mark the path root..node as used now; only its end can be a leaf needing a heap entry."""
        self._clock += 1
        end = node
        while node is not self.root:
            node.last_access = self._clock
            node = node.parent
        self._push_if_evictable(end)

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return (
            node is not self.root and not node.detached and not node.children and not node.lock_ref
        )

    def _push_if_evictable(self, node: RadixNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        heapq.heappush(self._heap, (node.last_access, node.uid, node))
        # Stale entries pile up under heavy reuse; rebuild from the live leaves now and then.
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._heap = [
                (n.last_access, n.uid, n) for n in self._iter_nodes() if self._is_evictable_leaf(n)
            ]
            heapq.heapify(self._heap)

    def _iter_nodes(self, top: RadixNode | None = None) -> Iterator[RadixNode]:
        """Every node below the root (or `top` and its descendants), parents first."""
        stack = list(self.root.children.values()) if top is None else [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
