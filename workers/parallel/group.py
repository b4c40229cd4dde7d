"""Tensor-parallel group: which rank this is, how many ranks, and the collectives between them.

Passed explicitly to every TP-aware layer (no global state). Size 1 makes every collective a
no-op, so the same model code runs unsharded. `rendezvous.init_group` joins a process to a
group of size > 1 (torch.distributed: NCCL on CUDA, gloo on the CPU; on one host's GPUs, small
all-reduces over CUDA IPC, `ipc_all_reduce.py`); `workers/engine/tp_runner.py` starts the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1 (the device's backend)
    control: Any = None  # gloo group for host objects (plans), without a collective timeout
    ipc: Any = None  # ipc_all_reduce.IpcAllReduce: small all-reduces between GPUs of one host

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside group of size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place: over CUDA IPC where it takes x (a decode step's
        messages), else NCCL or gloo."""
        if self.size > 1:
            if self.ipc is not None and self.ipc.takes(x):
                return self.ipc(x)
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's host object, in rank order, on every rank (control group)."""
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """`x` from rank 0 into `x` on every rank, on the device (queued, no host sync)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_object(self, obj: object) -> object:
        """A picklable host object from rank 0 (others pass None); blocks until it arrives."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_object(self, obj: object) -> list[object] | None:
        """Every rank's host object, in rank order, on rank 0 (None elsewhere); over the
        control group."""
        out: list[object] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (host ints, over the control group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def shard(self, total: int, what: str) -> int:
        """Size of this rank's equal share of `total`; refuse uneven splits."""
        if total % self.size:
            raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={self.size}")
        return total // self.size


SINGLE = TPGroup()
