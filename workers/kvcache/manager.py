"""Sequences' pages: reuse from the prefix cache, growth as tokens are added, release.

Ranges of a running sequence's `pages` (page_size tokens each):
- `[0, num_tree_pages)`: pages the radix tree owns. They came from a prefix match at admission
  or were handed to the tree by `cache_computed()`; the sequence holds them through its lock on
  `seq.prefix_node` and never frees them.
- `[num_tree_pages, len(pages))`: allocated for this sequence, owned by it alone.
`cache_computed()` moves whole computed pages from the second range to the first (the tree adopts
new content; where it already held the same tokens, the sequence switches to the tree's pages and
frees its own duplicates). On release the partial last page and any uncached pages are freed and
the lock is dropped. Without a prefix cache every page is the sequence's own and is freed.

With KV tiers, a waiting sequence whose prompt continues its device match in host memory or on
disk first gets those pages loaded (`start_onload`): the load job holds the device match's lock
and the pages it fills, the sequence holds nothing and waits. When the job ends its pages join
the tree (`finished_onloads`) and the sequence's next `match_prefix` finds them on the device. A
sequence that leaves meanwhile leaves the job to end on its own; its pages still join the tree.
"""

from __future__ import annotations

from workers.kvcache.allocator import PageAllocator
from workers.kvcache.kv_events import LORA_SALT, ROOT, prefix_cache_ids
from workers.kvcache.radix_cache import RadixCache
from workers.kvcache.tiers.offloader import OnloadJob, TieredStore
from workers.sequence import Sequence


class KVManager:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        prefix_caching: bool,
        tiers: TieredStore | None = None,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.radix = RadixCache(page_size, allocator) if prefix_caching else None
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.tiers = tiers if self.radix is not None else None
        if self.tiers is not None and self.radix is not None:
            self.radix.below = self.tiers
            self.tiers.on_device = self.radix.holds
        self._onloaded: set[Sequence] = set()  # loaded for: their next match counts the hit

    def match_prefix(self, seq: Sequence) -> None:
        """Take the longest cached prefix (leaving at least one token to compute)."""
        assert not seq.pages and seq.prefix_node is None
        if self.radix is None or seq.wants_prompt_logprobs:  # those come from computing it
            return
        self._onloaded.discard(seq)
        match = self.radix.match_prefix(_ids(seq), max_tokens=seq.num_tokens - 1)
        self.radix.lock(match.node)
        seq.prefix_node = match.node
        seq.pages = list(match.pages)
        seq.num_tree_pages = len(match.pages)
        seq.num_computed_tokens = match.num_tokens
        if seq.num_output_tokens == 0:  # a first admission, not a recompute after preemption
            seq.num_cached_tokens = match.num_tokens
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += match.num_tokens

    def start_onload(self, seq: Sequence) -> bool | None:
        """Start loading the pages of `seq`'s prompt that continue its device match from the
        tiers below (True: started, or still loading); False when they hold none; None when
        they do but no device page is free for them yet (the sequence should wait, not
        compute them: a chunk of its prefill needs fewer pages than the load)."""
        tiers, radix = self.tiers, self.radix
        if tiers is None or radix is None or seq.wants_prompt_logprobs or seq in self._onloaded:
            return False
        if tiers.is_loading_for(seq):
            return True
        ids = _ids(seq)
        match = radix.match_prefix(ids, max_tokens=seq.num_tokens - 1)
        start, end = len(match.pages), (seq.num_tokens - 1) // self.page_size
        parent = match.node.names[-1] if match.node.names else ROOT
        found = tiers.lookup(ids, start, end, parent)
        if not found:
            return False
        radix.lock(match.node)
        tiers.pin(found)  # the eviction that makes room must not take them
        pages = self.allocate(len(found))
        if pages is None:
            radix.unlock(match.node)
            tiers.unpin(found)
            return None
        tokens = ids[: (start + len(found)) * self.page_size]
        tiers.start(OnloadJob(seq, match.node, tokens, match.pages, pages, found))
        return True

    def finished_onloads(self) -> list[Sequence]:
        """The sequences whose loads ended (their pages are in the tree now, or, where a load
        failed, freed: the sequence computes them)."""
        if self.tiers is None or self.radix is None:
            return []
        waiters = []
        for job in self.tiers.poll():
            if job.error is None:
                result = self.radix.insert(job.tokens, job.prefix_pages + job.pages)
                self.allocator.free(result.duplicate_pages)
            else:
                self.allocator.free(job.pages)
            self.radix.unlock(job.node)
            if job.owner is not None:
                self._onloaded.add(job.owner)
                waiters.append(job.owner)
        return waiters

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq.pages` cover `num_tokens` tokens, evicting cached pages if needed."""
        need = -(-num_tokens // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.allocate(need)
        if pages is None:
            return False
        seq.pages += pages
        return True

    def allocate(self, n: int) -> list[int] | None:
        """`n` pages of no sequence (e.g. a hand-off's staging), evicting cached pages if
        needed; None when there are not that many. The caller frees them to the allocator."""
        short = n - self.allocator.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        if not self.allocator.can_allocate(n):
            return None
        return self.allocator.allocate(n)

    def cache_computed(self, seq: Sequence) -> None:
        """Hand `seq`'s whole computed pages to the tree, so other requests can share them now."""
        if self.radix is None:
            return
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.page_size  # known ids
        if full <= seq.num_tree_pages:
            return
        tokens = _ids(seq)[: full * self.page_size]
        result = self.radix.insert(tokens, seq.pages[:full])
        self.radix.lock(result.node)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node = result.node
        if result.duplicate_pages:
            seq.pages[:full] = self.radix.match_prefix(tokens).pages
            self.allocator.free(result.duplicate_pages)
        seq.num_tree_pages = full

    def drop_lora(self, lora_id: int) -> int:
        """Free the cached pages of an unloaded LoRA adapter (held ones stay till released)."""
        if self.radix is None:
            return 0
        return self.radix.drop_where(lambda key: key[0] // LORA_SALT == lora_id)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Give back every page of `seq`: computed ones to the tree where `cache`, else freed."""
        if cache:
            self.cache_computed(seq)
        self._onloaded.discard(seq)
        if self.tiers is not None:
            self.tiers.disown(seq)
        pages, seq.pages = seq.pages, []
        self.allocator.free(pages[seq.num_tree_pages :])
        if self.radix is not None and seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node, seq.num_tree_pages, seq.num_computed_tokens = None, 0, 0

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_usable - self.allocator.num_free

    @property
    def num_pinned_pages(self) -> int:
        return 0 if self.radix is None else self.radix.num_locked_pages


def _ids(seq: Sequence) -> list[int]:
    """`seq`'s ids as the prefix cache keys them (its adapter's range and its salt,
    `prefix_cache_ids`)."""
    return list(prefix_cache_ids(seq.token_ids, seq.lora_id, seq.cache_salt))
