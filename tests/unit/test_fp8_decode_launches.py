"""The FP8 decode kernel's launch table (`kernels/tuning.py`, tables/fp8_decode_<GPU>.json):
it loads without a GPU or Triton, and each batch size gets the entry of the largest batch
size not above it; a sweep's winners make it (`fp8_decode_table`)."""

from __future__ import annotations

import json

from workers.kernels.tuning import (
    FP8DecodeLaunch,
    dumps_fp8_decode,
    fp8_decode_launch,
    fp8_decode_launches,
    fp8_decode_table,
    parse_fp8_decode,
    table_path,
)

H200 = "NVIDIA H200"


def test_h200_table_picks_by_batch_size() -> None:
    table = fp8_decode_launches(H200)
    assert min(table) == 1  # every batch size has an entry
    assert fp8_decode_launch(1, H200) == table[1] == FP8DecodeLaunch(programs=256)  # 32 splits
    one_warp = FP8DecodeLaunch(tile=64, num_warps=1, stages=3, programs=1024)
    assert fp8_decode_launch(16, H200) == fp8_decode_launch(64, H200) == one_warp
    assert fp8_decode_launch(255, H200) == one_warp
    assert fp8_decode_launch(256, H200).programs == 4096


def test_gpu_without_table_gets_defaults() -> None:
    assert fp8_decode_launches("NVIDIA H100 80GB HBM3") == {}
    assert fp8_decode_launch(64, "NVIDIA H100 80GB HBM3") == FP8DecodeLaunch()


def test_table_from_sweep_winners_round_trips() -> None:
    """Per batch size its longest context's winner, splits as programs, and no entry where the
    launch repeats the one below; the file is what `dumps_fp8_decode` writes."""
    one_warp = FP8DecodeLaunch(tile=64, num_warps=1)
    winners = {
        (1, 4096): (FP8DecodeLaunch(), 32),
        (16, 4096): (one_warp, 8),
        (64, 4096): (one_warp, 2),  # 64 x 8 x 2 programs: 16's launch again
        (256, 2048): (one_warp, 1),
        (256, 4096): (one_warp, 2),  # the longer context decides
    }
    table = fp8_decode_table(winners, num_kv_heads=8)
    assert table == fp8_decode_launches(H200)
    assert table_path(H200, "fp8_decode").read_text() == dumps_fp8_decode(table, H200)
    assert parse_fp8_decode(json.loads(dumps_fp8_decode(table, H200))) == table
