"""One tier's index of the pages it holds: page name -> entry, least recently used first.

A page is keyed by its name (`page_hashes`: it stands for the whole prefix that ends with the
page) and keeps its own tokens and its parent's name, which a lookup checks, so a hit is the
page that follows the pages already matched. A pinned entry (a load reads it) is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(eq=False)
class TierEntry:
    name: int
    parent: int  # the name of the page before it (ROOT for a first page)
    tokens: tuple[int, ...]
    slot: int = -1  # host tier: its row of the buffer; disk tier: unused
    pins: int = 0


class TierIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # pages
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: int) -> bool:
        return name in self.entries

    def get(self, name: int, parent: int, tokens: tuple[int, ...]) -> TierEntry | None:
        """The entry of page `name`, if it is the page of `tokens` after page `parent`."""
        entry = self.entries.get(name)
        if entry is None or entry.parent != parent or entry.tokens != tokens:
            return None
        return entry

    def touch(self, entry: TierEntry) -> None:
        self.entries.move_to_end(entry.name)

    def add(self, entry: TierEntry) -> None:
        self.entries[entry.name] = entry

    def remove(self, entry: TierEntry) -> None:
        del self.entries[entry.name]

    def victims(self) -> Iterator[TierEntry]:
        """Unpinned entries, least recently used first (remove each before taking the next)."""
        for entry in list(self.entries.values()):
            if entry.pins == 0:
                yield entry
