"""Per-pool SLA autoscaling: a pool's replica count from its replicas' own signals and targets.

Each replica reports its load (`workers/serve/load_meter.py`); Serve averages every signal per
replica over the look-back window and calls the pool's policy (`SlaPolicy`, Serve's
`AutoscalingContext` in, a replica count out) every control-loop tick. The decision itself is
`decide()`, a pure function that the simulated-load benchmark (bench/autoscale_sim.py) drives
too. How it decides:
- the load ratio: for each signal, what the pool must do over what its running replicas do at
  `usage_target` of the signal's limit; the worst one counts (prefill: prompt tokens arriving
  against the replicas' measured compute, the time to compute the queued ones and the measured
  TTFT against `ttft_ms`; decode: the measured TPOT against `tpot_ms`, KV pages and batch seats
  against all of them) (`load_ratios`);
- above 1 (for `upscale_delay_s`): ceil(running x ratio) replicas, at most `max_step_up` more
  than the current target; replicas still starting count, so the pool does not add them twice;
- under `downscale_below` for `downscale_delay_s`, with no change under way: down by at most
  `max_step_down`, never below the count that would put the ratio back above the middle of the
  band; in between nothing moves (the hysteresis band), and each step down waits a full delay.
Serve's own delay logic, scaling factors and target_ongoing_requests are bypassed (the pool's
delays are applied here; `cluster/app.py` gives Serve zeros); min/max replicas bound the result.

This module is cloudpickled by value into Serve's controller: it imports nothing of pdserve
but the signal names (plain strings).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from workers.serve.load_meter import (
    ARRIVING_TOKENS_PER_S,
    KV_USAGE,
    PREFILL_TOKENS_PER_S,
    QUEUED_PROMPT_TOKENS,
    SEAT_USAGE,
    TPOT_FLOOR_MS,
    TPOT_MS,
    TTFT_MS,
)

UP_SINCE, DOWN_SINCE = "sla_up_since", "sla_down_since"  # keys of Serve's policy_state


@dataclass(frozen=True)
class Targets:
    """A pool's SLA targets and step bounds (the SLA fields of its AutoscalingConfig)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    usage_target: float = 0.85
    max_step_up: int = 2
    max_step_down: int = 1
    downscale_below: float = 0.6
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 600.0


@dataclass(frozen=True)
class PoolSignals:
    """A pool's signals, over its running replicas: a total for queued tokens, means (over the
    replicas that measured them) for the rest; None: nothing measured."""

    queued_prompt_tokens: float = 0.0
    arriving_tokens_per_s: float = 0.0  # pool total
    prefill_tokens_per_s: float | None = None  # one replica's rate while it has work
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tpot_floor_ms: float | None = None  # a step's fixed cost: TPOT with one stream
    kv_usage: float = 0.0
    seat_usage: float = 0.0


def load_ratios(signals: PoolSignals, targets: Targets, running: int) -> dict[str, float]:
    """Each signal over what `running` replicas meet at `usage_target` of its limit (1: there).
    The limits: the TTFT target for the time to compute the queued prompt tokens and for the
    measured TTFT, the replicas' measured compute for the arriving tokens (the leading signal:
    it rises before a queue does), the TPOT target, and all of the KV pages and batch seats.
    TPOT is a floor (a step's fixed cost, measured with one stream) plus a cost per sequence in
    the batch, and only that part shrinks with more replicas: once the floor is measured (and
    well under the aim) the ratio is of the parts above it."""
    aim = targets.usage_target
    ratios: dict[str, float] = {}
    if targets.ttft_ms is not None:
        capacity = max(1, running) * (signals.prefill_tokens_per_s or 0.0)  # tokens/s
        if capacity:
            ratios["arrivals"] = signals.arriving_tokens_per_s / (capacity * aim)
            drain_ms = 1e3 * signals.queued_prompt_tokens / capacity
            ratios["queue"] = drain_ms / (targets.ttft_ms * aim)
        if signals.ttft_ms is not None:
            ratios["ttft"] = signals.ttft_ms / (targets.ttft_ms * aim)
    if targets.tpot_ms is not None:
        if signals.tpot_ms is not None:
            limit, floor = targets.tpot_ms * aim, signals.tpot_floor_ms or 0.0
            floor = floor if floor < 0.75 * limit else 0.0  # near the aim: the whole TPOT
            ratios["tpot"] = max(0.0, signals.tpot_ms - floor) / (limit - floor)
        ratios["kv"] = signals.kv_usage / aim
        ratios["seats"] = signals.seat_usage / aim
    return ratios


