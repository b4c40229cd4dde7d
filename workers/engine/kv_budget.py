"""How many KV pages an engine's pool gets: on a GPU, its share of the GPU less what it holds.

Several engines may share one GPU (a Serve pool's `num_gpus_per_rank` below 1: two replicas at
0.5 each). Each may use `total x gpu_memory_utilization x gpu_share` bytes in all; its weights
and buffers come out of that and the KV pool gets the rest. The GPU's free memory alone would
not do: it counts the other engines' pools or not, depending on which started first. Free
memory only caps the pool (less this engine's part of the headroom that `gpu_memory_utilization`
leaves), so that an engine whose share something else took fails with a message, not an
out-of-memory error; with the whole GPU (share 1) the cap is the budget, as before shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.config import EngineConfig

GiB = 2**30
CPU_DEFAULT_KV_GB = 1.0
FIX = (
    "raise gpu_memory_utilization or the pool's num_gpus_per_rank (the engine's gpu_share), "
    "or lower max_model_len, or set num_kv_pages or kv_cache_memory_gb, or store KV in FP8 "
    "(kv_cache_dtype=fp8_e4m3: twice the tokens)"
)


class KVBudgetError(ValueError):
    """The KV pool the engine may have is too small to serve; the message says what to change."""


@dataclass(frozen=True)
class GPUMemory:
    """Bytes of one GPU: all of it, free now (every process's allocations taken), and held by
    this engine (its tensors: weights, buffers)."""

    total: int
    free: int
    held: int

    @classmethod
    def measure(cls, device: torch.device, allocated_before: int) -> GPUMemory:
        """`allocated_before`: this process's allocated bytes before the engine's first tensor
        (other engines in the process hold those)."""
        torch.cuda.empty_cache()  # cached blocks no tensor uses would count as taken in `free`
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_allocated(device) - allocated_before)


def gpu_kv_pages(
    mem: GPUMemory, utilization: float, share: float, page_bytes: int, min_pages: int
) -> int:
    """The pages of `page_bytes` the engine's share leaves it; KVBudgetError below `min_pages`."""
    allowed = mem.total * utilization * share
    headroom = mem.total * (1 - utilization) * share
    by_share, by_free = allowed - mem.held, mem.free - headroom
    budget = int(min(by_share, by_free))
    pages = max(0, budget // page_bytes)
    if pages >= min_pages:
        return pages
    if by_share <= by_free:
        why = (
            f"this engine may use {allowed / GiB:.2f} GiB (gpu_memory_utilization {utilization} "
            f"x gpu_share {share} of the GPU's {mem.total / GiB:.2f} GiB) and its weights and "
            f"buffers hold {mem.held / GiB:.2f} GiB of it"
        )
    else:
        why = (
            f"the GPU has {mem.free / GiB:.2f} GiB free of its {mem.total / GiB:.2f} GiB (this "
            f"engine's weights and buffers hold {mem.held / GiB:.2f} GiB) and this engine keeps "
            f"{headroom / GiB:.2f} GiB of it for activations and workspace"
        )
    raise KVBudgetError(
        f"KV cache: {why}, leaving {max(0, budget) / GiB:.2f} GiB, {pages} pages; one sequence of "
        f"max_model_len tokens needs {min_pages} pages of {page_bytes / 2**20:.2f} MiB "
        f"({min_pages * page_bytes / GiB:.2f} GiB): {FIX}"
    )


def fixed_kv_pages(budget_bytes: int, page_bytes: int) -> int:
    """The pages of `page_bytes` in a set budget (kv_cache_memory_gb, the CPU's default)."""
    pages = budget_bytes // page_bytes
    if pages < 2:  # page 0 is scratch
        raise KVBudgetError(
            f"KV cache: {budget_bytes / GiB:.3f} GiB holds {pages} pages of "
            f"{page_bytes / 2**20:.2f} MiB, the pool needs 2 at least: raise "
            f"kv_cache_memory_gb or set num_kv_pages"
        )
    return pages


def engine_kv_pages(
    cfg: EngineConfig, page_bytes: int, device: torch.device, allocated_before: int,
    max_model_len: int,
) -> int:  # fmt: skip
    """The pages of an engine's pool: the config's count or bytes, a fixed size on the CPU, else
    its share of the GPU (`allocated_before`: this process's bytes that are not the engine's)."""
    if cfg.num_kv_pages is not None:
        return cfg.num_kv_pages
    if cfg.kv_cache_memory_gb is not None:
        return fixed_kv_pages(int(cfg.kv_cache_memory_gb * GiB), page_bytes)
    if device.type == "cpu":
        return fixed_kv_pages(int(CPU_DEFAULT_KV_GB * GiB), page_bytes)
    mem = GPUMemory.measure(device, allocated_before)
    min_pages = 1 + -(-max_model_len // cfg.page_size)  # + the scratch page
    return gpu_kv_pages(mem, cfg.gpu_memory_utilization, cfg.gpu_share, page_bytes, min_pages)
