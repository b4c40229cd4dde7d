"""A replica's side of /v1/unload_lora_adapter: free the run-time adapters the app's registry no
longer lists (`workers/lora/registered.py`): their device slot, host copy and prefix-cache pages.

The router's unload only deletes the adapter's registry entry, so one write reaches every replica
of both pools on any node, replicas started later included, and no replica must be reachable at
the moment of the unload. Each replica, on its engine loop thread between steps, reads the
registry every `period_s` while it holds a run-time adapter (`LoRARequest.runtime`), and frees
each one that the registry lists no more (or lists with another path), unless a request here
still uses it: a request the router resolved before the unload runs to its end with its adapter
(as vLLM frees an adapter once no running request uses it), and the adapter goes at the first
read after it. So an unloaded adapter leaves a replica within `period_s` and one engine step of
the unload, or of the end of its last request there (on a prefill replica, of the release of
that request's hand-off lease: `kv_transfer.lease_s` at most).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from workers.engine.engine import Engine
from workers.lora.registered import read_registered

logger = logging.getLogger(__name__)


def free_unloaded(engine: Engine, registered: dict[str, str]) -> list[str]:
    """Free the run-time adapters `engine` took that `registered` (name -> path) no longer
    lists, except those a request here still uses; the names freed."""
    manager = engine.runner.lora
    if manager is None:
        return []
    gone = [r for r in manager.taken.values()
            if r.runtime and registered.get(r.lora_name) != r.lora_path]  # fmt: skip
    used = engine.lora_ids_in_use() if gone else set()
    freed = [r for r in gone if r.lora_int_id not in used]
    for r in freed:
        engine.remove_lora(r.lora_int_id)
    return [r.lora_name for r in freed]


class LoRASync:
    """Called on the engine loop thread after each step (`EngineWorker._on_stats`); reads the
    registry of `app` at most once per `period_s`, and only while a run-time adapter is held."""

    def __init__(
        self, app: str, period_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.app = app
        self.period_s = period_s
        self._clock = clock
        self._next = 0.0

    def __call__(self, engine: Engine) -> list[str]:
        """The adapters freed now (mostly none)."""
        manager, now = engine.runner.lora, self._clock()
        if manager is None or now < self._next:
            return []
        self._next = now + self.period_s
        if not any(r.runtime for r in manager.taken.values()):
            return []
        registered = read_registered(self.app)
        if registered is None:  # outside Ray: nothing to compare with
            return []
        freed = free_unloaded(engine, registered)
        if freed:
            logger.info("LoRA adapters unloaded from the registry freed: %s", ", ".join(freed))
        return freed
