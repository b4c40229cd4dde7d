"""KV events: the names of the pages a replica's prefix cache stores and evicts.

A page is named by `page_hashes`: page i of a token sequence by `hash((name of page i-1, its
tokens))`, so one name stands for the whole prefix that ends with that page (nano-vllm's chained
block hashes). Names are plain Python hashes of int tuples: the same in every process, whatever
PYTHONHASHSEED says. The radix cache names its pages with this function and the router names a
prompt's pages with it too (through `workers.api`), so both sides agree by construction.

`KVEventLog` collects the net change since the last `drain()`: a page stored then evicted
within one batch is reported evicted (the reader holds sets, so only the last word matters).
With KV tiers (`workers/kvcache/tiers`) a page the device pool evicts may be offloaded instead:
kept in host memory (tier 1) or on disk (tier 2), where a request still finds it, at the cost of
a load; its event names the tier it is in now (the highest that holds it).
`KVEventBatch` is what a replica publishes: its changes with its incarnation id, so a reader
drops what it knew of a replica whose incarnation changed (a restart with an empty cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROOT = 0x5EED  # the name "before" the first page


LORA_SALT = 1 << 32  # above every token id: an adapter's cache ids sit in a range of their own
_SALTED = 1 << 31  # a salted first id: in the upper half of its adapter's range, past any token


def prefix_cache_ids(
    token_ids: Sequence[int], lora_id: int, cache_salt: str | None = None
) -> Sequence[int]:
    """The ids the prefix cache keys a request's pages by (and names them from): its tokens,
    shifted by its LoRA adapter's id times LORA_SALT (0, the base model: unchanged), so that the
    same text under two adapters never shares KV; with `cache_salt` (vLLM's), the first id
    replaced by a 31-bit hash of the salt and that token, so requests share KV only with those
    of the same salt (two salts meet at one first token with odds of 2^-31)."""
    if not lora_id and cache_salt is None:
        return token_ids
    shift = lora_id * LORA_SALT
    ids = [t + shift for t in token_ids]
    if cache_salt is not None and ids:
        key = f"{cache_salt}\0{token_ids[0]}".encode()
        salted = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest()) % _SALTED
        ids[0] = shift + _SALTED + salted
    return ids


def page_hashes(token_ids: Sequence[int], page_size: int, parent: int = ROOT) -> list[int]:
    """Chained names of the whole pages of `token_ids`, following the page named `parent`."""
    n = len(token_ids) // page_size
    names, prev = [], parent
    for i in range(0, n * page_size, page_size):
        prev = hash((prev, *token_ids[i : i + page_size]))
        names.append(prev)
    return names


@dataclass
class KVEventBatch:
    """One replica's cache changes. `snapshot`: `stored` is its whole cache, drop the rest."""

    replica: str
    incarnation: str
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    snapshot: bool = False
    offloaded: list[tuple[int, int]] = field(default_factory=list)  # (name, tier 1 or 2)

    def __len__(self) -> int:
        return len(self.stored) + len(self.removed) + len(self.offloaded)


class KVEventLog:
    """Net page changes of one cache since the last `drain()` (touched by one thread)."""

    def __init__(self) -> None:
        self._net: dict[int, int] = {}  # name -> tier holding it (0: the device), or -1: gone
        self.num_events = 0  # changes recorded, ever

    def stored(self, names: Iterable[int]) -> None:
        self._mark(names, 0)

    def removed(self, names: Iterable[int]) -> None:
        self._mark(names, -1)

    def offloaded(self, names: Iterable[int], tier: int) -> None:
        self._mark(names, tier)

    def _mark(self, names: Iterable[int], tier: int) -> None:
        for name in names:
            self._net[name] = tier
            self.num_events += 1

    def drain(self) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """(stored, removed, offloaded as (name, tier)) since the last drain."""
        net, self._net = self._net, {}
        stored = [n for n, t in net.items() if t == 0]
        removed = [n for n, t in net.items() if t < 0]
        return stored, removed, [(n, t) for n, t in net.items() if t > 0]
