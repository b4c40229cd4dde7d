from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from workers.kvcache.allocator import PageAllocator
from workers.kvcache.radix_cache import InsertResult, RadixCache, RadixNode


def make_cache(page_size: int = 4, num_pages: int = 64) -> RadixCache:
    return RadixCache(page_size, PageAllocator(num_pages))


def put(cache: RadixCache, tokens: list[int]) -> InsertResult:
    """Insert `tokens` with freshly allocated pages, as a finished request would."""
    pages = cache.allocator.allocate(len(tokens) // cache.page_size)
    result = cache.insert(tokens, pages)
    cache.allocator.free(result.duplicate_pages)
    return result


def assert_no_leak(cache: RadixCache) -> None:
    cache.check_invariants()
    assert cache.allocator.num_free + cache.num_cached_pages == cache.allocator.num_usable


def test_match_on_empty_cache_returns_root() -> None:
    cache = make_cache()
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert (match.pages, match.num_tokens, match.node) == ([], 0, cache.root)


def test_match_returns_whole_pages_only() -> None:
    cache = make_cache(page_size=4)
    pages = put(cache, list(range(8))).node.pages
    match = cache.match_prefix([0, 1, 2, 3, 4, 5, 6])  # second page incomplete in the prompt
    assert match.pages == pages[:1] and match.num_tokens == 4
    match = cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 9])  # second page differs at its end
    assert match.pages == pages[:1] and match.num_tokens == 4
    assert_no_leak(cache)


def test_insert_caches_only_full_pages() -> None:
    cache = make_cache(page_size=4)
    result = cache.insert(list(range(10)), cache.allocator.allocate(2))
    assert result.num_new_pages == 2 and result.duplicate_pages == []
    assert cache.match_prefix(list(range(10))).num_tokens == 8
    with pytest.raises(ValueError):
        cache.insert(list(range(10)), [7])
    assert_no_leak(cache)


def test_match_respects_max_tokens() -> None:
    cache = make_cache(page_size=4)
    prompt = list(range(12))
    pages = put(cache, prompt).node.pages
    assert cache.match_prefix(prompt, max_tokens=len(prompt) - 1).pages == pages[:2]
    assert cache.match_prefix(prompt, max_tokens=4).num_tokens == 4
    assert cache.match_prefix(prompt, max_tokens=3).node is cache.root
    assert cache.match_prefix(prompt, max_tokens=-1).num_tokens == 0
    assert_no_leak(cache)


def test_insert_splits_edge_at_page_boundary() -> None:
    cache = make_cache(page_size=2)
    first = put(cache, [1, 1, 2, 2, 3, 3])
    second = put(cache, [1, 1, 2, 2, 9, 9])
    shared = second.node.parent
    assert shared is not None and shared is first.node.parent
    assert shared.tokens == [1, 1, 2, 2] and len(shared.pages) == 2
    assert first.node.tokens == [3, 3] and second.node.tokens == [9, 9]
    assert second.num_new_pages == 1 and len(second.duplicate_pages) == 2
    assert_no_leak(cache)


def test_match_splits_edge_so_returned_node_ends_at_match() -> None:
    cache = make_cache(page_size=2)
    leaf = put(cache, [1, 1, 2, 2, 3, 3]).node
    match = cache.match_prefix([1, 1, 2, 2, 7, 7])
    assert match.num_tokens == 4 and match.node.tokens == [1, 1, 2, 2]
    assert leaf.parent is match.node and leaf.tokens == [3, 3]
    assert_no_leak(cache)


def test_duplicate_pages_are_returned_to_caller() -> None:
    cache = make_cache(page_size=4)
    tree_pages = put(cache, list(range(8))).node.pages
    mine = cache.allocator.allocate(3)
    result = cache.insert(list(range(12)), mine)
    assert result.duplicate_pages == mine[:2] and result.num_new_pages == 1
    assert cache.match_prefix(list(range(12))).pages == tree_pages + mine[2:]
    cache.allocator.free(result.duplicate_pages)
    assert_no_leak(cache)


