"""The OpenAI-compatible HTTP app, independent of Ray Serve: `build_openai_app(...)`.

The Serve ingress mounts the returned FastAPI app with `@serve.ingress`; anything that implements
`GenerationBackend` (the colocated `LocalBackend`, a prefill -> decode backend) can sit behind it.

    POST /v1/completions, /v1/chat/completions   SSE when stream=true, else one JSON body
    GET  /v1/models                              the served model and its LoRA adapters
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   at run time, where allowed
    GET  /health                                 200 (empty); 503 while a pool has no live replica
    GET  /metrics                                Prometheus text, `pdserve:` or `vllm:` names
    POST /tokenize, /detokenize                  vLLM's helpers
    GET /version, GET|POST /ping, POST /invocations   vLLM's extras (`router.extra_routes`)

With an API key configured, every path but /health, /ping, /metrics and /version needs
`Authorization: Bearer <key>` (401 otherwise; `router.auth`). With `IngressLimits`, a body over
the size limit is 413 and a request beyond the queue bound 429 (`router.admission`). Tokenization
and chat templating run in threads, so one huge prompt never holds up the event loop (nor
/health).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from router.admission import Admission, BodyLimit, IngressLimits, Slot
from router.auth import APIKeyMiddleware
from router.backend import GenerationBackend, LocalBackend, RoleStats
from router.errors import (
    APIError,
    BadRequestError,
    error_response,
    install_error_handlers,
    unknown_model,
)
from router.extra_routes import extra_routes
from router.generation import Job, build_job, merge_streams
from router.health import PoolWatch
from router.lora_registry import LoRARegistry
from router.lora_routes import lora_routes
from router.metrics import Metrics, RequestOutcome, error_status
from router.metrics_board import MetricsBoard
from router.params import check_supported
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
)
from router.responses import chat_response, completion_response
from router.streaming import HEADERS, MEDIA_TYPE, stream_events
from router.structured import constraint_params
from router.tokenizer import Prompts
from router.tools.choice import ToolPlan, plan_tools
from router.tools.parsers import default_parser
from workers.api import LoRARequest, RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["GenerationBackend", "LocalBackend", "Metrics", "RoleStats", "build_openai_app"]


def build_openai_app(
    backend: GenerationBackend,
    tokenizer: Any,
    served_model_name: str,
    max_model_len: int,
    api_key: str | None = None,
    metrics: Metrics | None = None,
    sampling_defaults: Mapping[str, float] | None = None,
    board: MetricsBoard | None = None,
    limits: IngressLimits | None = None,
    health: PoolWatch | None = None,
    tool_parser: str | None = None,
    prompt_tokens_details: bool = False,
    open_invocations: bool = False,
    loras: LoRARegistry | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The app for one served model; `tokenizer` is the model's transformers tokenizer.

    `sampling_defaults` fills omitted temperature / top_p / top_k / min_p / repetition_penalty
    (`params.generation_defaults`: vLLM reads them from generation_config.json); `metrics`
    defaults to a fresh `Metrics` with its own registry.
    `board` (one of several router replicas) shares the request metrics with the other replicas,
    so /metrics covers them all; without it /metrics shows this process's requests.
    `limits`: body size and queue bounds (none without). `health` (in Serve) says whether every
    pool has a live replica; without it /health is 200 while the app answers.
    `tool_parser` (`router.tools.parsers.PARSERS`) finds tool calls in `auto` answers; default:
    the one the chat template's tool format names.
    `prompt_tokens_details`: fill usage.prompt_tokens_details (null otherwise, as vLLM).
    `open_invocations`: /invocations needs no API key (`router.auth`).
    `loras`: the LoRA adapters a request's `model` may name (none without);
    `allow_runtime_lora_updating`: mount /v1/load_lora_adapter and /v1/unload_lora_adapter.
    """
    prompts = Prompts(tokenizer, max_model_len)
    metrics = metrics or Metrics(served_model_name)
    tool_parser = tool_parser or default_parser(getattr(tokenizer, "chat_template", None), None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Post in the background, not per request, so an unscraped replica still counts.
        tasks = [] if board is None else [asyncio.create_task(board.run(metrics.request_stats))]
        if health is not None:
            tasks.append(asyncio.create_task(health.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.backend, app.state.metrics = backend, metrics
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_invocations=open_invocations)
    if limits is not None:
        app.add_middleware(BodyLimit, max_bytes=limits.max_request_bytes)  # outermost
    admission = (Admission(on_reject=metrics.reject) if limits is None else
                 Admission(limits.max_queued_requests, limits.retry_after_s, metrics.reject))

    def check_model(name: str | None) -> LoRARequest | None:
        """The LoRA adapter `name` picks (None: the base model; "" too, as absent in vLLM)."""
        if loras is not None:
            return loras.resolve(name)
        if name and name != served_model_name:
            raise unknown_model(name)
        return None

    async def run(
        req: SamplingFields, prompt_ids: list[list[int]], slot: Slot, outcome: RequestOutcome,
        arrival: float, tools: ToolPlan | None = None, lora: LoRARequest | None = None,
    ) -> Response:
        # In a thread: checking a constraint may compile a grammar.
        constraints = await asyncio.to_thread(constraint_params, req, prompts, tools)
        model = served_model_name if lora is None else lora.lora_name
        job = build_job(req, prompt_ids, prompts, model, metrics, sampling_defaults, tools,
                        constraints, arrival, lora)
        job.outcome, job.prompt_tokens_details = outcome, prompt_tokens_details
        merged = merge_streams([backend.generate(r) for r in job.requests], job.leaders())
        try:
            first = await anext(merged, None)
        except BaseException as e:
            status = error_status(e)
            job.close("abort" if status is None else "error", status or 500)
            await merged.aclose()
            raise
        slot.release()  # answered: no longer queued
        if first is None:
            job.close("error")
            raise APIError("the backend ended the request without output")
        if req.stream:
            events = stream_events(job, first, merged, prompts)
            return StreamingResponse(events, media_type=MEDIA_TYPE, headers=HEADERS)
        await _collect(job, first, merged)
        body = chat_response(job, prompts) if job.chat else completion_response(job, prompts)
        return Response(body.model_dump_json(), media_type="application/json")

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(req: CompletionRequest) -> Response:
        arrival = time.monotonic()
        lora = check_model(req.model)
        check_supported(req)
        with admission.slot() as slot, metrics.outcome() as outcome:
            ids = await asyncio.to_thread(prompts.completion_prompts, req.prompt)
            return await run(req, ids, slot, outcome, arrival, lora=lora)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        arrival = time.monotonic()
        lora = check_model(req.model)
        check_supported(req)
        tools = plan_tools(req.tools, req.tool_choice, tool_parser)
        with admission.slot() as slot, metrics.outcome() as outcome:
            ids = await asyncio.to_thread(
                prompts.chat_prompt,
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                None if tools is None else tools.tools,
            )
            return await run(req, [ids], slot, outcome, arrival, tools, lora)

    @v1.get("/models")
    async def models() -> ModelList:
        card = ModelCard(id=served_model_name, root=served_model_name, max_model_len=max_model_len)
        adapters = [] if loras is None else await asyncio.to_thread(loras.adapters)
        return ModelList(data=[card] + [
            ModelCard(id=a.lora_name, root=a.lora_path, parent=served_model_name,
                      max_model_len=max_model_len) for a in adapters
        ])  # fmt: skip

    app.include_router(v1)
    if loras is not None and allow_runtime_lora_updating:
        app.include_router(lora_routes(loras))

    @app.get("/health")
    async def health_check() -> Response:
        problem = None if health is None else health.problem()
        if problem is not None:
            return error_response(503, problem)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        snapshot: list[RoleStats] | None = None
        try:
            snapshot = await backend.stats()
        except Exception:  # noqa: BLE001 - still serve the router's own metrics
            logger.exception("backend stats failed")
        peers = None if board is None else await board.peers(metrics.request_stats())
        return Response(metrics.render(snapshot, peers), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(req.model)
        if req.messages is not None:
            plan = plan_tools(req.tools, None, tool_parser)  # the tools as the template takes them
            ids = await asyncio.to_thread(prompts.chat_prompt, req.messages,
                                          req.add_generation_prompt, req.continue_final_message,
                                          req.chat_template_kwargs,
                                          None if plan is None else plan.tools)
        else:
            ids = await asyncio.to_thread(prompts.encode, req.prompt or "",
                                          req.add_special_tokens)
        strs = await asyncio.to_thread(prompts.token_strs, ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(req.model)
        try:
            text = await asyncio.to_thread(prompts.decode, req.tokens, False)
        except Exception as e:  # noqa: BLE001 - ids the tokenizer cannot decode
            raise BadRequestError(f"cannot decode tokens: {e}", param="tokens") from e
        return DetokenizeResponse(prompt=text)

    app.include_router(extra_routes(health_check, chat_completions, completions))
    return app


async def _collect(
    job: Job,
    first: tuple[int, RequestOutput],
    rest: AsyncGenerator[tuple[int, RequestOutput], None],
) -> None:
    """Run a non-streaming job to its end; an engine error fails the whole request (500)."""
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            index, out = item
            job.add(index, out)
            if out.finish_reason == "error":
                raise APIError(out.error or "generation failed")
            item = await anext(rest, None)
    except Exception as e:
        job.close("error", error_status(e) or 500)
        raise
    finally:
        job.close("abort")  # cancelled: the client went away
        await rest.aclose()
