"""The pinned staging on a GPU: copies queued behind a long kernel, from segments the staging goes
round many times meanwhile, all land with their own values (a segment is rewritten only after the
copies from it have run), and the host never waited for a copy to be written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.kernels.host_staging import PinnedStaging

pytestmark = pytest.mark.gpu


def test_copies_queued_behind_the_gpu_keep_their_values_across_rounds() -> None:
    staging = PinnedStaging(segment_bytes=4096, segments=3)
    rng = np.random.default_rng(0)
    sent = [rng.integers(0, 2**31, size=int(rng.integers(1, 700)), dtype=np.int32)
            for _ in range(300)]  # fmt: skip
    torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: every copy below queues behind it
    got = [staging.host(a).to("cuda", non_blocking=True) for a in sent]
    torch.cuda.synchronize()
    assert all(np.array_equal(g.cpu().numpy(), a) for g, a in zip(got, sent))


def test_staged_and_oversized_arrays_are_page_locked() -> None:
    staging = PinnedStaging(segment_bytes=4096, segments=2)
    small = staging.host(np.arange(100, dtype=np.int64))
    big = staging.host(np.arange(10_000, dtype=np.int64))  # larger than a segment
    assert small.is_pinned() and big.is_pinned()
    assert big.tolist() == list(range(10_000))
