"""Every shipped config file is one that its tool accepts, checked offline.

Serve configs (configs/*.yaml and the RayService's serveConfigV2): only field names Ray's Serve
schema knows, `cluster.app:build_app` as import path, and `args` valid as `AppConfig`.
`ray up` files: the cluster launcher's own preparation and validation, as `ray up` runs them.
The Grafana dashboard: every query names only metric families and labels /metrics exports.
"""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError
from ray.serve import schema as serve_schema

from cluster.config import MIN_FAILOVER_DEADLINE_S, AppConfig
from router.backend import RoleStats
from router.metrics import Metrics
from workers.api import EngineStats

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
LAUNCHERS = sorted((ROOT / "deploy").glob("ray-cluster.*.yaml"))
AWS = ROOT / "deploy" / "ray-cluster.aws.yaml"
ONPREM = ROOT / "deploy" / "ray-cluster.onprem.yaml"
RAYSERVICE = ROOT / "deploy" / "kuberay" / "rayservice.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
GRAFANA = ROOT / "deploy" / "grafana"
LAUNCHER_KEYS = {
    "cluster_name", "provider", "auth", "file_mounts", "setup_commands",
    "head_start_ray_commands", "worker_start_ray_commands",
}  # fmt: skip


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def rayservice_serve_config() -> dict[str, Any]:
    return yaml.safe_load(load(RAYSERVICE)["spec"]["serveConfigV2"])


SERVE_CONFIGS = [pytest.param(load(p), id=p.name) for p in CONFIGS] + [
    pytest.param(rayservice_serve_config(), id="rayservice.serveConfigV2")
]


def unknown_keys(mapping: dict[str, Any], model: type[BaseModel]) -> set[str]:
    # Serve's schema ignores unknown keys, so a misspelt one would pass silently.
    return set(mapping) - set(model.model_fields)


def gpu_limit(group: dict[str, Any]) -> int:
    return int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])


def llama_args() -> dict[str, Any]:
    return copy.deepcopy(load(ROOT / "configs" / "llama.yaml")["applications"][0]["args"])


