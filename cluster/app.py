"""The Serve application: `serve run configs/local.yaml` imports `cluster.app:build_app`.

    router (HTTP ingress, OpenAI API) --> prefill pool (PrefillWorker replicas)
                                      --> decode pool  (DecodeWorker replicas)
In "colocated" mode there is no prefill pool: decode replicas serve whole requests.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from cluster import resources
from cluster.autoscaling_policy import SlaPolicy, Targets
from cluster.config import AppConfig, RouterConfig
from cluster.ingress import OpenAIIngress
from cluster.pool_config import AutoscalingConfig, PoolConfig
from cluster.startup import DecodeReplica, PrefillReplica

logger = logging.getLogger(__name__)


def _deployment_options(
    name: str, pool: PoolConfig, request_router: dict[str, Any] | None = None
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.queue_bound(),  # beyond: BackPressureError, answered 429
        "ray_actor_options": {
            "num_cpus": pool.num_cpus_per_rank,
            "num_gpus": pool.num_gpus_per_rank,
        },
        "health_check_period_s": 10,
    }
    if pool.resources:  # the replica's node type (with TP, bundle 0 holds them too)
        options["ray_actor_options"]["resources"] = dict(pool.resources)
    if pool.tensor_parallel_size > 1:
        # One replica = one TP group: the replica is rank 0 in bundle 0, its rank actors take
        # the other bundles (workers/parallel/ranks.py), all on one node.
        rank = {"CPU": pool.num_cpus_per_rank, "GPU": pool.num_gpus_per_rank, **pool.resources}
        rank = {k: v for k, v in rank.items() if v > 0} or {"CPU": 0.01}  # Ray: no empty bundle
        options["placement_group_bundles"] = [rank] * pool.tensor_parallel_size
        options["placement_group_strategy"] = "STRICT_PACK"
    if pool.autoscaling is not None:
        options["autoscaling_config"] = serve_autoscaling_config(pool.autoscaling)
    else:
        options["num_replicas"] = pool.num_replicas
    if request_router is not None:
        options["request_router_config"] = request_router
    return options


def serve_autoscaling_config(a: AutoscalingConfig) -> dict[str, Any]:
    """Serve's `autoscaling_config`: its default policy (ongoing requests) for a pool without
    SLA targets; with targets, `SlaPolicy`, which applies the pool's delays itself."""
    targets = {f.name: getattr(a, f.name) for f in dataclasses.fields(Targets)}
    shared = {"upscale_delay_s", "downscale_delay_s"}  # the only Targets fields Serve knows
    serve_fields = a.model_dump(exclude_none=True, exclude=set(targets) - shared)
    if not a.has_targets():
        return serve_fields
    policy = {"policy_function": f"{SlaPolicy.__module__}:{SlaPolicy.__name__}",
              "policy_kwargs": targets}  # fmt: skip
    return {**serve_fields, "upscale_delay_s": 0, "downscale_delay_s": 0, "policy": policy}


def _request_routers(cfg: AppConfig) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """`request_router_config` of the prefill and the decode pool (None: Serve's default,
    power of two choices on queue length). In colocated mode the decode pool also prefills,
    so it gets the prefix-aware router; in disaggregated mode it does with
    `decode_prefix_aware`, for the pages its replicas cache."""
    r: RouterConfig = cfg.router
    page_size = cfg.engine.page_size
    kv_events_period_s = cfg.kv_events_period()
    prefix_kwargs = {
        "page_size": page_size,
        "load_weight": r.prefix_load_weight,
        "pages_per_replica": r.prefix_index_pages,
        "kv_events_period_s": kv_events_period_s,
        "lora_miss_tokens": r.lora_miss_tokens,
    }
    prefix = {
        "request_router_class": "router.routing.serve_routers:PrefillRouter",
        "request_router_kwargs": prefix_kwargs,
        "request_routing_stats_period_s": r.routing_stats_period_s,
    }
    load = {
        "request_router_class": "router.routing.serve_routers:DecodeRouter",
        "request_router_kwargs": {"page_size": page_size, "lora_miss": r.lora_miss_requests},
        "request_routing_stats_period_s": r.routing_stats_period_s,
    }
    prefill_router = prefix if r.prefix_aware else None
    decode_router = load if r.decode_load_aware else None
    if cfg.mode == "colocated":
        return None, prefill_router or decode_router
    decode_prefix = {
        **prefix,
        "request_router_class": "router.routing.serve_routers:DecodePrefixRouter",
        "request_router_kwargs": {**prefix_kwargs, "max_running_gap": r.decode_max_running_gap},
    }
    return prefill_router, decode_prefix if r.decode_prefix_aware else decode_router


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    """Validate the config file's `args` and bind the router and both pools (whose replicas
    load their engines once the router runs: cluster/startup.py)."""
    cfg = AppConfig.model_validate(args)
    if ray.is_initialized():  # `serve run`/`deploy` and `pdserve serve` build it connected
        for warning in resources.report(cfg, resources.ray_nodes())[1]:
            logger.warning("pdserve: %s", warning)
    transfer = cfg.kv_transfer.model_dump()
    prefill_router, decode_router = _request_routers(cfg)
    stall_s = cfg.router.replica_timeout_s  # a step this long: keepalives stop, the router gives up
    # the replicas free adapters unloaded at run time; without run-time loads there are none
    sync_s = cfg.router.lora_sync_period_s if cfg.router.allow_runtime_lora_updating else 0.0
    shared = (transfer, cfg.kv_events_period(), stall_s, sync_s)
    decode = serve.deployment(**_deployment_options("decode", cfg.decode, decode_router))(
        DecodeReplica
    ).bind(cfg.decode.engine(cfg.engine).model_dump(), *shared)
    prefill = None
    if cfg.mode == "disaggregated":
        prefill = serve.deployment(**_deployment_options("prefill", cfg.prefill, prefill_router))(
            PrefillReplica
        ).bind(cfg.prefill.engine(cfg.engine).model_dump(), *shared)
    router = serve.deployment(
        name="router",
        num_replicas=cfg.router.num_replicas,
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.router.num_cpus},
    )(OpenAIIngress)
    return router.bind(cfg.model_dump(), decode, prefill)
