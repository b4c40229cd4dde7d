"""The KV tiers under tensor parallelism: rank 0's `TieredStore` decides, and ranks 1..N-1
replay its ops on their own shards (`TierData`), sent as `RankCommand`s between steps."""

from __future__ import annotations

from typing import Any

from workers.config import EngineConfig
from workers.engine.tp_runner import RankCommand, RankRunner, TPDriverRunner
from workers.kvcache.tiers.data import LoadResult, TierData, TierOp
from workers.kvcache.tiers.index import TierEntry
from workers.kvcache.tiers.offloader import TieredStore, tier_data, tier_meta

Finished = tuple[dict[int, LoadResult], list[TierEntry]]


def rank_data(runner: RankRunner) -> TierData:
    """This rank's tiers, made at their first use."""
    data: TierData | None = getattr(runner, "tiers", None)
    if data is None:
        cfg = runner.cfg
        assert cfg.kv_offload is not None
        meta = tier_meta(runner.pool, cfg, runner.dtype, runner.tp.rank)
        data = tier_data(runner.pool, cfg.kv_offload, meta)
        runner.tiers = data  # type: ignore[attr-defined]
    return data


class ApplyTierOps(RankCommand):
    def __init__(self, ops: list[TierOp]) -> None:
        self.ops = ops

    def run(self, runner: RankRunner) -> str | None:
        try:
            rank_data(runner).apply(self.ops)
            return None
        except Exception as e:  # noqa: BLE001 - a command must not raise (it ends the rank)
            return f"{type(e).__name__}: {e}"


class FinishedTierLoads(RankCommand):
    def run(self, runner: RankRunner) -> Finished | str:
        try:
            return rank_data(runner).finished()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"


class FlushTiers(RankCommand):
    def run(self, runner: RankRunner) -> str | None:
        try:
            rank_data(runner).flush()
            return None
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"


class RankTiers:
    """Rank 0's handle on ranks 1..N-1's tiers."""

    def __init__(self, runner: TPDriverRunner) -> None:
        self.runner = runner
        self.size = runner.tp.size - 1

    def apply(self, ops: list[TierOp]) -> None:
        _check(self.runner.command(ApplyTierOps(ops)))

    def finished(self) -> list[Finished]:
        answers: list[Any] = self.runner.command(FinishedTierLoads())
        _check([a for a in answers if isinstance(a, str)])
        return answers

    def flush(self) -> None:
        _check(self.runner.command(FlushTiers()))


def _check(errors: list[Any]) -> None:
    """A rank whose tiers failed leaves its pages unlike rank 0's: no step can trust them."""
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError(f"KV tiers failed on a TP rank: {failed[0]}")


def build_tiers(runner: Any, cfg: EngineConfig) -> TieredStore | None:
    """The engine's tiers under its runner's pool (None when `cfg.kv_offload` is off); a TP
    driver's ranks replay their ops."""
    peers = RankTiers(runner) if cfg.tensor_parallel_size > 1 else None
    return TieredStore.for_pool(runner.pool, cfg, runner.dtype, peers)
