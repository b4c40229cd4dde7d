"""Triton kernels' launch configs per GPU model: data files under `tables/`, one per kernel and
GPU. The skinny GEMM's first, then the FP8 decode attention's (`FP8DecodeLaunch`).

Each file (`bench/sweep_skinny_gemm.py` writes one for the GPU it runs on) maps a cell,
"N,K,M bucket" (M rounded up to a power of two), to the `Config` that ran fastest there, and
lists the cells where that config beat F.linear on its own (`wins`). A GPU without a file gets
an empty table: F.linear everywhere. docs/notes/skinny-gemm-tuning.md tells how the H200's
table was chosen. No Triton here, so the tables load and test on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
TABLES = Path(__file__).parent / "tables"
Cell = tuple[int, int, int]  # (N, K, M bucket)


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False  # tensor-core kernel (else the GEMV kernel, for M <= MAX_GEMV_ROWS)
    swap: bool = False  # dot kernel computes y^T = W x^T
    split_k: int = 1  # programs per output tile, each over a K range (see skinny_tiles.epilogue)
    maxnreg: int | None = None  # registers a thread at most (ptxas's own choice when None)


@dataclass(frozen=True)
class SkinnyGemmTable:
    configs: dict[Cell, Config]
    wins: frozenset[Cell]  # cells where the kernel beat F.linear without dependent launch


EMPTY = SkinnyGemmTable({}, frozenset())
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}


def table_path(gpu_name: str, kernel: str = "skinny_gemm") -> Path:
    """`tables/<kernel>_<name>.json`, the name as torch.cuda.get_device_name gives it."""
    return TABLES / f"{kernel}_{re.sub(r'[^A-Za-z0-9]+', '_', gpu_name).strip('_')}.json"


def _cell(key: str) -> Cell:
    n, k, m = (int(v) for v in key.split(","))
    return n, k, m


def parse(data: dict[str, Any]) -> SkinnyGemmTable:
    configs = {_cell(key): Config(**fields) for key, fields in data["configs"].items()}
    wins = frozenset(_cell(key) for key in data["wins"])
    if not wins <= configs.keys():
        raise ValueError(f"wins without a config: {sorted(wins - configs.keys())}")
    return SkinnyGemmTable(configs, wins)


def dumps(table: SkinnyGemmTable, gpu_name: str) -> str:
    """The JSON text of `table`, a cell a line, each config by its fields that differ from the
    defaults."""
    lines = []
    for (n, k, m), cfg in sorted(table.configs.items()):
        fields = {f: v for f, v in dataclasses.asdict(cfg).items() if v != _DEFAULTS[f]}
        lines.append(f'    "{n},{k},{m}": {json.dumps(fields)}')
    wins = ", ".join(f'"{n},{k},{m}"' for n, k, m in sorted(table.wins))
    configs = ",\n".join(lines)
    head = f'{{\n  "gpu": {json.dumps(gpu_name)},\n  "configs": {{\n'
    return f'{head}{configs}\n  }},\n  "wins": [{wins}]\n}}\n'


@functools.cache
def skinny_gemm_table(gpu_name: str) -> SkinnyGemmTable:
    """The table for a GPU model, read once; EMPTY where none was measured."""
    path = table_path(gpu_name)
    if not path.is_file():
        logger.info("no skinny GEMM launch table for %s (%s): F.linear throughout", gpu_name, path)
        return EMPTY
    return parse(json.loads(path.read_text()))


@dataclass(frozen=True)
class FP8DecodeLaunch:
    """How `kernels/fp8_decode.py` launches: tokens a tile, warps a program, tiles in flight,
    and each sequence's splits for about `programs` programs (`split_kv_common.num_splits`).
    The defaults: the first launch measured on an H200, kept for GPUs without a table."""

    tile: int = 128
    num_warps: int = 4
    stages: int = 3
    programs: int = 1024


@functools.cache
def _fp8_decode_file(gpu_name: str) -> dict[str, Any]:
    """A GPU model's FP8 decode table file (`tables/fp8_decode_<name>.json`), read once; empty
    where none was measured."""
    path = table_path(gpu_name, "fp8_decode")
    return json.loads(path.read_text()) if path.is_file() else {}


def fp8_decode_launches(gpu_name: str) -> dict[int, FP8DecodeLaunch]:
    """The table's "launches": the smallest batch size a launch is for -> its fields."""
    data = _fp8_decode_file(gpu_name)
    return parse_fp8_decode(data) if data else {}


def _by_batch(per_case: dict[tuple[int, int], T], start: T | None) -> dict[int, T]:
    """Per batch size its longest context's value, an entry only where it differs from the one
    below (`start` below the first)."""
    longest = dict(sorted(per_case))  # batch -> its longest context (sorted: the last wins)
    table: dict[int, T] = {}
    below = start
    for batch, context in longest.items():
        if (value := per_case[batch, context]) != below:
            table[batch] = below = value
    return table


