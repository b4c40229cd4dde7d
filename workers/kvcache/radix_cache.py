"""Radix prefix cache over KV pages: a token tree whose edges hold whole pages.

Invariants:
- Only full pages are cached. Every edge holds a positive multiple of `page_size` tokens and one
  page id per `page_size` tokens; a node's children are keyed by the tuple of the tokens of their
  first page, so siblings never share a first page. Edges split only at page boundaries.
- Every page id in the tree is owned by the tree (allocated, never free, held by no sequence) and
  appears once. The tree frees pages only in `evict()`, back to its allocator.
- `lock(node)` adds one reference to the node and each ancestor (the root is not counted);
  `unlock(node)` removes it (an unmatched ref raises). Locking the root, which an empty match
  returns, does nothing. So a parent's ref is >= each child's ref, and an unlocked node has
  no locked descendant. Locked nodes are never evicted or truncated.
- Who locks: a sequence that uses cached pages locks the node from `match_prefix()` before it
  allocates or evicts anything, and after `insert()` locks the returned node and unlocks the old
  one. Pages from `match_prefix()` stay valid only while the returned node (or a descendant) is
  locked; a node reference held unlocked may be evicted or truncated at any later call.
- A node keeps its identity across splits: it always ends at the same token prefix (a split
  inserts a new parent above it).
- LRU: `match_prefix()` and `insert()` stamp each node on their path with one counter value, so
  a parent's stamp is >= its children's. `evict()` takes unlocked leaves oldest stamp first from
  a heap holding stale entries, which it skips: an entry is live only if its node is still an
  attached, unlocked leaf with the same stamp. A node that becomes an unlocked leaf is pushed.
- Names: `node.names[i]` is `page_hashes` of the prefix ending with the node's page i (chained
  from its parent's last name), so the tree and the router name pages alike. With `events` set,
  every page the tree adopts is reported stored and every page it frees evicted.
- Tiers: with `below` set (a `TieredStore`), evicted pages are offered to the tiers below
  before they are freed; the pages a tier kept are reported there by the tiers, the rest evicted.
  `holds(name)` says whether a page is in the tree (the tiers report a page's highest tier).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.kvcache.allocator import PageAllocator
from workers.kvcache.kv_events import ROOT, KVEventLog, page_hashes

if TYPE_CHECKING:
    from workers.kvcache.tiers.offloader import TieredStore


class RadixNode:
    __slots__ = ("parent", "children", "tokens", "pages", "names", "ref", "last_access")

    def __init__(
        self, parent: RadixNode | None, tokens: list[int], pages: list[int], names: list[int]
    ) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.tokens = tokens
        self.pages = pages
        self.names = names
        self.ref = 0
        self.last_access = 0


@dataclass
class PrefixMatch:
    pages: list[int]
    num_tokens: int
    node: RadixNode


@dataclass
class InsertResult:
    duplicate_pages: list[int]  # the caller's pages the tree did not adopt; the caller frees them
    node: RadixNode  # ends at the inserted prefix; lock it to keep the pages
    num_new_pages: int  # pages adopted from the caller


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.root = RadixNode(None, [], [], [])
        self.events: KVEventLog | None = None  # set by a replica that publishes KV events
        self.below: TieredStore | None = None  # the KV tiers evicted pages go down to
        self._names: set[int] = set()
        self._clock = 0
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, push order, leaf)
        self._pushes = 0
        self._num_nodes = 0
        self._num_cached = 0
        self._num_locked = 0

    @property
    def num_cached_pages(self) -> int:
        return self._num_cached

    @property
    def num_locked_pages(self) -> int:
        return self._num_locked

    @property
    def num_evictable_pages(self) -> int:
        return self._num_cached - self._num_locked

    def holds(self, name: int) -> bool:
        return name in self._names

    def page_names(self) -> list[int]:
        """The names of every cached page (a replica's snapshot for a new reader)."""
        names, stack = list[int](), [self.root]
        while stack:
            node = stack.pop()
            names += node.names
            stack.extend(node.children.values())
        return names

    def lower_names(self) -> list[tuple[int, int]]:
        """(name, tier) of the pages only the tiers below hold (a snapshot's rest)."""
        return [] if self.below is None else self.below.names()

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of `token_ids` in whole pages, at most `max_tokens` tokens."""
        tokens = list(token_ids)
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        limit -= limit % self.page_size
        node, pos, pages = self.root, 0, list[int]()
        while pos < limit:
            child = node.children.get(tuple(tokens[pos : pos + self.page_size]))
            if child is None:
                break
            matched = self._matched_pages(child, tokens, pos, limit)
            if matched < len(child.pages):
                child = self._split(child, matched)
            pages += child.pages
            pos += len(child.tokens)
            node = child
        self._touch(node)
        return PrefixMatch(pages, pos, node)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Cache `pages` as the KV of `token_ids` (cut to whole pages); the tree keeps its own
        pages where it already holds the prefix and hands the caller's back as duplicates."""
        ps = self.page_size
        if len(pages) != len(token_ids) // ps:
            raise ValueError(f"{len(pages)} pages for {len(token_ids)} tokens at page {ps}")
        end = len(pages) * ps
        tokens = list(token_ids[:end])
        node, pos, duplicates, num_new = self.root, 0, list[int](), 0
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                num_new = (end - pos) // ps
                child = self._add_leaf(node, tokens[pos:], list(pages[pos // ps :]))
            else:
                matched = self._matched_pages(child, tokens, pos, end)
                if matched < len(child.pages):
                    child = self._split(child, matched)
                ours = pages[pos // ps : pos // ps + matched]
                duplicates += [p for p, q in zip(ours, child.pages, strict=True) if p != q]
            pos += len(child.tokens)
            node = child
        self._touch(node)
        return InsertResult(duplicates, node, num_new)

    def lock(self, node: RadixNode) -> None:
        self._check_attached(node)
        while node is not self.root:
            if node.ref == 0:
                self._num_locked += len(node.pages)
            node.ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        self._check_attached(node)
        if node is not self.root and node.ref <= 0:
            raise ValueError("unlock of a radix node that is not locked")
        if node is not self.root and not node.children:
            self._push(node)  # stamp unchanged; pushed again in case it was dropped while locked
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self._num_locked -= len(node.pages)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages from LRU unlocked leaves; return how many were freed.
        Frees exactly min(num_pages, num_evictable_pages): a leaf longer than needed loses
        only its tail pages, keeping its prefix cached."""
        freed = 0
        while freed < num_pages and self._heap:
            stamp, _, leaf = heapq.heappop(self._heap)
            if leaf.parent is None or leaf.children or leaf.ref or leaf.last_access != stamp:
                continue  # stale entry
            take = min(num_pages - freed, len(leaf.pages))
            if take < len(leaf.pages):
                self._truncate(leaf, len(leaf.pages) - take)
            else:
                self._remove_leaf(leaf)
            freed += take
        return freed

    def drop_where(self, owns: Callable[[tuple[int, ...]], bool]) -> int:
        """Evict the unlocked pages of the prefixes whose first page `owns` (an unloaded LoRA
        adapter's, `prefix_cache_ids`); return how many were freed."""
        order, stack = [], [c for key, c in self.root.children.items() if owns(key)]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        freed = 0
        for node in reversed(order):  # children before their parents
            if node.parent is not None and not node.children and not node.ref:
                freed += len(node.pages)
                self._remove_leaf(node, spill=False)  # the adapter is gone: not to the tiers
        return freed

    def check_invariants(self) -> None:
        ps, seen, cached, locked, nodes = self.page_size, set[int](), 0, 0, 0
        stack = [self.root]
        assert not self.root.tokens and not self.root.pages and self.root.ref == 0
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node
                assert child.tokens and len(child.tokens) % ps == 0, "edge not whole pages"
                assert len(child.pages) == len(child.tokens) // ps
                assert child.names == page_hashes(child.tokens, ps, _last_name(node))
                assert key == tuple(child.tokens[:ps]), "child key is not its first page"
                assert child.ref >= 0 and (node is self.root or child.ref <= node.ref)
                assert child.last_access <= node.last_access or node is self.root
                assert 0 not in child.pages, "scratch page cached"
                assert seen.isdisjoint(child.pages) and len(set(child.pages)) == len(child.pages)
                seen.update(child.pages)
                cached += len(child.pages)
                locked += len(child.pages) if child.ref else 0
                nodes += 1
                stack.append(child)
        assert (cached, locked, nodes) == (self._num_cached, self._num_locked, self._num_nodes)

    # ---- internals ----

    def _matched_pages(self, child: RadixNode, tokens: list[int], pos: int, end: int) -> int:
        """Whole pages of `child`'s edge equal to tokens[pos:end] (its first page already is)."""
        ps, edge = self.page_size, child.tokens
        n = min(len(edge), end - pos)
        n -= n % ps
        if edge[:n] == tokens[pos : pos + n]:
            return n // ps
        i = ps
        while i < n and edge[i : i + ps] == tokens[pos + i : pos + i + ps]:
            i += ps
        return i // ps

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Put a new parent above `node` holding its first `num_pages` pages; return it."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_pages < len(node.pages)
        mid = RadixNode(parent, node.tokens[:cut], node.pages[:num_pages], node.names[:num_pages])
        mid.ref, mid.last_access = node.ref, node.last_access
        parent.children[tuple(mid.tokens[: self.page_size])] = mid
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[num_pages:], mid
        node.names = node.names[num_pages:]
        mid.children[tuple(node.tokens[: self.page_size])] = node
        self._num_nodes += 1
        return mid

    def _add_leaf(self, parent: RadixNode, tokens: list[int], pages: list[int]) -> RadixNode:
        names = page_hashes(tokens, self.page_size, _last_name(parent))
        leaf = RadixNode(parent, tokens, pages, names)
        if self.events is not None:
            self.events.stored(names)
        self._names.update(names)
        parent.children[tuple(tokens[: self.page_size])] = leaf
        self._num_nodes += 1
        self._num_cached += len(pages)
        return leaf

    def _remove_leaf(self, leaf: RadixNode, spill: bool = True) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[tuple(leaf.tokens[: self.page_size])]
        leaf.parent = None
        self._free(leaf.pages, leaf.names, leaf.tokens, _last_name(parent), spill)
        self._num_nodes -= 1
        self._num_cached -= len(leaf.pages)
        if parent is not self.root and not parent.children and parent.ref == 0:
            self._push(parent)

    def _truncate(self, leaf: RadixNode, keep_pages: int) -> None:
        cut = keep_pages * self.page_size
        parent = leaf.names[keep_pages - 1]
        self._free(leaf.pages[keep_pages:], leaf.names[keep_pages:], leaf.tokens[cut:], parent)
        leaf.names = leaf.names[:keep_pages]
        self._num_cached -= len(leaf.pages) - keep_pages
        leaf.pages = leaf.pages[:keep_pages]
        leaf.tokens = leaf.tokens[: keep_pages * self.page_size]
        self._push(leaf)

    def _free(
        self, pages: list[int], names: list[int], tokens: list[int], parent: int, spill: bool = True
    ) -> None:
        """Evicted pages: offered to the tiers below (which copy them) where `spill`, then freed."""
        self._names.difference_update(names)
        below = self.below if spill else None
        kept = [False] * len(pages) if below is None else below.spill(
            pages, names, tokens, parent, self.events
        )  # fmt: skip
        self.allocator.free(pages)
        if self.events is not None:
            self.events.removed([n for n, k in zip(names, kept, strict=True) if not k])

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        walk = node
        while walk is not self.root:
            walk.last_access = self._clock
            walk = walk.parent  # type: ignore[assignment]
        if node is not self.root and not node.children:
            self._push(node)

    def _push(self, leaf: RadixNode) -> None:
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._rebuild_heap()
        self._pushes += 1
        heapq.heappush(self._heap, (leaf.last_access, self._pushes, leaf))

    def _rebuild_heap(self) -> None:
        """Drop stale entries: keep one per attached unlocked leaf."""
        self._heap, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.ref == 0:
                self._pushes += 1
                self._heap.append((node.last_access, self._pushes, node))
        heapq.heapify(self._heap)

    def _check_attached(self, node: RadixNode) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError("radix node was evicted")


def _last_name(node: RadixNode) -> int:
    """The name of the last page of the prefix that ends at `node`."""
    return node.names[-1] if node.names else ROOT
