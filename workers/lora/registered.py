"""Where an application's run-time LoRA adapters are listed: Ray's internal KV, a key per adapter
(`<prefix><app>:<name>` -> its path). The router's registry (`router/lora_registry.py`) writes
it on /v1/load_lora_adapter and deletes on /v1/unload_lora_adapter; the replicas read it to
free the adapters it no longer lists (`workers/serve/lora_sync.py`)."""

from __future__ import annotations

from workers.ray_kv import ray_internal_kv

KV_PREFIX = "pdserve-lora:"


def registry_prefix(app: str) -> str:
    """The keys of `app`'s run-time adapters start with this; the adapter's name follows."""
    return f"{KV_PREFIX}{app}:"


def read_registered(app: str) -> dict[str, str] | None:
    """`app`'s run-time adapters, name -> path (blocking: a few calls to Ray's GCS); None
    outside Ray."""
    kv = ray_internal_kv()
    if kv is None:
        return None
    prefix = registry_prefix(app)
    out = {}
    for key in kv._internal_kv_list(prefix):
        path = kv._internal_kv_get(key)
        if path is not None:
            out[_text(key)[len(prefix) :]] = _text(path)
    return out


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