def test_configs_dir_holds_the_cpu_default_and_the_gpu_cluster() -> None:
    assert {"local.yaml", "llama.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_serve_config_uses_only_fields_serve_reads(config: dict[str, Any]) -> None:
    serve_schema.ServeDeploySchema.model_validate(config)
    assert not unknown_keys(config, serve_schema.ServeDeploySchema)
    assert not unknown_keys(config.get("http_options", {}), serve_schema.HTTPOptionsSchema)
    assert config["applications"]
    for app in config["applications"]:
        assert not unknown_keys(app, serve_schema.ServeApplicationSchema)
        assert app["import_path"] == "cluster.app:build_app"


@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_application_args_validate_as_app_config(config: dict[str, Any]) -> None:
    for app in config["applications"]:
        AppConfig.model_validate(app["args"])


@pytest.mark.parametrize("config", SERVE_CONFIGS)
def test_application_args_build_the_serve_app(config: dict[str, Any]) -> None:
    from ray.serve import Application

    from cluster.app import build_app

    for app in config["applications"]:
        assert isinstance(build_app(app["args"]), Application)


def test_llama_config_runs_each_pool_on_its_own_gpus() -> None:
    cfg = AppConfig.model_validate(llama_args())
    assert (cfg.engine.device, cfg.engine.dtype, cfg.mode) == ("cuda", "bfloat16", "disaggregated")
    for pool in (cfg.prefill, cfg.decode):
        assert pool.num_gpus_per_rank == 1
        assert pool.tensor_parallel_size == 1
    assert cfg.decode.autoscaling is not None
    assert cfg.decode.autoscaling.max_replicas > cfg.decode.autoscaling.min_replicas


def test_a_pools_queue_bound_defaults_to_its_capacity_and_reaches_its_deployment() -> None:
    from cluster.app import _deployment_options

    args = llama_args()
    args["prefill"] = {"num_replicas": 2, "max_ongoing_requests": 8}
    args["decode"] = {"autoscaling": {"max_replicas": 3}, "max_ongoing_requests": 16}
    cfg = AppConfig.model_validate(args)
    assert (cfg.prefill.queue_bound(), cfg.decode.queue_bound()) == (2 * 8, 3 * 16)
    set_bound = cfg.prefill.model_copy(update={"max_queued_requests": 5})
    assert _deployment_options("prefill", set_bound)["max_queued_requests"] == 5
    assert _deployment_options("decode", cfg.decode)["max_queued_requests"] == 48


def test_a_pools_resources_pin_its_replicas_and_every_tp_rank() -> None:
    from cluster.app import _deployment_options

    cfg = AppConfig.model_validate(llama_args())
    pinned = cfg.prefill.model_copy(update={"resources": {"pd_prefill_node": 1.0}})
    options = _deployment_options("prefill", pinned)
    assert options["ray_actor_options"]["resources"] == {"pd_prefill_node": 1.0}
    tp = _deployment_options("prefill", pinned.model_copy(update={"tensor_parallel_size": 2}))
    assert all(b["pd_prefill_node"] == 1.0 for b in tp["placement_group_bundles"])
    assert "resources" not in _deployment_options("decode", cfg.decode)["ray_actor_options"]


def test_rayservice_embeds_the_llama_config() -> None:
    assert rayservice_serve_config() == load(ROOT / "configs" / "llama.yaml")


@pytest.mark.parametrize(
    "path, value",
    [
        (("prefil",), {"num_replicas": 2}),
        (("engine", "page_sise"), 16),
        (("decode", "autoscaling", "max_replica"), 6),
    ],
)
def test_a_misspelt_field_fails_naming_it(path: tuple[str, ...], value: Any) -> None:
    args = llama_args()
    parent = args
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(ValidationError) as err:
        AppConfig.model_validate(args)
    assert [(e["loc"], e["type"]) for e in err.value.errors()] == [(path, "extra_forbidden")]
    assert ".".join(path) in str(err.value)


def test_a_wrong_value_fails_naming_the_field() -> None:
    args = llama_args()
    args["engine"]["dtype"] = "bf16"
    with pytest.raises(ValidationError, match=r"engine\.dtype"):
        AppConfig.model_validate(args)


def test_a_failover_deadline_inside_the_liveness_window_is_refused() -> None:
    """A deadline a busy replica's missed heartbeat could outlast would fail live replicas."""
    assert MIN_FAILOVER_DEADLINE_S == 4.5  # 3 s stale + 1 s post period + 0.5 s verdict reuse
    args = llama_args()
    for short in (MIN_FAILOVER_DEADLINE_S, 3.0):
        args["router"] = {"failover_deadline_s": short}
        with pytest.raises(ValidationError, match=r"router\.failover_deadline_s") as err:
            AppConfig.model_validate(args)
        assert "greater than 4.5 s" in str(err.value)
    args["router"] = {"failover_deadline_s": MIN_FAILOVER_DEADLINE_S + 0.5}
    assert AppConfig.model_validate(args).router.failover_deadline_s == 5.0


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_config_passes_the_checks_ray_up_runs(path: Path) -> None:
    # `ray up` prepares (defaults, node types) then validates against Ray's JSON schema.
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(path)
    assert not LAUNCHER_KEYS - set(config), LAUNCHER_KEYS - set(config)
    assert "." in config["file_mounts"].values()  # the repo itself reaches every node
    assert any("pdserve[gpu,cu12]" in cmd for cmd in config["setup_commands"])  # cu128 image
    # every node starts Ray with the env file's secrets and Ray token (deploy/README.md)
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all(". ~/pdserve.env" in cmd for cmd in starts if "ray start" in cmd)
    validate_config(prepare_config(config))


def test_aws_cluster_has_a_gpu_free_head_and_gpu_workers() -> None:
    config = load(AWS)
    assert config["provider"]["type"] == "aws"
    types = config["available_node_types"]
    head = config["head_node_type"]
    assert head in types
    assert types[head]["resources"].get("GPU") == 0
    assert any("--num-gpus=0" in cmd for cmd in config["head_start_ray_commands"])
    workers = [t for name, t in types.items() if name != head]
    assert workers and all(t["max_workers"] >= t.get("min_workers", 0) >= 0 for t in workers)


def test_onprem_cluster_names_its_machines() -> None:
    config = load(ONPREM)
    provider = config["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] and provider["worker_ips"]
    assert config["min_workers"] == config["max_workers"] == len(provider["worker_ips"])


def test_rayservice_has_a_coordinator_head_and_gpu_workers() -> None:
    doc = load(RAYSERVICE)
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0", "num-gpus": "0"}  # strings, as KubeRay wants
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8265, 8000} <= ports
    groups = cluster["workerGroupSpecs"]
    assert groups
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert gpu_limit(group) >= 1


def test_rayservice_has_gpus_for_both_pools_at_their_largest() -> None:
    cluster = load(RAYSERVICE)["spec"]["rayClusterConfig"]
    gpus = sum(g["maxReplicas"] * gpu_limit(g) for g in cluster["workerGroupSpecs"])
    cfg = AppConfig.model_validate(rayservice_serve_config()["applications"][0]["args"])
    needed = 0.0
    for pool in (cfg.prefill, cfg.decode):
        replicas = pool.autoscaling.max_replicas if pool.autoscaling else pool.num_replicas
        needed += replicas * pool.tensor_parallel_size * pool.num_gpus_per_rank
    assert gpus >= needed


def test_rayservice_takes_its_secrets_from_kubernetes_secrets() -> None:
    text = RAYSERVICE.read_text()
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", text)  # no token pasted in
    cluster = load(RAYSERVICE)["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # Ray's token, made by the operator
    env: dict[str, Any] = {}
    for group in cluster["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            env.update({e["name"]: e for e in container.get("env", [])})
    for name in ("HF_TOKEN", "PDSERVE_API_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], name


def test_image_and_ray_version_agree_everywhere() -> None:
    ray_version = re.search(r"^ARG RAY_VERSION=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert ray_version is not None
    cluster = load(RAYSERVICE)["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_version.group(1)
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    images = {c["image"] for pod in pods for c in pod["template"]["spec"]["containers"]}
    images |= {load(path)["docker"]["image"] for path in LAUNCHERS}
    assert len(images) == 1, images


def exported_metrics() -> dict[str, set[str]]:
    """Sample name -> its label names, as an app's /metrics renders them with both pools up."""
    from prometheus_client.parser import text_string_to_metric_families

    fields = EngineStats.model_fields.items()
    idle = EngineStats(**{name: 0 for name, field in fields if field.is_required()})
    metrics = Metrics("m", cache_info={"block_size": "16"})
    text = metrics.render([RoleStats(role, idle) for role in ("prefill", "decode")]).decode()
    labels: dict[str, set[str]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels[sample.name] |= set(sample.labels)
    return labels


def dashboard_queries() -> list[str]:
    doc = json.loads((GRAFANA / "pdserve.json").read_text())
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)  # any Prometheus
    variables = [v["query"]["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return [t["expr"] for p in panels for t in p["targets"]] + variables


def test_grafana_queries_name_only_exported_metrics_and_their_labels() -> None:
    exported = exported_metrics()
    used: set[str] = set()
    for query in dashboard_queries():
        names = re.findall(r"pdserve:[A-Za-z0-9_:]+", query)
        assert names and all(n in exported for n in names), query
        common = set.intersection(*(exported[n] for n in names))
        for group in re.findall(r"\bby \(([^)]*)\)", query):
            assert {label.strip() for label in group.split(",")} <= common, query
        used.update(names)
    # TTFT, TPOT, queues, KV use, prefix-cache hits, NIXL bytes and time
    wanted = ["time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
              "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
              "nixl_bytes_transferred_total", "nixl_xfer_time_seconds_sum"]  # fmt: skip
    assert {f"pdserve:{name}" for name in wanted} <= used


def test_grafana_provisioning_loads_the_dashboard_folder() -> None:
    [provider] = load(GRAFANA / "provisioning" / "dashboards.yaml")["providers"]
    assert provider["type"] == "file"
    [source] = load(GRAFANA / "provisioning" / "datasources.yaml")["datasources"]
    assert source["type"] == "prometheus"
    [job] = load(GRAFANA / "prometheus.yaml")["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