def test_pages_the_caller_matched_are_not_duplicates() -> None:
    cache = make_cache(page_size=4)
    put(cache, list(range(8)))
    prompt = list(range(16))
    match = cache.match_prefix(prompt)
    cache.lock(match.node)
    result = cache.insert(prompt, match.pages + cache.allocator.allocate(2))
    assert result.duplicate_pages == [] and result.num_new_pages == 2
    cache.lock(result.node)
    cache.unlock(match.node)
    assert cache.num_locked_pages == 4
    assert_no_leak(cache)


def test_locked_nodes_are_never_evicted() -> None:
    cache = make_cache(page_size=1)
    locked = put(cache, [1, 2, 3]).node
    put(cache, [5, 6])
    cache.lock(locked)
    assert cache.num_locked_pages == 3 and cache.num_evictable_pages == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).num_tokens == 3
    cache.unlock(locked)
    assert cache.evict(100) == 3 and cache.num_cached_pages == 0
    assert_no_leak(cache)


def test_lock_protects_ancestors_shared_with_other_leaves() -> None:
    cache = make_cache(page_size=1)
    locked = put(cache, [1, 2, 3]).node
    put(cache, [1, 2, 9])
    cache.lock(locked)
    assert cache.evict(100) == 1  # only [9]; [1, 2] is an ancestor of the locked leaf
    assert cache.match_prefix([1, 2, 3]).num_tokens == 3
    assert_no_leak(cache)


def test_unlock_underflow_raises() -> None:
    cache = make_cache()
    node = put(cache, list(range(4))).node
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(ValueError):
        cache.unlock(node)


def test_lock_of_evicted_node_raises() -> None:
    cache = make_cache()
    node = put(cache, list(range(4))).node
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.lock(node)


def test_evict_frees_lru_leaf_first() -> None:
    cache = make_cache(page_size=1)
    old, new = put(cache, [1, 1]).node, put(cache, [2, 2]).node
    cache.match_prefix([1, 1])  # touch: [2, 2] is now the least recently used
    assert cache.evict(2) == 2
    assert new.parent is None and old.parent is not None
    assert cache.match_prefix([1, 1]).num_tokens == 2
    assert_no_leak(cache)


def test_evict_takes_parent_after_its_children() -> None:
    cache = make_cache(page_size=1)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    put(cache, [7])
    cache.match_prefix([7])
    assert cache.evict(4) == 4  # leaves [3], [4], then their parent [1, 2]
    assert cache.match_prefix([7]).num_tokens == 1 and cache.num_cached_pages == 1
    assert_no_leak(cache)


def test_evict_frees_exactly_the_tail_of_a_long_leaf() -> None:
    cache = make_cache(page_size=2)
    pages = put(cache, list(range(10))).node.pages
    assert cache.evict(2) == 2
    assert cache.match_prefix(list(range(10))).pages == pages[:3]
    assert cache.allocator.generation[pages[4]] == 1 and cache.allocator.generation[pages[2]] == 0
    assert_no_leak(cache)


def test_lru_heap_stays_bounded_under_many_matches() -> None:
    cache = make_cache(page_size=1)
    for i in range(8):
        put(cache, [i, i])
    for step in range(5000):
        cache.match_prefix([step % 8, step % 8])
    assert len(cache._heap) <= 4 * 8 + 64 + 1
    assert cache.evict(100) == 16
    assert_no_leak(cache)


# ---- property test: random request lifecycles against the cache ----


@dataclass
class Request:
    prompt: list[int]
    node: RadixNode  # locked while the request holds it
    cached: list[int]  # tree pages from the match, valid while `node` is locked
    private: list[int] = field(default_factory=list)  # pages the request owns
    generations: list[int] = field(default_factory=list)


