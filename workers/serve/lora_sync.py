"""A replica's side of /v1/unload_lora_adapter: free the run-time adapters the app's registry no
longer lists (`workers/lora/registered.py`): their device slot, host copy and prefix-cache pages.

The router's unload only deletes the adapter's registry entry, so one write reaches every replica
of both pools on any node, replicas started later included, and no replica must be reachable at
the moment of the unload. Each replica reads the registry every `period_s` while it holds a
run-time adapter (`LoRARequest.runtime`), and on its engine loop thread, between steps, frees
each one that the registry lists no more (or lists with another path), unless a request here
still uses it: a request the router resolved before the unload runs to its end with its adapter
(as vLLM frees an adapter once no running request uses it), and the adapter goes at the first
read after it. So an unloaded adapter leaves a replica within `period_s` (plus the read's own
time) and one engine step of the unload, or of the end of its last request there (on a prefill
replica, of the release of that request's hand-off lease: `kv_transfer.lease_s` at most).

The reads (a GCS round trip per listed adapter) run on a thread of their own: the engine loop
only applies the newest read to what it holds, so a slow or unreachable GCS never stalls a
step. A read that began before this replica first held an adapter may predate its
registration (the router writes it before sending the request), so it frees no such adapter.
"""

from __future__ import annotations

import logging
import threading
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
    """Called on the engine loop thread after each step (`EngineWorker._on_stats`); a daemon
    thread reads the registry of `app` (`read`) once per `period_s` while a run-time adapter is
    held, and the newest read is applied once, on the engine loop."""

    def __init__(
        self, app: str, period_s: float,
        read: Callable[[str], dict[str, str] | None] = read_registered,
    ) -> None:  # fmt: skip
        self.app = app
        self.period_s = period_s
        self._read = read
        self._first_held: dict[int, float] = {}  # run-time adapter id -> when first seen held
        self._newest: tuple[float, dict[str, str]] | None = None  # (read's start, registry)
        self._lock = threading.Lock()
        self._wanted = threading.Event()  # set while a run-time adapter is held
        self._thread: threading.Thread | None = None

    def __call__(self, engine: Engine) -> list[str]:
        """The adapters freed now (mostly none)."""
        manager = engine.runner.lora
        runtime = [] if manager is None else [r for r in manager.taken.values() if r.runtime]
        if not runtime:
            self._wanted.clear()
            return []
        now = time.monotonic()
        for r in runtime:
            self._first_held.setdefault(r.lora_int_id, now)
        self._wanted.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._reads, name="lora-sync", daemon=True)
            self._thread.start()
        with self._lock:
            newest, self._newest = self._newest, None
        if newest is None:
            return []
        started, registered = newest
        # held since the read began: its registration may postdate the read, keep it
        unseen = {
            r.lora_name: r.lora_path for r in runtime if self._first_held[r.lora_int_id] >= started
        }
        freed = free_unloaded(engine, registered | unseen)
        if freed:
            logger.info("LoRA adapters unloaded from the registry freed: %s", ", ".join(freed))
            held = {r.lora_int_id for r in engine.runner.lora.taken.values()}  # type: ignore[union-attr]
            self._first_held = {i: t for i, t in self._first_held.items() if i in held}
        return freed

    def _reads(self) -> None:
        while True:
            self._wanted.wait()
            started = time.monotonic()
            try:
                registered = self._read(self.app)
            except Exception:  # GCS unreachable for now: the next period tries again
                logger.warning("reading the LoRA registry failed", exc_info=True)
                registered = None
            if registered is not None:
                with self._lock:
                    self._newest = (started, registered)
            time.sleep(self.period_s)