@dataclass(frozen=True)
class Decision:
    replicas: int
    ratio: float  # the worst signal's load ratio
    signal: str  # which signal that was ("" when none was measured)


def decide(
    signals: PoolSignals,
    targets: Targets,
    *,
    running: int,
    target: int,
    bounds: tuple[int, int],
    now: float,
    state: dict[str, Any],
) -> Decision:
    """The pool's next target replica count. `running`: replicas serving now; `target`: the
    current target (above `running` while replicas start); `bounds`: (min, max) replicas;
    `state`: the policy's memory between calls (up/down timers), updated in place."""
    lo, hi = bounds
    ratios = load_ratios(signals, targets, running)
    signal, ratio = max(ratios.items(), key=lambda kv: kv[1], default=("", 0.0))
    keep = Decision(min(hi, max(lo, target)), ratio, signal)
    if running == 0:  # nothing measured yet: Serve starts the first replicas
        state.pop(UP_SINCE, None)
        state.pop(DOWN_SINCE, None)
        return keep
    if ratio > 1:
        state.pop(DOWN_SINCE, None)
        desired = math.ceil(running * ratio - 1e-9)
        if desired <= target:  # replicas already starting cover it
            state.pop(UP_SINCE, None)
            return keep
        since = state.setdefault(UP_SINCE, now)
        if now - since < targets.upscale_delay_s:
            return keep
        state.pop(UP_SINCE, None)
        return Decision(min(hi, desired, target + targets.max_step_up), ratio, signal)
    state.pop(UP_SINCE, None)
    if ratio >= targets.downscale_below or running != target or target <= lo:
        state.pop(DOWN_SINCE, None)  # in the band, a change under way, or at the floor
        return keep
    since = state.setdefault(DOWN_SINCE, now)
    if now - since < targets.downscale_delay_s:
        return keep
    state.pop(DOWN_SINCE, None)  # the next step down waits a full delay again
    middle = (1 + targets.downscale_below) / 2
    floor = math.ceil(running * ratio / middle - 1e-9)
    return Decision(max(lo, floor, target - targets.max_step_down), ratio, signal)


def pool_signals(metrics: dict[str, dict[Any, float]]) -> PoolSignals:
    """`PoolSignals` from Serve's aggregated custom metrics (name -> replica -> window mean)."""

    def mean(name: str) -> float | None:
        values = list(metrics.get(name, {}).values())
        return sum(values) / len(values) if values else None

    return PoolSignals(
        queued_prompt_tokens=sum(metrics.get(QUEUED_PROMPT_TOKENS, {}).values()),
        arriving_tokens_per_s=sum(metrics.get(ARRIVING_TOKENS_PER_S, {}).values()),
        prefill_tokens_per_s=mean(PREFILL_TOKENS_PER_S),
        ttft_ms=mean(TTFT_MS),
        tpot_ms=mean(TPOT_MS),
        tpot_floor_ms=mean(TPOT_FLOOR_MS),
        kv_usage=mean(KV_USAGE) or 0.0,
        seat_usage=mean(SEAT_USAGE) or 0.0,
    )


class SlaPolicy:
    """The Serve adapter: `autoscaling_config.policy.policy_function`, built once per deployment
    with `policy_kwargs` (the `Targets` fields) and called with Serve's AutoscalingContext."""

    def __init__(self, **targets: Any) -> None:
        self.targets = Targets(**targets)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state or {})
        decision = decide(
            pool_signals(ctx.aggregated_metrics or {}),
            self.targets,
            running=ctx.current_num_replicas,
            target=ctx.target_num_replicas,
            bounds=(ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas),
            now=ctx.current_time or time.time(),
            state=state,
        )
        return decision.replicas, state
