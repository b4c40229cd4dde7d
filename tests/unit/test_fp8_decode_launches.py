"""The FP8 decode kernel's launch table (`kernels/tuning.py`, tables/fp8_decode_<GPU>.json):
it loads without a GPU or Triton, and each batch size gets the entry of the largest batch
size not above it."""

from __future__ import annotations

from workers.kernels.tuning import FP8DecodeLaunch, fp8_decode_launch, fp8_decode_launches

H200 = "NVIDIA H200"


def test_h200_table_picks_by_batch_size() -> None:
    table = fp8_decode_launches(H200)
    assert min(table) == 1  # every batch size has an entry
    assert fp8_decode_launch(1, H200) == table[1] == FP8DecodeLaunch()
    one_warp = FP8DecodeLaunch(tile=64, num_warps=1, stages=3, programs=1024)
    assert fp8_decode_launch(16, H200) == fp8_decode_launch(64, H200) == one_warp
    assert fp8_decode_launch(255, H200) == one_warp
    assert fp8_decode_launch(256, H200).programs == 4096


def test_gpu_without_table_gets_defaults() -> None:
    assert fp8_decode_launches("NVIDIA H100 80GB HBM3") == {}
    assert fp8_decode_launch(64, "NVIDIA H100 80GB HBM3") == FP8DecodeLaunch()
