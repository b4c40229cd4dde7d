"""`bench/kernel_build.py` on the CPU: the int8 decode kernel's SM90 build, at each launch the
H200's table picks, spills nothing and copies no tile asynchronously into a transposed
unswizzled shared layout (the bank conflicts that made one form of the kernel twice as slow on
an H100, docs/notes/fp8-kv.md); and the check flags such a layout when a build has one."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("triton")

from bench.kernel_build import KERNELS, Build  # noqa: E402
from workers.kernels.tuning import int8_decode_launches  # noqa: E402

ROW_MAJOR = "#ttg.swizzled_shared<{vec = 16, perPhase = 1, maxPhase = 8, order = [1, 0]}>"
TRANSPOSED = "#ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, order = [0, 1]}>"
ONE_D = "#ttg.swizzled_shared<{vec = 1, perPhase = 1, maxPhase = 1, order = [0]}>"


def test_conflicted_copies_are_the_transposed_unswizzled_tiles() -> None:
    copies = [("k", "64x128", ROW_MAJOR), ("v", "128x32", TRANSPOSED), ("page", "4", ONE_D)]
    build = Build(255, 0, 900, [], [], copies)
    assert build.conflicted_copies() == [("v", "128x32", TRANSPOSED)]


H200_LAUNCHES = sorted(
    {(x.tile, x.num_warps, x.stages) for x in int8_decode_launches("NVIDIA H200").values()}
)


@pytest.mark.parametrize(("tile", "warps", "stages"), H200_LAUNCHES)
def test_int8_decode_builds_without_spills_or_conflicted_copies(
    tile: int, warps: int, stages: int
) -> None:
    args = argparse.Namespace(tile=tile, warps=warps, stages=stages, arch=90)
    build = KERNELS["int8_decode"](args)
    assert build.spill_bytes == 0, build
    assert build.conflicted_copies() == [], build.copies
    assert any(name == "k" for name, _, _ in build.copies)  # K still streams in ahead
    assert build.loop_instructions > 0
