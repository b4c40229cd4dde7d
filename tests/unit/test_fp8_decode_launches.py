"""The FP8 decode table (`kernels/tuning.py`, tables/fp8_decode_<GPU>.json): it loads without a
GPU or Triton, and each batch size gets the entry of the largest batch size not above it, for
the Triton kernel's launch and for XQA's programs; a sweep's winners make it
(`fp8_decode_table`, `xqa_table`); the config or the table picks the kernel (`splits_for`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.attention.xqa_decode import DEFAULT_PROGRAMS, splits_for
from workers.kernels import tuning
from workers.kernels.split_kv_common import num_splits
from workers.kernels.tuning import (
    FP8DecodeLaunch,
    dumps_fp8_decode,
    fp8_decode_launch,
    fp8_decode_launches,
    fp8_decode_table,
    int8_decode_launch,
    int8_decode_launches,
    parse_fp8_decode,
    table_path,
    with_int8_launches,
    xqa_programs,
    xqa_table,
)

H200 = "NVIDIA H200"


def test_h200_table_picks_by_batch_size() -> None:
    table = fp8_decode_launches(H200)
    assert min(table) == 1  # every batch size has an entry
    assert fp8_decode_launch(1, H200) == table[1] == FP8DecodeLaunch(programs=128)  # 16 splits
    one_warp = FP8DecodeLaunch(tile=64, num_warps=1, stages=3, programs=1024)
    assert fp8_decode_launch(16, H200) == fp8_decode_launch(64, H200) == one_warp
    assert fp8_decode_launch(255, H200) == one_warp
    assert fp8_decode_launch(256, H200).programs == 2048


def test_h200_table_has_xqa_from_16_sequences() -> None:
    """XQA where it was >= 5% faster: from 16 sequences up; batch 1 keeps the Triton kernel."""
    assert [xqa_programs(b, H200) for b in (1, 8, 15)] == [0, 0, 0]
    assert xqa_programs(16, H200) == xqa_programs(63, H200) == 256  # 2 splits
    assert xqa_programs(64, H200) == 1024 and xqa_programs(512, H200) == 4096


@pytest.mark.parametrize(
    "batch, gpu, choice, served, splits",
    [
        (64, H200, None, True, num_splits(64, 8, 1024)),  # the table: 2 splits
        (4, H200, None, True, 0),  # the table keeps Triton below 16
        (64, H200, None, False, 0),  # XQA does not serve the pool (a page size, not Hopper)
        (64, H200, "triton", True, 0),
        (4, H200, "xqa", True, num_splits(4, 8, DEFAULT_PROGRAMS)),  # asked for: default split
        (64, "NVIDIA H100 80GB HBM3", None, True, 0),  # no table: Triton
    ],
)
def test_config_or_table_picks_the_kernel(
    batch: int, gpu: str, choice: str | None, served: bool, splits: int
) -> None:
    assert splits_for(batch, 8, gpu, choice, served) == splits


def test_xqa_asked_where_it_cannot_serve_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fp8_decode_kernel='xqa' needs a Hopper GPU"):
        splits_for(64, 8, H200, "xqa", served=False)


def test_gpu_without_table_gets_defaults() -> None:
    assert fp8_decode_launches("NVIDIA H100 80GB HBM3") == {}
    assert fp8_decode_launch(64, "NVIDIA H100 80GB HBM3") == FP8DecodeLaunch()


def test_table_from_sweep_winners_round_trips() -> None:
    """Per batch size its longest context's winner, splits as programs, and no entry where the
    launch repeats the one below; XQA's entries where it won, 0 where Triton won again; the
    file is what `dumps_fp8_decode` writes (the H200 sweep's winners)."""
    one_warp, four_warps = FP8DecodeLaunch(tile=64, num_warps=1), FP8DecodeLaunch()
    winners = {
        (1, 4096): (four_warps, 16),
        (16, 4096): (one_warp, 8),
        (64, 4096): (one_warp, 2),  # 64 x 8 x 2 programs: 16's launch again
        (256, 2048): (four_warps, 1),
        (256, 4096): (four_warps, 1),  # the longer context decides
    }
    xqa_winners = {(1, 4096): 0, (16, 4096): 2, (64, 4096): 2, (256, 2048): 1, (256, 4096): 2}
    table, xqa = fp8_decode_table(winners, num_kv_heads=8), xqa_table(xqa_winners, 8)
    assert table == fp8_decode_launches(H200)
    assert xqa == {16: 256, 64: 1024, 256: 4096}
    assert xqa_table({(1, 64): 0, (16, 64): 2, (64, 64): 0}, 8) == {16: 256, 64: 0}
    text = dumps_fp8_decode(table, xqa, H200, int8_decode_launches(H200))
    assert table_path(H200, "fp8_decode").read_text() == text
    assert parse_fp8_decode(json.loads(text)) == table


def test_int8_launches_kept_beside_the_fp8_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The int8 sweep's launches become the table's `"int8"` section, its FP8 launches and XQA
    entries unchanged; int8 rows take them per batch size, the FP8 launch where there are
    none (no section, or batch sizes below its first entry)."""
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    tuning._fp8_decode_file.cache_clear()
    gpu = "Some GPU"
    assert int8_decode_launch(64, gpu) == FP8DecodeLaunch()  # no file: the FP8 defaults
    fp8 = {1: FP8DecodeLaunch(programs=128), 16: FP8DecodeLaunch(tile=64, num_warps=1)}
    table_path(gpu, "fp8_decode").write_text(dumps_fp8_decode(fp8, {16: 256}, gpu))
    tuning._fp8_decode_file.cache_clear()
    assert int8_decode_launch(64, gpu) == fp8[16]  # no int8 section: the FP8 launch
    int8 = {16: FP8DecodeLaunch(tile=32, num_warps=4, programs=2048)}
    table_path(gpu, "fp8_decode").write_text(with_int8_launches(gpu, int8))
    tuning._fp8_decode_file.cache_clear()
    try:
        assert fp8_decode_launches(gpu) == fp8 and xqa_programs(16, gpu) == 256
        assert int8_decode_launch(8, gpu) == fp8[1]  # below the section's first entry
        assert int8_decode_launch(16, gpu) == int8_decode_launch(300, gpu) == int8[16]
        assert fp8_decode_launch(300, gpu) == fp8[16]
    finally:
        tuning._fp8_decode_file.cache_clear()
