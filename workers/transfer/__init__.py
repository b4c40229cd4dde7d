"""NIXL KV hand-off between worker ranks: pages of a peer's KV pool read into the local pool.

`KVTransferAgent` (agent.py) owns one NIXL agent per rank; `descriptors.py` turns page ids into
transfer descriptors; `peers.py` publishes and fetches agents' records in Ray's internal KV;
`generations.py` reads page generation numbers for the stale-read check; `device_copy.py` copies
the pages of a peer on the same GPU (another process) through CUDA IPC instead of a NIXL READ.

Threading: a NIXL agent is not thread-safe (it is created without a listener thread, so NIXL
takes no locks). Exactly one thread, the rank's engine loop, calls every method of one
`KVTransferAgent`, from `__init__` to `close()`. `read_pages` posts and returns, `poll` checks,
and the loop keeps stepping other requests while a read is in flight. One exception, measured:
between processes of one host over DRAM, UCX reads with cma (process_vm_readv) and the whole
copy happens inside the post, so `read_pages` returns when the bytes are there (about 8 GB/s on
a CPU host: 47 ms for 8k SmolLM2 tokens). VRAM reads (cuda_ipc, RDMA) are asynchronous.

Progress: NIXL's progress thread is off by default, because it spins (one full core per idle
agent, measured on a CPU host). Then UCX moves only inside an agent's calls, so a rank
whose pages are being read must keep calling `get_notifs()`: every engine step, and every
millisecond or so while idle with pages leased out (ranks 1..N-1 of a prefill TP group, which
get no notifications, every `disagg.prefill.GROUP_DRAIN_S`). Measured on a CPU host (data
moves over cma, notifications over tcp/lo): a peer's first READ waits for the owner's side of
the UCX wire-up; a READ that carries a notification, or is posted while an earlier notification
to the owner is still unconsumed, stays PROC until the owner calls in; other READs need nothing
from the owner. `progress_thread=True` lifts this duty at the cost of the spinning thread.
"""

from __future__ import annotations

from workers.transfer.agent import KVTransferAgent
from workers.transfer.descriptors import PageRun, PoolRegion, build_descriptors, merge_page_runs
from workers.transfer.errors import (
    KVLayoutMismatchError,
    PeerUnavailableError,
    TransferError,
    TransportUnavailableError,
)
from workers.transfer.handle import TransferHandle, TransferStats, XferState

__all__ = [
    "KVLayoutMismatchError",
    "KVTransferAgent",
    "PageRun",
    "PeerUnavailableError",
    "PoolRegion",
    "TransferError",
    "TransferHandle",
    "TransferStats",
    "TransportUnavailableError",
    "XferState",
    "build_descriptors",
    "merge_page_runs",
]
