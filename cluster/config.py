"""The application's one config schema: every knob of `serve run configs/X.yaml` lands here.

`build_app(args)` validates the config file's `args` mapping into `AppConfig`; an unknown or
mistyped field fails the deploy with pydantic's message naming it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from cluster.pool_config import PoolConfig, Strict
from router.liveness import FRESH_S
from workers import env
from workers.api import POST_INTERVAL_S, STALE_AFTER_S
from workers.config import EngineConfig, KVTransferConfig

# The longest a live replica can look dead: its last post just missed the staleness window, its
# next is a post period away, and the router reuses a pool's verdict for FRESH_S. A failover
# deadline at or under it could give up on a pool whose replica is only busy.
MIN_FAILOVER_DEADLINE_S = STALE_AFTER_S + POST_INTERVAL_S + FRESH_S


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
        0.05,
        gt=0,
        description="how often a replica publishes its cache changes, and how long "
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
        1.0,
        gt=0,
        description="how often the router asks Serve which pools have a live replica "
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
        "error event once streaming). It bounds that wait only, never a stream that goes on. "
        f"Must exceed {MIN_FAILOVER_DEADLINE_S:g} s, the longest a live replica can look dead "
        "on the stats board, so a dead pool is seen and the other one takes over within it",
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
    lora_sync_period_s: float = Field(
        1.0, gt=0, description="allow_runtime_lora_updating: how often each replica compares "
        "the run-time adapters it holds with the app's list; an unloaded adapter's device slot, "
        "host copy and cached pages are freed within this period (and one engine step) of the "
        "unload, or of the end of the last request on that replica already using it",
    )  # fmt: skip
    lora_miss_tokens: int = Field(
        256, ge=0, description="prefix-aware routing: a replica that does not hold a request's "
        "LoRA adapter (device slot or host copy) costs this many more prompt tokens to compute "
        "(loading the adapter), so replicas holding it are preferred, not required",
    )  # fmt: skip
    lora_miss_requests: float = Field(
        2.0, ge=0, description="load-aware decode routing: a replica that does not hold a "
        "request's LoRA adapter counts as running this many more requests",
    )  # fmt: skip

    @field_validator("failover_deadline_s")
    @classmethod
    def _deadline_outlasts_liveness(cls, v: float) -> float:
        if v <= MIN_FAILOVER_DEADLINE_S:
            raise ValueError(
                f"must be greater than {MIN_FAILOVER_DEADLINE_S:g} s (the stats board's "
                f"staleness window {STALE_AFTER_S:g} s + post period {POST_INTERVAL_S:g} s + "
                f"liveness cache {FRESH_S:g} s), else a live but busy replica could be "
                "declared dead"
            )
        return v


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
            raise ValueError(
                "prefill.autoscaling.tpot_ms: a prefill replica emits no output "
                "tokens after the first; set tpot_ms on decode.autoscaling"
            )
        if self.mode == "disaggregated" and decode is not None and decode.ttft_ms is not None:
            raise ValueError(
                "decode.autoscaling.ttft_ms: in disaggregated mode the prefill "
                "pool makes the first token; set ttft_ms on prefill.autoscaling "
                "(decode's ttft_ms is for colocated mode)"
            )
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