def _at(table: dict[int, T], batch_size: int, default: T) -> T:
    """The entry of the largest batch size not above `batch_size`, else `default`."""
    below = [batch for batch in table if batch <= batch_size]
    return table[max(below)] if below else default


def fp8_decode_table(
    winners: dict[tuple[int, int], tuple[FP8DecodeLaunch, int]], num_kv_heads: int
) -> dict[int, FP8DecodeLaunch]:
    """A launch table from a sweep's fastest (launch, splits) per (batch, context) case: per
    batch size its longest context's winner, `programs` set so that `num_splits` gives the
    winning splits, and an entry only where the launch differs from the one below it."""
    launches = {
        (batch, context): dataclasses.replace(launch, programs=batch * num_kv_heads * splits)
        for (batch, context), (launch, splits) in winners.items()
    }
    return _by_batch(launches, None)


def xqa_table(winners: dict[tuple[int, int], int], num_kv_heads: int) -> dict[int, int]:
    """XQA's entries from a sweep's (batch, context) -> its fastest splits where it beat the
    Triton kernel, else 0: per batch size its longest context's, as programs (0: Triton), an
    entry only where that changes from the one below."""
    programs = {(b, c): b * num_kv_heads * splits for (b, c), splits in winners.items()}
    return _by_batch(programs, 0)


def parse_fp8_decode(data: dict[str, Any]) -> dict[int, FP8DecodeLaunch]:
    return {int(batch): FP8DecodeLaunch(**fields) for batch, fields in data["launches"].items()}


def _launch_lines(launches: dict[int, FP8DecodeLaunch]) -> str:
    return ",\n".join(f'    "{batch}": {json.dumps(dataclasses.asdict(launches[batch]))}'
                      for batch in sorted(launches))  # fmt: skip


def dumps_fp8_decode(
    launches: dict[int, FP8DecodeLaunch], xqa: dict[int, int], gpu_name: str,
    int8: dict[int, FP8DecodeLaunch] | None = None,
) -> str:  # fmt: skip
    """The JSON text of an FP8 decode table, a batch size a line: the Triton kernel's launches,
    the batch sizes from which FlashInfer's XQA is the faster, with its programs, and where
    swept, the same kernel's launches over int8 rows (`"int8"`)."""
    xqa_lines = [f'    "{batch}": {{"programs": {xqa[batch]}}}' for batch in sorted(xqa)]
    xqa_body = ",\n".join(xqa_lines)
    text = (f'{{\n  "gpu": {json.dumps(gpu_name)},\n  "launches": {{\n{_launch_lines(launches)}'
            f'\n  }},\n  "xqa": {{\n{xqa_body}\n  }}')  # fmt: skip
    if int8:
        text += f',\n  "int8": {{\n{_launch_lines(int8)}\n  }}'
    return text + "\n}\n"


def with_int8_launches(gpu_name: str, int8: dict[int, FP8DecodeLaunch]) -> str:
    """The GPU's FP8 decode table text (as it is, or empty) with `int8` as its int8 launches."""
    return dumps_fp8_decode(fp8_decode_launches(gpu_name), fp8_decode_xqa(gpu_name), gpu_name, int8)


def fp8_decode_xqa(gpu_name: str) -> dict[int, int]:
    """The table's XQA entries (`"xqa"`: the smallest batch size an entry is for -> its
    programs, 0 where the Triton kernel is the faster again)."""
    xqa = _fp8_decode_file(gpu_name).get("xqa", {})
    return {int(batch): fields["programs"] for batch, fields in xqa.items()}


def xqa_programs(batch_size: int, gpu_name: str) -> int:
    """XQA's programs for decode steps of `batch_size` sequences, 0 where the table does not
    have it the faster (or has no entry up to that size)."""
    return _at(fp8_decode_xqa(gpu_name), batch_size, 0)


def fp8_decode_launch(batch_size: int, gpu_name: str) -> FP8DecodeLaunch:
    """The launch for decode steps of `batch_size` sequences: the table's entry of the largest
    batch size not above it, else the defaults."""
    return _at(fp8_decode_launches(gpu_name), batch_size, FP8DecodeLaunch())


def int8_decode_launch(batch_size: int, gpu_name: str) -> FP8DecodeLaunch:
    """The same kernel's launch over int8 rows: the table's `"int8"` entry of the largest batch
    size not above it, else the FP8 launch (int8 tiles convert each byte to fp16 with an
    integer conversion and carry each row's scale: their best tiles differ)."""
    return _at(int8_decode_launches(gpu_name), batch_size, fp8_decode_launch(batch_size, gpu_name))


def int8_decode_launches(gpu_name: str) -> dict[int, FP8DecodeLaunch]:
    """The table's `"int8"` launches (the smallest batch size a launch is for -> its fields)."""
    data = _fp8_decode_file(gpu_name).get("int8", {})
    return {int(batch): FP8DecodeLaunch(**fields) for batch, fields in data.items()}
