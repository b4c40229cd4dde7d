"""Same-GPU KV reads: a peer's pool opened through CUDA IPC and copied device to device.

When a prefill and a decode replica share one GPU (fractional `num_gpus`), UCX does not take
its cuda_ipc path between the two processes: it moves VRAM over TCP at ~0.5 GB/s
(docs/notes/kv-transfer.md). So each agent also exports its pool's CUDA IPC handle in its peer
record (`IpcPool`), with the GPU's UUID; a reader whose own pool lies on the GPU of that UUID,
in another process, opens the peer's pool once (`open_pool`, cached with the peer) and copies
pages from it with `DeviceCopies.copy`: one copy a run of pages consecutive on both sides, or,
for scattered pages, one gather and one scatter a chunk, on a side stream.

Only the KV bytes take this path. The generation numbers that prove no page was reused while it
was read, and the notification that ends the lease, still go over NIXL, so a device copy is
checked and released exactly as a NIXL read is.

Invariants:
- The copy is queued after every kernel already queued on the reader's current stream (a step
  in flight may still write pages freed to this read), and reports DONE only when it has run.
- A copy cannot be cancelled: `DeviceCopy.wait` (called on release) blocks until it has run,
  so local pages are never reused under it. It is queued GPU work, so the wait is bounded.
"""

from __future__ import annotations

import base64
import logging
import uuid
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from workers.transfer.descriptors import merge_page_runs
from workers.transfer.handle import XferState

logger = logging.getLogger(__name__)

# Names this process among a GPU's users: a pool is opened through IPC only from another one
# (CUDA refuses to open a handle in the process that made it).
PROCESS_ID = uuid.uuid4().hex
MAX_RUN_COPIES = 8  # more runs than this: gather + scatter instead of one copy a run
GATHER_BYTES = 256 * 2**20  # the gathered pages' temporary buffer, at most, a chunk


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


@dataclass(frozen=True)
class IpcPool:
    """A KV pool tensor as another process on its GPU opens it (`reduce_tensor`'s fields)."""

    device_uuid: str
    process_id: str
    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    handle: str  # base64, like the other byte fields
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str
    event_sync_required: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same for every process that sees it, whatever its device index."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(pages: torch.Tensor) -> IpcPool | None:
    """`pages`' IPC handle, or None (a CPU pool, or memory CUDA IPC cannot share)."""
    if not pages.is_cuda:
        return None
    try:
        _, args = reduce_tensor(pages)
    except Exception as e:  # e.g. expandable segments: the NIXL path remains
        logger.warning("KV pool not shareable through CUDA IPC: %r", e)
        return None
    (_, size, stride, offset, _, _, _, handle, nbytes, storage_offset, _,
     rc_handle, rc_offset, event_handle, event_sync) = args  # fmt: skip
    return IpcPool(
        device_uuid(pages.device), PROCESS_ID, list(size), list(stride), offset,
        str(pages.dtype).removeprefix("torch."), _b64(handle), nbytes, storage_offset,
        _b64(rc_handle), rc_offset, _b64(event_handle), bool(event_sync),
    )  # fmt: skip


def same_gpu(local_uuid: str | None, remote: IpcPool | None) -> bool:
    """Whether a reader whose pool is on GPU `local_uuid` (None: not on a GPU) copies a peer's
    pages through IPC: the peer's pool is on that GPU and in another process."""
    return (
        local_uuid is not None
        and remote is not None
        and remote.device_uuid == local_uuid
        and remote.process_id != PROCESS_ID
    )


def open_pool(ipc: IpcPool, device: torch.device) -> torch.Tensor:
    """The peer's pool tensor, mapped into this process on `device` (the GPU of its UUID)."""
    d = base64.b64decode
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(ipc.size), tuple(ipc.stride), ipc.offset,
        torch.storage.TypedStorage, getattr(torch, ipc.dtype), device.index or 0,
        d(ipc.handle), ipc.storage_bytes, ipc.storage_offset, False,
        d(ipc.ref_counter_handle), ipc.ref_counter_offset, d(ipc.event_handle),
        ipc.event_sync_required,
    )  # fmt: skip


class DeviceCopy:
    """One posted copy; `state` is DONE once the GPU has run it."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self._done = done

    def state(self) -> XferState:
        return "DONE" if self._done.query() else "PROC"

    def wait(self) -> None:
        self._done.synchronize()


class DeviceCopies:
    """Copies into one local pool, on its own stream."""

    def __init__(self, pages: torch.Tensor) -> None:
        self.pages = pages
        self.stream = torch.cuda.Stream(pages.device)

    def open_peer(
        self, ours: IpcPool | None, theirs: IpcPool | None, name: str
    ) -> torch.Tensor | None:
        """Peer `name`'s pool when it lies on our GPU, in another process; None otherwise, or
        when CUDA cannot open it (that peer's reads then stay on NIXL)."""
        if not same_gpu(None if ours is None else ours.device_uuid, theirs):
            return None
        assert theirs is not None
        try:
            pool = open_pool(theirs, self.pages.device)
        except Exception as e:  # noqa: BLE001 - NIXL still reads it
            logger.warning("cannot open %s's KV pool through CUDA IPC (%r): NIXL reads it", name, e)
            return None
        logger.info("peer %s shares this GPU: its KV pages are copied through CUDA IPC", name)
        return pool

    def copy(
        self, remote: torch.Tensor, local_pages: np.ndarray, remote_pages: np.ndarray
    ) -> DeviceCopy:
        """Queue local page `local_pages[i]` <- remote page `remote_pages[i]`; do not wait."""
        if remote.shape[1:] != self.pages.shape[1:] or remote.dtype != self.pages.dtype:
            raise ValueError(f"peer pool {tuple(remote.shape)} {remote.dtype} is not like ours")
        self.stream.wait_stream(torch.cuda.current_stream(self.pages.device))
        with torch.cuda.stream(self.stream):
            runs = merge_page_runs(local_pages, remote_pages)
            if len(runs) <= MAX_RUN_COPIES:
                for r in runs:
                    self.pages[r.local_start : r.local_start + r.length].copy_(
                        remote[r.remote_start : r.remote_start + r.length]
                    )
            else:
                self._gather_scatter(remote, local_pages, remote_pages)
            done = torch.cuda.Event()
            done.record(self.stream)
        return DeviceCopy(done)

    def _gather_scatter(self, remote: torch.Tensor, lp: np.ndarray, rp: np.ndarray) -> None:
        dev = self.pages.device
        chunk = max(1, GATHER_BYTES // (self.pages[0].numel() * self.pages.element_size()))
        li = torch.from_numpy(lp).to(dev, non_blocking=True)
        ri = torch.from_numpy(rp).to(dev, non_blocking=True)
        for s in range(0, len(lp), chunk):
            self.pages.index_copy_(0, li[s : s + chunk], remote.index_select(0, ri[s : s + chunk]))
