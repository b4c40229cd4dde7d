"""Ray's internal KV store, where replicas leave what others must find (NIXL peer records, the
stats board, fault strikes). Its own module: the routers read the board without importing the
NIXL transport."""

from __future__ import annotations

from types import ModuleType


def ray_internal_kv() -> ModuleType | None:
    """Ray's internal KV module when this process is connected to Ray (imported lazily)."""
    try:
        from ray.experimental import internal_kv
    except ImportError:
        return None
    return internal_kv if internal_kv._internal_kv_initialized() else None
