"""Checks several tests make of an engine once its requests are gone."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from workers.config import EngineConfig, KVTransferConfig
from workers.engine.engine import Engine
from workers.protocol import GenerateRequest, RequestOutput

if TYPE_CHECKING:
    from workers.disagg.decode import DecodeEngine
    from workers.disagg.prefill import PrefillEngine


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


@contextlib.contextmanager
def engine_pair(
    prefill_cfg: EngineConfig, decode_cfg: EngineConfig | None = None
) -> Iterator[tuple[PrefillEngine, DecodeEngine]]:
    """A prefill and a decode engine in one process (NIXL over DRAM), the decode holding the
    prefill's agent as a peer; both agents closed on the way out."""
    from workers.disagg.decode import DecodeEngine
    from workers.disagg.prefill import PrefillEngine

    transfer = KVTransferConfig(lease_s=60.0)
    prefill = PrefillEngine(prefill_cfg, transfer, "p")
    decode = DecodeEngine(decode_cfg or prefill_cfg, transfer, "d")
    try:
        decode.agent.add_peer(prefill.agent.metadata())
        yield prefill, decode
    finally:
        decode.agent.close()
        prefill.agent.close()


def prefill_then_decode(
    prefill: PrefillEngine, decode: DecodeEngine, req: GenerateRequest, timeout_s: float = 60
) -> list[int]:
    """`req` prefilled on `prefill` and decoded on `decode` (in-process engines, NIXL over
    DRAM, the decode holding the prefill's agent as a peer): its tokens."""
    prefill.add_request(req)
    deadline = time.monotonic() + timeout_s
    first: RequestOutput | None = None
    while first is None:
        assert time.monotonic() < deadline, "no first token"
        first = next(iter(prefill.step()), None)
    decode.add_remote(req, first)
    tokens = list(first.token_ids)
    while len(tokens) < req.params.max_tokens:
        assert time.monotonic() < deadline, "the decode did not finish"
        prefill.poll()
        tokens += [t for c in decode.poll() + decode.step() for t in c.token_ids]
    return tokens
