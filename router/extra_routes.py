"""vLLM's endpoints beside the OpenAI API: /version, and SageMaker's pair /ping and /invocations.

    GET  /version                 {"version": <pdserve's version>}
    GET, POST /ping               what /health answers (SageMaker's liveness probe)
    POST /invocations             a chat or a completion request, told apart by its body: the
                                  first of ChatCompletionRequest, CompletionRequest that it
                                  validates as, as vLLM dispatches; neither is 400
With an API key, /invocations needs it as /v1 does (it generates), unless
`router.open_invocations`; /version and /ping stay open (`router.auth`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from router.errors import BadRequestError
from router.protocol import ChatCompletionRequest, CompletionRequest

Handler = Callable[[Any], Awaitable[Response]]


def pdserve_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def extra_routes(health: Callable[[], Awaitable[Response]], chat: Handler,
                 completion: Handler) -> APIRouter:
    """The routes, calling the app's /health, chat and completions handlers."""
    routes = APIRouter()
    handlers: list[tuple[type[BaseModel], Handler]] = [
        (ChatCompletionRequest, chat),
        (CompletionRequest, completion),
    ]

    @routes.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": pdserve_version()}

    @routes.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @routes.post("/invocations")
    async def invocations(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as e:
            raise BadRequestError(f"the body is not JSON: {e}") from e
        for model, handler in handlers:
            try:
                req = model.model_validate(body)
            except ValidationError:
                continue
            return await handler(req)
        raise BadRequestError("Cannot find suitable handler for request. Expected one of: "
                              + ", ".join(model.__name__ for model, _ in handlers))

    return routes
