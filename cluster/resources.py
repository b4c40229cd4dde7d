"""What an application's pools ask of the Ray cluster, against what its nodes hold.

Serve places a replica only where one node has all of its resources (a TP group: all its
ranks, packed on one node); a replica that fits nowhere waits for ever and the router's
/health answers 503 meanwhile. `pdserve check` prints this report and `build_app` logs its
warnings at start-up, so the shortfall is named before anyone waits on it. With the Ray
autoscaler, nodes may still be added: the report is a warning, never a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import AppConfig
from cluster.pool_config import PoolConfig

Resources = dict[str, float]
SHOWN = ("CPU", "GPU")  # always shown; custom resources where a pool asks for them
EPS = 1e-9  # Ray counts fractions of a resource in 1e-4 units; sums of fractions round


@dataclass(frozen=True)
class Pool:
    """A deployment's replicas: how many at start, how many at most, each one's resources."""

    name: str
    replicas: int
    max_replicas: int
    per_replica: Resources

    def total(self, replicas: int) -> Resources:
        return {k: v * replicas for k, v in self.per_replica.items()}


def _pool(name: str, pool: PoolConfig) -> Pool:
    rank = {"CPU": pool.num_cpus_per_rank, "GPU": pool.num_gpus_per_rank, **pool.resources}
    per_replica = {k: v * pool.tensor_parallel_size for k, v in rank.items() if v > 0}
    a = pool.autoscaling
    if a is None:
        return Pool(name, pool.num_replicas, pool.num_replicas, per_replica)
    start = a.initial_replicas if a.initial_replicas is not None else a.min_replicas
    return Pool(name, start, a.max_replicas, per_replica)


def demand(cfg: AppConfig) -> list[Pool]:
    """The application's deployments in the order they are listed (and placed, by `place`):
    the router first, as nothing answers without it, then decode, then prefill."""
    router = {"CPU": cfg.router.num_cpus} if cfg.router.num_cpus > 0 else {}
    pools = [Pool("router", cfg.router.num_replicas, cfg.router.num_replicas, router)]
    pools.append(_pool("decode", cfg.decode))
    if cfg.mode == "disaggregated":
        pools.append(_pool("prefill", cfg.prefill))
    return pools


def _fits(need: Resources, free: Resources) -> bool:
    return all(free.get(k, 0.0) + EPS >= v for k, v in need.items())


def place(pools: list[Pool], nodes: list[Resources]) -> dict[str, int]:
    """How many of each pool's starting replicas fit, first fit over the nodes in `pools`'
    order. Ray places them in no fixed order, so where replicas are short another pool than
    the one named here may be the one left waiting."""
    free = [dict(n) for n in nodes]
    placed = {}
    for pool in pools:
        placed[pool.name] = 0
        for _ in range(pool.replicas):
            node = next((n for n in free if _fits(pool.per_replica, n)), None)
            if node is None:
                break
            for k, v in pool.per_replica.items():
                node[k] -= v
            placed[pool.name] += 1
    return placed


def _fmt(resources: Resources, keys: list[str]) -> str:
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in keys)


def _keys(pools: list[Pool]) -> list[str]:
    custom = sorted({k for p in pools for k in p.per_replica} - set(SHOWN))
    return [*SHOWN, *custom]


def report(cfg: AppConfig, nodes: list[Resources] | None) -> tuple[list[str], list[str]]:
    """Lines describing each pool's demand (and, with the cluster's `nodes`, its total), and
    warnings: replicas that cannot be placed, pools that cannot grow to their maximum."""
    pools = demand(cfg)
    keys = _keys(pools)
    lines = [
        f"{p.name}: {p.replicas} replica(s) x ({_fmt(p.per_replica, keys)})"
        + (f", up to {p.max_replicas}" if p.max_replicas != p.replicas else "")
        for p in pools
    ]
    start: Resources = {k: sum(p.total(p.replicas).get(k, 0.0) for p in pools) for k in keys}
    lines.append(f"at start: {_fmt(start, keys)}")
    if nodes is None:
        return lines, []
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in keys}
    lines.append(f"cluster: {_fmt(have, keys)} on {len(nodes)} node(s)")
    placed = place(pools, nodes)
    warnings = [
        f"{p.replicas - placed[p.name]} of {p.replicas} {p.name} replica(s) cannot be placed "
        f"(each needs {_fmt(p.per_replica, keys)} on one node; the pools ask for "
        f"{_fmt(start, keys)}, the cluster has {_fmt(have, keys)}): they wait until a node "
        "frees or joins, and /health answers 503 meanwhile"
        for p in pools
        if placed[p.name] < p.replicas
    ]
    if not warnings:
        warnings = [
            f"{p.name} can grow to {peak} of its max_replicas {p.max_replicas} on these nodes"
            for p, peak in ((p, _peak(pools, p, nodes)) for p in pools)
            if peak < p.max_replicas
        ]
    return lines, warnings


def _peak(pools: list[Pool], pool: Pool, nodes: list[Resources]) -> int:
    """How many replicas `pool` can grow to beside the other pools' starting replicas."""
    others = [p for p in pools if p is not pool]
    return place([*others, Pool(pool.name, pool.max_replicas, pool.max_replicas,
                                pool.per_replica)], nodes)[pool.name]  # fmt: skip


def ray_nodes() -> list[Resources]:
    """The resources of the connected Ray cluster's live nodes (each one's total)."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
