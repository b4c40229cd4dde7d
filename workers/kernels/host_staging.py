"""Page-locked host memory, reused, for the small arrays a step copies to its GPU.

A step's inputs (token ids and positions, the page table, attention metadata, sampling rules)
are built as numpy arrays on the host. `Tensor.pin_memory()` on each cost ~75 µs of host time
(six a decode step: ~0.45 ms at batch 64, measured on an H200's host under torch.profiler),
time the host spends before the step is launched, on the critical path of every step that
waits for its inputs (a constrained step waits for its token masks). Here arrays are written
into one pinned buffer instead, in segments used in turn: a segment is written again only once
an event recorded on the stream when the writes moved on from it has completed, so every copy
queued from it before then has run. Segments are large (many steps each), so that wait is
already over when it is asked.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

SEGMENT_BYTES = 2 * 2**20
SEGMENTS = 8
_ALIGN = 64  # bytes: every array starts on a cache line (and on any element's alignment)


class Waitable(Protocol):
    def synchronize(self) -> None: ...


def _record() -> Waitable:
    event = torch.cuda.Event()
    event.record()
    return event


class PinnedStaging:
    """Writes arrays into page-locked host memory for copies on the current CUDA stream.

    `record` makes the marker a segment waits on before it is written again (a CUDA event on
    the current stream; a test may pass its own)."""

    def __init__(
        self, segment_bytes: int = SEGMENT_BYTES, segments: int = SEGMENTS, pin: bool = True,
        record: Callable[[], Waitable] = _record,
    ) -> None:  # fmt: skip
        self._bytes = torch.empty(segment_bytes * segments, dtype=torch.uint8, pin_memory=pin)
        self._host = self._bytes.numpy()
        self._segment_bytes = segment_bytes
        self._done: list[Waitable | None] = [None] * segments
        self._segment, self._offset = 0, 0
        self._record = record
        self._lock = threading.Lock()

    def host(self, array: np.ndarray) -> torch.Tensor:
        """A page-locked host tensor holding `array`'s values. Valid for copies queued on the
        current stream before the staging has gone round all its segments once more (many steps);
        an array larger than a segment gets page-locked memory of its own."""
        if array.nbytes > self._segment_bytes:
            return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()
        with self._lock:
            start = -(-self._offset // _ALIGN) * _ALIGN
            if start + array.nbytes > self._segment_bytes:
                self._done[self._segment] = self._record()
                self._segment = (self._segment + 1) % len(self._done)
                done = self._done[self._segment]
                if done is not None:
                    done.synchronize()  # its last copies, queued a whole round ago
                start = 0
            self._offset = start + array.nbytes
            at = self._segment * self._segment_bytes + start
        out = self._host[at : at + array.nbytes].view(array.dtype).reshape(array.shape)
        out[...] = array
        return torch.from_numpy(out)


@functools.cache
def staging(device: torch.device) -> PinnedStaging:
    """The process's staging for copies to `device` (a CUDA device), made on first use."""
    with torch.cuda.device(device):
        return PinnedStaging()


def host_array(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a host tensor for a step on `device`: staged in page-locked memory on a GPU,
    the array's own memory on the CPU."""
    return staging(device).host(array) if device.type == "cuda" else torch.from_numpy(array)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`, copied without the host waiting (the array itself on the CPU)."""
    return host_array(array, device).to(device, non_blocking=True)
