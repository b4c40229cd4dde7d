"""One-shot all-reduce of small tensors over CUDA IPC, for a TP group on one host (NVLink).

A decode step all-reduces each row-parallel output: at batch 1 on Llama-3-8B that is 65 messages
of 8 KiB a step, and NCCL's all-reduce took 6.5-10 µs for each inside a CUDA graph on two H200s
(docs/notes/tensor-parallel.md). PyTorch's symmetric-memory all-reduce does not start under
Ray, where every rank sees its own GPU as `cuda:0`; CUDA IPC maps a peer's memory regardless
(as UCX does for the KV hand-off). So each rank shares one buffer with its peers at start-up
(`torch.multiprocessing`'s CUDA IPC handles), and one kernel per all-reduce, in each program:
1. copies its slice of x into this rank's buffer (one of two slots, alternating by call);
2. raises its flag in every peer's buffer (a release at system scope, after the copy);
3. waits until every peer's flag for this program has reached this call (acquire);
4. sums every rank's slice from their buffers in rank order, so every rank gets the same bits,
   and writes it over x.
`all_reduce_add_rms_norm` does the same exchange a row a program and then `fused.add_rms_norm`'s
arithmetic, launched with PDL: a layer's row-parallel outputs reach their next norm as partial
sums (`RMSNorm.add_forward(x, residual, tp)`), so the all-reduce, the residual add and the norm
are one launch (two H200s, TP=2 batch 1: 3.19 ms a step with NCCL, 3.07-3.12 with the plain
kernel and a norm kernel after it, 2.88 with this one).
Each program counts its own calls (a counter in this rank's memory), so the flags need no reset
and CUDA graphs replay the kernel as is. Two slots make reuse safe: a peer's program writes slot
s again two calls later, and it cannot start that call before this rank has finished the call
between (step 3 of that call waits for this rank's flags, raised after it read slot s).
The programs must all be resident at once on every rank (each waits for a peer's program of the
same index), so a call uses at most MAX_PROGRAMS, and no more than the GPU's multiprocessors.
Larger messages, other dtypes and groups that span hosts stay on NCCL (`TPGroup.all_reduce`).
The kernels run on the one stream of a rank's steps, so no two of them overlap on a rank. A rank
that dies mid-step leaves its peers' kernels waiting, as NCCL's would until its timeout; the
replica's health check (`TPDriverRunner.check_alive`: a dead rank actor) then replaces it.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import cast

import torch
import triton

from workers.kernels import all_reduce, pdl
from workers.parallel.group import TPGroup

logger = logging.getLogger(__name__)

# Per message: up to 8 rows of Llama-3-8B's hidden size in bf16. Two H200s, TP=2 decode steps
# (`bench_decode --tp 2`, with and without `--set kernels.ipc_all_reduce=false`): 8 KiB messages
# (batch 1) and 32 KiB (batch 4) gained 0.13-0.16 ms a step, 128 KiB (16) 0.02, and 512 KiB (64)
# lost 0.44.
MAX_BYTES = 64 * 1024
MAX_PROGRAMS = 64  # and at most one per multiprocessor: all resident at once
MIN_BLOCK = 1024  # elements a program: small messages still spread over a few programs
MAX_ROW = 16384  # elements of a row for the fused norm (one program holds it)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_BYTES = MAX_BYTES
_FLAG_OFFSET = 2 * _SLOT_BYTES  # flags after the two data slots: [MAX_PROGRAMS, world] int64
VERIFY_SPINS = 1 << 22  # start-up check: give up waiting for a peer after ~seconds, not forever


class IpcAllReduce:
    """This rank's shared buffer, its peers' mapped buffers, and the all-reduce over them."""

    def __init__(
        self, rank: int, size: int, device: torch.device,
        gather: Callable[[object], list[object]],
    ) -> None:  # fmt: skip
        """`gather(obj)` returns every rank's `obj` in rank order (a collective over the
        group's control channel). Raises RuntimeError if a peer is on another host."""
        from torch.multiprocessing.reductions import reduce_tensor

        self.rank, self.size = rank, size
        # Two regions (slots and flags), one for each kernel: a program index of one kernel
        # covers other elements than the same index of the other, so they may not share slots.
        self.region = -(-(_FLAG_OFFSET + MAX_PROGRAMS * size * 8) // 256) * 256
        self.buffer = torch.zeros(2 * self.region, dtype=torch.uint8, device=device)
        self.counters = torch.zeros(2, MAX_PROGRAMS, dtype=torch.int64, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_programs = min(MAX_PROGRAMS, sms)
        torch.cuda.synchronize(device)  # the zeros are in place before a peer maps them
        shared = cast(
            list[tuple[str, tuple[Callable[..., torch.Tensor], tuple[object, ...]]]],
            gather((socket.gethostname(), reduce_tensor(self.buffer))),
        )
        hosts = sorted({host for host, _ in shared})
        if len(hosts) > 1:
            raise RuntimeError(f"TP ranks span hosts {hosts}: no CUDA IPC between them")
        # Peers' buffers mapped into this process (kept: the mapping lives as long as they do).
        self._peers = [
            self.buffer if r == rank else rebuild(*args)
            for r, (_, (rebuild, args)) in enumerate(shared)
        ]
        self.bases = torch.tensor([b.data_ptr() for b in self._peers], dtype=torch.int64).to(device)

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda and x.dtype in DTYPES and x.is_contiguous()
            and 0 < x.numel() * x.element_size() <= MAX_BYTES
        )  # fmt: skip

    def __call__(self, x: torch.Tensor, max_spins: int = 0) -> torch.Tensor:
        """Sum `x` over the group in place (every rank calls it with the same shape and dtype,
        in the same order). `max_spins` > 0 bounds each wait for a peer (start-up check)."""
        n = x.numel()
        block = max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(n, self.max_programs)))
        all_reduce.ipc_all_reduce_kernel[(triton.cdiv(n, block),)](
            x, self.bases, self.counters[0], n, self.rank, max_spins,
            WORLD=self.size, BLOCK=block, SLOT_ELEMS=_SLOT_BYTES // x.element_size(),
            FLAG_OFFSET=_FLAG_OFFSET, num_warps=4,
        )  # fmt: skip
        return x

    def takes_rows(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether `all_reduce_add_rms_norm` takes these `[rows, n]` 16-bit rows."""
        return (
            x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and x.is_contiguous() and residual.is_contiguous()
            and residual.shape == x.shape and residual.dtype == x.dtype
            and 0 < x.shape[0] <= self.max_programs and x.shape[1] <= MAX_ROW
            and x.numel() * x.element_size() <= MAX_BYTES
        )  # fmt: skip

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`fused.add_rms_norm(all_reduce(x), residual, weight, eps)` in one launch (a program
        a row, with programmatic dependent launch): no norm kernel waits on the all-reduce."""
        rows, n = x.shape
        out, total = torch.empty_like(x), torch.empty_like(x)
        all_reduce.ipc_all_reduce_add_rms_norm_kernel[(rows,)](
            x, residual, weight, out, total, self.bases, self.counters[1], n, self.rank, eps,
            WORLD=self.size, BLOCK=triton.next_power_of_2(n),
            SLOT_ELEMS=_SLOT_BYTES // x.element_size(), REGION=self.region,
            FLAG_OFFSET=_FLAG_OFFSET, num_warps=4 if n <= 2048 else 8, **pdl.launch_options(x),
        )  # fmt: skip
        return out, total

    def check(self) -> bool:
        """Whether a test message sums correctly (each rank sends its rank + 1 in every element
        of a few sizes), with bounded waits: a peer mapping that does not work fails here
        instead of hanging a step."""
        ok = True
        expect = self.size * (self.size + 1) / 2
        for dtype in (torch.bfloat16, torch.float32):
            for numel in (1, 4096, MAX_BYTES // dtype.itemsize):
                x = torch.full((numel,), self.rank + 1.0, dtype=dtype, device=self.buffer.device)
                self(x, max_spins=VERIFY_SPINS)
                ok &= bool((x == expect).all())
        return ok


def start(tp: TPGroup, device: torch.device) -> IpcAllReduce | None:
    """The group's IPC all-reduce, or None (NCCL then) where any rank cannot map its peers or
    its check fails: every rank makes the same choice (over the control group)."""
    ipc: IpcAllReduce | None = None
    try:
        ipc = IpcAllReduce(tp.rank, tp.size, device, tp.all_gather_object)
    except Exception as e:  # noqa: BLE001 - any failure leaves NCCL in place
        logger.warning("TP rank %d: no IPC all-reduce (%s); NCCL only", tp.rank, e)
    if not tp.min_int(int(ipc is not None)):
        return None
    assert ipc is not None
    if not tp.min_int(int(ipc.check())):
        logger.warning("TP rank %d: the IPC all-reduce check failed; NCCL only", tp.rank)
        return None
    logger.info("TP rank %d: IPC all-reduce up to %d KiB a message", tp.rank, MAX_BYTES // 1024)
    return ipc
