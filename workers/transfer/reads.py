"""`ReadTracker`: posts NIXL READs (and same-GPU device copies, `device_copy.DeviceCopy`),
follows them to DONE or ERR, and keeps the counters.

Invariants:
- A handle's state goes PROC -> DONE or PROC -> ERR, once; `finished_at` is set with it.
- A generation READ's slot is released when the READ is DONE (values copied out first), ERR,
  or released by the caller; a slot whose READ NIXL could not cancel is never reused.
- Counters of transfers, bytes, descriptors and time count finished KV reads only, device
  copies among them (also counted in `device_copies`).
- A device copy cannot be cancelled: releasing one in flight waits until it has run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from workers.transfer.device_copy import DeviceCopy
from workers.transfer.errors import TransferError
from workers.transfer.generations import GenerationSlots
from workers.transfer.handle import TransferHandle, TransferStats, XferState

logger = logging.getLogger(__name__)


class ReadTracker:
    """The READs of one NIXL agent; driven by that agent's thread (see the package docstring)."""

    def __init__(self, nixl_agent: Any, gen_slots: GenerationSlots) -> None:
        self._nixl = nixl_agent
        self._gen_slots = gen_slots
        self.stats = TransferStats()

    def post(self, handle: TransferHandle, make: Callable[[], Any]) -> TransferHandle:
        """Make the NIXL request with `make()` and post it; TransferError if either fails."""
        t0 = time.perf_counter()
        try:
            handle._xfer = make()
            handle.posted_at = time.perf_counter()
            xfer = handle._xfer
            state = xfer.state() if isinstance(xfer, DeviceCopy) else self._nixl.transfer(xfer)
        except Exception as e:
            state, error = "ERR", repr(e)
        else:
            error = "ERR when posted"
        if state == "ERR":
            self._fail(handle)
            self.release(handle)
            raise TransferError(f"READ from {handle.remote_agent} could not be posted: {error}")
        self.stats.post_time_s += handle.posted_at - t0
        self._set_state(handle, state)
        return handle

    def poll(self, handle: TransferHandle) -> XferState:
        if handle.state == "PROC":
            xfer = handle._xfer
            try:
                if isinstance(xfer, DeviceCopy):
                    state = xfer.state()
                else:
                    state = self._nixl.check_xfer_state(xfer)
            except Exception as e:  # e.g. the remote disconnected mid-transfer
                logger.warning("READ from %s failed: %r", handle.remote_agent, e)
                state = "ERR"
            self._set_state(handle, state)
        return handle.state

    def _set_state(self, handle: TransferHandle, state: XferState) -> None:
        if state == "PROC":
            return
        if state == "ERR":
            logger.warning("READ from %s failed", handle.remote_agent)
            self._fail(handle)
            return
        handle.state, handle.finished_at = "DONE", time.perf_counter()
        if handle._slot is not None:
            handle.generations = self._gen_slots.values(handle._slot, handle.num_bytes // 8)
            self._gen_slots.release(handle._slot)
            handle._slot = None
            return
        s = self.stats
        s.num_transfers += 1
        s.bytes_transferred += handle.num_bytes
        s.num_descriptors += handle.num_descriptors
        s.xfer_time_s += handle.finished_at - handle.posted_at
        s.device_copies += isinstance(handle._xfer, DeviceCopy)

    def _fail(self, handle: TransferHandle) -> None:
        handle.state, handle.finished_at = "ERR", time.perf_counter()
        self.stats.num_failed_transfers += 1

    def count_failure(self) -> None:
        self.stats.num_failed_transfers += 1

    def release(self, handle: TransferHandle) -> None:
        xfer, handle._xfer = handle._xfer, None
        slot, handle._slot = handle._slot, None
        try:
            if isinstance(xfer, DeviceCopy):
                xfer.wait()  # queued GPU work: the local pages are free once it has run
            elif xfer is not None:
                self._nixl.release_xfer_handle(xfer)
        except Exception as e:  # NIXL keeps a handle it cannot cancel and retries at teardown
            logger.warning("releasing READ from %s: %r", handle.remote_agent, e)
            return  # a generation slot NIXL may still write is never reused
        if slot is not None:
            self._gen_slots.release(slot)

    def snapshot(self) -> TransferStats:
        return replace(self.stats)
