"""The application's one config schema: every knob of `serve run configs/X.yaml` lands here.

`build_app(args)` validates the config file's `args` mapping into `AppConfig`; an unknown or
mistyped field fails the deploy with pydantic's message naming it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers import env
from workers.config import EngineConfig, KVTransferConfig


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


class LoRAModule(Strict):
    name: str = Field(min_length=1, description="the model name requests give")
    path: str = Field(min_length=1, description="the PEFT adapter's directory")


class RouterConfig(Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1, ge=0)
    max_ongoing_requests: int = Field(1024, ge=1)
    prefix_aware: bool = Field(
        True,
        description="send prompts to the prefill replica whose "
        "cache holds their longest prefix, weighed against load",
    )
    prefix_load_weight: float = Field(
        1.0, ge=0, description="cost of a pending prefill token against an uncached one"
    )
    prefix_index_pages: int = Field(
        1 << 16,
        ge=1,
        description="without kv_events: prefix pages the router's guess remembers per replica "
        "(about its KV pool)",
    )
    # KV events: replicas publish their prefix caches' pages; routers route on them
    kv_events: bool = Field(
        True,
        description="replicas publish the pages their prefix caches store and evict, and the "
        "prefix-aware routers route on that exact index (else on a guess from what they sent)",
    )
    kv_events_period_s: float = Field(
        0.05, gt=0, description="how often a replica publishes its cache changes, and how long "
        "a router waits after reading some before it reads again (it waits for new ones by long "
        "poll): the index's delay",
    )
    decode_prefill_max_tokens: int = Field(
        0,
        ge=0,
        description="disaggregated mode: prompts with at most this many tokens to compute skip "
        "the prefill pool and are prefilled by their decode replica (no KV transfer); tokens to "
        "compute are those the best-placed decode replica does not cache (from its KV events; "
        "the whole prompt without kv_events); 0 = never",
    )
    prefill_queue_max_requests: int = Field(
        0,
        ge=0,
        description="disaggregated mode: while this many of a router replica's prompts wait on "
        "the prefill pool, its further prompts are prefilled by their decode replica; 0 = no "
        "bound",
    )
    decode_load_aware: bool = Field(
        True, description="send decodes to the fewest running requests, then most free pages"
    )
    decode_prefix_aware: bool = Field(
        False,
        description="disaggregated mode: route decodes as prefills are (longest prefix the "
        "replica holds, weighed against its load), so a conversation's next turn reads only its "
        "new pages; overrides decode_load_aware",
    )
    decode_max_running_gap: int = Field(
        8,
        ge=0,
        description="decode_prefix_aware: a decode replica running more than this many requests "
        "above the least busy one loses the preference its cached pages give it",
    )
    routing_stats_period_s: float = Field(
        2.0, gt=0, description="how often Serve polls replicas' record_routing_stats()"
    )
    max_request_bytes: int = Field(
        4 << 20,
        ge=1,
        description="largest request body accepted; a larger one is answered 413 before it is "
        "parsed",
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="requests a router replica holds that have not yet received their first "
        "token; beyond it 429 with Retry-After (so R router replicas queue R x this)",
    )
    retry_after_s: int = Field(
        1, ge=0, description="the Retry-After header (seconds) of a 429 for a full queue"
    )
    health_period_s: float = Field(
        1.0, gt=0, description="how often the router asks Serve which pools have a live replica "
        "(what /health answers)",
    )
    failover_attempts: int = Field(
        3,
        ge=0,
        description="re-sends a request may have since its stream last sent a token, after its "
        "replica failed (died, or silent past replica_timeout_s): a prefill once more to the "
        "pool, then to a decode replica; a stream resumed on another decode replica, or on the "
        "prefill replica while no decode replica lives. A token sent renews the count, so a "
        "long stream survives any number of separate failures",
    )
    failover_deadline_s: float = Field(
        30.0,
        gt=0,
        description="after a replica failed, the longest wait for another engine to take the "
        "request (its first chunk or keepalive), all re-sends included; past it, a 503 (or an "
        "error event once streaming). It bounds that wait only, never a stream that goes on: "
        "keep it above the stats board's 3 s liveness bound, so a dead pool is seen and the "
        "other one takes over within it",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto",
        description="how tool calls are found in answers with tool_choice auto: hermes "
        "(`<tool_call>` JSON: Qwen, Hermes), llama3_json (Llama 3.1+), mistral "
        "(`[TOOL_CALLS]`); auto: the format the model's chat template writes, else by "
        "architecture, else hermes",
    )
    replica_timeout_s: float = Field(
        60.0,
        gt=0,
        description="longest silence of a replica: a prefill's answer (queueing included), or "
        "a stream's next chunk, where a replica whose engine runs sends a keepalive every second "
        "(so a busy replica never times out; one whose step has run this long stops sending "
        "them); past it the replica counts as failed",
    )
    metric_prefix: Literal["pdserve", "vllm"] = Field(
        "pdserve",
        description="/metrics family names: pdserve:<name>, or vllm:<name> with vLLM's label "
        "names (engine for role) so dashboards built for vLLM work unchanged",
    )
    enable_prompt_tokens_details: bool = Field(
        False,
        description="usage.prompt_tokens_details.cached_tokens in responses (prefix-cache hits); "
        "off, it is null, as vLLM's --enable-prompt-tokens-details",
    )
    open_invocations: bool = Field(
        False,
        description="/invocations (SageMaker's) answers without the API key, for a gateway that "
        "authenticates in front; off, it needs the key as /v1 does",
    )
    # LoRA adapters (engine.enable_lora): served under their names beside the base model
    lora_modules: tuple[LoRAModule, ...] = Field(
        (), description="adapters offered from the start: a request's `model` picks one by name"
    )
    allow_runtime_lora_updating: bool = Field(
        False, description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove "
        "adapters at run time (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they are 404",
    )  # fmt: skip


class AppConfig(Strict):
    engine: EngineConfig = EngineConfig()
    served_model_name: str | None = Field(None, description="name clients send; default: model")
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    router: RouterConfig = RouterConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    api_key: str | None = Field(None, description="default: $PDSERVE_API_KEY; none = open")

    @model_validator(mode="after")
    def _per_pool(self) -> AppConfig:
        # The pools may differ (each decode rank reads the prefill ranks holding its KV heads);
        # each pool's size must divide the model's KV heads, which its engine checks at start.
        if self.engine.tensor_parallel_size != 1:
            raise ValueError("set tensor_parallel_size per pool (prefill, decode), not in engine")
        # An engine's share of its GPU is its pool's Ray GPU fraction, which PoolConfig passes.
        if self.engine.gpu_share != 1:
            raise ValueError("set a pool's num_gpus_per_rank (prefill, decode), not gpu_share")
        return self

    @model_validator(mode="after")
    def _lora_enabled(self) -> AppConfig:
        r = self.router
        if (r.lora_modules or r.allow_runtime_lora_updating) and not self.engine.enable_lora:
            raise ValueError("router.lora_modules and allow_runtime_lora_updating need "
                             "engine.enable_lora")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _sla_targets_fit_pools(self) -> AppConfig:
        """A pool can only be held to a target its replicas measure."""
        prefill, decode = self.prefill.autoscaling, self.decode.autoscaling
        if prefill is not None and prefill.tpot_ms is not None:
            raise ValueError("prefill.autoscaling.tpot_ms: a prefill replica emits no output "
                             "tokens after the first; set tpot_ms on decode.autoscaling")
        if self.mode == "disaggregated" and decode is not None and decode.ttft_ms is not None:
            raise ValueError("decode.autoscaling.ttft_ms: in disaggregated mode the prefill "
                             "pool makes the first token; set ttft_ms on prefill.autoscaling "
                             "(decode's ttft_ms is for colocated mode)")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    def resolved_api_key(self) -> str | None:
        return self.api_key or env.api_key()

    def kv_events_period(self) -> float:
        """How often replicas publish KV events and routers read them; 0 = no KV events."""
        on = self.router.kv_events and self.engine.enable_prefix_caching
        return self.router.kv_events_period_s if on else 0.0
