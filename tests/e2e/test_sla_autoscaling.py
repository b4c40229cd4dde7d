"""SLA autoscaling through Serve itself: the controller unpickles `SlaPolicy` (by value, as
cluster/app.py configures it), collects a replica's `record_autoscaling_stats()`, and scales the
deployment as `decide()` says. A stand-in deployment reports a prefill backlog, so no engine
starts; its replicas push their metrics every half second instead of every 10 s."""

from __future__ import annotations

import pytest
from ray import serve

from cluster.app import serve_autoscaling_config
from cluster.pool_config import AutoscalingConfig
from tests.e2e.backlogged import Backlogged
from tests.e2e.conftest import running
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

PUSH_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}


def running_replicas(app: str) -> int:
    deployment = serve.status().applications[app].deployments["Backlogged"]
    return deployment.replica_states.get("RUNNING", 0)


def test_serve_scales_a_pool_on_its_signals(serve_url: str) -> None:
    pool = AutoscalingConfig(min_replicas=1, max_replicas=3, ttft_ms=500, upscale_delay_s=0,
                             look_back_period_s=2)  # fmt: skip
    options = {
        "autoscaling_config": serve_autoscaling_config(pool),
        "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": PUSH_ENV}},
    }
    app = serve.deployment(**options)(Backlogged).bind()
    with running("sla-autoscaling", app, route_prefix=None):
        # 4 wanted, 2 more at most (max_step_up), and 3 at most (max_replicas)
        wait_until(lambda: running_replicas("sla-autoscaling") == 3, 60,
                   interval_s=0.5, what="Serve to scale the pool to 3 replicas")  # fmt: skip
