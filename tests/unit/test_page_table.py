"""`PageTable` builds the same table as converting every `seq.pages` afresh, under every way
`KVManager` changes a sequence's pages: prefix match, growth, caching (with duplicate pages
swapped for the tree's), release and re-admission."""

from __future__ import annotations

import random

import numpy as np
import pytest

from workers.kvcache.allocator import PageAllocator
from workers.kvcache.manager import KVManager
from workers.kvcache.page_table import PageTable
from workers.protocol import SamplingParams
from workers.sequence import Sequence

PAGE = 4


def fresh_table(seqs: list[Sequence], used: np.ndarray) -> np.ndarray:
    table = np.zeros((len(used), int(used.max())), dtype=np.int32)
    for row, seq in enumerate(seqs):
        table[row, : used[row]] = seq.pages[: used[row]]
    return table


@pytest.mark.parametrize("seed", range(5))
def test_page_table_equals_a_fresh_conversion_through_kv_manager_changes(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVManager(PageAllocator(400), PAGE, prefix_caching=True)
    shared = [rng.randrange(50) for _ in range(3 * PAGE)]  # prompts share whole pages
    seqs = []
    for i in range(6):
        tokens = shared + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        seqs.append(Sequence(str(i), tokens, len(tokens), SamplingParams(max_tokens=64), None))
    table = PageTable()
    for _ in range(120):
        seq = rng.choice(seqs)
        action = rng.random()
        if not seq.pages or action < 0.05:  # (re-)admission, after a release if it held pages
            if seq.pages:
                kv.release(seq, cache=rng.random() < 0.5)
            kv.match_prefix(seq)
        elif action < 0.25:  # a prefill chunk or a hand-off: cache its computed pages
            seq.num_computed_tokens = seq.num_tokens
            kv.cache_computed(seq)
        seq.token_ids.append(rng.randrange(50))  # a decode step's token
        assert kv.reserve(seq, seq.num_tokens)
        step = [s for s in seqs if s.pages and rng.random() < 0.8]
        if not step:
            continue
        used = np.array([-(-s.num_tokens // PAGE) for s in step] + [1] * rng.randrange(3))
        np.testing.assert_array_equal(table.build(step, used), fresh_table(step, used))
