"""A worker pool's part of the config schema: its replicas, their resources, its autoscaling
(Serve's, or the SLA policy of `cluster/autoscaling_policy.py`) and its engine overrides.
`cluster/config.py` assembles the pools into the application's `AppConfig`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.config import EngineConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingConfig(Strict):
    min_replicas: int = Field(1, ge=0)
    initial_replicas: int | None = Field(None, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(16, gt=0)
    upscale_delay_s: float = Field(30, ge=0)
    downscale_delay_s: float = Field(600, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self

    # ---- SLA targets (cluster/autoscaling_policy.py) -------------------------------------------
    # With a target the pool scales on its replicas' own signals against it (target_ongoing_requests
    # is then unused) and the policy applies the delays above itself.
    ttft_ms: float | None = Field(
        None,
        gt=0,
        description="SLA target: time to first token (the prefill pool; the decode pool in "
        "colocated mode); scales on queued prompt tokens against what a replica computes per "
        "second, and on the measured TTFT",
    )
    tpot_ms: float | None = Field(
        None,
        gt=0,
        description="SLA target: time per output token (the decode pool); scales on the "
        "measured TPOT, KV usage and running sequences (batch seats)",
    )
    usage_target: float = Field(
        0.85,
        gt=0,
        le=1,
        description="with a target: the share of each limit the pool aims to run at (the SLA "
        "target, a replica's measured prefill compute, its KV pages and batch seats); above it "
        "the pool grows, so 1 - usage_target is the headroom that covers a new replica's start",
    )
    max_step_up: int = Field(
        2, ge=1, description="with a target: replicas added per decision at most"
    )
    max_step_down: int = Field(
        1, ge=1, description="with a target: replicas removed per decision at most"
    )
    downscale_below: float = Field(
        0.6,
        gt=0,
        lt=1,
        description="with a target: scale down only after every signal stayed under this share "
        "of its target for downscale_delay_s (between it and 1 nothing changes: the hysteresis)",
    )
    look_back_period_s: float = Field(
        30, gt=0, description="window over which Serve averages each replica's signals"
    )

    @model_validator(mode="after")
    def _sla_fields_need_a_target(self) -> AutoscalingConfig:
        tuning = {"usage_target", "max_step_up", "max_step_down", "downscale_below"}
        stray = sorted(tuning & self.model_fields_set)
        if stray and not self.has_targets():
            raise ValueError(
                f"{', '.join(stray)} only act with an SLA target: set ttft_ms and/or tpot_ms, "
                "or leave them out"
            )
        return self

    def has_targets(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


class PoolConfig(Strict):
    """One pool of workers (prefill or decode): replicas, their resources, engine overrides."""

    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingConfig | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    num_gpus_per_rank: float = Field(
        0,
        ge=0,
        description="0 on CPU; 1 for a GPU per TP rank; a fraction shares a GPU (0.5: two "
        "replicas on one), the engine's memory following it (its gpu_share)",
    )
    num_cpus_per_rank: float = Field(1, ge=0)
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources, e.g. to pin a pool to a node type"
    )
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int | None = Field(
        None,
        ge=1,
        description="calls a router replica may hold for this pool while every replica has "
        "max_ongoing_requests; beyond it the call fails at once and the client gets 429 with "
        "Retry-After. Default: the pool's capacity, replicas (max_replicas when autoscaling) x "
        "max_ongoing_requests",
    )
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)

    def queue_bound(self) -> int:
        """`max_queued_requests`, by default one more pool-load of calls: a queued call waits
        for about one turn of the pool's work at most; beyond that the client is better told to
        retry than left waiting two turns or more."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        replicas = self.num_replicas if self.autoscaling is None else self.autoscaling.max_replicas
        return replicas * self.max_ongoing_requests

    def engine(self, base: EngineConfig) -> EngineConfig:
        """The shared engine settings with this pool's overrides applied."""
        overrides = {
            k: v
            for k, v in dict(
                tensor_parallel_size=self.tensor_parallel_size,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                kv_cache_memory_gb=self.kv_cache_memory_gb,
                gpu_memory_utilization=self.gpu_memory_utilization,
                gpu_share=min(1.0, self.num_gpus_per_rank) or None,  # 0: CPU, or unaccounted
            ).items()
            if v is not None
        }
        return base.model_copy(update=overrides)
