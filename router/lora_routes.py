"""vLLM's runtime LoRA endpoints, mounted with `router.allow_runtime_lora_updating`:

POST /v1/load_lora_adapter    {"lora_name", "lora_path"}: 200 with a text body; 400 for a
                              missing field or a name already loaded, 404 for no adapter there
POST /v1/unload_lora_adapter  {"lora_name"}: 200; 400 without a name, 404 for an unknown one
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from router.lora_registry import LoRARegistry


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str | None = None
    lora_int_id: int | None = None


def lora_routes(registry: LoRARegistry) -> APIRouter:
    routes = APIRouter(prefix="/v1")

    @routes.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(registry.load(req.lora_name, req.lora_path))

    @routes.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        return PlainTextResponse(registry.unload(req.lora_name))

    return routes
