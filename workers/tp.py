"""Tensor-parallel group: which rank this is, how many ranks, and the collectives between them.

Passed explicitly to every TP-aware layer (no global state). Size 1 makes every collective a
no-op, so the same model code runs unsharded. `init_group` joins a process to a group of size
> 1 (torch.distributed: NCCL on CUDA, gloo on the CPU; on one host's GPUs, small all-reduces
over CUDA IPC, `ipc_all_reduce.py`); `workers/tp_runner.py` starts the ranks.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a rank that hangs this long inside a step fails the step
IDLE_TIMEOUT = timedelta(days=365)  # plans: a worker waits as long as its engine idles


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


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the rendezvous of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_group(rank: int, size: int, address: str, device: torch.device) -> TPGroup:
    """Join this process to the TP group that rendezvouses at `address` ("host:port").

    torch.distributed keeps one default group per process, so a process holds one TP engine.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one TP engine per process"
        )
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if cuda else None,
    )
    # Plans travel on their own gloo group: an idle engine sends none for hours, and the
    # device group's timeout would otherwise fail the waiting ranks.
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    logger.info("TP rank %d/%d joined %s over %s", rank, size, address, dist.get_backend())
    tp = TPGroup(rank, size, dist.group.WORLD, control)
    if cuda and os.environ.get("PDSERVE_IPC_ALL_REDUCE", "1") != "0":
        from workers import ipc_all_reduce  # Triton: CUDA only

        tp = replace(tp, ipc=ipc_all_reduce.start(tp, device))
    return tp


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
