"""Per-pool SLA autoscaling: the decision function, the config's checks, the Serve adapter on
Serve's own context objects, and the replica's load meter."""

from __future__ import annotations

import random
from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from cluster.app import serve_autoscaling_config
from cluster.autoscaling_policy import Decision, PoolSignals, SlaPolicy, Targets, decide
from cluster.config import AppConfig
from cluster.pool_config import AutoscalingConfig
from workers.serve.load_meter import (
    PREFILL_TOKENS_PER_S,
    QUEUED_PROMPT_TOKENS,
    TPOT_FLOOR_MS,
    TPOT_MS,
    TTFT_MS,
    LoadMeter,
)

# usage_target 1: ratios are signal / target, to keep the arithmetic below plain
PREFILL = Targets(ttft_ms=500, usage_target=1, upscale_delay_s=0, downscale_delay_s=60)
DECODE = Targets(tpot_ms=20, usage_target=1, upscale_delay_s=0, downscale_delay_s=60)


class Pool:
    """A pool the policy scales, replicas starting at once; `tick` makes one decision a second."""

    def __init__(self, targets: Targets, replicas: int = 1, bounds: tuple[int, int] = (1, 8)):
        self.targets, self.replicas, self.bounds = targets, replicas, bounds
        self.now, self.state, self.history = 0.0, {}, [replicas]

    def tick(self, signals: PoolSignals) -> Decision:
        self.now += 1
        d = decide(signals, self.targets, running=self.replicas, target=self.replicas,
                   bounds=self.bounds, now=self.now, state=self.state)  # fmt: skip
        self.replicas = d.replicas
        self.history.append(d.replicas)
        return d

    def reversals(self) -> int:
        steps = [b - a for a, b in zip(self.history, self.history[1:]) if b != a]
        return sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))


def decode_tpot_ms(sequences: float, replicas: int) -> float:
    """A decode replica's TPOT: 4 ms a step plus 0.1 ms a sequence in its batch."""
    return 4 + 0.1 * sequences / replicas


def test_steps_up_bounded_and_reaches_the_need_within_a_few_decisions() -> None:
    pool = Pool(PREFILL)
    # 30k queued tokens at 10k/s a replica: 3 s to compute on one, 6x the 500 ms target
    hot = PoolSignals(queued_prompt_tokens=30_000, prefill_tokens_per_s=10_000)
    decisions = [pool.tick(hot) for _ in range(4)]
    assert [d.replicas for d in decisions] == [3, 5, 6, 6]  # max_step_up 2 per decision
    assert decisions[0].signal == "queue"


def test_scale_down_waits_for_the_delay_and_steps_by_one() -> None:
    pool = Pool(PREFILL, replicas=6)
    idle = PoolSignals(queued_prompt_tokens=100, prefill_tokens_per_s=10_000, ttft_ms=40)
    counts = [pool.tick(idle).replicas for _ in range(200)]
    first_down = counts.index(5)
    assert first_down == PREFILL.downscale_delay_s  # 60 s after the first tick under it
    assert counts[first_down + 1 : first_down + 60] == [5] * 59  # a full delay per step
    assert all(b - a >= -1 for a, b in zip(counts, counts[1:]))
    assert pool.reversals() == 0


def test_in_the_band_nothing_moves() -> None:
    pool = Pool(DECODE, replicas=3)
    for _ in range(300):
        assert pool.tick(PoolSignals(tpot_ms=16, kv_usage=0.6, seat_usage=0.5)).replicas == 3


def test_noisy_flat_load_makes_no_reversal() -> None:
    rng = random.Random(0)
    pool = Pool(DECODE, replicas=2)
    for _ in range(3000):  # 240 sequences: 16 ms on 2 replicas, 28 ms on 1; +-10% noise
        tpot = decode_tpot_ms(240, pool.replicas) * rng.uniform(0.9, 1.1)
        pool.tick(PoolSignals(tpot_ms=tpot, tpot_floor_ms=4, kv_usage=0.3, seat_usage=0.4))
    assert pool.reversals() == 0 and len(set(pool.history)) <= 2


def test_step_load_is_met_within_n_decisions_and_then_holds() -> None:
    pool = Pool(DECODE, replicas=1)
    decisions = [
        pool.tick(PoolSignals(tpot_ms=decode_tpot_ms(500, pool.replicas), tpot_floor_ms=4))
        for _ in range(60)
    ]  # 500 sequences: 54 ms on one replica, 20 ms needs 4
    met = next(i for i, d in enumerate(decisions) if d.ratio <= 1)
    assert met <= 3 and pool.replicas == 4, [d.replicas for d in decisions]
    assert pool.history[met + 1 :] == [4] * (len(pool.history) - met - 1)


def test_tpot_floor_lets_an_idle_pool_shrink() -> None:
    idle = PoolSignals(tpot_ms=decode_tpot_ms(10, 4))  # 4.25 ms: 0.21 of the target
    assert decide(idle, DECODE, running=4, target=4, bounds=(1, 8), now=0,
                  state={"sla_down_since": -60}).replicas == 3  # fmt: skip
    # the same TPOT with the floor known is all floor: the pool may shrink to one at once
    floored = PoolSignals(tpot_ms=4.25, tpot_floor_ms=4)
    wide = Targets(tpot_ms=20, usage_target=1, max_step_down=8, downscale_delay_s=0)
    assert decide(floored, wide, running=4, target=4, bounds=(1, 8), now=0, state={}).replicas == 1


