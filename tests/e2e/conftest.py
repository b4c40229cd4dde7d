"""Serve for the end-to-end modules: one Serve instance on the shared Ray cluster, applications
deployed side by side under their own route prefixes, and the configs/local.yaml applications
(both modes) that several modules query, deployed once; the disaggregated one with its prefill
and its decode pool on different nodes of the shared cluster (tests/conftest.py).

An application costs ~30 s to start on 2 cores (every replica imports torch and transformers
and builds its engine); a module deploys its own only for a configuration of its own and
deletes it when it ends.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import yaml
from ray import serve
from ray.serve import Application

from cluster.app import build_app
from tests.conftest import DECODE_NODE, PREFILL_NODE
from tests.e2e.app_process import REPO
from tests.waiting import wait_until
from workers.parallel.rendezvous import free_port

MODES = ("disaggregated", "colocated")


def in_both_modes(check: Callable[..., None]) -> Callable[..., None]:
    """The test `check(apps, mode, ...)` run for both modes at once, a thread each: each mode's
    application computes on a core of its own. A failure names its mode."""

    def test(apps: dict[str, str], *args: Any, **kwargs: Any) -> None:
        with ThreadPoolExecutor(len(MODES)) as pool:
            runs = {mode: pool.submit(check, apps, mode, *args, **kwargs) for mode in MODES}
        for mode, run in runs.items():
            try:
                run.result()
            except AssertionError as e:
                raise AssertionError(f"{mode}: {e}") from e

    test.__name__, test.__doc__ = check.__name__, check.__doc__
    test.__dict__.update(check.__dict__)  # marks such as parametrize
    params = [p for name, p in inspect.signature(check).parameters.items() if name != "mode"]
    test.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return test


VLLM_MAX_QUEUED = 4  # the vLLM-named application's router admits this many requests at a time
HEALTHY_DEADLINE_S = 120  # a replica killed by an earlier module is replaced within this


def local_args(mode: str, **router: Any) -> dict[str, Any]:
    """configs/local.yaml's application arguments in `mode`, with a shorter context and half a
    CPU per rank so that several applications fit; `router` fields override its router's."""
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    args = config["applications"][0]["args"]
    args["mode"] = mode
    args["engine"]["max_model_len"] = 512
    args["router"].update(router)
    for pool in ("prefill", "decode"):
        args[pool]["num_cpus_per_rank"] = 0.5
    return args


@pytest.fixture(scope="session")
def serve_url(ray_cluster: None) -> Iterator[str]:
    """The base URL of the one Serve instance (its HTTP proxy on a free port)."""
    port = free_port("127.0.0.1")
    # one proxy, on the head: the cluster's nodes share this machine and so its ports
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@contextmanager
def running(name: str, app: Application, route_prefix: str | None) -> Iterator[Any]:
    """Application `name` until the block ends: its ingress's handle."""
    handle = serve.run(app, name=name, route_prefix=route_prefix)
    try:
        yield handle
    finally:
        serve.delete(name)


@contextmanager
def deployed(serve_url: str, name: str, args: dict[str, Any]) -> Iterator[str]:
    """Application `name` built from `args`, at `serve_url/name` until the block ends."""
    with running(name, build_app(args), f"/{name}"):
        yield f"{serve_url}/{name}"


def wait_healthy(base: str) -> None:
    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, HEALTHY_DEADLINE_S, interval_s=0.5, what=f"{base}/health to answer 200")


@pytest.fixture(scope="session")
def _local_apps(serve_url: str) -> Iterator[dict[str, str]]:
    for mode in MODES:
        # usage.prompt_tokens_details on: tests read the prefix cache's hits from it; LoRA
        # adapters loaded at run time (test_lora_serving.py)
        args = local_args(mode, enable_prompt_tokens_details=True,
                          allow_runtime_lora_updating=True)  # fmt: skip
        args["engine"].update(enable_lora=True, max_loras=2, max_lora_rank=8)
        if mode == "disaggregated":  # each pool on a node of its own: every hand-off crosses
            args["prefill"]["resources"] = {PREFILL_NODE: 1}
            args["decode"]["resources"] = {DECODE_NODE: 1}
        serve.run(build_app(args), name=mode, route_prefix=f"/{mode}")
    yield {mode: f"{serve_url}/{mode}" for mode in MODES}


@pytest.fixture(scope="module")
def local_apps(_local_apps: dict[str, str]) -> dict[str, str]:
    """Base URL of each mode's configs/local.yaml application, shared by the modules: healthy
    when a module starts (an earlier one may have killed a replica), counters cumulative."""
    for base in _local_apps.values():
        wait_healthy(base)
    return _local_apps


@pytest.fixture(scope="session")
def vllm_app(serve_url: str) -> Iterator[str]:
    """Base URL of a disaggregated configs/local.yaml application under vLLM's metric names (and
    its default of no prompt_tokens_details) whose router admits `VLLM_MAX_QUEUED` requests at
    a time: one application for the modules that need either (an application is ~30 s)."""
    args = local_args("disaggregated", metric_prefix="vllm", enable_prompt_tokens_details=False,
                      max_queued_requests=VLLM_MAX_QUEUED)
    with deployed(serve_url, "vllm", args) as base:
        yield base
