"""The rollback of rejected drafts' KV: a sequence's computed tokens cut back, and its pages past
them freed (they hold the rejected drafts' KV, which the next step overwrites anyway)."""

from __future__ import annotations

from workers.kvcache.manager import KVManager
from workers.sequence import Sequence


def truncate_kv(kv: KVManager, seq: Sequence, num_computed: int) -> None:
    """Keep `seq`'s KV for its first `num_computed` tokens, and pages for its known tokens."""
    seq.num_computed_tokens = num_computed
    keep = max(-(-len(seq.token_ids) // kv.page_size), seq.num_tree_pages)
    if len(seq.pages) > keep:
        extra, seq.pages = seq.pages[keep:], seq.pages[:keep]  # a new list: the step's page
        kv.allocator.free(extra)  # table rebuilds its row (`PageTable`)
