"""The pinned staging's segments (`workers/kernels/host_staging.py`): values, alignment, and that
a segment is written again only after the marker recorded when the writes left it was waited on.
Host memory without page-locking here (no CUDA); tests/gpu/test_host_staging.py copies for real.
"""

from __future__ import annotations

import numpy as np

from workers.kernels.host_staging import PinnedStaging


class Marker:
    """What `record` returns: remembers whether it was waited on."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


def test_arrays_keep_their_values_until_a_segment_is_reused_after_its_marker() -> None:
    log: list[str] = []
    made = iter(range(100))

    def record() -> Marker:
        name = f"m{next(made)}"
        log.append(f"record {name}")
        return Marker(log, name)

    staging = PinnedStaging(segment_bytes=256, segments=2, pin=False, record=record)
    a = staging.host(np.arange(10, dtype=np.int32))  # 40 bytes at 0
    b = staging.host(np.full((3, 4), 7, dtype=np.int64))  # 96 bytes at 64
    assert a.data_ptr() % 64 == 0 and b.data_ptr() - a.data_ptr() == 64
    assert a.tolist() == list(range(10)) and b.shape == (3, 4) and b.sum().item() == 84
    assert log == []
    c = staging.host(np.ones(20, dtype=np.float64))  # 160 bytes: not in segment 0's rest
    assert log == ["record m0"]  # the second segment was never used: nothing to wait for
    assert a.tolist() == list(range(10))  # segment 0 untouched
    staging.host(np.zeros(8, dtype=np.int32))  # fits after c
    d = staging.host(np.arange(30, dtype=np.int64))  # 240 bytes: back to segment 0
    assert log == ["record m0", "record m1", "wait m0"]
    assert d.data_ptr() == a.data_ptr() and d.tolist() == list(range(30))
    assert c.tolist() == [1.0] * 20


def test_a_strided_array_is_written_in_order() -> None:
    staging = PinnedStaging(1024, 2, pin=False, record=lambda: Marker([], ""))
    grid = np.arange(24, dtype=np.int32).reshape(4, 6)
    assert staging.host(grid.T).tolist() == grid.T.tolist()
    assert staging.host(np.empty((0, 3), dtype=np.int64)).shape == (0, 3)
