"""Joining a process to its tensor-parallel group, and leaving it.

`init_group` starts torch.distributed (NCCL on CUDA, gloo on the CPU) plus a gloo control group
for plans, and on one host's GPUs the IPC all-reduce for small messages (`ipc_all_reduce.py`).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from workers.parallel.group import TPGroup

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0  # a rank that hangs this long inside a step fails the step
IDLE_TIMEOUT = timedelta(days=365)  # plans: a worker waits as long as its engine idles


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the rendezvous of a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_group(
    rank: int, size: int, address: str, device: torch.device, *, ipc_all_reduce: bool
) -> TPGroup:
    """Join this process to the TP group that rendezvouses at `address` ("host:port").
    `ipc_all_reduce` (`KernelConfig.ipc_all_reduce`): on CUDA, small all-reduces over the peers'
    memory instead of NCCL.

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
    if cuda and ipc_all_reduce:
        from workers.parallel.ipc_all_reduce import start  # Triton: CUDA only

        tp = replace(tp, ipc=start(tp, device))
    return tp


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