class RadixCacheMachine(RuleBasedStateMachine):
    prompts = Bundle("prompts")

    @initialize(page_size=st.sampled_from([1, 4]), num_pages=st.integers(6, 32))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.cache = RadixCache(page_size, PageAllocator(num_pages))
        self.alloc = self.cache.allocator
        self.content: dict[int, tuple[int, ...]] = {}  # page -> prefix whose KV it holds
        self.running: list[Request] = []  # own private pages, lock their match
        self.pinned: list[Request] = []  # finished; lock their inserted prefix

    @initialize(target=prompts, tokens=st.lists(st.integers(0, 2), max_size=16))
    def first_prompt(self, tokens: list[int]) -> list[int]:
        return tokens

    @rule(target=prompts, tokens=st.lists(st.integers(0, 2), max_size=16))
    def new_prompt(self, tokens: list[int]) -> list[int]:
        return tokens

    @rule(target=prompts, base=prompts, suffix=st.lists(st.integers(0, 2), max_size=8))
    def extend_prompt(self, base: list[int], suffix: list[int]) -> list[int]:
        return base + suffix

    def check_match(self, prompt: list[int], pages: list[int], num_tokens: int) -> None:
        ps = self.cache.page_size
        assert num_tokens == len(pages) * ps <= len(prompt)
        for i, page in enumerate(pages):
            assert self.content[page] == tuple(prompt[: (i + 1) * ps]), "page holds other KV"

    @rule(prompt=prompts, max_tokens=st.none() | st.integers(-1, 20))
    def match_only(self, prompt: list[int], max_tokens: int | None) -> None:
        match = self.cache.match_prefix(prompt, max_tokens)
        self.check_match(prompt, match.pages, match.num_tokens)
        if max_tokens is not None:
            assert match.num_tokens <= max(max_tokens, 0)

    @rule(prompt=prompts)
    def start_request(self, prompt: list[int]) -> None:
        self.admit(prompt)

    def admit(self, prompt: list[int]) -> bool:
        """Match, lock, and allocate the rest of the prompt's full pages, as prefill does."""
        match = self.cache.match_prefix(prompt, max_tokens=len(prompt) - 1)
        self.check_match(prompt, match.pages, match.num_tokens)
        self.cache.lock(match.node)
        need = len(prompt) // self.cache.page_size - len(match.pages)
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:
            self.cache.unlock(match.node)
            return False
        gens = [self.alloc.generation[p] for p in match.pages]
        request = Request(prompt, match.node, match.pages, self.alloc.allocate(need), gens)
        ps, first = self.cache.page_size, len(match.pages)
        for i, page in enumerate(request.private, start=first):
            self.content[page] = tuple(prompt[: (i + 1) * ps])
        self.running.append(request)
        return True

    @rule(prompt=prompts, pin=st.booleans())
    def serve_request(self, prompt: list[int], pin: bool) -> None:
        if self.admit(prompt):
            self.finish_request(len(self.running) - 1, pin)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50), pin=st.booleans())
    def finish_request(self, i: int, pin: bool) -> None:
        req = self.running.pop(i % len(self.running))
        result = self.cache.insert(req.prompt, req.cached + req.private)
        assert set(result.duplicate_pages) <= set(req.private)
        assert len(result.duplicate_pages) + result.num_new_pages == len(req.private)
        self.alloc.free(result.duplicate_pages)
        full = len(req.prompt) // self.cache.page_size
        if pin:
            self.cache.lock(result.node)
            match = self.cache.match_prefix(req.prompt)
            assert len(match.pages) == full
            gens = [self.alloc.generation[p] for p in match.pages]
            self.pinned.append(Request(req.prompt, result.node, match.pages, [], gens))
        self.cache.unlock(req.node)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 50))
    def abort_request(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        self.alloc.free(req.private)
        self.cache.unlock(req.node)

    @precondition(lambda self: self.pinned)
    @rule(i=st.integers(0, 50))
    def release_pinned(self, i: int) -> None:
        self.cache.unlock(self.pinned.pop(i % len(self.pinned)).node)

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        evictable = self.cache.num_evictable_pages
        assert self.cache.evict(n) == min(n, evictable)

    @invariant()
    def pages_are_conserved(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        held = sum(len(r.private) for r in self.running)
        assert self.alloc.num_free + self.cache.num_cached_pages + held == self.alloc.num_usable
        for req in self.running + self.pinned:  # locked pages are never freed under a holder
            assert [self.alloc.generation[p] for p in req.cached] == req.generations
            self.check_match(req.prompt, req.cached, len(req.cached) * self.cache.page_size)

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        while self.running:
            self.abort_request(0)
        while self.pinned:
            self.release_pinned(0)
        assert self.cache.num_locked_pages == 0
        self.cache.evict(self.alloc.num_usable)
        self.cache.check_invariants()
        assert self.cache.num_cached_pages == 0 and self.cache.root.children == {}
        assert self.alloc.num_free == self.alloc.num_usable


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_cache_state_machine = RadixCacheMachine.TestCase
