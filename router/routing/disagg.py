"""Conditional disaggregation: whether a prompt goes to the prefill pool or is prefilled by its
decode replica (Dynamo's and llm-d's rule): remotely when the decode side lacks many of its
tokens and the prefill pool is not backed up.

`DecodeCacheView` answers the first from the decode pool's KV events: the tokens of a prompt the
best-placed decode replica does not cache (the decode router sends the prompt where its prefix
is when it routes on the prefix, `decode_prefix_aware`). The second is this router's prompts
waiting on the prefill pool (`DisaggregatedBackend` counts them).
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

from router.routing.kv_feed import KVEventFeed
from router.routing.prefix_index import PrefixIndex, uncached_tokens
from workers.api import KVEventBatch, page_hashes


def prefill_remotely(
    uncached_tokens: int, prefills_waiting: int, max_local_tokens: int, max_waiting: int
) -> bool:
    """Prefill on the prefill pool: more than `max_local_tokens` to compute, and fewer than
    `max_waiting` prompts already waiting there (0: no bound)."""
    backed_up = max_waiting > 0 and prefills_waiting >= max_waiting
    return uncached_tokens > max_local_tokens and not backed_up


class DecodeCacheView:
    """The decode pool's caches, from its KV events (read on the caller's loop)."""

    def __init__(self, app: str, page_size: int, period_s: float, pool: str = "decode") -> None:
        self.page_size = page_size
        self.index = PrefixIndex()
        self._events: queue.SimpleQueue[KVEventBatch] = KVEventFeed.of(app, period_s).subscribe(
            pool
        )

    def uncached_tokens(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` that the decode replica caching most of it lacks."""
        while not self._events.empty():
            self.index.apply(self._events.get_nowait())
        names = page_hashes(prompt, self.page_size)
        for i in range(len(names) - 1, -1, -1):
            if self.index.owners(names[i]):
                return uncached_tokens(len(prompt), i + 1, self.page_size)
        return len(prompt)
