"""What an engine reports about itself: its counters and gauges (`EngineStats`, read by the
routers' metrics and load signals) and its death (`EngineDeadError`)."""

from __future__ import annotations

from pydantic import BaseModel

# vLLM's buckets of tokens per engine step (its iteration_tokens_total histogram)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineDeadError(RuntimeError):
    """The engine failed a step with an error not of one request's making (a device error, a
    broken TP group): it aborted every request it held and serves nothing more. The router treats
    it as a replica's death (`router/failover.py`); the worker's health check makes Serve
    replace the replica."""

    replica: str | None = None  # the Serve replica (`ReplicaID.unique_id`) whose engine died


class EngineStats(BaseModel):
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_pinned: int
    kv_pages_cached: int = 0  # in the radix tree (used, but evictable unless pinned)
    kv_pages_evictable: int = 0  # of those, the ones no request holds: free to allocate
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_handoffs_pending: int = 0  # prefill: pinned prompts awaiting a reader; decode: reads
    nixl_bytes_transferred: int = 0  # decode: KV bytes read from prefill replicas
    nixl_transfers: int = 0
    nixl_xfer_time_s: float = 0.0
    kv_pages_read: int = 0  # decode: prompt pages read over NIXL ...
    kv_pages_reused: int = 0  # ... and found in this replica's prefix cache instead
    num_recomputed: int = 0  # decode: hand-offs that failed and were prefilled here
    kv_device_copies: int = 0  # decode: KV reads copied from a peer on this GPU, not over NIXL
    prompt_tokens_computed: int
    generation_tokens: int
    # tokens per step: cumulative count per ITERATION_TOKENS_BUCKETS bound (+Inf last), and sum
    iteration_tokens: list[int] = []
    iteration_tokens_sum: int = 0
    # speculative decoding, as vLLM's spec_decode_* counters: sequence-steps that verified
    # drafts, drafted tokens, accepted ones, and accepted ones per draft position (0..k-1)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # KV events: page stores and evictions this replica published to the routers
    kv_events_published: int = 0
    # LoRA (0: off): device slots; the adapters of running and waiting requests, by name; those
    # the replica holds (a device slot or its host copy), by name and by lora_int_id
    max_loras: int = 0
    lora_running: list[str] = []
    lora_waiting: list[str] = []
    lora_resident: list[str] = []
    lora_resident_ids: list[int] = []
    # KV tiers below the device pool (EngineConfig.kv_offload): pages and bytes each holds now,
    # prompt tokens found there, bytes moved down (device -> host) and up (loads), the loads'
    # copy time
    kv_host_pages: int = 0
    kv_host_bytes: int = 0
    kv_disk_pages: int = 0
    kv_disk_bytes: int = 0
    kv_host_hit_tokens: int = 0
    kv_disk_hit_tokens: int = 0
    kv_offload_bytes: int = 0
    kv_onload_bytes: int = 0
    kv_onload_time_s: float = 0.0
    kv_onloads: int = 0
    num_swap_preemptions: int = 0  # preemptions whose pages went down the tiers
    # MoE: per sparse layer, tokens routed to each expert by eager forwards since the start
    moe_expert_tokens: dict[str, list[int]] = {}
    # the engine's death (`EngineDeadError`): the exception type that killed it -> 1; the
    # routers skip a replica that posted one
    engine_deaths: dict[str, int] = {}

    @property
    def kv_pages_held(self) -> int:
        """Pages requests hold: the prefix cache's evictable pages are free to allocate, so a
        replica with a warm cache and nothing running is as empty as a cold one."""
        return self.kv_pages_used - self.kv_pages_evictable

    @property
    def dead(self) -> bool:
        return bool(self.engine_deaths)
