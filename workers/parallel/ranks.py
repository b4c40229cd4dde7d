"""Where TP ranks 1..N-1 run: Ray actors, one per bundle of a placement group.

Inside a Serve replica the replica's own placement group holds one bundle per rank (bundle 0 is
the replica itself, rank 0); elsewhere (an offline `LLM`) Ray is started locally when needed and
a placement group is made here, and removed again on `stop()`. Imported only when
tensor_parallel_size > 1, so a single-rank engine never imports Ray.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers import env

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0  # loading a shard of a large checkpoint
STOP_TIMEOUT_S = 10.0
REPO_ROOT = str(Path(__file__).resolve().parents[2])


class TPRankError(RuntimeError):
    """A TP rank died or the group fell out of step; the engine cannot step any more."""


@ray.remote
class _GPUHolder:
    """Holds bundle 0's GPU offline, so Ray gives the other ranks the GPUs rank 0 does not use."""


def _ensure_ray() -> bool:
    """Start a local Ray for an offline engine; True if this call started it."""
    if ray.is_initialized():
        return False
    path = env.python_path(REPO_ROOT)
    ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    return True


def _bundle_options(spec: dict[str, float]) -> dict[str, Any]:
    other = {k: v for k, v in spec.items() if k not in ("CPU", "GPU", "memory")}
    return {"num_cpus": spec.get("CPU", 0), "num_gpus": spec.get("GPU", 0), "resources": other}


class RankActors:
    """The actors of ranks 1..N-1 and the placement that holds them.

    `broken` is set once a step failed: the group's collectives are out of step for good.
    """

    def __init__(self, worker_cls: type, cfg: Any, size: int, device: torch.device) -> None:
        self.size = size
        self.broken = False
        self._owned_pg: PlacementGroup | None = None
        self._holder: Any = None
        self._serving: list[ray.ObjectRef] = []
        self.actors: list[Any] = []
        pg, first = self._placement(device)
        self.actors = [
            ray.remote(worker_cls)
            .options(
                **_bundle_options(pg.bundle_specs[first + r - 1]),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, first + r - 1),
            )
            .remote(cfg, r, size)
            for r in range(1, size)
        ]
        uuids = self._get([a.device_uuid.remote() for a in self.actors], START_TIMEOUT_S)
        if device.type == "cuda":
            mine = str(torch.cuda.get_device_properties(device).uuid)
            if len({mine, *uuids}) != size:
                self.stop()
                raise TPRankError(f"TP ranks share GPUs ({[mine, *uuids]}): one GPU per rank")

    def _placement(self, device: torch.device) -> tuple[PlacementGroup, int]:
        """The placement group and the bundle index of rank 1."""
        pg = ray.util.get_current_placement_group()
        if pg is not None:  # a Serve replica: bundle 0 is this process (rank 0)
            if pg.bundle_count < self.size:
                raise ValueError(
                    f"tensor_parallel_size={self.size} needs one placement group bundle per "
                    f"rank; this replica's group has {pg.bundle_count}"
                )
            logger.info("TP ranks 1..%d go to this replica's placement group", self.size - 1)
            return pg, 1
        _ensure_ray()
        gpu = device.type == "cuda"
        rank = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
        bundles = [rank] * (self.size if gpu else self.size - 1)  # + rank 0's GPU
        need = {k: v * len(bundles) for k, v in rank.items()}
        have = ray.cluster_resources()
        if any(have.get(k, 0) < v for k, v in need.items()):
            raise ValueError(
                f"tensor_parallel_size={self.size} needs {need} in Ray for its ranks; "
                f"the cluster has {{'CPU': {have.get('CPU', 0)}, 'GPU': {have.get('GPU', 0)}}}"
            )
        pg = placement_group(bundles, strategy="STRICT_PACK")
        self._owned_pg = pg
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise ValueError(
                f"could not place {len(bundles)} TP rank bundles of {rank} on one node within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; free: {ray.available_resources()}"
            ) from None
        if gpu:
            strategy = PlacementGroupSchedulingStrategy(pg, 0)
            holder = _GPUHolder.options  # type: ignore[attr-defined]  # an ActorClass once decorated
            self._holder = holder(num_gpus=1, scheduling_strategy=strategy).remote()
            return pg, 1
        return pg, 0

    def start(self, address: str) -> list[ray.ObjectRef]:
        """Ask every rank to join the group at `address` and build its runner."""
        return [a.start.remote(address) for a in self.actors]

    def serve(self) -> None:
        """Enter every rank's step loop (it returns when rank 0 broadcasts the stop)."""
        self._serving = [a.serve.remote() for a in self.actors]

    def _get(self, refs: list[ray.ObjectRef], timeout: float) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout)
        except Exception as e:
            self.stop()
            raise TPRankError(f"a TP rank failed to start: {e}") from e

    def wait_started(self, refs: list[ray.ObjectRef]) -> None:
        self._get(refs, START_TIMEOUT_S)

    def failure(self, error: BaseException) -> TPRankError:
        """What to raise after `error` broke a step: which rank died, if one did."""
        self.broken = True
        dead = self.dead_rank(timeout=1.0)
        if dead is not None:
            return dead
        return TPRankError(f"TP step failed ({type(error).__name__}: {error}); ranks out of step")

    def dead_rank(self, timeout: float = 0.0) -> TPRankError | None:
        """The first rank whose step loop has ended (died, or left it), if any."""
        done, _ = ray.wait(self._serving, num_returns=len(self._serving), timeout=timeout)
        for rank, ref in enumerate(self._serving, start=1):
            if ref in done:
                self.broken = True
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - reported in the error
                    return TPRankError(f"TP rank {rank} died: {type(e).__name__}: {e}")
                return TPRankError(f"TP rank {rank} left its step loop")
        return None

    def join(self) -> None:
        """Wait for the ranks to leave their loops (after the stop broadcast)."""
        try:
            ray.get(self._serving, timeout=STOP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - they are killed next anyway
            logger.warning("TP ranks did not stop cleanly: %s", e)

    def stop(self) -> None:
        for actor in [*self.actors, self._holder]:
            if actor is not None:
                ray.kill(actor)
        self.actors, self._holder, self._serving = [], None, []
        if self._owned_pg is not None:
            remove_placement_group(self._owned_pg)
            self._owned_pg = None
