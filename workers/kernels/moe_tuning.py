"""The fused MoE kernel's launch configs per GPU model (`tables/moe_fused_<gpu>.json`, written by
bench/sweep_moe.py): per expert shape "E,H,I,top_k" (this rank's experts), the config that ran
fastest for each token-count bucket (a power of two): the aligned grouped-GEMM kernels' tiles,
or (`gemv`) the small-batch GEMV kernels' (`moe_gemv.py`). A GPU or shape without an entry takes
`default_config`. No Triton here, so tables load and test on any machine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

from workers.kernels.tuning import table_path

logger = logging.getLogger(__name__)

Shape = tuple[int, int, int, int]  # (experts on this rank, hidden, intermediate, top_k)


@dataclass(frozen=True)
class MoEConfig:
    block_m: int = 16  # (token, expert) pairs a tile; each expert's pairs padded to a multiple
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # The GEMV kernels (no alignment, a program per pair or token): block_n and block_k are then
    # their output rows and reduction tile, num_stages their K loop's stages; block_m is unused.
    gemv: bool = False
    # GEMV path: the down kernel's tile holds a token's k slots at once (k x block_n rows, the
    # routing loaded before the loop) instead of looping over the slots.
    down_slots: bool = False
    # GEMV path: the down kernel's own (block_n, block_k, num_warps, num_stages), where its best
    # tiles differ from gate/up's (a GEMV over I = 768 against one over H = 2048); None: the same.
    down: tuple[int, int, int, int] | None = None

    def __post_init__(self) -> None:  # JSON gives a list
        if self.down is not None:
            object.__setattr__(self, "down", tuple(self.down))


# Before a sweep, at batch 1-8: the H200's measured skinny GEMV cell at M = 1 for the nearest
# dense shape (N 4096, K 2048: 4 rows a program, 512-wide K tiles), with 2 loop stages (the
# loads then go through cp.async). At Qwen3-30B-A3B's batch 1 that is 1,536 gate/up and 512
# down programs (16 rows would leave down 128, fewer than the H200's 132 multiprocessors);
# SM90 builds: 80 and 48 registers, no spills.
GEMV_DEFAULT = MoEConfig(block_n=4, block_k=512, num_warps=4, num_stages=2, gemv=True)


MoETable = dict[Shape, dict[int, MoEConfig]]  # shape -> token bucket -> config


def bucket(tokens: int) -> int:
    return 1 << max(0, tokens - 1).bit_length()


def default_config(tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """Before a sweep: the GEMV kernels while the (token, slot) pairs are at most half the
    experts, small tiles where each expert sees a few pairs (decode), larger where each sees
    many (prefill).

    GEMV up to E/2 pairs (batch 1-8 at Qwen3-30B-A3B's 128 experts and top-8): n pairs routed
    at random touch E (1 - e^(-n/E)) experts, so at n = E/2 an expert with pairs has ~1.3 of
    them. The aligned kernels' 16-row tiles are then >90% padding and their two alignment
    launches and the top-k sum buy nothing; the GEMV reads a shared expert's weights once per
    pair instead (~20% of pairs at E/2), and those re-reads run side by side, from L2. Above
    that the shared reads grow and the grouped tiles' reuse wins back."""
    if 2 * tokens * top_k <= num_experts:
        return GEMV_DEFAULT
    per_expert = tokens * top_k / num_experts
    if per_expert <= 16:
        return MoEConfig(16, 64, 128, 4, 3)
    if per_expert <= 64:
        return MoEConfig(32, 64, 64, 4, 3)
    return MoEConfig(64, 128, 64, 8, 3)


def parse(data: dict[str, Any]) -> MoETable:
    table: MoETable = {}
    for key, per_bucket in data["configs"].items():
        e, h, i, k = (int(v) for v in key.split(","))
        table[e, h, i, k] = {int(b): MoEConfig(**f) for b, f in per_bucket.items()}
    return table


def _fields(cfg: MoEConfig) -> dict[str, Any]:
    """A config's JSON fields: `gemv`, `down_slots` and `down` only where set, so the tables
    written before them stay as they were (`parse` takes either)."""
    fields = dataclasses.asdict(cfg)
    for flag in ("gemv", "down_slots", "down"):
        if not fields[flag]:
            del fields[flag]
    if "down" in fields:
        fields["down"] = list(fields["down"])
    return fields


def dumps(table: MoETable, gpu_name: str) -> str:
    """A table's JSON text: a shape per block, a token bucket a line."""
    blocks = []
    for shape in sorted(table):
        lines = [f'      "{b}": {json.dumps(_fields(c))}'
                 for b, c in sorted(table[shape].items())]  # fmt: skip
        blocks.append(f'    "{",".join(map(str, shape))}": {{\n' + ",\n".join(lines) + "\n    }")
    body = ",\n".join(blocks)
    return f'{{\n  "gpu": {json.dumps(gpu_name)},\n  "configs": {{\n{body}\n  }}\n}}\n'


@functools.cache
def moe_table(gpu_name: str) -> MoETable:
    """A GPU model's table, read once; empty where none was measured."""
    path = table_path(gpu_name, "moe_fused")
    if not path.is_file():
        logger.info("no fused MoE launch table for %s (%s): default configs", gpu_name, path)
        return {}
    return parse(json.loads(path.read_text()))


def moe_config(table: MoETable, shape: Shape, tokens: int) -> MoEConfig:
    """The table's config for `tokens` tokens (the nearest measured bucket), else the default."""
    per_bucket = table.get(shape)
    if not per_bucket:
        return default_config(tokens, shape[3], shape[0])
    b = bucket(tokens)
    return per_bucket[min(per_bucket, key=lambda m: (abs(m.bit_length() - b.bit_length()), m))]
