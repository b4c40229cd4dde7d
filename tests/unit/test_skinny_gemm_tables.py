"""The skinny GEMM's launch tables (workers/kernels/tables/) load without Triton, and the H200's
holds exactly the configs and wins the kernel used when they were written in its code, but for
the cells re-chosen since (docs/notes/skinny-gemm-tuning.md)."""

from __future__ import annotations

import json
from dataclasses import replace

from workers.kernels.tuning import (
    EMPTY,
    Config,
    SkinnyGemmTable,
    dumps,
    skinny_gemm_table,
    table_path,
)

H200 = "NVIDIA H200"  # torch.cuda.get_device_name on an H200


def h200_table_as_it_was_in_code() -> SkinnyGemmTable:
    """CONFIGS and WINS as workers/kernels/skinny_gemm.py held them, then gate_up at M = 32 and
    64 re-chosen for the gated tensor-core launch."""
    gemv4 = Config(4, 512)
    gemv4_pipelined = Config(4, 1024, 4, 2)
    gemv8 = Config(8, 512, maxnreg=80)
    swap64 = Config(64, 128, 4, 4, dot=True, swap=True)
    swap128 = Config(128, 128, 4, 3, dot=True, swap=True)
    configs = {
        (6144, 4096, 1): gemv8,
        **{(6144, 4096, m): swap64 for m in (2, 4, 8, 16, 32, 64)},
        (4096, 4096, 1): gemv4_pipelined,
        **{(4096, 4096, m): replace(swap64, split_k=4 if m == 2 else 2) for m in (2, 4, 8, 16, 32)},
        (4096, 4096, 64): Config(32, 128, 4, 4, dot=True),
        (28672, 4096, 1): Config(2, 512, 1, 3),
        **{(28672, 4096, m): swap128 for m in (2, 4, 8, 16)},
        (28672, 4096, 32): swap128,
        (28672, 4096, 64): Config(256, 64, 8, 3, dot=True, swap=True),
        (4096, 14336, 1): gemv4_pipelined,
        **{(4096, 14336, m): replace(swap64, split_k=4) for m in (2, 4, 8)},
        **{(4096, 14336, m): replace(swap64, split_k=2) for m in (16, 32, 64)},
        (128256, 4096, 1): Config(8, 1024, 4, 2),
        **{(128256, 4096, m): swap128 for m in (2, 4)},
        (128256, 4096, 64): Config(128, 64, 8, 6, dot=True, swap=True),
        **{(128256, 4096, m): swap64 for m in (8, 16, 32)},
        (3072, 4096, 1): gemv4,
        (4096, 2048, 1): gemv4,
        (14336, 4096, 1): Config(2, 512, 1),
        (4096, 7168, 1): gemv4,
        (64128, 4096, 1): replace(swap128, num_warps=8),
    }
    wins = {
        (6144, 4096, 1),
        *[(4096, 4096, m) for m in (1, 4, 8, 16, 32)],
        (4096, 14336, 64),
        *[(128256, 4096, m) for m in (1, 2, 4, 8, 16, 32, 64)],
    }
    return SkinnyGemmTable(configs, frozenset(wins))


def test_h200_table_holds_the_configs_the_code_held() -> None:
    table = skinny_gemm_table(H200)
    expected = h200_table_as_it_was_in_code()
    assert table.configs == expected.configs
    assert table.wins == expected.wins


def test_table_file_is_what_dumps_writes() -> None:
    """The sweep script writes files with `dumps`: the committed one reads back to its text."""
    text = table_path(H200).read_text()
    assert dumps(skinny_gemm_table(H200), H200) == text
    assert json.loads(text)["gpu"] == H200


def test_unmeasured_gpu_gets_the_empty_table() -> None:
    assert skinny_gemm_table("NVIDIA GeForce RTX 4090") is EMPTY
    assert table_path("NVIDIA H100 80GB HBM3").name == "skinny_gemm_NVIDIA_H100_80GB_HBM3.json"
