"""The Serve application: `serve run configs/local.yaml` imports `cluster.app:build_app`.

    router (HTTP ingress, OpenAI API) --> prefill pool (PrefillWorker replicas)
                                      --> decode pool  (DecodeWorker replicas)
In "colocated" mode there is no prefill pool: decode replicas serve whole requests.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import AppConfig, PoolConfig
from router.backend import GenerationBackend
from router.openai_api import build_openai_app
from router.pd_backend import DisaggregatedBackend
from workers.decode_worker import DecodeWorker
from workers.model.loader import load_model_config, load_tokenizer, resolve_model
from workers.prefill_worker import PrefillWorker

logger = logging.getLogger(__name__)


@serve.ingress()
class OpenAIIngress:
    """The HTTP door: validates, tokenizes, and hands requests to the worker pools."""

    def __init__(self, config: dict[str, Any], decode: Any, prefill: Any = None) -> None:
        self.config = AppConfig.model_validate(config)
        self.backend: GenerationBackend = DisaggregatedBackend(prefill, decode)
        model_dir = resolve_model(self.config.engine.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = load_model_config(model_dir).context_limit(
            self.config.engine.max_model_len
        )

    def __serve_build_asgi_app__(self) -> Any:
        return build_openai_app(
            self.backend,
            self.tokenizer,
            self.config.model_name,
            self.max_model_len,
            api_key=self.config.resolved_api_key(),
        )


def _deployment_options(name: str, pool: PoolConfig) -> dict[str, Any]:
    if pool.tensor_parallel_size > 1:
        raise ValueError(f"{name}.tensor_parallel_size > 1 is not implemented yet")
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "ray_actor_options": {
            "num_cpus": pool.num_cpus_per_rank,
            "num_gpus": pool.num_gpus_per_rank,
        },
        "health_check_period_s": 10,
    }
    if pool.autoscaling is not None:
        options["autoscaling_config"] = pool.autoscaling.model_dump(exclude_none=True)
    else:
        options["num_replicas"] = pool.num_replicas
    return options


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    """Validate the config file's `args` and bind the router and both pools."""
    cfg = AppConfig.model_validate(args)
    transfer = cfg.kv_transfer.model_dump()
    decode = serve.deployment(DecodeWorker, **_deployment_options("decode", cfg.decode)).bind(
        cfg.decode.engine(cfg.engine).model_dump(), transfer
    )
    prefill = None
    if cfg.mode == "disaggregated":
        prefill = serve.deployment(
            PrefillWorker, **_deployment_options("prefill", cfg.prefill)
        ).bind(cfg.prefill.engine(cfg.engine).model_dump(), transfer)
    router = serve.deployment(
        OpenAIIngress,
        name="router",
        num_replicas=cfg.router.num_replicas,
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.router.num_cpus},
    )
    return router.bind(cfg.model_dump(), decode, prefill)
