"""The greedy argmax kernels give torch's argmax: the first index of the maximum, NaN first."""

from __future__ import annotations

import pytest
import torch

from workers.sampling.sampler import argmax_rows

pytestmark = pytest.mark.gpu


def test_argmax_kernels_give_torchs_first_index_of_the_max() -> None:
    """Ties within and across chunks, a maximum in the last entry, NaN (before and after an
    inf), all equal, all -inf; Llama 3's vocabulary (256 chunks of 501), a prime one (the last
    chunk short), SmolLM2's, one under a chunk, and rows strided apart."""
    gen = torch.Generator().manual_seed(0)
    vocab = 128256
    x = torch.randint(0, 50, (8, vocab), generator=gen).float()  # many ties
    x[1, 1000] = x[1, 90000] = x[1, 500] = 80.0  # ties across chunks: the first wins
    x[2, 501] = x[2, 1001] = 80.0  # the first entries of chunks 1 and 2
    x[3, -1] = 80.0  # the very last entry
    x[4, 7000] = x[4, 9000] = float("nan")  # torch treats NaN as the maximum
    x[4, 100] = float("inf")
    x[5] = -3.0  # all equal
    x[6, :] = float("-inf")
    x[7, 60000] = float("inf")
    got = argmax_rows(x.cuda())
    assert got.dtype == torch.int64 and got.is_cuda
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got.tolist()[1:] == [500, 501, vocab - 1, 7000, 0, 0, 60000]
    for rows, width in ((3, 65537), (2, 49152), (5, 100)):
        y = torch.randint(0, 9, (rows, width), generator=gen).float().cuda()
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1)), width
    wide = torch.randn(4, 70000, device="cuda")
    strided = wide[:, :65000]  # rows 70000 apart
    assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))
