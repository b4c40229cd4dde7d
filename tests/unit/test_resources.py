"""What the pools ask of the Ray cluster (`cluster/resources.py`): `pdserve check` and start-up
warn of replicas no node can hold, which would otherwise leave /health at 503 for ever."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster import cli, resources
from cluster.app import build_app
from cluster.config import AppConfig

REPO = Path(__file__).resolve().parents[2]
TWO_CORES = [{"CPU": 2.0, "memory": 8e9}]


def local(*assignments: str) -> AppConfig:
    """configs/local.yaml's application with `--set` style overrides."""
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    args = cli.apply_overrides(config["applications"][0]["args"], list(assignments))
    return AppConfig.model_validate(args)


def test_the_readme_example_fits_two_cores() -> None:
    """`--set decode.num_replicas=2` on configs/local.yaml: 1 prefill + 2 decode replicas."""
    lines, warnings = resources.report(local("decode.num_replicas=2"), TWO_CORES)
    assert warnings == []
    assert "decode: 2 replica(s) x (0.5 CPU, 0 GPU)" in lines
    assert "at start: 1.5 CPU, 0 GPU" in lines and "cluster: 2 CPU, 0 GPU on 1 node(s)" in lines


def test_a_replica_beyond_the_cores_is_named() -> None:
    """The report of the issue: 3 replicas x 1 CPU on 2 cores; one is never placed."""
    one_cpu = ("decode.num_cpus_per_rank=1", "prefill.num_cpus_per_rank=1")
    cfg = local("decode.num_replicas=2", *one_cpu)
    _, [warning] = resources.report(cfg, TWO_CORES)
    assert warning.startswith("1 of 1 prefill replica(s) cannot be placed")
    assert "the pools ask for 3 CPU, 0 GPU, the cluster has 2 CPU, 0 GPU" in warning


def test_a_tp_group_needs_its_gpus_on_one_node() -> None:
    """Two nodes of one GPU hold 2 GPUs, but not a TP-2 replica (packed on one node)."""
    cfg = local("decode.tensor_parallel_size=2", "decode.num_gpus_per_rank=1")
    nodes = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    lines, [warning] = resources.report(cfg, nodes)
    assert "decode: 1 replica(s) x (1 CPU, 2 GPU)" in lines
    assert warning.startswith("1 of 1 decode replica(s) cannot be placed")
    assert resources.report(cfg, [{"CPU": 8.0, "GPU": 2.0}])[1] == []


def test_custom_resources_and_autoscaling_maxima() -> None:
    cfg = local("prefill.resources={prefill_node: 1}")
    lines, [warning] = resources.report(cfg, TWO_CORES)
    assert "prefill: 1 replica(s) x (0.5 CPU, 0 GPU, 1 prefill_node)" in lines
    assert warning.startswith("1 of 1 prefill replica(s) cannot be placed")
    grow = local("decode.autoscaling={min_replicas: 1, max_replicas: 8}")
    lines, [warning] = resources.report(grow, TWO_CORES)
    assert "decode: 1 replica(s) x (0.5 CPU, 0 GPU), up to 8" in lines
    assert warning == "decode can grow to 3 of its max_replicas 8 on these nodes"


def test_without_a_cluster_check_prints_the_demand_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["check", "--address", "none", str(REPO / "configs" / "local.yaml")]) == 0
    out = capsys.readouterr().out
    assert "Ray cluster: not connected" in out and "at start: 1 CPU, 0 GPU" in out
    assert "WARNING" not in out


def test_check_and_start_up_warn_against_the_connected_cluster(
    ray_cluster: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The test cluster's largest node holds 16 CPUs: a second decode replica of 16 cannot be
    placed anywhere, and both `pdserve check` and `build_app` say so (nothing is deployed)."""
    from tests.conftest import RAY_CPUS

    config: dict[str, Any] = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    args = config["applications"][0]["args"]
    args["decode"] = {"num_replicas": 2, "num_cpus_per_rank": RAY_CPUS}
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["check", str(path)]) == 0  # a warning: an autoscaler may add nodes
    out = capsys.readouterr().out
    assert "ray.cluster_resources() = " in out
    assert f"WARNING: 1 of 2 decode replica(s) cannot be placed (each needs {RAY_CPUS} CPU" in out
    with caplog.at_level(logging.WARNING, logger="cluster.app"):
        build_app(args)
    assert "1 of 2 decode replica(s) cannot be placed" in caplog.text
