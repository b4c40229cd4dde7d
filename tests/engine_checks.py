"""Checks several tests make of an engine once its requests are gone."""

from __future__ import annotations

from workers.engine.engine import Engine


def drain_and_check_released(engine: Engine) -> None:
    """Step until idle, then: nothing runs or is pinned, the radix tree is consistent, and every
    page is either free or cached in the tree."""
    while engine.has_work():
        engine.step()
    stats = engine.stats()
    assert stats.kv_pages_pinned == 0 and stats.num_running == 0
    radix = engine.kv.radix
    assert radix is not None
    radix.check_invariants()
    assert engine.allocator.num_free + radix.num_cached_pages == engine.allocator.num_usable
