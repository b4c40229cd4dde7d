"""The router's Serve deployment: the HTTP ingress (OpenAI API) in front of the worker pools.

Its own module, imported by every router replica: nothing here imports torch or the engines
(the worker pools' classes are `build_app`'s, in `cluster/app.py`), so a router replica starts
without them (~3 s of CPU and ~300 MB less).
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from cluster.config import AppConfig
from router.admission import IngressLimits
from router.backend import GenerationBackend
from router.failover import FailoverPolicy
from router.health import PoolWatch
from router.lora_registry import LoRARegistry
from router.metric_names import Naming
from router.metrics import Metrics
from router.metrics_board import MetricsBoard
from router.openai_api import build_openai_app
from router.params import generation_defaults
from router.pd_backend import DisaggregatedBackend
from router.routing.disagg import DecodeCacheView
from router.tools.parsers import default_parser
from workers.model.files import load_model_config, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)


@serve.ingress()
class OpenAIIngress:
    """The HTTP door: validates, tokenizes, and hands requests to the worker pools."""

    def __init__(self, config: dict[str, Any], decode: Any, prefill: Any = None) -> None:
        self.config = AppConfig.model_validate(config)
        ctx = serve.get_replica_context()
        app_name = ctx.app_name
        r = self.config.router
        failover = FailoverPolicy(r.failover_attempts, r.failover_deadline_s, r.replica_timeout_s)
        backend = DisaggregatedBackend(
            prefill, decode, app_name, r.decode_prefill_max_tokens, failover
        )
        backend.prefill_queue_max_requests = r.prefill_queue_max_requests
        events_period_s = self.config.kv_events_period()
        if prefill is not None and events_period_s > 0 and r.decode_prefill_max_tokens > 0:
            page_size = self.config.engine.page_size
            backend.decode_cache = DecodeCacheView(app_name, page_size, events_period_s)
        self.backend: GenerationBackend = backend
        # Several router replicas: each scrape reaches one, so they share request metrics.
        self.board = MetricsBoard(app_name, str(ctx.replica_id.unique_id))
        pools = ["decode"] if prefill is None else ["prefill", "decode"]
        self.health = PoolWatch(app_name, pools, self.config.router.health_period_s)
        model_dir = resolve_model(self.config.engine.model, self.config.engine.load_format)
        self.tokenizer = load_tokenizer(model_dir)
        model_config = load_model_config(model_dir)
        self.max_model_len = model_config.context_limit(self.config.engine.max_model_len)
        self.tool_parser: str = r.tool_call_parser
        if self.tool_parser == "auto":
            self.tool_parser = default_parser(self.tokenizer.chat_template,
                                              model_config.architecture)
        self.loras = None
        if self.config.engine.enable_lora:  # adapters by name, shared by the app's routers
            modules = {m.name: m.path for m in r.lora_modules}
            self.loras = LoRARegistry(self.config.model_name, modules,
                                      self.config.engine.max_lora_rank, app_name)
        self.sampling_defaults = generation_defaults(model_dir)
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json: %s", self.sampling_defaults)

    def metrics(self) -> Metrics:
        """The app's metrics, named per `router.metric_prefix`."""
        engine = self.config.engine
        cache_info = {
            "block_size": str(engine.page_size),
            "cache_dtype": engine.kv_cache_dtype,  # vLLM's label: auto, or fp8_e4m3
            "enable_prefix_caching": str(engine.enable_prefix_caching),
            "gpu_memory_utilization": str(engine.gpu_memory_utilization),
        }
        return Metrics(self.config.model_name, naming=Naming(self.config.router.metric_prefix),
                       max_model_len=self.max_model_len, cache_info=cache_info)

    def __serve_build_asgi_app__(self) -> Any:
        return build_openai_app(
            self.backend,
            self.tokenizer,
            self.config.model_name,
            self.max_model_len,
            api_key=self.config.resolved_api_key(),
            metrics=self.metrics(),
            prompt_tokens_details=self.config.router.enable_prompt_tokens_details,
            open_invocations=self.config.router.open_invocations,
            sampling_defaults=self.sampling_defaults,
            board=self.board,
            limits=IngressLimits(
                max_request_bytes=self.config.router.max_request_bytes,
                max_queued_requests=self.config.router.max_queued_requests,
                retry_after_s=self.config.router.retry_after_s,
            ),
            health=self.health,
            tool_parser=self.tool_parser,
            loras=self.loras,
            allow_runtime_lora_updating=self.config.router.allow_runtime_lora_updating,
        )