def test_replicas_still_starting_are_not_added_twice() -> None:
    state: dict[str, Any] = {}
    hot = PoolSignals(tpot_ms=40)  # 2x the target: 2 running want 4
    first = decide(hot, DECODE, running=2, target=2, bounds=(1, 8), now=1, state=state)
    again = decide(hot, DECODE, running=2, target=4, bounds=(1, 8), now=2, state=state)
    assert (first.replicas, again.replicas) == (4, 4)


def test_up_delay_and_bounds() -> None:
    slow = Targets(ttft_ms=500, upscale_delay_s=5)
    state: dict[str, Any] = {}
    hot = PoolSignals(ttft_ms=5000)
    counts = [decide(hot, slow, running=2, target=2, bounds=(2, 3), now=t, state=state).replicas
              for t in range(7)]  # fmt: skip
    assert counts == [2, 2, 2, 2, 2, 3, 2]  # at t=6 the caller still holds 2 running, target 2


# ---- config ---------------------------------------------------------------------------------


def test_sla_fields_validate_with_clear_messages() -> None:
    with pytest.raises(ValidationError, match="max_step_up only act with an SLA target"):
        AutoscalingConfig(max_step_up=3)
    with pytest.raises(ValidationError, match="usage_target only act with an SLA target"):
        AutoscalingConfig(usage_target=0.5)
    with pytest.raises(ValidationError, match="downscale_below"):
        AutoscalingConfig(ttft_ms=300, downscale_below=1.2)
    with pytest.raises(ValidationError, match="prefill.autoscaling.tpot_ms"):
        AppConfig.model_validate({"prefill": {"autoscaling": {"tpot_ms": 20}}})
    with pytest.raises(ValidationError, match="decode.autoscaling.ttft_ms"):
        AppConfig.model_validate({"decode": {"autoscaling": {"ttft_ms": 300}}})
    colocated = {"mode": "colocated", "decode": {"autoscaling": {"ttft_ms": 300, "tpot_ms": 20}}}
    assert AppConfig.model_validate(colocated).decode.autoscaling is not None


def test_serve_gets_its_default_policy_without_targets() -> None:
    options = serve_autoscaling_config(AutoscalingConfig(max_replicas=4))
    assert "policy" not in options and options["downscale_delay_s"] == 600
    ServeAutoscalingConfig(**options)


# ---- the Serve adapter on Serve's own objects ------------------------------------------------


def serve_context(
    config: ServeAutoscalingConfig,
    metrics: dict[str, dict[str, float]],
    running: int,
    state: dict[str, Any],
    now: float,
) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=DeploymentID(name="prefill", app_name="pdserve"),
        deployment_name="prefill",
        app_name="pdserve",
        current_num_replicas=running,
        target_num_replicas=running,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=lambda: metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def test_serve_adapter_decides_on_serves_context() -> None:
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    pool = AutoscalingConfig(min_replicas=1, max_replicas=4, ttft_ms=500, upscale_delay_s=0,
                             downscale_delay_s=10)  # fmt: skip
    config = ServeAutoscalingConfig(**serve_autoscaling_config(pool))
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))  # as Serve does
    assert isinstance(policy.__wrapped__, SlaPolicy)  # type: ignore[attr-defined]
    hot = {QUEUED_PROMPT_TOKENS: {"r1": 20_000.0}, PREFILL_TOKENS_PER_S: {"r1": 10_000.0}}
    replicas, state = policy(serve_context(config, hot, 1, {}, now=100.0))
    assert replicas == 3  # 2 s of queue against 500 ms: 4 wanted, 2 more at most
    idle = {QUEUED_PROMPT_TOKENS: {"r1": 0.0, "r2": 0.0}, TTFT_MS: {"r1": 30.0, "r2": 50.0}}
    for now in (101.0, 105.0, 111.0):
        replicas, state = policy(serve_context(config, idle, 2, state, now=now))
    assert replicas == 1


# ---- the replica's meter -------------------------------------------------------------------


def test_load_meter_signals() -> None:
    now = [0.0]
    meter = LoadMeter(clock=lambda: now[0])
    meter.admitted(3000)
    now[0] = 1.0
    meter.prefilled(3000, ttft_s=1.0)  # busy 1 s for 3000 tokens
    stream = meter.stream(0)
    now[0] = 1.5
    stream.chunk(10)  # 10 tokens in 0.5 s, the only stream: the floor too
    other = meter.stream(0)
    now[0] = 1.6
    stream.chunk(1)  # 0.1 s, beside another stream: not the floor
    other.close()
    snap = meter.snapshot(kv_usage=0.25, seat_usage=0.5)
    assert snap[QUEUED_PROMPT_TOKENS] == 0 and snap[PREFILL_TOKENS_PER_S] == pytest.approx(3000)
    assert snap[TTFT_MS] == pytest.approx(1000) and snap[TPOT_MS] == pytest.approx(1e3 * 0.6 / 11)
    assert snap[TPOT_FLOOR_MS] == pytest.approx(50)
    later = meter.snapshot(kv_usage=0.0, seat_usage=0.0)
    assert TTFT_MS not in later and TPOT_MS not in later  # nothing new measured
    assert later[PREFILL_TOKENS_PER_S] == pytest.approx(3000)  # the last rate is kept
    local = meter.stream(100)
    assert meter.snapshot(0, 0)[QUEUED_PROMPT_TOKENS] == 100
    local.close()
    assert meter.snapshot(0, 0)[QUEUED_PROMPT_TOKENS] == 0
    with pytest.raises(RuntimeError), meter.prefill(50):
        raise RuntimeError("replica failed")
    assert meter.snapshot(0, 0)[QUEUED_PROMPT_TOKENS] == 0
