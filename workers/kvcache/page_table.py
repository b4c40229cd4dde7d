"""The step's page table `[rows, max_pages]` built from page ids converted once per sequence.

Turning every running sequence's `pages` list into numpy on every step costs one Python int per
page: 1.2 ms of a 256 x 2048 Llama-3-8B decode step on an H200 (~32k pages). A decode step
appends at most one page per sequence, so `PageTable` keeps each sequence's ids as a numpy row
and converts only the pages that are new since the step before.

When a kept row is still `seq.pages`, by how `KVManager` changes `seq.pages`:
- `match_prefix` and `release` assign a new list: the row (which holds the old list, so its
  identity cannot be reused) no longer matches, and is rebuilt;
- `reserve` appends: the row converts the new tail;
- `cache_computed` may rewrite leading entries in place (duplicates swapped for the tree's
  pages), and always raises `num_tree_pages` when it does: the row keeps `num_tree_pages` and
  is rebuilt when it differs.
Any other in-place change of `seq.pages` must do one of these, or this table goes stale. A row
lives while its sequence is in consecutive steps; a step drops the rows of absent sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workers.sequence import Sequence


@dataclass(eq=False)
class _Row:
    seq: Sequence  # held, so id(seq) keys no other sequence while the row lives
    pages: list[int]  # the very list object the ids came from
    num_tree_pages: int
    ids: np.ndarray  # int32; ids[:n] == pages[:n]
    n: int = 0

    def matches(self, seq: Sequence) -> bool:
        return (
            self.pages is seq.pages
            and self.num_tree_pages == seq.num_tree_pages
            and len(seq.pages) >= self.n
        )

    def extend(self, pages: list[int], upto: int) -> None:
        if upto > len(self.ids):
            grown = np.empty(max(upto, 2 * len(self.ids)), dtype=np.int32)
            grown[: self.n] = self.ids[: self.n]
            self.ids = grown
        self.ids[self.n : upto] = pages[self.n : upto]
        self.n = upto


class PageTable:
    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}

    def build(self, seqs: list[Sequence], used: np.ndarray) -> np.ndarray:
        """`[len(used), used.max()]` int32: row r holds `seqs[r].pages[:used[r]]`, then zeros
        (scratch page 0); rows past `len(seqs)` (graph padding) are all zeros."""
        table = np.zeros((len(used), int(used.max())), dtype=np.int32)
        rows: dict[int, _Row] = {}
        for r, seq in enumerate(seqs):
            u = int(used[r])
            row = self._rows.get(id(seq))
            if row is None or not row.matches(seq):
                row = _Row(seq, seq.pages, seq.num_tree_pages, np.empty(max(u, 8), np.int32))
            if row.n < u:
                row.extend(seq.pages, u)
            table[r, :u] = row.ids[:u]
            rows[id(seq)] = row
        self._rows = rows
        return table
