"""A FlashInfer wrapper is planned again only once the copy of its previous plan has run.

FlashInfer's `plan` writes a step's work schedule (tile and request indices, split offsets) into
a page-locked host buffer of the wrapper and queues its copy to the device on the current stream
without waiting (`cudaMemcpyAsync(int_buffer, page_locked_int_buffer, ...)` in its
`scheduler.cuh`); the wrapper's next `plan` rewrites that host buffer. With overlap scheduling
the host plans step n+1 having waited only for step n-1 (`Engine.step`; not even that when step
n-1 sampled nothing), so step n's copy may not have run yet: it waits behind the work queued
before it (with KV tiers, the copies down an eviction makes the compute stream wait for). Copied
late, it carries step n+1's schedule into step n's kernels, which index step n's own arrays with
it: an illegal memory access where those are smaller, else wrong attention. Under
`CUDA_LAUNCH_BLOCKING=1` each kernel launch returns only once the work queued before it is done,
so the host is never ahead and the race never shows.

`ReplanGate.plan` waits, before a wrapper's plan, for an event recorded after that wrapper's last
plan: on the host's critical path only when the GPU really is that far behind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workers.kernels.host_staging import Waitable


def _record() -> Waitable:
    event = torch.cuda.Event()
    event.record()
    return event


class ReplanGate:
    """`record` makes the marker a wrapper's next plan waits on (a CUDA event on the current
    stream, after the plan's copy; a test may pass its own)."""

    def __init__(self, record: Callable[[], Waitable] = _record) -> None:
        self._record = record
        self._planned: dict[int, Waitable] = {}  # id of a wrapper (the backend holds it)

    def plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """`wrapper.plan(*args, **kwargs)`, once the copy of its previous plan has run."""
        last = self._planned.get(id(wrapper))
        if last is not None:
            last.synchronize()
        wrapper.plan(*args, **kwargs)
        self._planned[id(wrapper)] = self._record()
