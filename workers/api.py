"""The workers' door: everything the router (and the app that wires it) may use of the workers.

Types that cross between the router and the engines (requests, sampling parameters, output
chunks, engine stats, KV events and the page names they carry), the stats board's readers,
through which the router sees every replica's counters, and Ray's internal KV with the run-time
LoRA registry's keys in it. The router imports nothing else from
`workers`; `tests/unit/test_layout.py` holds it to that.
"""

from __future__ import annotations

from workers.engine_stats import ITERATION_TOKENS_BUCKETS, EngineDeadError, EngineStats
from workers.kvcache.kv_events import KVEventBatch, page_hashes, prefix_cache_ids
from workers.lora.registered import read_registered, registry_prefix
from workers.protocol import (
    MAX_LOGPROBS,
    FinishReason,
    GenerateRequest,
    KVHandle,
    LoRARequest,
    RequestOutput,
    SamplingParams,
    StructuredOutputs,
    TokenLogprob,
    truncated_prompt,
)
from workers.ray_kv import ray_internal_kv
from workers.sampling.grammar import check_structured_outputs
from workers.serve.kv_event_hub import KVEventRead, read_kv_events
from workers.serve.stats_board import (
    POST_INTERVAL_S,
    STALE_AFTER_S,
    Posted,
    StatsPoster,
    read_pool,
    read_role,
)

__all__ = [
    "ITERATION_TOKENS_BUCKETS",
    "MAX_LOGPROBS",
    "POST_INTERVAL_S",
    "STALE_AFTER_S",
    "EngineDeadError",
    "EngineStats",
    "FinishReason",
    "GenerateRequest",
    "KVEventBatch",
    "KVEventRead",
    "KVHandle",
    "LoRARequest",
    "Posted",
    "RequestOutput",
    "SamplingParams",
    "StatsPoster",
    "StructuredOutputs",
    "TokenLogprob",
    "check_structured_outputs",
    "page_hashes",
    "prefix_cache_ids",
    "ray_internal_kv",
    "read_kv_events",
    "read_pool",
    "read_registered",
    "read_role",
    "registry_prefix",
    "truncated_prompt",
]
