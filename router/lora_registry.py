"""The LoRA adapters a served model offers, by the `model` name a request gives.

Adapters come from the config (`router.lora_modules`) and, with
`router.allow_runtime_lora_updating`, from POST /v1/load_lora_adapter at run time. Those loaded at
run time live in Ray's internal KV under the application's name when this process is connected to
Ray (`workers/lora/registered.py`), so every router replica of the app sees them (a load on one
replica, a request on another), and the engine replicas free an adapter once it leaves; without
Ray, in this process only. Each adapter's `lora_int_id` is derived from its name and path:
replicas agree on it without talking, and the engines load it on demand from the path.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from router.errors import BadRequestError, NotFoundError, unknown_model
from workers.api import LoRARequest, ray_internal_kv, read_registered, registry_prefix


def lora_int_id(name: str, path: str) -> int:
    """A positive id of the adapter (name, path), the same on every replica."""
    return zlib.crc32(f"{name}\0{path}".encode()) % (2**31 - 1) + 1


class LoRARegistry:
    def __init__(
        self, base_model: str, modules: dict[str, str], max_lora_rank: int, app_name: str = ""
    ) -> None:
        self.base_model = base_model
        self.max_lora_rank = max_lora_rank
        self._static = {n: _request(n, p) for n, p in modules.items()}
        self._local: dict[str, LoRARequest] = {}  # loaded at run time, without Ray
        self._app = app_name
        self._key = registry_prefix(app_name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name); an
        unknown name is a 404."""
        if not model or model == self.base_model:
            return None
        found = self._static.get(model) or self._local.get(model)
        kv = ray_internal_kv()
        if found is None and kv is not None:
            path = kv._internal_kv_get(self._key + model)
            found = None if path is None else _request(model, _text(path), runtime=True)
        if found is None:
            raise unknown_model(model)
        return found

    def adapters(self) -> list[LoRARequest]:
        """Those of the config in its order, then those loaded at run time by name."""
        runtime = sorted(self._runtime().values(), key=lambda r: r.lora_name)
        return [*self._static.values(), *runtime]

    def load(self, name: str | None, path: str | None) -> str:
        """vLLM's /v1/load_lora_adapter: 400 for a missing field or a name taken, 404 for a path
        without an adapter; the engines load it at its first request."""
        if not name or not path:
            raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base_model or name in self._static or name in self._runtime():
            raise BadRequestError(f"The lora adapter '{name}' has already been loaded.")
        config = Path(path) / "adapter_config.json"
        if not config.is_file():
            raise NotFoundError(f"Loading lora {name} failed: No adapter found for {path}")
        rank = json.loads(config.read_text()).get("r", 0)
        if rank > self.max_lora_rank:
            raise BadRequestError(
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}."
            )
        kv = ray_internal_kv()
        if kv is None:
            self._local[name] = _request(name, path, runtime=True)
        elif kv._internal_kv_put(self._key + name, path, overwrite=False):  # it existed
            raise BadRequestError(f"The lora adapter '{name}' has already been loaded.")
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str | None) -> str:
        """vLLM's /v1/unload_lora_adapter: 400 without a name, 404 for one not loaded at run
        time; later requests naming it are 404."""
        if not name:
            raise BadRequestError("'lora_name' needs to be provided to unload a LoRA adapter.")
        kv = ray_internal_kv()
        removed = (
            self._local.pop(name, None) is not None
            if kv is None
            else bool(kv._internal_kv_del(self._key + name))
        )
        if not removed:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _runtime(self) -> dict[str, LoRARequest]:
        registered = read_registered(self._app)
        if registered is None:
            return self._local
        return {n: _request(n, p, runtime=True) for n, p in registered.items()}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _request(name: str, path: str, runtime: bool = False) -> LoRARequest:
    return LoRARequest(
        lora_name=name, lora_int_id=lora_int_id(name, path), lora_path=path, runtime=runtime
    )
